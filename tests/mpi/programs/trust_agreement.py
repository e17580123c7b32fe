"""The agreement's own faults, on one rank: every rank's outcome is asserted.

Run as `mpiexec -n P python trust_agreement.py CASE`. Each case first runs the call it breaks (so its layout is
cached), then a caught bad-input error (so the fault comes after an earlier error), then the fault on rank 1
only, then checks the context still gives the right numbers. A rank prints `rank R: ok CASE` and exits 0 when its
own checks pass. No timing is asserted: a fault that took the slow route (the stall limit instead of the
agreement) shows up as DdlfastTimeoutError, which every case refuses.

- named-skip: rank 1 skips step 3 of a loop of same-layout calls that pass name=step; every form of collective.
- validation-exception: an exception that is not a DdlfastError (RuntimeError, MemoryError) raised on rank 1 while
  its arguments are validated; every form of collective.
- validation-interrupt: KeyboardInterrupt on rank 1 while its arguments are validated: it propagates there, a
  refusal takes the call's place in order, and the others raise at this call; the context stays usable.
"""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

import ddlfast

CASE = sys.argv[1]
comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
problems: list[str] = []
LARGE = 70_000  # float32 elements: above DDLFAST_SMALL_BYTES, so the ring runs


def expect(condition: bool, message: str) -> None:
    if not condition:
        problems.append(message)


def raises(action, kind: type, *needles: str) -> str:
    try:
        action()
    except BaseException as error:  # noqa: BLE001 - checked below
        text = f"{type(error).__name__}: {error}"
        expect(isinstance(error, kind), f"expected {kind.__name__}, got {text}")
        expect(not isinstance(error, ddlfast.DdlfastTimeoutError), f"the slow route (a stall): {text}")
        for needle in needles:
            expect(needle in str(error), f"message lacks {needle!r}: {text}")
        return str(error)
    problems.append(f"expected {kind.__name__}, nothing was raised")
    return ""


def check_healthy() -> None:
    """Right numbers, identical on every rank, on the small path and the ring."""
    for n in (100, LARGE):
        x = np.arange(n, dtype=np.float32) * (rank + 1)
        ddlfast.fused_allreduce([x, np.full(7, rank, np.float64)])
        want = (np.arange(n, dtype=np.float64) * sum(r + 1 for r in range(world))).astype(np.float32)
        expect(np.array_equal(x, want), f"wrong numbers after the fault (n={n})")
        expect(len(set(comm.allgather(x.tobytes()))) == 1, "results differ across ranks after the fault")


class BadOp(str):
    """An op that passes isinstance(op, str) but fails when validation hashes it."""

    failure: BaseException = RuntimeError("injected while validating")

    def __hash__(self) -> int:
        raise self.failure

    def __eq__(self, other: object) -> bool:
        raise self.failure


def forms(op: object, name: object = None) -> dict:
    """Every public collective, as a callable taking the op (or name) under test, with an independent check."""
    big = np.full(LARGE, rank + 1, np.float32)
    total = float(sum(r + 1 for r in range(world)))

    def allreduce_small() -> None:
        x = np.full(1000, rank + 1, np.float32)
        ddlfast.allreduce(x, op=op, name=name)
        expect(np.all(x == total), "allreduce (latency path)")

    def allreduce_large() -> None:
        x = big.copy()
        ddlfast.allreduce(x, op=op, name=name)
        expect(np.all(x == total), "allreduce (ring)")

    def fused() -> None:
        x, y = big.copy(), np.full(10, rank, np.int64)
        ddlfast.fused_allreduce([x, y], op=op, name=name)
        expect(np.all(x == total) and np.all(y == sum(range(world))), "fused_allreduce")

    def fused_async() -> None:
        x, y = big.copy(), big.copy()
        ddlfast.fused_allreduce_async([x, y], op=op, name=name).wait()
        expect(np.all(x == total) and np.all(y == total), "fused_allreduce_async")

    def reduce_scatter() -> None:
        out = ddlfast.reduce_scatter(np.full(LARGE * world, rank + 1, np.float32), op=op, name=name)
        expect(out.shape == (LARGE,) and np.all(out == total), "reduce_scatter")

    def fused_reduce_scatter_async() -> None:
        a, b = np.full(LARGE * world, rank + 1, np.float32), np.full(8 * world, rank, np.float64)
        got = ddlfast.fused_reduce_scatter_async([a, b], op=op, name=name).wait()
        expect(np.all(got[0] == total) and np.all(got[1] == sum(range(world))), "fused_reduce_scatter_async")

    forms = {"allreduce-small": allreduce_small, "allreduce-large": allreduce_large, "fused": fused,
             "fused-async": fused_async, "reduce-scatter": reduce_scatter,
             "fused-reduce-scatter-async": fused_reduce_scatter_async}
    if type(op) is str and op == "sum":  # the collectives without an op
        def allgather() -> None:
            got = ddlfast.allgather(np.full(LARGE, rank, np.float32), name=name)
            expect(np.array_equal(got, np.repeat(np.arange(world, dtype=np.float32), LARGE)), "allgather")

        def broadcast() -> None:
            x = np.full(LARGE, rank, np.float32)
            ddlfast.broadcast(x, root=world - 1, name=name)
            expect(np.all(x == world - 1), "broadcast")

        def barrier() -> None:
            ddlfast.barrier(name=name)

        def objects() -> None:
            expect(ddlfast.allgather_object({"r": rank}, name=name) == [{"r": r} for r in range(world)],
                   "allgather_object")

        forms.update({"allgather": allgather, "broadcast": broadcast, "barrier": barrier, "objects": objects})
    return forms


def named_skip() -> None:
    """A loop of same-layout calls named by their step: rank 1 skips step 3, and the next call meets a different
    name on every rank (unnamed, the same skip pairs step k with step k+1 unseen: docs/trust.md)."""
    for form in forms("sum"):
        for step in range(6):
            if rank == 1 and step == 3:
                continue  # the skipped step
            call = forms("sum", name=f"step {step}")[form]
            if step == 4 or (rank != 1 and step == 3):
                raises(call, ddlfast.DdlfastConsistentError, "different names", "rank 1 passed name='step 4'")
                break
            call()
    check_healthy()


def validation_exception() -> None:
    """A RuntimeError and a MemoryError raised on rank 1 only while the call is validated: every rank raises a
    DdlfastError at this call (rank 1's names the exception), and the context stays usable."""
    for failure in (RuntimeError("injected while validating"), MemoryError("injected")):
        BadOp.failure = failure
        for form in forms("sum"):
            if form in ("allgather", "broadcast", "barrier", "objects"):
                continue  # no op: injected through root= below
            forms("sum")[form]()  # cached
            raises(lambda f=form: forms("not-an-op")[f](), ddlfast.DdlfastError, "not-an-op")  # an earlier error
            op = BadOp("sum") if rank == 1 else "sum"
            message = raises(lambda f=form, op=op: forms(op)[f](), ddlfast.DdlfastError, "rank 1")
            expect(type(failure).__name__ in message, f"{form}: the exception is not named: {message}")
        x = np.arange(10, dtype=np.float32)
        raises(lambda x=x: ddlfast.broadcast(x, root=_BadRoot(0) if rank == 1 else 0), ddlfast.DdlfastError,
               "rank 1", "RuntimeError")
    check_healthy()


class _BadRoot(int):
    def __ge__(self, other: object) -> bool:
        raise RuntimeError("injected root comparison")

    __le__ = __lt__ = __gt__ = __ge__


def validation_interrupt() -> None:
    """KeyboardInterrupt while rank 1 validates: it propagates there, and a refusal takes the call's place in
    order, so the others raise at this call naming rank 1 and the context stays usable (blocking and async)."""
    x = np.full(LARGE, rank + 1, np.float32)
    for form in ("blocking", "async"):
        def call(op: object, form: str = form) -> None:
            if form == "blocking":
                ddlfast.fused_allreduce([x, x.copy()], op=op)
            else:
                ddlfast.fused_allreduce_async([x, x.copy()], op=op).wait()

        call("sum")
        BadOp.failure = KeyboardInterrupt()
        if rank == 1:
            raises(lambda call=call: call(BadOp("sum")), KeyboardInterrupt)
        else:
            raises(lambda call=call: call("sum"), ddlfast.DdlfastConsistentError, "rank 1: KeyboardInterrupt")
    check_healthy()


def torch_skipped_batch() -> None:
    """A training loop in which rank 1 skips batch 2 (`continue`, as a loss check on one rank would): with
    set_step(step), ddlfast.torch's buckets and the DDP hook's buckets are named by the loop's step, so every rank
    raises at rank 1's next bucket, naming the ranks' steps. Unnamed, the same skip would average batch 3 of rank 1
    with batch 2 of the others."""
    import torch
    import torch.distributed as dist

    import ddlfast.torch as dt

    torch.manual_seed(0)
    torch.set_num_threads(1)

    def model() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

    def train(step_of: object, backward: object) -> None:
        for step in range(5):
            if rank == 1 and step == 2:
                continue  # the skipped batch
            step_of(step)
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            if step == 3 or (rank != 1 and step == 2):
                raises(lambda x=x: backward(x), Exception, "different names")
                return
            backward(x)
        problems.append("the skipped batch was not detected")

    # 1. ddlfast.torch.distribute
    net = model()
    dt.broadcast_parameters(net)
    reducer = dt.distribute(net, bucket_bytes=256, first_bucket_bytes=128)  # several buckets
    optimizer = dt.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), reducer)

    def distributed_step(x: torch.Tensor) -> None:
        optimizer.zero_grad()
        net(x).square().mean().backward()
        optimizer.step()

    train(reducer.set_step, distributed_step)
    # 2. DDP with ddlfast's hook, on the ddlfast backend
    dt.init_process_group(backend="ddlfast")
    ddp = torch.nn.parallel.DistributedDataParallel(model(), bucket_cap_mb=0.0001)
    state = dt.HookState()
    ddp.register_comm_hook(state, dt.allreduce_hook)

    def ddp_step(x: torch.Tensor) -> None:
        ddp.zero_grad()
        ddp(x).square().mean().backward()

    train(state.set_step, ddp_step)
    dist.destroy_process_group()


CASES = {"named-skip": named_skip, "validation-exception": validation_exception,
         "validation-interrupt": validation_interrupt, "torch-skipped-batch": torch_skipped_batch}

if __name__ == "__main__":
    CASES[CASE]()
    for problem in problems:
        print(f"rank {rank}: PROBLEM {CASE}: {problem}", flush=True)
    if not problems:
        print(f"rank {rank}: ok {CASE}", flush=True)
    sys.exit(1 if problems else 0)
