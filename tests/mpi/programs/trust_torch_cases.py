"""Runs on every rank: the torch integrations' trust defects of issue 22, each fault injected on one rank (and
after the same call succeeded, and after an earlier caught error), every rank's outcome checked: the error class
and that its message names what and where, or results equal to an independent NumPy reference and bit-identical
on every rank. argv[1]:

- "inputs" (DDLFAST_TIMEOUT_S large): sparse gradients whose table differs per rank, a broadcast (backend's and
  broadcast_parameters) whose dtypes differ per rank, a parameter unfrozen after distribute(), tensors that
  require grad, point-to-point tags, dropped/unwaited Works and recvs waited for out of order;
- "deadlock" (DDLFAST_TIMEOUT_S small): every rank receives from the next one, which never sends: every rank
  raises DdlfastTimeoutError naming the point-to-point receives, then destroy_process_group() is quiet.

Prints "<n> failures" on rank 0, and "time <case> rank <r> <seconds>" lines, each followed by the error: the
time from each injected fault to the error on every rank (for docs/trust.md; never asserted)."""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable

import harness
import numpy as np
import torch
import torch.distributed as dist
from backend_common import case, comm, fail, rank, world

import ddlfast
import ddlfast.torch as dt
from ddlfast.errors import DdlfastConsistentError, DdlfastError, DdlfastTimeoutError
from ddlfast.integrations import torch_backend

group_of = sys.argv[1] if len(sys.argv) > 1 else "inputs"
timings: list[str] = []
ODD = 1  # the rank that injects the fault


def raises(name: str, action: Callable[[], object], kind: type[BaseException], *needles: str) -> None:
    """`action` raises `kind` on this rank, its message naming every needle; the time it took is recorded."""
    start = time.perf_counter()
    try:
        action()
    except Exception as error:  # noqa: BLE001 - checked below
        timings.append(f"time {name} rank {rank} {time.perf_counter() - start:.3f}")
        timings.append(f"  {type(error).__name__}: {str(error)[:600]}")
        if not isinstance(error, kind):
            fail(name, f"raised {type(error).__name__}, not {kind.__name__}: {error}")
        missing = [n for n in needles if n not in str(error)]
        if missing:
            fail(name, f"message does not name {missing}: {error}")
    else:
        fail(name, "did not raise")


def identical(name: str, tensor: torch.Tensor) -> None:
    mine = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    if len(set(comm.allgather(mine))) != 1:
        fail(name, "results differ across ranks")


def equal(name: str, got: torch.Tensor, want: np.ndarray, tolerance: float = 0.0, same: bool = True) -> None:
    """Equal to NumPy's `want`; and, unless the result is per rank (`same=False`), bit-identical on every rank."""
    got_np = got.detach().to(torch.float64).numpy()
    if got_np.shape != want.shape or not np.allclose(got_np, want, rtol=tolerance, atol=tolerance):
        fail(name, f"{got_np.ravel()[:6]} differs from NumPy's {np.asarray(want).ravel()[:6]}")
    if same:
        identical(name, got)


# -- 1. sparse gradients (Embedding(sparse=True)) whose table size differs per rank -----------------------------

def embedding_step(rows: int, index_rows: int, corrupt: bool = False) -> torch.Tensor:
    """One step of Embedding(rows, 3, sparse=True) on rank-dependent indices; returns the averaged gradient."""
    torch.manual_seed(0)
    model = torch.nn.Embedding(rows, 3, sparse=True)
    reducer = dt.distribute(model)
    idx = torch.tensor([(rank * 3 + k) % index_rows for k in range(4)])
    if index_rows > 10:
        idx[-1] = index_rows - 1
    weights = torch.arange(12, dtype=torch.float32).reshape(4, 3) + rank
    (model(idx) * weights).sum().backward()
    if corrupt:  # a gradient whose row index lies outside the table (torch's invariants not checked)
        g = model.weight.grad.coalesce()
        bad = g.indices().clone()
        bad[0, 0] = rows + 2
        model.weight.grad = torch.sparse_coo_tensor(bad, g.values(), model.weight.shape, check_invariants=False)
    reducer.synchronize()
    grad = model.weight.grad.to_dense()
    reducer.remove()
    return grad


def embedding_reference(rows: int) -> np.ndarray:
    want = np.zeros((rows, 3))
    for r in range(world):
        for k in range(4):
            want[(r * 3 + k) % rows] += np.arange(3 * k, 3 * k + 3) + r
    return want / world


# -- 3. a parameter unfrozen after distribute() -----------------------------------------------------------------

def small_model() -> torch.nn.Module:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[1].bias.requires_grad_(False)
    return model


def batch(r: int) -> torch.Tensor:
    return torch.arange(8, dtype=torch.float32).reshape(2, 4) / (r + 1)


def reference_grads(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Every rank's gradients computed here on a copy of the model (each rank's batch is known), averaged in
    NumPy: the reference the reducer's averages must match."""
    per_rank = []
    for r in range(world):
        copy = small_model()
        copy.load_state_dict(model.state_dict())
        for (_, p), (_, q) in zip(model.named_parameters(), copy.named_parameters(), strict=True):
            q.requires_grad_(p.requires_grad)
        copy(batch(r)).sum().backward()
        per_rank.append({n: q.grad.numpy().astype(np.float64) for n, q in copy.named_parameters()
                         if q.grad is not None})
    return {n: np.mean([g[n] for g in per_rank], axis=0) for n in per_rank[0]}


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(batch(rank)).sum().backward()
    optimizer.synchronize()


if group_of == "inputs":
    @case
    def sparse_table_size_differs() -> None:
        # Layouts cached: the same call succeeds first, with the right numbers.
        equal("sparse, equal tables", embedding_step(10, 10), embedding_reference(10), 1e-6)
        # One rank's table has 4000 rows: every rank raises, naming both shapes.
        # (Its indices reach row 3999: gathered into the others' 10-row tables they wrote out of bounds.)
        big = rank == ODD
        raises("sparse table size", lambda: embedding_step(4000 if big else 10, 4000 if big else 10),
               DdlfastConsistentError, "weight float32[10,3]", "weight float32[4000,3]", f"rank {ODD} passed")
        # After that error: right numbers again.
        equal("sparse after the error", embedding_step(10, 10), embedding_reference(10), 1e-6)
        # A gathered row index outside the table (one rank's corrupt gradient): every rank raises, naming it.
        raises("sparse index out of range", lambda: embedding_step(10, 10, corrupt=rank == ODD),
               DdlfastConsistentError, f"rank {ODD}", "row index 12", "10 rows")
        equal("sparse after the index error", embedding_step(10, 10), embedding_reference(10), 1e-6)
        # Two sparse tables, the second one's gradient corrupt on one rank: named by parameter and rank.
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"a": torch.nn.Embedding(10, 3, sparse=True),
                                     "b": torch.nn.Embedding(10, 3, sparse=True)})
        reducer = dt.distribute(model)
        idx = torch.tensor([(rank * 3 + k) % 10 for k in range(4)])
        (model["a"](idx).sum() + model["b"](idx).sum()).backward()
        if rank == ODD:
            g = model["b"].weight.grad.coalesce()
            bad = g.indices().clone()
            bad[0, -1] = -1
            model["b"].weight.grad = torch.sparse_coo_tensor(bad, g.values(), (10, 3), check_invariants=False)
        raises("sparse index, second table", reducer.synchronize, DdlfastConsistentError, "b.weight",
               f"rank {ODD}'s", "row index -1")
        reducer.remove()

    @case
    def broadcast_dtypes_differ() -> None:
        want = np.arange(4, dtype=np.float64) * 1.5
        t = torch.tensor(want if rank == 0 else np.zeros(4), dtype=torch.float32)
        dist.broadcast(t, src=0)
        equal("broadcast float32", t, want)
        wrong = torch.zeros(4, dtype=torch.int32) if rank == ODD else t.clone()
        raises("broadcast dtype", lambda: dist.broadcast(wrong, src=0), DdlfastConsistentError,
               "float32[4]", "int32[4]", f"rank {ODD}")
        # Coalesced (DDP's buffers): the same bytes in another dtype order on one rank.
        group = dist.group.WORLD
        mine = [torch.full((2,), 3.0), torch.full((2,), 7, dtype=torch.int64)]
        if rank == ODD:
            mine.reverse()
        raises("coalesced broadcast order", lambda: group.broadcast(mine, dist.BroadcastOptions()).wait(),
               DdlfastConsistentError, "array 0", "float32[2]", "int64[2]")
        # After the errors: right numbers, coalesced too.
        t2 = torch.tensor(want if rank == 0 else np.zeros(4), dtype=torch.float32)
        dist.broadcast(t2, src=0)
        equal("broadcast after errors", t2, want)
        pair = [torch.full((2,), float(rank)), torch.full((3,), rank, dtype=torch.int64)]
        group.broadcast(pair, dist.BroadcastOptions()).wait()
        equal("coalesced after errors a", pair[0], np.zeros(2))
        equal("coalesced after errors b", pair[1], np.zeros(3))

    @case
    def broadcast_parameters_layouts_differ() -> None:
        def params(r: int, wide: bool = False) -> dict[str, torch.Tensor]:
            weight = torch.full((2, 2), float(r), dtype=torch.float64) if wide else torch.full((2, 4), float(r))
            return {"weight": weight, "bias": torch.full((2,), 10.0 + r)}

        mine = params(rank)
        dt.broadcast_parameters(mine, root=0)  # the layout cached
        equal("broadcast_parameters weight", mine["weight"], np.zeros((2, 4)))
        equal("broadcast_parameters bias", mine["bias"], np.full(2, 10.0))
        # The same 40 bytes on one rank as float64[2,2] + float32[2]: every rank raises, naming both layouts.
        odd = params(rank, wide=rank == ODD)
        raises("broadcast_parameters dtypes", lambda: dt.broadcast_parameters(odd, root=0), DdlfastConsistentError,
               "0:float32[2,4]", "0:float64[2,2]", f"rank {ODD} passed")
        mine = params(rank)
        dt.broadcast_parameters(mine, root=0)
        equal("broadcast_parameters after the error", mine["weight"], np.zeros((2, 4)))

    @case
    def parameter_unfrozen_after_distribute() -> None:
        model = small_model()
        reducer = dt.distribute(model)
        optimizer = dt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), reducer)
        train_step(model, optimizer)  # the plan's buckets went out once
        want = reference_grads(model)
        for name, p in model.named_parameters():
            if p.requires_grad:
                equal(f"step before unfreezing {name}", p.grad, want[name], 1e-6)
        # One rank unfreezes a parameter: every rank raises at the step, naming it and the rank.
        if rank == ODD:
            model[1].bias.requires_grad_(True)
        raises("unfrozen on one rank", lambda: train_step(model, optimizer), DdlfastError,
               "1.bias", f"rank {ODD}", "rebuild()")
        # Every rank unfreezes it: every rank raises again (the plan is stale everywhere) ...
        model[1].bias.requires_grad_(True)
        raises("unfrozen on every rank", lambda: train_step(model, optimizer), DdlfastError, "1.bias",
               "rebuild()")
        # ... until every rank rebuilds: then the new parameter is averaged like the others.
        reducer.rebuild()
        train_step(model, optimizer)
        want = reference_grads(model)
        for name, p in model.named_parameters():
            equal(f"step after rebuild {name}", p.grad, want[name], 1e-6)
        # A parameter added on one rank after distribute(): raises everywhere, naming it.
        if rank == ODD:
            model.extra = torch.nn.Parameter(torch.zeros(2))
        raises("added on one rank", lambda: train_step(model, optimizer), DdlfastError, "extra", f"rank {ODD}")
        if rank == ODD:
            del model.extra
        train_step(model, optimizer)
        for name, p in model.named_parameters():
            equal(f"step after removing it {name}", p.grad, want[name], 1e-6)
        # A parameter frozen on one rank after distribute() (it would get averaged zeros): the same.
        if rank == ODD:
            model[0].weight.requires_grad_(False)
        raises("frozen on one rank", lambda: train_step(model, optimizer), DdlfastError, "0.weight",
               "no longer requires gradients", f"rank {ODD}")
        model[0].weight.requires_grad_(True)
        train_step(model, optimizer)
        for name, p in model.named_parameters():
            equal(f"step after unfreezing again {name}", p.grad, want[name], 1e-6)
        reducer.remove()

    @case
    def tensors_that_require_grad() -> None:
        def leaf(r: int, n: int = 6) -> torch.Tensor:
            return (torch.arange(n, dtype=torch.float32) + 10 * r).requires_grad_(rank == ODD or r < 0)

        every = np.stack([np.arange(6) + 10 * r for r in range(world)]).astype(np.float64)
        for attempt in ("first", "again"):  # the second time after layouts were cached
            p = leaf(rank)
            storage = p.data_ptr()
            dist.all_reduce(p)
            equal(f"all_reduce requires_grad {attempt}", p, every.sum(axis=0))
            if p.data_ptr() != storage:
                fail("all_reduce requires_grad", "the result did not land in the tensor's storage")
            gathered = ddlfast.allgather(leaf(rank))
            equal(f"allgather requires_grad {attempt}", gathered, every.reshape(-1))
            n = 2 * world
            shard = ddlfast.reduce_scatter(torch.arange(n, dtype=torch.float32).requires_grad_(rank == ODD))
            equal(f"reduce_scatter requires_grad {attempt}", shard,
                  (np.arange(n) * world)[2 * rank:2 * rank + 2].astype(np.float64), same=False)
            out = torch.zeros(world * 6)
            dist.all_gather_into_tensor(out, leaf(rank))
            equal(f"all_gather_into_tensor requires_grad {attempt}", out, every.reshape(-1))
        # After an earlier caught error.
        raises("mismatch before requires_grad", lambda: dist.all_reduce(torch.ones(3 + (rank == ODD))),
               DdlfastConsistentError, "disagree")
        p = leaf(rank)
        dist.all_reduce(p)
        equal("all_reduce requires_grad after an error", p, every.sum(axis=0))

    @case
    def point_to_point_tags() -> None:
        backend = next(g for g in torch_backend._groups if g.size() == world)
        bound = backend._tag_bound
        peer = 1 - rank if rank < 2 else None
        for tag in (0, 3, bound, bound + 1, 2**30, 2**31 + 7):
            if peer is None:
                continue
            out = torch.full((3,), float(rank * 100 + tag % 1000))
            into = torch.empty(3)
            sent = dist.isend(out, peer, tag=tag)
            dist.recv(into, peer, tag=tag)
            sent.wait()
            equal(f"tag {tag}", into, np.full(3, float(peer * 100 + tag % 1000)), same=False)
        if peer is not None:
            raises("negative tag", lambda: dist.send(torch.ones(1), peer, tag=-2), DdlfastError, "tag -2")
        dist.barrier()
        # A recv dropped without wait() must not take the header of a later message with its tag.
        if rank == ODD:
            dropped = dist.irecv(torch.empty(2), 0, tag=7)
            del dropped
            gc.collect()
        dist.barrier()
        if rank == 0:
            dist.send(torch.tensor([4.0, 5.0]), ODD, tag=7)
        elif rank == ODD:
            into = torch.empty(2)
            dist.recv(into, 0, tag=7)
            if into.tolist() != [4.0, 5.0]:
                fail("dropped recv", f"the later recv got {into.tolist()}")
        # Two recvs from one sender with one tag, waited for in the other order: each gets its own message.
        if rank == 0:
            dist.send(torch.tensor([1.0, 1.0]), ODD, tag=13)
            dist.send(torch.tensor([2.0, 2.0]), ODD, tag=13)
        elif rank == ODD:
            first, second = torch.empty(2), torch.empty(2)
            a, b = dist.irecv(first, 0, tag=13), dist.irecv(second, 0, tag=13)
            b.wait()
            a.wait()
            if first.tolist() != [1.0, 1.0] or second.tolist() != [2.0, 2.0]:
                fail("recvs waited out of order", f"got {first.tolist()} and {second.tolist()}")
        # Sends never waited for are reaped once complete (not kept for good).
        if rank == 0:
            for k in range(40):
                dist.isend(torch.full((2,), float(k)), ODD, tag=11)
        elif rank == ODD:
            for k in range(40):
                into = torch.empty(2)
                dist.recv(into, 0, tag=11)
                if into.tolist() != [float(k)] * 2:
                    fail("unwaited sends", f"message {k} was {into.tolist()}")
        dist.barrier()
        if rank == 0:
            dist.send(torch.ones(1), ODD, tag=12)
            if len(backend._sends) > 1:
                fail("unwaited sends", f"{len(backend._sends)} completed sends are still kept")
        elif rank == ODD:
            dist.recv(torch.empty(1), 0, tag=12)
        # The group still works.
        t = torch.ones(2)
        dist.all_reduce(t)
        equal("after point to point", t, np.full(2, float(world)))

if group_of == "deadlock":
    @case
    def point_to_point_deadlock() -> None:
        t = torch.ones(2)
        dist.all_reduce(t)  # layouts cached, the group healthy
        raises("mismatch before the deadlock", lambda: dist.all_reduce(torch.ones(2 + (rank == ODD))),
               DdlfastConsistentError, "disagree")  # an earlier caught error
        # Every rank receives from the next one; nobody sends.
        source = (rank + 1) % world
        raises("p2p deadlock", lambda: dist.recv(torch.empty(2), source, tag=5), DdlfastTimeoutError,
               "point-to-point receive from rank", "tag 5")
        # After the stall, teardown is quiet and bounded.
        start = time.perf_counter()
        try:
            dist.destroy_process_group()
        except Exception as error:  # noqa: BLE001 - checked
            fail("destroy after stall", f"raised {type(error).__name__}: {error}")
        timings.append(f"time destroy_process_group rank {rank} {time.perf_counter() - start:.3f}")


def report() -> None:
    status = harness.report()
    times = [t for per_rank in comm.allgather(timings) for t in per_rank]
    if rank == 0:
        print("\n".join(times), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(status)


report()
