"""Runs on every rank: the "ddlfast" torch.distributed backend's collectives against NumPy references (each rank
builds every rank's input from a seed, so the reference is computed independently on each rank), results
bit-identical on every rank; new_group with a subset; point-to-point without deadlock; mixed ddlfast and MPI
operations in torch's order; bad input on one rank raises on every rank through torch's API.
argv[1]: "core" (default), "ops" (min/max/product: needs them in ddlfast) or "shard" (reduce_scatter: needs
ddlfast.reduce_scatter). Prints "<n> failures" on rank 0."""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from backend_common import case, comm, fail, rank, report_and_exit, world

import ddlfast

group_of = sys.argv[1] if len(sys.argv) > 1 else "core"


def inputs(seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's input for a case (rank r's is [r]); integers small enough that products stay exact."""
    out = []
    for r in range(world):
        gen = torch.Generator().manual_seed(1000 * seed + r)
        if dtype.is_floating_point:
            out.append(torch.randn(shape, generator=gen).to(dtype))
        else:
            out.append(torch.randint(-3, 4, shape, generator=gen).to(dtype))
    return out


def identical(name: str, tensor: torch.Tensor) -> None:
    mine = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    if len(set(comm.allgather(mine))) != 1:
        fail(name, "results differ across ranks")


def close(name: str, got: torch.Tensor, want: np.ndarray, exact: bool) -> None:
    """Compared as float64 (exact where the op is: integers, min/max, copies), then bit-identical across ranks."""
    got_np = got.to(torch.float64).numpy()
    want = np.asarray(want, np.float64)
    if got_np.shape != want.shape:
        fail(name, f"shape {got_np.shape}, expected {want.shape}")
    elif exact and not np.array_equal(got_np, want):
        fail(name, f"differs from NumPy: {got_np.ravel()[:4]} vs {want.ravel()[:4]}")
    elif not exact:
        tolerance = {torch.bfloat16: 3e-2, torch.float16: 3e-3, torch.float32: 1e-5}.get(got.dtype, 1e-12)
        if not np.allclose(got_np, want, rtol=tolerance, atol=tolerance):
            fail(name, f"differs from NumPy by {np.abs(got_np - want).max():.3g}")
    identical(name, got)


REDUCE = {"sum": (dist.ReduceOp.SUM, np.sum), "average": (dist.ReduceOp.AVG, np.mean),
          "min": (dist.ReduceOp.MIN, np.min), "max": (dist.ReduceOp.MAX, np.max),
          "product": (dist.ReduceOp.PRODUCT, np.prod)}
DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16, torch.float16)


def check_allreduce(op_names: tuple[str, ...]) -> None:
    for seed, (name, dtype, shape) in enumerate((n, d, s) for n in op_names for d in DTYPES
                                                for s in ((7,), (3, 1000))):
        if name == "average" and not dtype.is_floating_point:
            continue
        torch_op, numpy_op = REDUCE[name]
        all_inputs = inputs(seed, shape, dtype)
        want = numpy_op(np.stack([t.to(torch.float64).numpy() for t in all_inputs]), axis=0)
        tensor = all_inputs[rank].clone()
        dist.all_reduce(tensor, op=torch_op)
        exact = name in ("min", "max") or not dtype.is_floating_point
        close(f"allreduce {name} {dtype} {shape}", tensor, want, exact)


if group_of == "core":
    @case
    def allreduce_sum_average() -> None:
        check_allreduce(("sum", "average"))

    @case
    def allreduce_bare_tensor_and_coalesced() -> None:
        """DDP's join hook passes a bare tensor to ProcessGroup.allreduce and does not wait for it."""
        group = dist.group.WORLD
        counts = torch.tensor([rank + 1], dtype=torch.int32)
        group.allreduce(counts)
        a, b = inputs(1, (5,), torch.float64), inputs(2, (2, 3), torch.float64)
        mine = [a[rank].clone(), b[rank].clone()]
        group.allreduce_coalesced(mine).wait()
        close("coalesced a", mine[0], np.sum([t.numpy() for t in a], axis=0), exact=False)
        close("coalesced b", mine[1], np.sum([t.numpy() for t in b], axis=0), exact=False)
        close("bare tensor", counts, np.array([world * (world + 1) // 2]), exact=True)

    @case
    def broadcast_every_root_and_dtype() -> None:
        for root in range(world):
            for dtype in (torch.float32, torch.int64, torch.bool, torch.uint8, torch.bfloat16):
                all_inputs = inputs(root, (3, 5), torch.int64)
                tensor = all_inputs[rank].to(dtype)
                dist.broadcast(tensor, src=root)
                want = all_inputs[root].to(dtype).to(torch.float64).numpy()
                close(f"broadcast {dtype} root {root}", tensor, want, exact=True)
        # Several tensors of several dtypes in one call (DDP's buffer broadcasts): one ddlfast broadcast.
        group = dist.group.WORLD
        tensors = [torch.full((4,), float(rank)), torch.full((2, 2), rank, dtype=torch.int64),
                   torch.tensor([rank % 2 == 0])]
        opts = dist.BroadcastOptions()
        opts.rootRank = world - 1
        group.broadcast(tensors, opts).wait()
        for t in tensors:
            want = np.array([(world - 1) % 2 == 0]) if t.dtype == torch.bool else np.full(t.shape, world - 1)
            close("broadcast of several", t, want, exact=True)

    @case
    def reduce_to_root() -> None:
        all_inputs = inputs(5, (9,), torch.float64)
        tensor = all_inputs[rank].clone()
        dist.reduce(tensor, dst=world - 1)
        if rank == world - 1:
            close_local = np.allclose(tensor.numpy(), np.sum([t.numpy() for t in all_inputs], axis=0))
            if not close_local:
                fail("reduce", "root's result differs from NumPy")
        elif not torch.equal(tensor, all_inputs[rank]):
            fail("reduce", "a non-root rank's tensor changed")

    @case
    def functional_all_reduce() -> None:
        """torch's functional collectives reach the group from C++ (by its name), which calls back into Python."""
        from torch.distributed import _functional_collectives as functional

        all_inputs = inputs(8, (6,), torch.float64)
        result = functional.all_reduce(all_inputs[rank].clone(), "sum", dist.group.WORLD)
        result = result.wait() if hasattr(result, "wait") else result
        close("functional all_reduce", result, np.sum([t.numpy() for t in all_inputs], axis=0), exact=False)

    @case
    def allgathers() -> None:
        for dtype in (torch.float32, torch.int64):
            all_inputs = inputs(7, (2, 3), dtype)
            outputs = [torch.empty(2, 3, dtype=dtype) for _ in range(world)]
            dist.all_gather(outputs, all_inputs[rank])
            close(f"all_gather {dtype}", torch.stack(outputs), torch.stack(all_inputs).numpy(), exact=True)
            into = torch.empty(2 * world, 3, dtype=dtype)
            dist.all_gather_into_tensor(into, all_inputs[rank])
            close(f"all_gather_into_tensor {dtype}", into, torch.cat(all_inputs).numpy(), exact=True)
        gathered = [None] * world
        dist.all_gather_object(gathered, {"rank": rank, "text": "x" * rank})
        if gathered != [{"rank": r, "text": "x" * r} for r in range(world)]:
            fail("all_gather_object", f"got {gathered}")

    @case
    def barrier_alltoall_gather_scatter() -> None:
        dist.barrier()
        # alltoall with blocks of different sizes: rank s sends s + d + 1 elements to rank d.
        send = [torch.full((rank + d + 1,), float(100 * rank + d)) for d in range(world)]
        receive = [torch.empty(s + rank + 1) for s in range(world)]
        dist.all_to_all(receive, send)
        for s, t in enumerate(receive):
            if not torch.equal(t, torch.full((s + rank + 1,), float(100 * s + rank))):
                fail("all_to_all", f"block from rank {s} is {t.tolist()}")
        rows_in = [rank + d + 1 for d in range(world)]
        rows_out = [s + rank + 1 for s in range(world)]
        source = torch.cat([torch.full((n, 2), 10 * rank + d, dtype=torch.int64) for d, n in enumerate(rows_in)])
        output = torch.empty(sum(rows_out), 2, dtype=torch.int64)
        dist.all_to_all_single(output, source, rows_out, rows_in)
        want = np.concatenate([np.full((n, 2), 10 * s + rank) for s, n in enumerate(rows_out)])
        if not np.array_equal(output.numpy(), want):
            fail("all_to_all_single", f"got {output[:, 0].tolist()}")
        mine = torch.arange(4, dtype=torch.float64) + rank
        gathered = [torch.empty(4, dtype=torch.float64) for _ in range(world)] if rank == 0 else None
        dist.gather(mine, gathered, dst=0)
        if rank == 0 and not all(torch.equal(g, torch.arange(4, dtype=torch.float64) + r)
                                 for r, g in enumerate(gathered)):
            fail("gather", f"got {gathered}")
        part = torch.empty(3, dtype=torch.int32)
        dist.scatter(part, [torch.full((3,), r * 7, dtype=torch.int32) for r in range(world)] if rank == 1 else None,
                     src=1)
        if not torch.equal(part, torch.full((3,), rank * 7, dtype=torch.int32)):
            fail("scatter", f"got {part.tolist()}")

    @case
    def point_to_point_ring() -> None:
        """Every rank sends 1 MiB to the next before it receives from the previous (both posted first): must
        not deadlock (MPI's rendezvous would, were a send completed where it is posted)."""
        n = 2**18
        out = torch.full((n,), float(rank))
        into = torch.empty(n)
        sent = dist.isend(out, (rank + 1) % world, tag=3)
        received = dist.irecv(into, (rank - 1) % world, tag=3)
        received.wait()
        sent.wait()
        if not torch.equal(into, torch.full((n,), float((rank - 1) % world))):
            fail("p2p ring", "wrong data")
        if rank == 1:
            dist.send(torch.tensor([5, 6], dtype=torch.int64), 0, tag=9)
        if rank == 0:
            anywhere = torch.empty(2, dtype=torch.int64)
            source = dist.recv(anywhere, tag=9)
            if source != 1 or anywhere.tolist() != [5, 6]:
                fail("recv any source", f"source {source}, data {anywhere.tolist()}")

    @case
    def new_group_subset() -> None:
        members = [0, world - 1]
        group = dist.new_group(members)
        if rank not in members:
            if group != dist.GroupMember.NON_GROUP_MEMBER:
                fail("new_group", "a non-member got a group")
            return
        group_rank = members.index(rank)
        if (dist.get_rank(group), dist.get_world_size(group)) != (group_rank, 2):
            fail("new_group", f"rank {dist.get_rank(group)} of {dist.get_world_size(group)}")
        tensor = torch.tensor([float(rank + 1)])
        dist.all_reduce(tensor, group=group)
        if tensor.item() != 1 + world:
            fail("new_group allreduce", f"got {tensor.item()}")
        value = torch.tensor([rank], dtype=torch.int64)
        dist.broadcast(value, src=world - 1, group=group)  # src: a global rank
        if value.item() != world - 1:
            fail("new_group broadcast", f"got {value.item()}")
        dist.barrier(group=group)

    @case
    def mixed_order() -> None:
        """ddlfast and MPI operations issued asynchronously in one order, waited in reverse: each completes with
        its own data (every rank runs them in torch's order on one thread)."""
        a = torch.full((1000,), float(rank))
        b = torch.full((10,), float(rank), dtype=torch.float64)
        c = torch.full((3,), rank, dtype=torch.int64)
        out = torch.full((2**16,), float(rank))
        into = torch.empty(2**16)
        direct = np.full(5, rank, np.float32)
        works = [dist.all_reduce(a, async_op=True), dist.barrier(async_op=True),
                 dist.broadcast(b, src=world - 1, async_op=True), dist.isend(out, (rank + 1) % world),
                 dist.irecv(into, (rank - 1) % world)]
        handle = ddlfast.allreduce_async(direct, op="sum")
        works += [dist.all_reduce(c, op=dist.ReduceOp.SUM, async_op=True)]
        for work in reversed(works):
            if work.wait() is not True:
                fail("mixed order", "wait() did not return True")
        handle.wait()
        total = world * (world - 1) / 2
        checks = {"allreduce": torch.equal(a, torch.full((1000,), total)),
                  "broadcast": torch.equal(b, torch.full((10,), float(world - 1), dtype=torch.float64)),
                  "p2p": torch.equal(into, torch.full((2**16,), float((rank - 1) % world))),
                  "ddlfast.allreduce_async": np.array_equal(direct, np.full(5, total, np.float32)),
                  "int allreduce": torch.equal(c, torch.full((3,), int(total), dtype=torch.int64))}
        for name, ok in checks.items():
            if not ok:
                fail("mixed order", f"{name} wrong")

    def raises_everywhere(name: str, action: Callable[[], object], needle: str) -> None:
        """`action` must raise DdlfastError (or torch's RuntimeError carrying it) on this rank, naming `needle`."""
        try:
            action()
        except Exception as error:  # noqa: BLE001 - checked below
            if needle not in str(error):
                fail(name, f"raised without naming {needle!r}: {type(error).__name__}: {error}")
        else:
            fail(name, "did not raise")

    @case
    def errors_on_every_rank() -> None:
        # Shapes differ across ranks: the agreement refuses it on every rank; the group stays usable.
        mismatched = torch.ones(5 + (rank == 1))
        raises_everywhere("mismatched shape", lambda: dist.all_reduce(mismatched), "disagree")
        # wait() raises (never returns) and the future fails, for an asynchronous call.
        work = dist.all_reduce(torch.ones(3 + (rank == 0)), async_op=True)
        raises_everywhere("mismatched shape, wait()", work.wait, "disagree")
        raises_everywhere("mismatched shape, future", work.get_future().wait, "disagree")
        # A tensor on a device ddlfast does not take, on one rank: that rank raises at the call, the others at
        # the same collective.
        wrong_device = torch.ones(4, device="meta") if rank == world - 1 else torch.ones(4)
        raises_everywhere("wrong device", lambda: dist.all_reduce(wrong_device), "meta")
        wrong_dtype = torch.ones(4, dtype=torch.bool) if rank == 0 else torch.ones(4)
        raises_everywhere("unsupported dtype", lambda: dist.all_reduce(wrong_dtype), "bool")
        raises_everywhere("unsupported op", lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32),
                                                                    op=dist.ReduceOp.BAND), "BAND")
        shorter = [torch.empty(2 if rank == 0 else 1) for _ in range(world)]
        raises_everywhere("alltoall sizes", lambda: dist.all_to_all(shorter, [torch.ones(1)] * world),
                          "block sizes disagree")
        after = torch.ones(2)
        dist.all_reduce(after)
        if not torch.equal(after, torch.full((2,), float(world))):
            fail("after errors", f"allreduce gave {after.tolist()}")
        # Point to point: the receiver names a size mismatch (the sender's send completes).
        if rank == 0:
            dist.send(torch.ones(3), 1, tag=21)
        elif rank == 1:
            raises_everywhere("recv size", lambda: dist.recv(torch.empty(4), 0, tag=21), "sent 12 bytes")

if group_of == "ops":
    @case
    def allreduce_min_max_product() -> None:
        check_allreduce(("min", "max", "product"))

if group_of == "shard":
    @case
    def reduce_scatters() -> None:
        for dtype in (torch.float32, torch.int64):
            all_inputs = inputs(11, (2 * world, 3), dtype)
            want = np.sum(np.stack([t.numpy() for t in all_inputs]), axis=0)[2 * rank:2 * rank + 2]
            output = torch.empty(2, 3, dtype=dtype)
            dist.reduce_scatter_tensor(output, all_inputs[rank])
            if not np.allclose(output.numpy(), want, rtol=1e-5):
                fail(f"reduce_scatter_tensor {dtype}", f"differs from NumPy by {np.abs(output.numpy() - want).max()}")
            listed = torch.empty(2, 3, dtype=dtype)
            dist.reduce_scatter(listed, list(all_inputs[rank].chunk(world)))
            if not torch.equal(listed, output):
                fail(f"reduce_scatter {dtype}", "differs from reduce_scatter_tensor")

report_and_exit()
