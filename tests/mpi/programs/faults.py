"""Fault injection on one rank (or all): every rank's outcome is asserted.

Run as `mpiexec -n P python faults.py CASE`. Each case injects one fault of the
trust issue's classes — per-rank mismatches after layouts were cached, per-rank
alignment, aliasing, one rank skipping a call, per-rank settings, errors
followed by more calls, closing after errors, thread levels — and every rank
checks what it got: the right numbers, or a DdlfastError of the right kind that
names what is wrong. A rank prints `rank R: ok CASE` and exits 0 when its own
checks pass; any other exit fails the test. No timing is asserted: a fault
that took the slow route (a stall limit instead of the agreement) shows up as
the wrong error type or message.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

CASE = sys.argv[1]
if CASE == "env-differs-at-creation":
    from mpi4py import MPI as _MPI

    if _MPI.COMM_WORLD.Get_rank() == 1:
        os.environ["DDLFAST_SMALL_BYTES"] = "65536"
if CASE == "halving-differs-at-creation":
    from mpi4py import MPI as _MPI

    if _MPI.COMM_WORLD.Get_rank() == 1:
        os.environ["DDLFAST_HALVING_BYTES"] = "400"
if CASE == "emulated-hosts-differ":
    from mpi4py import MPI as _MPI

    if _MPI.COMM_WORLD.Get_rank() == 1:
        os.environ["DDLFAST_EMULATED_HOSTS"] = "2"

from mpi4py import MPI  # noqa: E402

import ddlfast  # noqa: E402

comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
problems: list[str] = []


def expect(condition: bool, message: str) -> None:
    if not condition:
        problems.append(message)


def raises(action, kind: type = ddlfast.DdlfastError, *needles: str, not_kind: type | None = None) -> str:
    """Runs action; expects `kind` (not `not_kind`) whose message contains every needle. Returns the message."""
    try:
        action()
    except BaseException as error:  # noqa: BLE001 - we check its type below
        text = f"{type(error).__name__}: {error}"
        expect(isinstance(error, kind), f"expected {kind.__name__}, got {text}")
        if not_kind is not None:
            expect(not isinstance(error, not_kind), f"expected no {not_kind.__name__}, got {text}")
        for needle in needles:
            expect(needle in str(error), f"message lacks {needle!r}: {text}")
        return str(error)
    problems.append(f"expected {kind.__name__}, nothing was raised")
    return ""


def reference(values_of_rank, op: str = "sum") -> np.ndarray:
    total = sum(values_of_rank(r).astype(np.float64) for r in range(world))
    return total / world if op == "average" else total


def check_healthy() -> None:
    """After a consistent error the context still gives the right numbers, identical on every rank."""
    x = np.arange(5000, dtype=np.float32) * (rank + 1)
    ddlfast.fused_allreduce([x, np.full(7, rank, np.float64)])
    want = np.arange(5000, dtype=np.float64) * sum(r + 1 for r in range(world))
    expect(np.array_equal(x, want.astype(np.float32)), "wrong numbers after a recovered error")
    digests = comm.allgather(x.tobytes())
    expect(len(set(digests)) == 1, "results differ across ranks after a recovered error")


def mismatch_after_cache() -> None:
    """float32[3000] on some ranks vs int32[3000] on rank 1, both layouts used (cached) before; then lengths."""
    f, i = np.ones(3000, np.float32), np.ones(3000, np.int32)
    for api in (lambda a: ddlfast.allreduce(a), lambda a: ddlfast.fused_allreduce([a, np.ones(4, a.dtype)])):
        api(f)
        api(i)
        raises(lambda api=api: api(i if rank == 1 else f), ddlfast.DdlfastError, "disagree",
               "rank 1 passed int32[3000]", not_kind=ddlfast.DdlfastBrokenError)
        g = np.ones(3001 if rank == 1 else 3000, np.float32)
        api(np.ones(3001, np.float32))
        raises(lambda api=api, g=g: api(g), ddlfast.DdlfastError, "rank 1 passed float32[3001]",
               not_kind=ddlfast.DdlfastBrokenError)
    small = np.ones(8, np.float32)  # the small-message path (<= DDLFAST_SMALL_BYTES)
    ddlfast.allreduce(small)
    raises(lambda: ddlfast.allreduce(np.ones(9 if rank == 1 else 8, np.float32)), ddlfast.DdlfastError,
           "rank 1 passed float32[9]", not_kind=ddlfast.DdlfastBrokenError)
    check_healthy()


def skipped_call() -> None:
    """Rank 1 skips a call the others make: the next call meets a different collective, not garbage."""
    a, b = np.ones(100, np.float32), np.ones(200, np.float32)
    ddlfast.allreduce(a)
    if rank != 1:
        raises(lambda: ddlfast.allreduce(a), ddlfast.DdlfastError, "disagree",
               not_kind=ddlfast.DdlfastBrokenError)
    else:
        raises(lambda: ddlfast.allreduce(b), ddlfast.DdlfastError, "disagree",
               not_kind=ddlfast.DdlfastBrokenError)
    check_healthy()


def alignment() -> None:
    """A large array unaligned on one rank only, among others in one fused call: right numbers everywhere."""
    n = 100_003
    values = [lambda r, k=k: (np.arange(n) % 97 + r * 10 + k).astype(np.float32) for k in range(3)]
    arrays = []
    for k in range(3):
        raw = np.zeros(n * 4 + 8, np.uint8)
        offset = 1 if (rank == 1 and k == 1) else 0
        view = np.frombuffer(raw.data, dtype=np.float32, count=n, offset=offset) if offset else \
            raw[:n * 4].view(np.float32)
        view = view if view.flags.writeable else np.frombuffer(memoryview(raw)[offset:offset + n * 4], np.float32)
        view[...] = values[k](rank)
        arrays.append(view)
    arrays.append(np.full(10, rank, np.float32))  # a small one: packed
    ddlfast.fused_allreduce(arrays)
    for k in range(3):
        want = reference(lambda r, k=k: values[k](r)).astype(np.float32)
        expect(np.array_equal(arrays[k], want), f"array {k}: wrong numbers with per-rank alignment")
    expect(len(set(comm.allgather(b"".join(a.tobytes() for a in arrays)))) == 1, "bits differ across ranks")


def aliasing() -> None:
    """The same array twice, or overlapping views, on one rank or all: an error naming both indices."""
    big = np.ones(100_000, np.float32)
    raises(lambda: ddlfast.fused_allreduce([big, big]), ddlfast.DdlfastError, "arrays 0 and 1",
           "overlap", not_kind=ddlfast.DdlfastBrokenError)
    other = np.ones(100_000, np.float32)
    whole = np.ones(200_000, np.float32)
    mine = [whole[:120_000], whole[100_000:]] if rank == world - 1 else [other, np.ones(100_000, np.float32)]
    if rank == world - 1:
        mine = [whole[:120_000][:100_000], whole[50_000:150_000]]
    raises(lambda: ddlfast.fused_allreduce(mine), ddlfast.DdlfastError, f"rank {world - 1}", "overlap",
           not_kind=ddlfast.DdlfastBrokenError)
    check_healthy()


def bad_input_one_rank() -> None:
    """Bad input on one rank reaches every rank through the agreement: its message, not a timeout."""
    good = np.ones(1000, np.float32)
    strided = np.ones(2000, np.float32)[::2]
    raises(lambda: ddlfast.allreduce(strided if rank == 1 else good), ddlfast.DdlfastError, "rank 1",
           "not C-contiguous", not_kind=ddlfast.DdlfastBrokenError)
    raises(lambda: ddlfast.fused_allreduce([good, np.ones(3, np.float32)], op="mean" if rank == 0 else "sum"),
           ddlfast.DdlfastError, "rank 0", "op='mean'", not_kind=ddlfast.DdlfastBrokenError)
    readonly = np.ones(1000, np.float32)
    readonly.flags.writeable = rank != world - 1
    raises(lambda: ddlfast.broadcast(readonly), ddlfast.DdlfastError, "read-only",
           not_kind=ddlfast.DdlfastBrokenError)
    handle = None
    try:
        handle = ddlfast.allreduce_async(strided if rank == 1 else good)
    except ddlfast.DdlfastError as error:
        expect(rank == 1 and "not C-contiguous" in str(error), f"async refusal on rank {rank}: {error}")
    if handle is not None:
        raises(handle.wait, ddlfast.DdlfastError, "rank 1", "not C-contiguous",
               not_kind=ddlfast.DdlfastBrokenError)
    check_healthy()


def broadcast_roots() -> None:
    """Both roots were used before; then every rank names itself as root: an error, not a hang."""
    x = np.full(1000, rank, np.float32)
    ddlfast.broadcast(x, root=0)
    expect(np.all(x == 0), "broadcast from root 0")
    ddlfast.broadcast(x, root=1)
    raises(lambda: ddlfast.broadcast(x, root=rank), ddlfast.DdlfastError, "disagree on root",
           not_kind=ddlfast.DdlfastBrokenError)
    y = np.full(1000, rank, np.float32)
    ddlfast.broadcast(y, root=world - 1)
    expect(np.all(y == world - 1), "broadcast after a refused one")
    check_healthy()


def env_differs_at_creation() -> None:
    """DDLFAST_SMALL_BYTES differs on rank 1 when the context is created: named at once."""
    raises(lambda: ddlfast.allreduce(np.ones(10, np.float32)), ddlfast.DdlfastError, "DDLFAST_SMALL_BYTES",
           "rank 1 passed DDLFAST_SMALL_BYTES=65536")


def halving_differs_at_creation() -> None:
    """DDLFAST_HALVING_BYTES (how the latency path's messages are cut) set on rank 1 only: named at once, never
    ranks running different steps."""
    raises(lambda: ddlfast.allreduce(np.ones(100, np.float32)), ddlfast.DdlfastError, "DDLFAST_HALVING_BYTES",
           "rank 1 passed DDLFAST_HALVING_BYTES=400")


def emulated_hosts_differ() -> None:
    """DDLFAST_EMULATED_HOSTS (the placement reproducible=True's chain follows) set on rank 1 only: every rank
    names it when the context is created, instead of running different orders."""
    raises(lambda: ddlfast.allreduce(np.ones(10, np.float32), reproducible=True), ddlfast.DdlfastError,
           "DDLFAST_EMULATED_HOSTS differs between the ranks", "rank 1: 2")


def env_differs_later() -> None:
    """An engine setting changed on one rank after layouts were cached: the next call names it."""
    x = np.ones(300_000, np.float32)
    ddlfast.allreduce(x)
    if rank == 0:
        os.environ["DDLFAST_CHUNK_BYTES"] = "64KiB"
    raises(lambda: ddlfast.allreduce(x), ddlfast.DdlfastError, "DDLFAST_CHUNK_BYTES",
           not_kind=ddlfast.DdlfastBrokenError)
    os.environ.pop("DDLFAST_CHUNK_BYTES", None)
    check_healthy()


class FailingCodec:
    """A user codec that raises on one rank, mid-collective (after the agreement)."""

    def compress(self, bucket: np.ndarray, state: dict) -> list[np.ndarray]:
        if rank == 1:
            raise RuntimeError("codec failure injected on rank 1")
        return [bucket.reshape(-1).copy()]

    def decompress(self, payloads, bucket, state) -> None:
        bucket[...] = sum(p[0] for p in payloads)


def error_then_calls() -> None:
    """A failure mid-collective on one rank: every rank raises, then every later call refuses (no wrong data,
    no hang), and close() returns."""
    x = np.ones(1000, np.float32)
    ddlfast.allreduce(x)
    message = raises(lambda: ddlfast.fused_allreduce([x], compression=FailingCodec()), ddlfast.DdlfastBrokenError)
    if rank != 1:
        expect("rank 1 abandoned" in message, f"rank {rank} was not told who failed: {message}")
    else:
        expect("codec failure injected" in message, message)
    for _ in range(3):
        raises(lambda: ddlfast.allreduce(x), ddlfast.DdlfastBrokenError, "unusable")
        raises(lambda: ddlfast.fused_allreduce([x, x.copy()]), ddlfast.DdlfastBrokenError, "unusable")
        raises(lambda: ddlfast.broadcast(x), ddlfast.DdlfastBrokenError, "unusable")
    raises(lambda: ddlfast.allreduce_async(x).wait(), ddlfast.DdlfastBrokenError, "unusable")
    ddlfast.api.default_context().close()
    raises(lambda: ddlfast.allreduce(x), ddlfast.DdlfastError, "closed")


def stall_then_calls() -> None:
    """One rank never joins: the others name it, later calls refuse at once; the late rank is told too."""
    x = np.ones(300_000, np.float32)
    ddlfast.allreduce(x)
    comm.Barrier()
    timeout = float(os.environ["DDLFAST_TIMEOUT_S"])
    if rank == world - 1:
        time.sleep(timeout + 4)  # past the others' stall limit and census
        raises(lambda: ddlfast.allreduce(x), ddlfast.DdlfastBrokenError, "gave up waiting")
    else:
        raises(lambda: ddlfast.allreduce(x), ddlfast.DdlfastTimeoutError, f"rank {world - 1} did not join")
        raises(lambda: ddlfast.allreduce(x), ddlfast.DdlfastBrokenError, "unusable")
    ddlfast.api.default_context().close()


def close_with_work_in_flight() -> None:
    """Queued work waits for a rank that never calls; close() still returns (the work is stall-limited), the
    handle says who was missing, and the interpreter exits without MPI being touched from two threads."""
    x = np.ones(300_000, np.float32)
    ddlfast.allreduce(x)
    comm.Barrier()
    if rank == world - 1:
        return  # never joins; exits once the others are done (its context closes at exit too)
    handle = ddlfast.allreduce_async(x)
    ddlfast.api.default_context().close()
    expect(handle.done(), "close() returned before the queued collective ended")
    raises(handle.wait, ddlfast.DdlfastTimeoutError, f"rank {world - 1} did not join")


def thread_level() -> None:
    """MPI below THREAD_MULTIPLE: async calls say how to fix it; blocking calls still work."""
    expect(MPI.Query_thread() < MPI.THREAD_MULTIPLE, f"thread level {MPI.Query_thread()}")
    x = np.ones(1000, np.float32)
    ddlfast.allreduce(x)
    expect(np.all(x == world), "blocking allreduce below THREAD_MULTIPLE")
    raises(lambda: ddlfast.allreduce_async(x), ddlfast.DdlfastError, "MPI_THREAD_MULTIPLE",
           "MPI4PY_RC_THREAD_LEVEL")
    y = np.ones(10, np.float32)
    ddlfast.fused_allreduce([y, y.copy()])
    expect(np.all(y == world), "blocking fused call after a refused async one")


def bad_environment() -> None:
    """An out-of-range value: a DdlfastError naming the variable, on every rank (no C++ abort)."""
    os.environ["DDLFAST_RECEIVES_IN_FLIGHT"] = "100000000"
    raises(lambda: ddlfast.allreduce(np.ones(300_000, np.float32)), ddlfast.DdlfastError,
           "DDLFAST_RECEIVES_IN_FLIGHT")
    os.environ["DDLFAST_RECEIVES_IN_FLIGHT"] = "4"
    os.environ["DDLFAST_CHUNK_BYTES"] = "8"
    raises(lambda: ddlfast.allreduce(np.ones(300_000, np.float32)), ddlfast.DdlfastError, "DDLFAST_CHUNK_BYTES")
    os.environ.pop("DDLFAST_CHUNK_BYTES")
    check_healthy()


CASES = {
    "mismatch-after-cache": mismatch_after_cache, "skipped-call": skipped_call, "alignment": alignment,
    "aliasing": aliasing, "bad-input-one-rank": bad_input_one_rank, "broadcast-roots": broadcast_roots,
    "env-differs-at-creation": env_differs_at_creation, "env-differs-later": env_differs_later,
    "error-then-calls": error_then_calls, "stall-then-calls": stall_then_calls, "thread-level": thread_level,
    "close-with-work-in-flight": close_with_work_in_flight, "emulated-hosts-differ": emulated_hosts_differ,
    "halving-differs-at-creation": halving_differs_at_creation, "bad-environment": bad_environment,
}

if __name__ == "__main__":
    CASES[CASE]()
    for problem in problems:
        print(f"rank {rank}: PROBLEM {CASE}: {problem}", flush=True)
    if not problems:
        print(f"rank {rank}: ok {CASE}", flush=True)
    sys.exit(1 if problems else 0)
