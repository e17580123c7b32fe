"""Lifecycle faults on one rank: a second thread, a fork() child, close() racing a submit, Ctrl-C in a wait.

Run as `mpiexec -n P python trust_lifecycle.py CASE`. Each case injects its fault on one rank (the victim, rank
1), after layouts were cached (the same call succeeded before) and after an earlier caught error, and every rank
checks what it got: the right numbers (against NumPy, bit-identical across ranks), or the right error naming
what and where. A rank prints `rank R: ok CASE` when its checks pass, and `TIME ...` lines (measurements for the
record; nothing asserts on them).
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

import ddlfast

CASE = sys.argv[1]
comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
VICTIM = 1
problems: list[str] = []


def expect(condition: bool, message: str) -> None:
    if not condition:
        problems.append(message)


def caught(action) -> BaseException | None:
    try:
        action()
    except BaseException as error:  # noqa: BLE001 - the caller checks what it was
        return error
    return None


def expect_error(action, kind: type, *needles: str) -> str:
    error = caught(action)
    text = f"{type(error).__name__}: {error}"
    expect(isinstance(error, kind), f"expected {kind.__name__}, got {text}")
    for needle in needles:
        expect(needle in str(error), f"{needle!r} not in {text}")
    return str(error)


def checked_sum(context: ddlfast.Context | None = None, count: int = 1024, seed: int = 0) -> None:
    """An allreduce whose result matches NumPy's sum of every rank's input and is bit-identical on every rank."""
    inputs = [np.random.default_rng(seed * 100 + r).integers(-1000, 1000, count).astype(np.float32)
              for r in range(world)]
    array = inputs[rank].copy()
    (context or ddlfast.default_context()).allreduce(array)
    expect(np.array_equal(array, np.sum(inputs, axis=0, dtype=np.float32)), f"sum of {count} differs from NumPy")
    digests = comm.allgather(hashlib.blake2b(array.tobytes()).hexdigest())
    expect(len(set(digests)) == 1, f"results differ across ranks: {digests}")


def cached_then_error(context: ddlfast.Context | None = None) -> None:
    """The history every case starts from: layouts cached, then an earlier error every rank caught."""
    context = context or ddlfast.default_context()
    checked_sum(context)
    bad = np.ones(1024, np.float32)
    if rank == VICTIM:
        bad.flags.writeable = False
    expect_error(lambda: context.allreduce(bad), ddlfast.DdlfastError, "rank 1")
    checked_sum(context, seed=1)


# -- 1. a second thread ----------------------------------------------------------------------------------------------


def second_thread() -> None:
    context = ddlfast.default_context()
    cached_then_error(context)
    if rank == VICTIM:  # the fault: another thread issues on the main thread's context, on this rank only
        outcomes: list[tuple[str, BaseException | None, float]] = []

        def intruder() -> None:
            x = np.ones(1024, np.float32)
            for name, action in (("allreduce", lambda: context.allreduce(x)),
                                 ("allreduce_async", lambda: context.allreduce_async(x)),
                                 ("fused_allreduce", lambda: context.fused_allreduce([x, x.copy()])),
                                 ("reduce_scatter", lambda: context.reduce_scatter(x[:world * 16])),
                                 ("allgather", lambda: context.allgather(x)),
                                 ("barrier", context.barrier),
                                 ("broadcast", lambda: context.broadcast(x)),
                                 ("submit", lambda: context.submit(lambda: None, "work"))):
                start = time.perf_counter()
                outcomes.append((name, caught(action), time.perf_counter() - start))

        thread = threading.Thread(target=intruder, name="intruder")
        thread.start()
        thread.join(60)
        expect(not thread.is_alive(), "the refused thread did not end")
        for name, error, seconds in outcomes:
            expect(isinstance(error, ddlfast.DdlfastError), f"{name} from a second thread: {error!r}")
            for needle in ("'intruder'", "'MainThread'", "one Context per thread", "rank 1"):
                expect(needle in str(error), f"{name} from a second thread: {needle!r} not in {error}")
            print(f"TIME rank {rank} second-thread {name} refused after {seconds * 1e6:.0f} us", flush=True)
    checked_sum(context, seed=2)  # nothing was sent: every rank goes on in step

    # The way it works: one context per thread, both threads issuing at once on every rank.
    own: dict[str, object] = {}

    def worker() -> None:
        try:
            mine = ddlfast.Context(comm.Dup())
            for i in range(30):
                checked_thread_sum(mine, i)
            mine.close()
            own["ok"] = True
        except BaseException as error:  # noqa: BLE001
            own["error"] = error

    def checked_thread_sum(mine: ddlfast.Context, i: int) -> None:
        value = np.full(256, float(rank + i), np.float64)
        mine.allreduce(value)
        if not np.all(value == sum(r + i for r in range(world))):
            own.setdefault("wrong", i)

    thread = threading.Thread(target=worker, name="own-context")
    thread.start()
    for i in range(30):
        value = np.full(300, float(rank * 7 + i), np.float32)
        context.allreduce(value)
        expect(np.all(value == sum(r * 7 + i for r in range(world))), f"main thread sum {i} wrong")
    thread.join(120)
    expect(own.get("ok") is True and "wrong" not in own, f"own context per thread: {own}")

    # An explicit hand-over: a context created here, used by a training thread, then refused here.
    moved = ddlfast.Context(comm.Dup())
    handed: dict[str, object] = {}

    def trainer() -> None:
        moved.hand_over()
        value = np.full(64, float(rank), np.float32)
        moved.allreduce(value)
        handed["sum"] = float(value[0])

    thread = threading.Thread(target=trainer, name="trainer")
    thread.start()
    thread.join(60)
    expect(handed.get("sum") == sum(range(world)), f"hand_over: {handed}")
    expect_error(lambda: moved.allreduce(np.ones(4, np.float32)), ddlfast.DdlfastError, "'trainer'", "'MainThread'")
    moved.close()
    checked_sum(context, seed=3)


# -- 2. fork() -------------------------------------------------------------------------------------------------------


def forked_child() -> None:
    context = ddlfast.default_context()
    cached_then_error(context)
    if rank == VICTIM:
        read, write = os.pipe()
        start = time.perf_counter()
        pid = os.fork()
        if pid == 0:  # the child: every call refused, the exit hooks touch no MPI and abort nothing
            os.close(read)
            lines = []
            x = np.ones(1024, np.float32)
            for name, action in (("allreduce", lambda: ddlfast.allreduce(x)),
                                 ("allreduce_async", lambda: context.allreduce_async(x)),
                                 ("reduce_scatter", lambda: ddlfast.reduce_scatter(x[:world * 16])),
                                 ("allgather", lambda: ddlfast.allgather(x)),
                                 ("barrier", context.barrier),
                                 ("new default-context call", lambda: ddlfast.broadcast(x))):
                error = caught(action)
                ok = isinstance(error, ddlfast.DdlfastError) and "fork() child" in str(error)
                lines.append(f"{'ok' if ok else 'BAD'} {name}: {type(error).__name__}: {error}")
            lines.append(f"TIME child refusal after {(time.perf_counter() - start) * 1e3:.1f} ms since fork")
            from ddlfast import api

            error = caught(api._close_contexts)  # the atexit hook
            lines.append(f"{'ok' if error is None else 'BAD'} exit hook: {error!r}")
            broken = ddlfast.DdlfastBrokenError("injected")
            error = caught(lambda: sys.excepthook(type(broken), broken, None))  # would MPI_Abort the parent's job
            lines.append(f"{'ok' if error is None else 'BAD'} excepthook: {error!r}")
            os.write(write, "\n".join(lines).encode())
            os._exit(0)  # no MPI_Finalize of the parent's MPI here
        os.close(write)
        report = b""
        while chunk := os.read(read, 65536):
            report += chunk
        os.close(read)
        _, status = os.waitpid(pid, 0)
        text = report.decode()
        print("\n".join(f"rank {rank} child: {line}" for line in text.splitlines()), flush=True)
        expect(status == 0, f"the child exited with status {status}")
        expect("BAD" not in text and text.count("ok ") == 8, f"the child's report: {text}")
    comm.Barrier()  # the parent's job goes on, in step, after its child
    checked_sum(context, seed=4)
    checked_sum(context, count=300_000, seed=5)


# -- 3. close() racing a submit --------------------------------------------------------------------------------------


def close_race() -> None:
    cached_then_error()
    if rank == VICTIM:  # contexts of this rank alone (COMM_SELF): the race is local
        hangs, rounds = 0, 40
        for _ in range(rounds):
            context = ddlfast.Context(MPI.COMM_SELF)
            handles: list = []
            outcome: dict = {}
            go = threading.Event()

            def submitter(context=context, handles=handles, outcome=outcome, go=go) -> None:
                context.hand_over()
                go.set()
                try:
                    while True:
                        handles.append(context.allreduce_async(np.ones(64, np.float32)))
                except ddlfast.DdlfastError as error:
                    outcome["refused"] = str(error)

            thread = threading.Thread(target=submitter)
            thread.start()
            go.wait(30)
            time.sleep(0.001)
            context.close()
            thread.join(30)
            expect("closed" in outcome.get("refused", ""), f"a submit after close: {outcome}")
            for handle in handles:
                try:
                    handle.wait(timeout=30)
                except ddlfast.DdlfastError as error:
                    if "did not complete" in str(error):
                        hangs += 1
        expect(hangs == 0, f"{hangs} handles never completed")
        print(f"TIME rank {rank} close-race {rounds} rounds, {hangs} hung handles", flush=True)
    comm.Barrier()
    checked_sum(seed=6)


# -- 4. Ctrl-C -------------------------------------------------------------------------------------------------------


def interrupt_in_wait() -> None:
    """The victim waits on rank 0, which sleeps; SIGINT reaches the victim: KeyboardInterrupt there within a
    fraction of a second, and every other rank raises DdlfastError naming it."""
    path = sys.argv[2]  # "fast": the latency path; "general": fused_allreduce of two dtypes
    context = ddlfast.default_context()
    cached_then_error(context)
    inputs = [np.ones(1024, np.float32), np.ones(100, np.float64)]
    run = ((lambda: context.allreduce(inputs[0])) if path == "fast"
           else (lambda: context.fused_allreduce(inputs)))
    run()  # this very call's layout cached
    inputs[0][...] = 1
    comm.Barrier()
    if rank == 0:
        time.sleep(3.0)  # the peer the victim waits on
    sent = [0.0]
    if rank == VICTIM:
        def interrupt() -> None:
            sent[0] = time.perf_counter()
            print(f"TIME rank {rank} SIGINT sent at {time.time():.4f}", flush=True)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Timer(0.5, interrupt).start()
    start = time.perf_counter()
    error = caught(run)
    end = time.perf_counter()
    if rank == VICTIM:
        expect(isinstance(error, KeyboardInterrupt), f"the interrupted rank got {error!r}")
        print(f"TIME rank {rank} SIGINT to KeyboardInterrupt {(end - sent[0]) * 1e3:.1f} ms", flush=True)
        expect_error(run, ddlfast.DdlfastBrokenError, "interrupted")
    elif error is None and path == "fast":
        # The latency path's butterfly can complete on a rank whose partners sent every message before one of them
        # was interrupted: then its numbers are right (every contribution arrived), and its next call fails
        # naming the interrupted rank.
        expect(np.array_equal(inputs[0], np.full(1024, world, np.float32)), f"rank {rank}: wrong {inputs[0][:4]}")
        later = caught(run)
        expect(isinstance(later, ddlfast.DdlfastError) and "rank 1" in str(later) and "interrupted" in str(later),
               f"rank {rank}'s next call got {later!r}")
        print(f"TIME rank {rank} completed its call with the right numbers; the next one raised: {later}", flush=True)
    else:
        expect(isinstance(error, ddlfast.DdlfastError), f"rank {rank} got {error!r}")
        expect("rank 1" in str(error) and "interrupted" in str(error), f"rank {rank}: {error}")
        print(f"TIME rank {rank} error at {time.time():.4f}, {(end - start) * 1e3:.0f} ms after entering the call: "
              f"{error}", flush=True)
        expect_error(run, ddlfast.DdlfastBrokenError)


def interrupt_after_completion() -> None:
    """SIGINT lands while the victim's wait spins (DDLFAST_SPIN_US: it never polls for signals there) and the
    collective then completes: the result stands on every rank, KeyboardInterrupt comes afterwards, and the
    context stays usable. Where the scheduler made the wait longer than the spin, the core saw the signal in the
    wait instead: then every rank must have failed naming the victim (both outcomes are checked; which one
    happened is printed)."""
    path = sys.argv[2]
    context = ddlfast.default_context()
    cached_then_error(context)
    rounds, stood = 5, 0
    for i in range(rounds):
        a = np.full(1024, float(rank + i), np.float32)
        b = np.full(100, float(2 * rank + i), np.float64)
        run = ((lambda a=a: context.allreduce(a)) if path == "fast"
               else (lambda a=a, b=b: context.fused_allreduce([a, b])))
        comm.Barrier()
        if rank == 0:
            time.sleep(0.04)
        # On a loaded machine the signal may land anywhere around the call, and every place has its right outcome:
        # before the call reached ddlfast (the victim then makes the call it owes), while ddlfast prepared it (a
        # refusal on every rank), in the wait (a broken context naming the victim), after completion in the core
        # (the result stands), after the call returned (it stood too).
        timer = threading.Timer(0.01, lambda: os.kill(os.getpid(), signal.SIGINT))
        sequence = context._state.core.sequence
        error = caught((lambda t=timer, r=run: (t.start(), r())) if rank == VICTIM else run)
        if rank == VICTIM and isinstance(error, KeyboardInterrupt) and context._state.core.sequence == sequence:
            print(f"TIME rank {rank} after-completion round {i}: the signal came before the call", flush=True)
            expect(caught(run) is None, f"round {i}: the call made after the signal failed")
        if rank == VICTIM and error is None:
            late = caught(lambda t=timer: (t.join(), time.sleep(0.2)))  # the interrupt lands here: the call stood
            error = late if isinstance(late, KeyboardInterrupt) else error
        refused = comm.allgather(isinstance(error, ddlfast.DdlfastError) and "before any data moved" in str(error)
                                 or (rank == VICTIM and isinstance(error, KeyboardInterrupt)
                                     and context.broken_reason is None and a[0] == rank + i))
        if all(refused):  # the timer fired while the victim still prepared its call: refused on every rank
            expect(a[0] == rank + i, f"round {i}: a refused call wrote its array: {a[:2]}")
            print(f"TIME rank {rank} after-completion round {i}: the signal came before any data moved", flush=True)
            checked_sum(context, seed=20 + i)
            continue
        broken = comm.allreduce(context.broken_reason is not None, op=MPI.LOR)
        if broken:
            if rank == VICTIM:  # broken only by the core seeing the signal in a wait, never for a completed call
                reason = context.broken_reason or ""
                expect(isinstance(error, KeyboardInterrupt) and "was interrupted" in reason,
                       f"round {i}: {error!r}, broken: {reason}")
            else:
                expect(isinstance(error, ddlfast.DdlfastError) and "rank 1" in str(error),
                       f"round {i}, rank {rank}: {error!r}")
            print(f"TIME rank {rank} after-completion round {i}: the core saw the signal in its wait", flush=True)
            return
        expect(a[0] == sum(r + i for r in range(world)), f"round {i}: the result did not stand: {a[:2]}")
        if path == "general":
            expect(b[0] == sum(2 * r + i for r in range(world)), f"round {i}: b = {b[:2]}")
        if rank == VICTIM:
            expect(isinstance(error, KeyboardInterrupt), f"round {i}: {error!r}")
        stood += 1
        checked_sum(context, seed=10 + i)  # the context is usable on every rank
    print(f"TIME rank {rank} after-completion: {stood} of {rounds} rounds stood", flush=True)


CASES = {
    "second-thread": second_thread, "fork": forked_child, "close-race": close_race,
    "interrupt-in-wait": interrupt_in_wait, "interrupt-after-completion": interrupt_after_completion,
}

if __name__ == "__main__":
    if CASE.startswith("interrupt") and rank == VICTIM:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # mpiexec may start ranks with SIGINT ignored
    CASES[CASE]()
    for problem in problems:
        print(f"rank {rank}: PROBLEM {CASE}: {problem}", flush=True)
    if not problems:
        print(f"rank {rank}: ok {CASE}", flush=True)
    sys.stdout.flush()
    sys.exit(1 if problems else 0)
