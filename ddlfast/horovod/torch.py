"""`ddlfast.horovod.torch`: Horovod's PyTorch API on ddlfast (`import ddlfast.horovod.torch as hvd`).

Tensors are converted to NumPy views and back around the collectives of `ddlfast.horovod` (CPU tensors; GPU
tensors need a CUDA build and are not covered here: docs/horovod.md). Autograd follows Horovod: the gradient of an
allreduce is the allreduce of the gradient, of an allgather the averaged gradient's own rows, of a broadcast the
averaged gradient on the root (zeros elsewhere), of an alltoall the alltoall back, of a reducescatter the
allgather of the gradient.
"""

from __future__ import annotations

import collections
import contextlib
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

import ddlfast
from ddlfast import horovod as _hvd
from ddlfast.horovod import (  # noqa: F401 (Horovod's names, re-exported)
    Adasum,
    Average,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    allgather_object,
    barrier,
    broadcast_object,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    poll,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
    synchronize,
)

# -- tensors <-> NumPy -------------------------------------------------------------------------------------------------


def _numpy(tensor: torch.Tensor, where: str = "tensor") -> np.ndarray:
    """A NumPy view of a CPU tensor (a contiguous copy when it is not contiguous); bfloat16 through ml_dtypes."""
    if not isinstance(tensor, torch.Tensor):
        raise _hvd.refuse(TypeError(f"{where} is a {type(tensor).__name__}, not a torch.Tensor"))
    if tensor.device.type != "cpu":
        raise _hvd.refuse(ddlfast.DdlfastError(
            f"{where} is on {tensor.device}: ddlfast.horovod.torch runs CPU tensors (docs/horovod.md)"))
    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if tensor.dtype == torch.bool:
        return tensor.numpy()
    return tensor.numpy()


def _tensor(array: Any, like: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(array, torch.Tensor):
        return array
    array = np.ascontiguousarray(array)
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _inplace_target(tensor: torch.Tensor) -> tuple[np.ndarray, Any]:
    """Where an in-place result lands: the tensor's own memory when contiguous, else a copy written back."""
    if tensor.is_contiguous():
        return _numpy(tensor), None
    return np.empty(tuple(tensor.shape), _numpy(tensor[:0] if tensor.dim() else tensor).dtype), tensor


# -- compression -------------------------------------------------------------------------------------------------------


class Compressor:
    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point:
            return tensor.type(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.type(ctx) if ctx is not None and ctx.is_floating_point else tensor


class Compression:
    none = NoneCompressor
    fp16 = FP16Compressor


# -- allreduce ---------------------------------------------------------------------------------------------------------


def _allreduce_entry(tensor: torch.Tensor, op: int, prescale_factor: float, postscale_factor: float,
                     process_set: ProcessSet, name: str | None, compression: Any, inplace: bool) -> int:
    compressed, ctx = compression.compress(tensor)
    array = _numpy(compressed)
    out, write_back = _inplace_target(tensor) if inplace and compression is NoneCompressor else (None, None)
    start, finish = _hvd.allreduce_parts(array, op, prescale_factor, postscale_factor, process_set, out)

    def done(result: Any) -> torch.Tensor:
        value = compression.decompress(_tensor(finish(result)), ctx)
        if inplace:
            if write_back is not None or compression is not NoneCompressor:
                (write_back if write_back is not None else tensor).copy_(value)
            return tensor
        return value

    return _hvd.submit(name, start, done, process_set)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    return _allreduce_entry(tensor, _hvd.resolve_op(op, average), prescale_factor, postscale_factor, process_set,
                            name, NoneCompressor, False)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    return _allreduce_entry(tensor, _hvd.resolve_op(op, average), prescale_factor, postscale_factor, process_set,
                            name, NoneCompressor, True)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: int, prescale_factor: float, postscale_factor: float,
                process_set: ProcessSet, name: str | None, compression: Any) -> torch.Tensor:
        ctx.op, ctx.scales, ctx.process_set = op, (prescale_factor, postscale_factor), process_set
        return synchronize(_allreduce_entry(tensor, op, prescale_factor, postscale_factor, process_set, name,
                                            compression, False))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        reduced = allreduce(grad, op=ctx.op, prescale_factor=ctx.scales[0], postscale_factor=ctx.scales[1],
                            process_set=ctx.process_set)
        return reduced, None, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """The reduction over the ranks of `tensor` (default op Average), a new tensor; the input is unchanged."""
    return _Allreduce.apply(tensor, _hvd.resolve_op(op, average), prescale_factor, postscale_factor, process_set,
                            name, compression)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def _grouped_entry(tensors: Sequence[torch.Tensor], op: int, prescale_factor: float, postscale_factor: float,
                   process_set: ProcessSet, name: str | None, inplace: bool) -> int:
    tensors = list(tensors)
    arrays = [_numpy(t, f"tensor {i}") for i, t in enumerate(tensors)]
    targets = [_inplace_target(t) if inplace else (None, None) for t in tensors]
    start, finish = _hvd.grouped_allreduce_parts(arrays, op, prescale_factor, postscale_factor, process_set,
                                                 [o for o, _ in targets])

    def done(results: Any) -> list:
        values = [_tensor(r) for r in finish(results)]
        if not inplace:
            return values
        for (_, back), value in zip(targets, values, strict=True):
            if back is not None:
                back.copy_(value)
        return tensors

    return _hvd.submit(name, start, done, process_set)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    return _grouped_entry(tensors, _hvd.resolve_op(op, average), prescale_factor, postscale_factor, process_set,
                          name, False)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    return _grouped_entry(tensors, _hvd.resolve_op(op, average), prescale_factor, postscale_factor, process_set,
                          name, True)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: int, prescale_factor: float, postscale_factor: float, process_set: ProcessSet,
                name: str | None, compression: Any, *tensors: torch.Tensor) -> tuple:
        ctx.op, ctx.scales, ctx.process_set = op, (prescale_factor, postscale_factor), process_set
        return tuple(synchronize(_grouped_entry(tensors, op, prescale_factor, postscale_factor, process_set, name,
                                                False)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        reduced = grouped_allreduce(list(grads), op=ctx.op, prescale_factor=ctx.scales[0],
                                    postscale_factor=ctx.scales[1], process_set=ctx.process_set)
        return (None, None, None, None, None, None, *reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: Any = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> list:
    return list(_GroupedAllreduce.apply(_hvd.resolve_op(op, average), prescale_factor, postscale_factor,
                                        process_set, name, compression, *tensors))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                           process_set: ProcessSet = global_process_set) -> Any:
    """A sparse tensor's allreduce as Horovod does it: allgather of the indices and values; returns a function
    that waits and returns the sparse result (Average divides the values by the number of ranks)."""
    handle = _sparse_allreduce(tensor, name, op, process_set)
    return lambda: synchronize(handle)


def _sparse_allreduce(tensor: torch.Tensor, name: str | None, op: int, process_set: ProcessSet) -> int:
    if not tensor.is_sparse:
        raise _hvd.refuse(TypeError("sparse_allreduce_async takes a sparse tensor"), process_set)
    sparse = tensor.coalesce()
    indices_handle = allgather_async(sparse.indices().t().contiguous(), process_set=process_set)
    comm, values = _hvd.comm_of(process_set), _numpy(sparse.values().contiguous())
    settings = _hvd.agreed_settings("sparse_allreduce", op, 1.0, 1.0)  # the division below: agreed like any op
    values_handle = _hvd.submit(None, lambda: ddlfast.allgatherv_async(values, comm=comm, name=settings), _tensor,
                                process_set)
    members = process_set.size()

    def start() -> Any:
        return _Done(None)

    def done(_: Any) -> torch.Tensor:
        indices = synchronize(indices_handle).t()
        values = synchronize(values_handle)
        if op == Average:
            values = values / members
        return torch.sparse_coo_tensor(indices, values, size=tensor.size())

    return _hvd.submit(name, start, done, process_set)


class _Done:
    def __init__(self, value: Any) -> None:
        self.value = value

    def wait(self) -> Any:
        return self.value

    def done(self) -> bool:
        return True


# -- allgather ---------------------------------------------------------------------------------------------------------


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    array = _numpy(tensor)
    if array.ndim == 0:
        array = array.reshape(1)
    comm = _hvd.comm_of(process_set)
    return _hvd.submit(name, lambda: ddlfast.allgatherv_async(array, comm=comm), lambda r: _tensor(r), process_set)


def _own_rows(grad: torch.Tensor, rows: int, process_set: ProcessSet) -> torch.Tensor:
    counts = allgather(torch.tensor([rows], dtype=torch.int64), process_set=process_set)
    offset = int(counts[:process_set.rank()].sum()) if process_set.rank() > 0 else 0
    return grad.narrow(0, offset, rows)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet) -> torch.Tensor:
        ctx.rows, ctx.process_set = (tensor.shape[0] if tensor.dim() else 1), process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        reduced = allreduce(grad, op=Average, process_set=ctx.process_set)
        return _own_rows(reduced, ctx.rows, ctx.process_set), None, None


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set) -> Any:
    """The ranks' tensors concatenated along the first dimension (which may differ per rank)."""
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    arrays = [a.reshape(1) if a.ndim == 0 else a for a in (_numpy(t) for t in tensors)]
    comm = _hvd.comm_of(process_set)
    return _hvd.submit(name, lambda: ddlfast.fused_allgatherv_async(arrays, comm=comm),
                       lambda r: [_tensor(x) for x in r], process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: ProcessSet, *tensors: torch.Tensor) -> tuple:
        ctx.rows = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.process_set = process_set
        return tuple(synchronize(grouped_allgather_async(tensors, name, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        reduced = grouped_allreduce(list(grads), op=Average, process_set=ctx.process_set)
        return (None, None, *[_own_rows(g, n, ctx.process_set) for g, n in zip(reduced, ctx.rows, strict=True)])


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list:
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


# -- broadcast ---------------------------------------------------------------------------------------------------------


def _broadcast_entry(tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet,
                     inplace: bool) -> int:
    comm = _hvd.comm_of(process_set)
    if inplace:
        target, back = _inplace_target(tensor)
        if back is not None:
            target[...] = _numpy(tensor)
    else:
        target, back = np.array(_numpy(tensor), copy=True), None

    def done(result: Any) -> torch.Tensor:
        if not inplace:
            return _tensor(target)
        if back is not None:
            back.copy_(_tensor(target))
        return tensor

    root = _hvd.root_in(process_set, root_rank)
    return _hvd.submit(name, lambda: ddlfast.broadcast_async(target, root=root, comm=comm), done, process_set)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    return _broadcast_entry(tensor, root_rank, name, process_set, False)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    return _broadcast_entry(tensor, root_rank, name, process_set, True)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None,
                process_set: ProcessSet) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        reduced = allreduce(grad, op=Average, process_set=ctx.process_set)
        if rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# -- alltoall ----------------------------------------------------------------------------------------------------------


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    array = _numpy(tensor)
    comm = _hvd.comm_of(process_set)
    if splits is not None:
        if isinstance(splits, torch.Tensor):
            if splits.dtype != torch.int32:
                raise _hvd.refuse(ValueError(f"alltoall: splits must be a tensor of int32, not {splits.dtype}"),
                                  process_set)
            splits = splits.tolist()
        else:
            splits = list(splits)
    return _hvd.submit(name, lambda: ddlfast.alltoall_async(array, splits, comm=comm),
                       lambda r: (_tensor(r[0]), torch.tensor(r[1], dtype=torch.int32)), process_set)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, process_set: ProcessSet) -> tuple:
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *unused: Any) -> tuple:
        back, _ = alltoall(grad.contiguous(), splits=ctx.received, process_set=ctx.process_set)
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Rows [sum(splits[:d]), sum(splits[:d+1])) to rank d; returns (the received rows in rank order, the rows
    received from each rank as int32). Without splits (equal blocks), as Horovod: the received rows alone."""
    output, received = _Alltoall.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


# -- reducescatter -----------------------------------------------------------------------------------------------------


def _reducescatter_entry(tensors: Sequence[torch.Tensor], op: int, name: str | None, process_set: ProcessSet,
                         prescale_factor: float, postscale_factor: float, single: bool) -> int:
    if op == Adasum:
        raise _hvd.refuse(ValueError("reducescatter: op=Adasum is not supported"), process_set)
    arrays = [_numpy(t, f"tensor {i}") for i, t in enumerate(tensors)]
    start, finish = _hvd.reducescatter_parts(arrays, op, prescale_factor, postscale_factor, process_set)

    def done(results: Any) -> Any:
        values = [_tensor(np.ascontiguousarray(r)) for r in finish(results)]
        return values[0] if single else values

    return _hvd.submit(name, start, done, process_set)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    return _reducescatter_entry([tensor], op, name, process_set, prescale_factor, postscale_factor, True)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None, op: int = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    return _reducescatter_entry(list(tensors), op, name, process_set, prescale_factor, postscale_factor, False)


def _scaled_grad(grad: torch.Tensor, ctx: Any) -> torch.Tensor:
    if ctx.op == Sum:
        grad = grad * ctx.process_set.size()
    return grad * ctx.scales[0] * ctx.scales[1] if ctx.scales != (1.0, 1.0) else grad


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: int, process_set: ProcessSet,
                prescale_factor: float, postscale_factor: float) -> torch.Tensor:
        ctx.op, ctx.process_set, ctx.scales = op, process_set, (prescale_factor, postscale_factor)
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return allgather(_scaled_grad(grad, ctx), process_set=ctx.process_set), None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = Compression.none,
                  op: int = Average, process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """The reduction over the ranks, rank r keeping its share of the first dimension (the first rows % size ranks
    one row more)."""
    return _Reducescatter.apply(tensor, name, op, process_set, prescale_factor, postscale_factor)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: int, process_set: ProcessSet, prescale_factor: float,
                postscale_factor: float, *tensors: torch.Tensor) -> tuple:
        ctx.op, ctx.process_set, ctx.scales = op, process_set, (prescale_factor, postscale_factor)
        return tuple(synchronize(grouped_reducescatter_async(tensors, name, op, process_set, prescale_factor,
                                                             postscale_factor)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        return (None, None, None, None, None,
                *grouped_allgather([_scaled_grad(g, ctx) for g in grads], process_set=ctx.process_set))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Any = Compression.none, op: int = Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list:
    return list(_GroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor, *tensors))


# -- model and optimizer state -----------------------------------------------------------------------------------------


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Root's values into every rank's parameters (a state_dict, named_parameters(), or a list of tensors), in
    place, in one order on every rank (sorted by name for dicts, as Horovod)."""
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, Iterable):
        items = list(params)
        if items and not isinstance(items[0], tuple):
            items = [(str(i), p) for i, p in enumerate(items)]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = []
    for _, p in items:
        if p is None:
            continue
        target = p.data if isinstance(p, torch.nn.Parameter) else p
        handles.append(broadcast_async_(target, root_rank, process_set=global_process_set))
    for handle in handles:
        synchronize(handle)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None) -> None:
    """Root's optimizer state and hyperparameters on every rank. A rank whose optimizer has no state yet makes it
    first with one local step on zero gradients (as Horovod does); root's state then decides which tensors there
    are: each is broadcast in place where this rank has it with root's dtype and shape, into a new tensor
    otherwise, and everything else comes as a pickled object."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    state_dict = optimizer.state_dict()
    if not state_dict["state"]:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = p.data.new(p.size()).zero_()
        if isinstance(optimizer, _DistributedOptimizerMixin):  # its step() would allreduce: a local step only
            super(_DistributedOptimizerMixin, optimizer).step()  # type: ignore[misc]
        else:
            optimizer.step()
        state_dict = optimizer.state_dict()
    tensors: dict[tuple, torch.Tensor] = {}
    others: dict[tuple, Any] = {}
    for index, state in state_dict["state"].items():
        for key, value in state.items():
            (tensors if torch.is_tensor(value) else others)[(index, key)] = value
    groups = [{k: v for k, v in g.items() if k != "params"} for g in state_dict["param_groups"]]
    layout = {k: (str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in tensors.items()}
    received_object: Any = broadcast_object((layout, others, groups), root_rank)
    root_layout, root_others, root_groups = received_object
    handles: list[int] = []
    received: dict[tuple, torch.Tensor] = {}
    for key in sorted(root_layout, key=repr):
        dtype, shape = root_layout[key]
        tensor = tensors.get(key)
        if tensor is None or layout[key] != (dtype, shape) or not tensor.is_contiguous():
            tensor = torch.zeros(shape, dtype=getattr(torch, dtype))
        received[key] = tensor
        handles.append(broadcast_async_(tensor, root_rank))
    for handle in handles:
        synchronize(handle)
    state_dict["state"] = {}
    for (index, key), value in [*received.items(), *root_others.items()]:
        state_dict["state"].setdefault(index, {})[key] = value
    for group, root_group in zip(state_dict["param_groups"], root_groups, strict=True):
        group.update(root_group)
    optimizer.load_state_dict(state_dict)


# -- DistributedOptimizer ----------------------------------------------------------------------------------------------


class _DistributedOptimizerMixin:
    """Gradients are allreduced as backward produces them (a hook per parameter, named by parameter), and step()
    waits for them (Horovod's DistributedOptimizer)."""

    param_groups: list[dict[str, Any]]  # the torch optimizer's, beside this class in the made class's bases

    def _hvd_setup(self, named_parameters: Any, compression: Any, backward_passes_per_step: int, op: int,
                   gradient_predivide_factor: float, groups: Any, sparse_as_dense: bool,
                   process_set: ProcessSet) -> None:
        self._compression = compression
        self._op = op
        self._predivide = gradient_predivide_factor
        self._sparse_as_dense = sparse_as_dense
        self._process_set = process_set
        self.backward_passes_per_step = backward_passes_per_step
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [(f"allreduce.noname.{i}.{j}", p) for i, group in enumerate(self.param_groups)
                                for j, p in enumerate(group["params"])]
        if any(not isinstance(p, tuple) for p in named_parameters):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced "
                             "by model.named_parameters().")
        names = [n for n, _ in named_parameters]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: "
                             f"{', '.join(duplicates)}")
        all_ids = {id(p) for group in self.param_groups for p in group["params"]}
        named_ids = {id(p) for _, p in named_parameters}
        missing = all_ids - named_ids
        if missing:
            raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                             "Python object ids: " + ", ".join(str(i) for i in sorted(missing)))
        self._names = {id(p): n for n, p in named_parameters}
        self._parameter_names = {p: n for n, p in named_parameters}  # Horovod's attribute of the same name
        self._groups = None
        if isinstance(groups, int) and groups > 0:
            params = [p for group in self.param_groups for p in group["params"]]
            self._groups = [params[i::groups] for i in range(groups)]
        elif isinstance(groups, list):
            self._groups = [list(g) for g in groups]
        self._handles: dict[int, tuple[int | None, Any]] = {}
        self._delay: collections.defaultdict[int, int] = collections.defaultdict(lambda: backward_passes_per_step)
        self._hooks: list[Any] = []
        self._synchronized = False
        self._should_synchronize = True
        if process_set.included():  # a rank outside the set steps on its own gradients, as in Horovod
            self._register_hooks()

    def _register_hooks(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._hook))

    def _hook(self, p: torch.Tensor) -> None:
        key = id(p)
        if key in self._handles and self._handles[key][0] is not None:
            if self._delay[key] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before call to step(). "
                    "Increase backward_passes_per_step to accumulate gradients locally.")
        self._delay[key] -= 1
        if self._delay[key] == 0:
            self._handles[key] = (self._reduce_async(p), None)
        else:
            self._handles[key] = (None, None)

    def _reduce_async(self, p: torch.Tensor) -> int:
        name = self._names.get(id(p))
        grad = p.grad
        if grad.is_sparse:
            if not self._sparse_as_dense:
                return _sparse_allreduce(grad, name, self._op, self._process_set)
            # Reduced dense, handed back sparse: the optimizer (SparseAdam, say) may take sparse gradients only.
            dense = grad.to_dense()
            handle = allreduce_async_(dense, name=name, op=self._op, process_set=self._process_set)
            entry = _hvd._runtime.entries[handle]
            entry.finish = lambda result, finish=entry.finish: finish(result).to_sparse()  # type: ignore[misc]
            return handle
        pre = post = 1.0
        if self._op == Average:
            pre, post = 1.0 / self._predivide, self._predivide
        compressed, ctx = self._compression.compress(grad)
        handle = allreduce_async_(compressed, name=name, op=self._op, prescale_factor=pre, postscale_factor=post,
                                  process_set=self._process_set)
        if compressed is not grad:
            entry = _hvd._runtime.entries[handle]
            finish = entry.finish

            def decompress(result: Any, finish: Any = finish, grad: torch.Tensor = grad) -> torch.Tensor:
                grad.copy_(self._compression.decompress(finish(result), ctx))
                return grad

            entry.finish = decompress
        return handle

    def synchronize(self) -> None:
        """Wait for every parameter's allreduce (submitting those whose hook did not run, e.g. unused ones)."""
        if not self._process_set.included():
            self._synchronized = True
            return
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                key = id(p)
                if key not in self._handles or self._handles[key][0] is None:
                    if p.grad is None:
                        p.grad = p.data.new(p.size()).zero_()
                    self._handles[key] = (self._reduce_async(p), None)
        pending = list(self._handles.items())
        for key, (handle, _) in pending:
            output = synchronize(handle) if handle is not None else None
            if isinstance(output, torch.Tensor) and output.is_sparse:
                for group in self.param_groups:
                    for p in group["params"]:
                        if id(p) == key:
                            p.grad = output
        self._handles.clear()
        self._delay.clear()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Any:
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to "
                              "consider using optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it can cause "
                                 "a race condition.")
        return super().zero_grad(set_to_none)  # type: ignore[misc]


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,  # noqa: N802 (Horovod's)
                         compression: Any = Compression.none, backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                         sparse_as_dense: bool = False, process_set: ProcessSet = global_process_set) -> Any:
    """Horovod's DistributedOptimizer: an optimizer of the same class whose step() first averages (op=) the
    gradients over the ranks."""
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if op == Adasum:
        raise HorovodInternalError("op=Adasum is not supported by ddlfast.horovod (docs/horovod.md)")
    cls: Any = type(optimizer.__class__.__name__, (_DistributedOptimizerMixin, optimizer.__class__), {})
    distributed = cls.__new__(cls)
    distributed.__dict__.update(optimizer.__dict__)
    distributed._hvd_setup(named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor,
                           groups if groups is not None else num_groups, sparse_as_dense, process_set)
    return distributed


class SyncBatchNorm(torch.nn.Module):
    """Horovod's SyncBatchNorm needs GPU tensors in Horovod itself; not provided here (docs/horovod.md)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise HorovodInternalError("ddlfast.horovod.torch.SyncBatchNorm is not supported (docs/horovod.md)")
