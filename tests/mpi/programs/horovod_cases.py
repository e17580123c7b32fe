"""Runs on every rank: ddlfast.horovod.torch as a Horovod script uses it (the ground Horovod's own
test/parallel/test_torch.py covers, in a few seconds): allreduce with every op, integer average toward zero,
prescale/postscale, in place and async; named async calls submitted in different orders on different ranks
(matched by name), a duplicate name (ValueError on the rank that repeats it), grouped allreduce; allgather with
per-rank first dimensions and its gradient; broadcast (and a root that differs across ranks: an error on every
rank); alltoall with splits (and bad splits on one rank: an error on every rank); reducescatter with uneven rows;
join with named allreduces; process sets; DistributedOptimizer against a NumPy reference; broadcast_parameters
and broadcast_optimizer_state; sizes above DDLFAST_SMALL_BYTES. Prints "N cases on P ranks, F failures".
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator

import torch
from harness import report_results
from mpi4py import MPI

import ddlfast.horovod.torch as hvd

comm = MPI.COMM_WORLD
results: list[tuple[str, str | None]] = []


def check(label: str, ok: bool, detail: str = "") -> None:
    results.append((label, None if ok else detail or "wrong result"))


def raises_everywhere(label: str, call: object, *exceptions: type) -> None:
    """Every rank must raise one of `exceptions` (never hang: every wait is stall-limited)."""
    try:
        call()  # type: ignore[operator]
        raised = None
    except exceptions as error:
        raised = type(error).__name__
    everyone = comm.allgather(raised)
    check(label, all(everyone), f"raised per rank: {everyone}")


@contextlib.contextmanager
def stall_limit(seconds: str) -> Iterator[None]:
    """DDLFAST_TIMEOUT_S for the calls inside (each call reads it)."""
    saved = os.environ.get("DDLFAST_TIMEOUT_S")
    os.environ["DDLFAST_TIMEOUT_S"] = seconds
    try:
        yield
    finally:
        if saved is None:
            del os.environ["DDLFAST_TIMEOUT_S"]
        else:
            os.environ["DDLFAST_TIMEOUT_S"] = saved


def values(rank: int, shape: tuple, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * rank + salt)
    return torch.randint(-100, 100, shape, generator=generator).to(dtype)


def settings_differ_on_one_rank(rank: int, size: int) -> None:
    """Every setting that changes a reduction's result (Horovod's integer Average against Sum, the scale factors)
    differing on rank 0 alone, below and above DDLFAST_SMALL_BYTES, plain, grouped, named (negotiated, fused)
    and reducescatter: an error on every rank, never ranks with different numbers; the context usable after."""
    for n in (2, 5000):
        settings_differ_at(n, rank, size)
    odd = rank == 0
    try:
        hvd.allreduce(torch.ones(3, dtype=torch.int32), op=hvd.Average if odd else hvd.Sum)
    except RuntimeError as error:
        check("the error names the settings", "op=Average" in str(error) and "op=Sum" in str(error), str(error))
    agreed = hvd.allreduce(torch.full((5000,), 2 * rank + 1, dtype=torch.int32), op=hvd.Sum, postscale_factor=2.0)
    check("the context is usable after the mismatches", torch.all(agreed == 2 * size * size).item())


def settings_differ_at(n: int, rank: int, size: int) -> None:
    odd = rank == 0
    ints = torch.full((n,), 2 * rank + 1, dtype=torch.int32)
    raises_everywhere(f"integer Average on one rank, Sum on the others [{n}]",
                      lambda: hvd.allreduce(ints, op=hvd.Average if odd else hvd.Sum), RuntimeError)
    raises_everywhere(f"prescale_factor differs on one rank [{n}]",
                      lambda: hvd.allreduce(torch.ones(n), op=hvd.Sum, prescale_factor=2.0 if odd else 1.0),
                      RuntimeError)
    raises_everywhere(f"postscale_factor differs on one rank [{n}]",
                      lambda: hvd.allreduce(torch.ones(n), postscale_factor=0.5 if odd else 1.0), RuntimeError)
    raises_everywhere(f"grouped: postscale_factor differs on one rank [{n}]",
                      lambda: hvd.grouped_allreduce([torch.ones(n), torch.ones(3)], op=hvd.Sum,
                                                    postscale_factor=3.0 if odd else 1.0), RuntimeError)
    raises_everywhere(f"reducescatter: prescale_factor differs on one rank [{n}]",
                      lambda: hvd.reducescatter(torch.ones(size, n), op=hvd.Sum,
                                                prescale_factor=0.25 if odd else 1.0), RuntimeError)

    def named(values: torch.Tensor) -> None:  # negotiated by name and fused into one ddlfast call
        handles = [hvd.allreduce_async(values, name=f"first.{n}", op=hvd.Sum),
                   hvd.allreduce_async(values, name=f"more.{n}", op=hvd.Average if odd else hvd.Sum),
                   hvd.allreduce_async(values, name=f"last.{n}", op=hvd.Sum)]
        failures = []
        for handle in handles:
            try:
                hvd.synchronize(handle)
            except RuntimeError as error:
                failures.append(error)
        if failures:
            raise failures[0]

    # Integers: the same ddlfast op (a sum) either way; floats: another ddlfast op, which fused the calls into
    # other groups on that rank (ranks then made different numbers of ddlfast calls, out of step for good).
    raises_everywhere(f"named, fused: integer Average on one rank [{n}]", lambda: named(ints), RuntimeError)
    sparse = torch.sparse_coo_tensor(torch.tensor([[rank % n]]), torch.ones(1), size=(n,), check_invariants=True)
    raises_everywhere(f"sparse: Average on one rank [{n}]",
                      lambda: hvd.sparse_allreduce_async(sparse, op=hvd.Average if odd else hvd.Sum)(), RuntimeError)
    raises_everywhere(f"named, fused: float Average on one rank [{n}]", lambda: named(torch.ones(n)), RuntimeError)


def ranks_on_other_sets(rank: int, size: int) -> None:
    """Rank 0 calls on a process set of ranks 0 and 1, the others on the global set: each side waits for the
    other. Every rank raises, naming both sets, long before the stall limit (60 s here: reaching it would break
    both contexts, and the checks after it would fail), and both contexts go on in step."""
    pair = hvd.add_process_set([0, 1])

    def mismatched(n: int) -> None:
        hvd.allreduce(torch.ones(n), op=hvd.Sum, process_set=pair if rank == 0 else hvd.global_process_set)

    with stall_limit("60"):
        for n in (3, 5000):
            raises_everywhere(f"rank 0 on another process set [{n}]", functools.partial(mismatched, n), RuntimeError)
        try:
            mismatched(3)
        except RuntimeError as error:
            check("the error names the process sets", "different process sets" in str(error), str(error))
    check("the global set goes on", torch.all(hvd.allreduce(torch.ones(3), op=hvd.Sum) == size).item())
    if pair.included():
        check("the pair goes on", torch.all(hvd.allreduce(torch.ones(3), op=hvd.Sum, process_set=pair) == 2).item())
    hvd.remove_process_set(pair)


def main() -> int:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(1)
    for shape in ((17,), (40, 300)):  # below and above DDLFAST_SMALL_BYTES
        for dtype in (torch.int32, torch.int64, torch.float32, torch.float64, torch.int16):
            every = [values(r, shape, dtype) for r in range(size)]
            mine = every[rank]
            total = sum(t.to(torch.int64 if not dtype.is_floating_point else torch.float64) for t in every)
            summed = hvd.allreduce(mine, op=hvd.Sum)
            check(f"sum {dtype} {shape}", torch.equal(summed, total.to(dtype)))
            averaged = hvd.allreduce(mine)  # Horovod's default: Average
            if dtype.is_floating_point:
                check(f"average {dtype} {shape}", torch.allclose(averaged.double(), total / size))
            else:
                check(f"average toward zero {dtype} {shape}",
                      torch.equal(averaged, torch.div(total, size, rounding_mode="trunc").to(dtype)))
            check(f"min {dtype}", torch.equal(hvd.allreduce(mine, op=hvd.Min), torch.stack(every).min(0).values))
            check(f"max {dtype}", torch.equal(hvd.allreduce(mine, op=hvd.Max), torch.stack(every).max(0).values))
        scaled = hvd.allreduce(torch.ones(shape), op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
        check(f"prescale/postscale {shape}", torch.allclose(scaled, torch.full(shape, 1.5 * size)))
        in_place = torch.full(shape, float(rank))
        hvd.allreduce_(in_place, op=hvd.Sum)
        check("allreduce_ in place", torch.all(in_place == sum(range(size))).item())

    # Named async calls, submitted in a different order on every rank, matched by name.
    names = [f"grad.{i}" for i in range(5)]
    order = names[rank % len(names):] + names[:rank % len(names)]
    handles = {n: hvd.allreduce_async(torch.full((600,), float(int(n[-1]) + rank)), name=n, op=hvd.Sum)
               for n in order}
    for n in reversed(order):
        want = sum(int(n[-1]) + r for r in range(size))
        check(f"named {n}", torch.all(hvd.synchronize(handles[n]) == want).item())
    first = hvd.allreduce_async(torch.ones(3), name="dup")
    try:
        hvd.allreduce_async(torch.ones(3), name="dup")
        check("duplicate name", False, "no ValueError")
    except ValueError:
        check("duplicate name", True)
    check("the first of the duplicates", torch.all(hvd.synchronize(first) == 1.0).item())
    grouped = hvd.grouped_allreduce([torch.ones(4), torch.full((3000,), 2.0)], op=hvd.Sum)
    check("grouped", torch.all(grouped[0] == size).item() and torch.all(grouped[1] == 2.0 * size).item())

    # allgather with first dimensions that differ per rank, and its gradient (Horovod: the average's own rows)
    x = torch.full((rank + 1, 3), float(rank), requires_grad=True)
    gathered = hvd.allgather(x)
    want = torch.cat([torch.full((r + 1, 3), float(r)) for r in range(size)])
    check("allgather", torch.equal(gathered.detach(), want))
    gathered.sum().backward()
    check("allgather grad", torch.all(x.grad == 1.0).item(), f"{x.grad}")
    check("broadcast", torch.all(hvd.broadcast(torch.full((900,), float(rank)), 0) == 0).item())
    if size > 1:
        raises_everywhere("broadcast roots differ", lambda: hvd.broadcast(torch.ones(3), rank), RuntimeError)
        raises_everywhere("allreduce shapes differ", lambda: hvd.allreduce(torch.ones(rank + 1)), RuntimeError)
        raises_everywhere("allreduce dtypes differ",
                          lambda: hvd.allreduce(torch.ones(3, dtype=torch.float32 if rank else torch.float64)),
                          RuntimeError)
        raises_everywhere("alltoall bad splits on one rank",
                          lambda: hvd.alltoall(torch.ones(size), torch.tensor([1] * (size - 1) + [1 + (rank == 0)],
                                                                              dtype=torch.int32)),
                          RuntimeError)
        raises_everywhere("alltoall splits of float", lambda: hvd.alltoall(torch.ones(size),
                                                                          torch.ones(size)), ValueError)
        # A name each rank submits alone: every rank raises once it waited past the stall limit, naming it.
        with stall_limit("3"):
            lonely = hvd.allreduce_async(torch.ones(3), name=f"lonely.{rank}")
            raises_everywhere("names never matched", lambda: hvd.synchronize(lonely), RuntimeError)
        check("the context is usable after it", torch.all(hvd.allreduce(torch.ones(3), op=hvd.Sum) == size).item())
        settings_differ_on_one_rank(rank, size)
    splits = torch.tensor([r + 1 for r in range(size)], dtype=torch.int32)
    sent = torch.cat([torch.full((r + 1, 2), float(rank)) for r in range(size)])
    received, received_splits = hvd.alltoall(sent, splits)
    check("alltoall", received_splits.tolist() == [rank + 1] * size
          and torch.equal(received, torch.cat([torch.full((rank + 1, 2), float(r)) for r in range(size)])))
    rows = 2 * size + 1
    scattered = hvd.reducescatter(torch.ones(rows, 700), op=hvd.Sum)
    mine_rows = rows // size + (1 if rank < rows % size else 0)
    check("reducescatter uneven", scattered.shape == (mine_rows, 700) and torch.all(scattered == size).item())

    # join: rank 0 runs out of data; the others' named allreduces complete with its zeros.
    if rank == 0:
        last = hvd.join()
    else:
        handle = hvd.allreduce_async(torch.full((2000,), 3.0), name="after_join", op=hvd.Average)
        joined = hvd.synchronize(handle)
        check("average with a joined rank", torch.allclose(joined, torch.full((2000,), 3.0 * (size - 1) / size)))
        last = hvd.join()
    lasts = comm.allgather(last)
    check("join's last rank", len(set(lasts)) == 1 and (size == 1 or lasts[0] != 0), f"{lasts}")

    # process sets
    evens = hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    if evens.included():
        value = hvd.allreduce(torch.ones(5), op=hvd.Sum, process_set=evens)
        check("process set", torch.all(value == evens.size()).item())
    hvd.remove_process_set(evens)
    if size >= 3:
        ranks_on_other_sets(rank, size)

    # DistributedOptimizer: one SGD step on every rank's own data equals the step on the averaged gradient.
    torch.manual_seed(0)
    model = torch.nn.Linear(30, 20)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    inputs = [torch.Generator().manual_seed(r) for r in range(size)]
    batches = [torch.randn(8, 30, generator=g) for g in inputs]
    grads = []
    for batch in batches:
        reference = torch.nn.Linear(30, 20)
        reference.load_state_dict({n: before[n] for n in before})
        reference(batch).pow(2).sum().backward()
        grads.append({n: p.grad for n, p in reference.named_parameters()})
    optimizer.zero_grad()
    model(batches[rank]).pow(2).sum().backward()
    optimizer.step()
    for n, p in model.named_parameters():
        mean = sum(g[n].double() for g in grads) / size
        check(f"optimizer step {n}", torch.allclose(p.detach().double(), before[n].double() - 0.1 * mean, atol=1e-5))
    digests = comm.allgather(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    check("parameters identical on every rank", len(set(digests)) == 1)
    return report_results(comm, results)


if __name__ == "__main__":
    sys.exit(main())
