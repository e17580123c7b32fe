"""Runs on every rank: ddlfast used the way torch users expect (issue 25, item 3). `import ddlfast.torch` then
plain `torch.distributed.init_process_group("ddlfast")` with no rendezvous variables set (mpiexec sets none);
torch CPU tensors (also ones that require grad) through ddlfast.allreduce/broadcast/fused_allreduce, compared
with NumPy references every rank computes itself and bit-identical across ranks; op= as mpi4py's and torch's op
objects; local_rank()/local_size() against MPI's own shared-memory split; ddlfast's collectives named in a
torch.profiler trace; sparse COO dist.all_reduce summed as gloo sums it; dist.all_gather_coalesced. Prints
"<n> failures" on rank 0 and exits 1 on every rank if any rank failed."""

from __future__ import annotations

import os
import warnings

import numpy as np
import torch
import torch.distributed as dist
from case_runner import case, comm, fail, rank, report_and_exit, world
from mpi4py import MPI

import ddlfast
import ddlfast.torch  # noqa: F401  (registers the backend and the MPI rendezvous)


def identical(name: str, array: np.ndarray) -> None:
    if len(set(comm.allgather(np.ascontiguousarray(array).tobytes()))) != 1:
        fail(name, "results differ across ranks")


def every_input(seed: int, n: int) -> list[np.ndarray]:
    """Every rank's float32 input: small integers and halves, so any order of summation is exact."""
    return [(np.random.default_rng(1000 * seed + r).integers(-64, 64, n) / 2).astype(np.float32)
            for r in range(world)]


@case
def init_process_group_plain() -> None:
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if os.environ.get(v)]
    if missing:
        fail("init_process_group_plain", f"the launcher set {missing}: this case needs them unset")
    dist.init_process_group("ddlfast")
    if (dist.get_rank(), dist.get_world_size(), dist.get_backend()) != (rank, world, "ddlfast"):
        fail("init_process_group_plain", f"got rank {dist.get_rank()} of {dist.get_world_size()} on "
             f"{dist.get_backend()}")
    tensor = torch.from_numpy(every_input(1, 33)[rank].copy())
    dist.all_reduce(tensor)
    expected = np.sum(np.stack(every_input(1, 33)), axis=0, dtype=np.float32)
    if not np.array_equal(tensor.numpy(), expected):
        fail("init_process_group_plain", "dist.all_reduce on ddlfast differs from the NumPy sum")
    identical("init_process_group_plain", tensor.numpy())


@case
def tensor_allreduce_in_place() -> None:
    inputs = every_input(2, 1000)
    for requires_grad in (False, True):
        tensor = torch.from_numpy(inputs[rank].copy()).requires_grad_(requires_grad)
        result = ddlfast.allreduce(tensor, op="max")
        expected = np.max(np.stack(inputs), axis=0)  # max is exact: bit-identical to NumPy's
        if result is not tensor:
            fail("tensor_allreduce_in_place", "allreduce did not return the tensor it was given")
        if not np.array_equal(tensor.detach().numpy(), expected):
            fail("tensor_allreduce_in_place", f"requires_grad={requires_grad}: not the elementwise max")
        identical("tensor_allreduce_in_place", tensor.detach().numpy())


@case
def tensor_fused_allreduce_integers() -> None:
    tensors = [torch.arange(7, dtype=torch.int64) * (rank + 1), torch.full((3, 2), rank, dtype=torch.int32)]
    ddlfast.fused_allreduce(tensors, op="sum")
    scale = world * (world + 1) // 2
    if not torch.equal(tensors[0], torch.arange(7, dtype=torch.int64) * scale):
        fail("tensor_fused_allreduce_integers", f"int64 sum {tensors[0].tolist()}")
    if not torch.equal(tensors[1], torch.full((3, 2), world * (world - 1) // 2, dtype=torch.int32)):
        fail("tensor_fused_allreduce_integers", f"int32 sum {tensors[1].tolist()}")


@case
def tensor_broadcast() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.bool):
        tensor = (torch.arange(10) % (rank + 2)).to(dtype)
        ddlfast.broadcast(tensor, root=world - 1)
        if not torch.equal(tensor, (torch.arange(10) % (world + 1)).to(dtype)):
            fail("tensor_broadcast", f"{dtype}: not root's tensor")
    weight = torch.full((4,), float(rank), requires_grad=True)
    ddlfast.broadcast(weight, root=0)
    if not torch.equal(weight.detach(), torch.zeros(4)):
        fail("tensor_broadcast", "a tensor that requires grad did not get root's values")


@case
def foreign_ops() -> None:
    ints = [np.arange(5, dtype=np.int64) + r for r in range(world)]
    for op, reference in ((MPI.SUM, np.sum), (MPI.MIN, np.min), (MPI.MAX, np.max), (MPI.PROD, np.prod),
                          (dist.ReduceOp.SUM, np.sum), (dist.ReduceOp.MIN, np.min), (dist.ReduceOp.MAX, np.max),
                          (dist.ReduceOp.PRODUCT, np.prod)):
        array = ints[rank].copy()
        ddlfast.allreduce(array, op=op)
        if not np.array_equal(array, reference(np.stack(ints), axis=0)):
            fail("foreign_ops", f"op={op!r}: {array.tolist()}")
    average = ints[rank].copy()
    ddlfast.fused_allreduce([average, np.zeros(3)], op=dist.ReduceOp.AVG)
    if not np.array_equal(average, np.sum(np.stack(ints), axis=0) // world):
        fail("foreign_ops", f"ReduceOp.AVG: {average.tolist()}")
    shard = ddlfast.reduce_scatter(np.ones(2 * world, dtype=np.float32), op=MPI.SUM)
    if not np.array_equal(shard, np.full(2, world, dtype=np.float32)):
        fail("foreign_ops", f"reduce_scatter with MPI.SUM: {shard.tolist()}")
    try:
        ddlfast.allreduce(np.ones(3), op=MPI.BAND if rank == 0 else "sum")
    except ddlfast.DdlfastError as error:
        if rank == 0 and "MPI.SUM" not in str(error):
            fail("foreign_ops", f"MPI.BAND's refusal does not list the accepted ops: {error}")
    else:
        fail("foreign_ops", "MPI.BAND on rank 0 did not raise on every rank")


@case
def local_rank_and_size() -> None:
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    expected = (node.Get_rank(), node.Get_size())
    node.Free()
    if (ddlfast.local_rank(), ddlfast.local_size()) != expected:
        fail("local_rank_and_size", f"{(ddlfast.local_rank(), ddlfast.local_size())}, MPI says {expected}")


@case
def profiler_names_collectives() -> None:
    array = np.ones(16, dtype=np.float32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        ddlfast.allreduce(array)
        ddlfast.fused_allreduce([array])
        ddlfast.fused_allreduce([array, array.copy()])
        ddlfast.broadcast(array, root=0)
        ddlfast.barrier()
    names = {event.key for event in profile.key_averages()}
    for expected in ("ddlfast:allreduce", "ddlfast:fused_allreduce", "ddlfast:broadcast", "ddlfast:barrier"):
        if expected not in names:
            fail("profiler_names_collectives", f"{expected} is not in the trace ({sorted(names)[:20]})")


@case
def sparse_all_reduce_sums_like_gloo() -> None:
    def sparse_input(r: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(500 + r)
        indices = torch.stack([torch.randint(0, 6, (5,), generator=gen), torch.randint(0, 3, (5,), generator=gen)])
        return torch.sparse_coo_tensor(indices, torch.randint(-4, 5, (5,), generator=gen).float(), (6, 3))

    tensor = sparse_input(rank)
    dist.all_reduce(tensor)
    expected = sum(sparse_input(r).to_dense() for r in range(world))  # small integers: every order is exact
    if not tensor.is_sparse or not torch.equal(tensor.to_dense(), expected):
        fail("sparse_all_reduce_sums_like_gloo", f"got {tensor.to_dense().tolist()}, expected {expected.tolist()}")
    identical("sparse_all_reduce_sums_like_gloo", tensor.to_dense().numpy())
    try:
        dist.all_reduce(sparse_input(rank), op=dist.ReduceOp.MAX)
    except Exception as error:  # noqa: BLE001 - torch may wrap it; the message is what counts
        if "takes ReduceOp.SUM" not in str(error):
            fail("sparse_all_reduce_sums_like_gloo", f"MAX refused with an unclear message: {error}")
    else:
        fail("sparse_all_reduce_sums_like_gloo", "a sparse MAX was not refused")


@case
def all_gather_coalesced() -> None:
    def inputs_of(r: int) -> list[torch.Tensor]:
        return [torch.full((2, 3), r + 0.5), torch.arange(5.0) + 10 * r]  # one dtype per call: torch's rule

    outputs = [[torch.empty(2, 3), torch.empty(5)] for _ in range(world)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch: "will be deprecated"
        dist.all_gather_coalesced(outputs, inputs_of(rank))
    for r, outs in enumerate(outputs):
        if not all(torch.equal(o, e) for o, e in zip(outs, inputs_of(r), strict=True)):
            fail("all_gather_coalesced", f"rank {r}'s tensors: {[o.tolist() for o in outs]}")


report_and_exit(before_exit=lambda: dist.destroy_process_group() if dist.is_initialized() else None)
