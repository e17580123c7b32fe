"""Reduce-scatter and allgather: the two passes of the ring allreduce as collectives of their own (MPI's
MPI_Reduce_scatter(_block) and MPI_Allgather semantics), for sharded training (ZeRO/FSDP).

This module validates a call on the caller's thread (so bad input raises where it was passed, and joins the
agreement as an error on every rank), builds the layout every rank must agree on, and turns arrays' blocks into
the segments of the core's one logical buffer (RingAllreduce::reduce_scatter / allgather in
src/engine/ring_allreduce.h), so a fused call is one core call per dtype, with no packing:

    reduce-scatter  input segments: block 0 of every array, then block 1 of every array, ...; output segments:
                    this rank's output arrays. The core reduces in one working copy (the input stays unchanged).
    allgather       input segments: this rank's arrays; output segments: for each rank, its block of every
                    output array. Uncompressed, elements are opaque bytes (any fixed-size dtype).

Small host calls ride in the agreement's own messages (carried_options); one array in equal blocks takes the fast
path (ddlfast/engine/fast_path.py), which asks carried_options too.

GPU arrays (CuPy, PyTorch CUDA tensors) go through pinned host copies (DeviceExecutor.to_host / from_host in
ddlfast/engine/device.py) and the host engine; torch CPU tensors through their NumPy view.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ddlfast.buffers.device import any_device_array, device_buffers
from ddlfast.buffers.dtypes import dtype_code, numpy_dtype
from ddlfast.buffers.host import host_view, torch_tensor_module
from ddlfast.compression.wire import wire_by_dim
from ddlfast.config import MAX_CARRIED_SHARD_BYTES, load_settings, with_reproducible
from ddlfast.engine import device
from ddlfast.engine.device import submit
from ddlfast.engine.host import check_wire_overflows
from ddlfast.engine.requests import check_op_on_wire, check_reproducible, resolve_compression
from ddlfast.engine.state import EngineState, is_half_sum
from ddlfast.errors import DdlfastError
from ddlfast.ops import OPS, check_op

REDUCE_SCATTER = "reduce_scatter"
ALLGATHER = "allgather"


class Spec(NamedTuple):
    """One input array as the layout and the core see it."""

    host: np.ndarray | None  # flat NumPy view (host arrays); None for GPU arrays (copied to the host at run time)
    dtype: np.dtype
    shape: tuple[int, ...]
    layout_dtype: object  # the dtype as it enters the layout ("cuda float32" for GPU arrays)


class ShardRequest(NamedTuple):
    """A validated reduce-scatter or allgather, ready to run on any thread."""

    kind: str
    op: str
    dims: tuple[int, ...]
    settings: Any
    codec: tuple[str, ...]
    specs: list[Spec]
    counts: list[tuple[int, ...]]  # per array: the elements of each rank's block
    outputs: list[np.ndarray]  # flat host arrays the core writes (the caller's out=, new arrays, or staging)
    copy_back: list[tuple[np.ndarray, np.ndarray]]  # (staging, target): staged outputs copied after the run
    results: list  # what the call returns, in array order
    single: bool  # a one-array call returns results[0]
    gpu: tuple[Any, Any] | None  # (inputs submission, outputs submission) for GPU arrays
    layout: tuple


def layout_of(kind: str, op: str, dims: tuple[int, ...], specs: Sequence[Spec], counts: object, codec: object,
              settings: Any) -> tuple:
    """Everything the ranks must agree on (agreement.describe reads it back)."""
    return (kind, op, dims, tuple((s.layout_dtype, s.shape) for s in specs), counts, codec,
            (settings.chunk_bytes, settings.small_bytes, settings.bucket_bytes, settings.first_bucket_bytes,
             settings.algorithm), settings.reproducible)


def _like(result: np.ndarray, original: object) -> Any:
    """A new result as the kind of array the caller passed (a torch CPU tensor for a torch CPU tensor)."""
    torch = torch_tensor_module(original)
    if torch is None:
        return result
    if original.dtype == torch.bfloat16:  # type: ignore[attr-defined]
        return torch.from_numpy(result.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(result)


def block_counts(counts: object, size: int, world: int, where: str) -> tuple[int, ...]:
    """counts=None: equal blocks (size a multiple of the world); else one non-negative count per rank summing
    to size."""
    if counts is None:
        if size % world:
            raise DdlfastError(f"{where} has {size} elements, not a multiple of the {world} ranks; pass counts= "
                               "for uneven blocks")
        return (size // world,) * world
    if isinstance(counts, (str, bytes)) or not isinstance(counts, (Sequence, np.ndarray)):
        raise DdlfastError(f"counts={counts!r} for {where} is not a sequence of {world} integers")
    values = []
    for value in counts:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise DdlfastError(f"counts={list(counts)!r} for {where} holds {value!r}, not a count >= 0")
        values.append(int(value))
    if len(values) != world:
        raise DdlfastError(f"counts={values!r} for {where} gives {len(values)} blocks for {world} ranks")
    if sum(values) != size:
        raise DdlfastError(f"counts={values!r} for {where} sums to {sum(values)}, but the array has {size} "
                           "elements")
    return tuple(values)


def result_shape(kind: str, shape: tuple[int, ...], counts: tuple[int, ...], explicit: bool, rank: int,
                 world: int) -> tuple[int, ...]:
    if kind == ALLGATHER:
        return (world * shape[0], *shape[1:]) if shape else (world,)
    if not explicit and shape and shape[0] % world == 0:
        return (shape[0] // world, *shape[1:])
    return (counts[rank],)


def _extent(array: np.ndarray) -> tuple[int, int]:
    return array.ctypes.data, array.nbytes


def _check_outputs_apart(outputs: Sequence[np.ndarray], inputs: Sequence[np.ndarray], rank: int) -> None:
    """Outputs may share memory with nothing (inputs may repeat: they are only read). One sweep over the spans
    sorted by start (n log n, so a call of 100k arrays validates as fast as one of 100k allreduce arrays): a
    span that starts before the furthest end so far overlaps the span that reaches there."""
    spans = sorted((start, start + size, is_input, i)
                   for is_input, arrays in ((False, outputs), (True, inputs))
                   for i, (start, size) in enumerate(map(_extent, arrays)) if size)
    reach_any = reach_out = -1
    holder_any = holder_out = (False, -1)  # (is_input, index) of the span reaching furthest, of any kind / an out
    for start, end, is_input, i in spans:
        if not is_input and start < reach_any:
            _raise_overlap((False, i), holder_any, rank)
        if is_input and start < reach_out:
            _raise_overlap(holder_out, (True, i), rank)
        if end > reach_any:
            reach_any, holder_any = end, (is_input, i)
        if not is_input and end > reach_out:
            reach_out, holder_out = end, (False, i)


def _raise_overlap(first: tuple[bool, int], second: tuple[bool, int], rank: int) -> None:
    """An output and another span share memory: named output first (the lower index of two outputs)."""
    output, other = sorted((first, second))
    names = [f"{'array' if is_input else 'out'} {i}" for is_input, i in (output, other)]
    raise DdlfastError(f"{names[0]} on rank {rank} overlaps {names[1]} in memory; the output must be memory of "
                       "its own")


def _host_out(out: object, dtype: np.dtype, elements: int, where: str) -> np.ndarray:
    out = host_view(out, where)
    if not isinstance(out, np.ndarray) or isinstance(out, np.ma.MaskedArray):
        raise DdlfastError(f"{where} is a {type(out).__module__}.{type(out).__qualname__}, not a NumPy array "
                           "(or torch CPU tensor) like the input")
    if out.dtype != dtype:
        raise DdlfastError(f"{where} is {out.dtype.name} but the array is {dtype.name}")
    if out.size != elements:
        raise DdlfastError(f"{where} has {out.size} elements; the result has {elements}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise DdlfastError(f"{where} must be C-contiguous and writable")
    return out


def _host_spec(array: object, kind: str, where: str) -> Spec:
    array = host_view(array, where)
    if not isinstance(array, np.ndarray) or isinstance(array, np.ma.MaskedArray):
        hint = " (CuPy/CUDA arrays need a CUDA build)" if hasattr(array, "__cuda_array_interface__") else ""
        raise DdlfastError(f"{where} is a {type(array).__module__}.{type(array).__qualname__}, not a NumPy array"
                           f"{hint}")
    _check_dtype(array.dtype, kind, where)
    if not array.flags.c_contiguous:
        raise DdlfastError(f"{where} is not C-contiguous (strides {array.strides}); pass np.ascontiguousarray(...)")
    return Spec(array.reshape(-1), array.dtype, array.shape, array.dtype)


def _check_dtype(dtype: np.dtype, kind: str, where: str) -> None:
    if kind == REDUCE_SCATTER:
        dtype_code(dtype, where)  # the reducible dtypes
    elif dtype.hasobject or dtype.itemsize == 0:
        raise DdlfastError(f"{where} has dtype {dtype}; allgather copies fixed-size elements (no objects)")


def _per_array(value: object, n: int, name: str, single: bool, rank: int) -> list:
    """A per-array argument of a fused call: None for all, or one entry per array."""
    if value is None:
        return [None] * n
    if single:
        return [value]
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise DdlfastError(f"{name}= of a fused call on rank {rank} needs one entry per array ({n}), not "
                           f"{len(value) if isinstance(value, (list, tuple)) else type(value).__name__}")
    return list(value)


def prepare(state: EngineState, kind: str, arrays: Any, op: str, dims: object, counts: object, out: object,
            compression: object, stream: object, single: bool, reproducible: object = None) -> ShardRequest:
    """Validate a call on the caller's thread, so bad input raises where it was passed."""
    if kind == REDUCE_SCATTER:
        op = check_op(op, state.rank)  # ddlfast's name (also for MPI.SUM, torch's ReduceOp.SUM, ...)
    settings = with_reproducible(load_settings(), reproducible, state.rank)
    ring_dims = state.resolve_dims(dims, settings)
    if compression is not None and not isinstance(compression, (str, tuple, list)):
        raise DdlfastError(f"compression={compression!r} on rank {state.rank}: {kind} takes a codec name "
                           "('none', 'fp16', 'bf16', per dimension, or 'auto'), not a user codec")
    codec = resolve_compression(compression, settings, [], state.rank)  # float32 is checked per array below
    check_op_on_wire(state, op, codec, ring_dims, False)  # also raises when codecs do not fit the dims
    check_reproducible(state, settings, codec, ring_dims)
    request = _validate(kind, arrays, op, ring_dims, counts, out, codec, settings, state.rank, state.size, stream,
                        single)
    # GPU arrays run on the host engine here, so every algorithm can; reproducible=True runs its own plan
    if settings.algorithm != "auto" and not settings.reproducible:
        compressed = bool(wire_by_dim(codec, ring_dims, state.hosts_tier(ring_dims)))
        largest = max((sum(map(sum, request.counts)) * max(s.dtype.itemsize for s in request.specs)
                       if request.specs else 0), 0)
        state.check_algorithm(settings, ring_dims, compressed, largest, gpu=False)
    return request


def execute(state: EngineState, request: ShardRequest) -> Any:
    """The agreement, then the collective; returns what the call returns. A small host call rides in the
    agreement's own messages instead (_carried)."""
    state.set_core_timeout(request.settings.timeout_s)
    if not _carried(state, request):
        state.agreed(request.layout, lambda: _run(state, request))
    return request.results[0] if request.single else request.results


def carried_options(state: EngineState, kind: str, nbytes: int, dims: tuple[int, ...], settings: Any,
                    wire: tuple[int, ...], half_sum: bool) -> Any:
    """The core's options for a call whose result rides in the agreement's own messages (Core::
    agreed_reduce_scatter / agreed_allgather, carried), or None: the agreement, then the ring's half.
    `nbytes`: the whole input of a reduce-scatter (an allreduce of it, as the latency path takes one; not for
    fp16/bf16 sums, `half_sum`), the whole result of an allgather (an exact int64 sum of each rank's block, padded
    to whole words: up to the small-message limit, and in shared memory, where a rank writes its block and copies
    the others', as far as the latency path reaches); neither above config.MAX_CARRIED_SHARD_BYTES. Uncompressed,
    not reproducible, not DDLFAST_ALGORITHM=mpi. From agreed values only (whether the ranks share the agreement's
    memory is one of them), so ranks that agree choose alike: the general path (_carried) and the fast path
    (ddlfast/engine/fast_path.py) both ask here."""
    if wire or settings.reproducible or settings.algorithm == "mpi" or nbytes > MAX_CARRIED_SHARD_BYTES:
        return None
    if kind == ALLGATHER:
        world = state.size
        words = world * -(-(nbytes // world) // 8) * 8  # Core::agreed_allgather's blocks of whole words
        if state.folds(words, settings):
            return state.call_options(words, dims, settings)
        if nbytes and state.core.shared_memory and state.latency_takes(words, settings):
            return state.call_options(words, dims, settings, latency=True)
        return None
    if half_sum or not state.latency_takes(nbytes, settings):
        # fp16/bf16 sums: the ring's reduce-scatter reports an overflow in this rank's block as its own, where the
        # allreduce would name the whole buffer's
        return None
    return state.call_options(nbytes, dims, settings, (), half_sum, latency=True)


def _carried(state: EngineState, request: ShardRequest) -> bool:
    """An uncompressed host call of one dtype that carried_options takes: its agreement and its result in one
    core call (agreed_in_core). False: not taken."""
    if request.gpu is not None or len({s.dtype for s in request.specs}) != 1:
        return False
    dtype = request.specs[0].dtype
    wire = wire_by_dim(request.codec, request.dims, state.hosts_tier(request.dims)) if dtype == np.float32 else ()
    inputs = [s.host for s in request.specs]
    ((method, arguments, nbytes),) = core_calls(request, inputs, state.rank, state.size, False)
    reduce = request.kind == REDUCE_SCATTER
    options = carried_options(state, request.kind, nbytes, request.dims, request.settings, wire,
                              reduce and is_half_sum(dtype, request.op))
    if options is None:
        return False
    core = state.core
    if reduce:
        op = OPS[request.op]
        state.agreed_in_core(request.layout, lambda fingerprint: core.reduce_scatter_segments(
            *arguments, op, options, agreement=fingerprint, carried=True))
    else:
        state.agreed_in_core(request.layout, lambda fingerprint: core.allgather_segments(
            *arguments, options, agreement=fingerprint, carried=True))
    for staging, target in request.copy_back:
        target[...] = staging
    return True


def chain_reduce_scatter(state: EngineState, settings: Any, wire: tuple[int, ...]) -> bool:
    """Whether reproducible=True's reduce_scatter runs the canonical chain's allreduce (src/engine/ring_allreduce.cc,
    reduce_scatter_by_chain): uncompressed (the wire's reduce-scatter keeps float32 sums), and where hosts hold 3
    ranks or more. The flat direct reduce-scatter sends (ranks per host)/2 times the data across the host link each
    way, the chain the data itself plus an allgather within each host: at 2 ranks per host the flat order measured
    faster (0.85x the chain's time at P = 4, 64 MiB, on 2 emulated hosts; at P = 8 the chain took 0.65x the flat's)."""
    if wire or not settings.reproducible:
        return False
    hosts = state.chain_hosts(settings)
    return hosts > 1 and state.size // hosts >= 3


def _run(state: EngineState, request: ShardRequest) -> None:
    settings, dims = request.settings, request.dims
    gpu = device.executor(state) if request.gpu is not None else None
    if gpu is not None:
        inputs = [c.reshape(-1) for c in gpu.to_host(request.gpu[0])]
    else:
        inputs = [s.host for s in request.specs]
    wire = wire_by_dim(request.codec, dims, state.hosts_tier(dims))
    if any(s.dtype != np.float32 for s in request.specs):
        wire = ()  # "auto" leaves other dtypes uncompressed (explicit codecs were refused for them)
    chain = request.kind == REDUCE_SCATTER and chain_reduce_scatter(state, settings, wire)
    for method, arguments, nbytes in core_calls(request, inputs, state.rank, state.size, bool(wire)):
        # (the allgather half has no direct step to run)
        options = state.call_options(nbytes, dims, settings, wire,
                                     request.kind != ALLGATHER and is_half_sum(request.specs[0].dtype, request.op),
                                     chain=chain)
        if method == "reduce_scatter_segments":
            state.core.reduce_scatter_segments(*arguments, OPS[request.op], options)
        else:
            state.core.allgather_segments(*arguments, options)
    state.record_events(state.core.take_events)
    state.flush_timeline()
    for staging, target in request.copy_back:
        target[...] = staging
    if wire:
        check_wire_overflows(state, request.codec, request.op, gathers=request.kind == ALLGATHER)
    if gpu is not None:
        gpu.from_host(request.gpu[1], request.outputs, wait_on_host=True)


def _validate(kind: str, arrays: object, op: str, dims: tuple[int, ...], counts: object, out: object,
              codec: tuple[str, ...], settings: Any, rank: int, world: int, stream: object,
              single: bool) -> ShardRequest:
    """The call's arrays, counts and outputs into a request; raises DdlfastError naming the rank."""
    name = f"fused_{kind}" if not single else kind
    if isinstance(arrays, np.ndarray) or not isinstance(arrays, Sequence):
        raise DdlfastError(f"{name} on rank {rank} takes a list of arrays; use ddlfast.{kind} for one array")
    if len(arrays) == 0:
        raise DdlfastError(f"{name} on rank {rank} got an empty list of arrays")
    if kind == ALLGATHER and counts is not None:
        raise DdlfastError(f"allgather on rank {rank} takes no counts= (every rank passes the same shape)")
    outs = _per_array(out, len(arrays), "out", single, rank)
    explicit = _per_array(counts, len(arrays), "counts", single, rank)
    where = [f"array {i} on rank {rank}" for i in range(len(arrays))]
    on_gpu = any_device_array(arrays)
    if on_gpu:
        buffers = device_buffers(arrays, rank, stream)
        specs = [Spec(None, numpy_dtype(b.dtype_name), tuple(b.shape), f"cuda {b.dtype_name}") for b in buffers]
        for spec, w in zip(specs, where, strict=True):
            _check_dtype(spec.dtype, kind, w)
    else:
        if stream is not None:
            raise DdlfastError(f"stream= was given on rank {rank} but the arrays are in host memory; streams "
                               "order GPU arrays only")
        specs = [_host_spec(a, kind, w) for a, w in zip(arrays, where, strict=True)]
    if codec not in (("none",), ("auto",)) and any(s.dtype != np.float32 for s in specs):
        bad = next(i for i, s in enumerate(specs) if s.dtype != np.float32)
        raise DdlfastError(f"array {bad} on rank {rank} is {specs[bad].dtype.name}: wire compression "
                           f"({','.join(codec)}) applies to float32 arrays only")
    sizes = [int(np.prod(s.shape, dtype=np.int64)) for s in specs]
    if kind == REDUCE_SCATTER:
        blocks = [block_counts(c, n, world, w) for c, n, w in zip(explicit, sizes, where, strict=True)]
    else:
        blocks = [(n,) * world for n in sizes]
    shapes = [result_shape(kind, s.shape, b, c is not None, rank, world)
              for s, b, c in zip(specs, blocks, explicit, strict=True)]
    elements = [b[rank] if kind == REDUCE_SCATTER else sum(b) for b in blocks]
    outputs: list[np.ndarray] = []
    copy_back: list[tuple[np.ndarray, np.ndarray]] = []
    results: list = []
    gpu = None
    if on_gpu:  # host staging, then the device outputs
        device_outs = [o if o is not None else _empty_device(a, shape, i, rank)
                       for i, (o, a, shape) in enumerate(zip(outs, arrays, shapes, strict=True))]
        out_buffers = device_buffers(device_outs, rank, stream)
        for i, (b, spec, n) in enumerate(zip(out_buffers, specs, elements, strict=True)):
            if b.dtype_name != spec.dtype.name or b.count != n:
                raise DdlfastError(f"out {i} on rank {rank} is {b.dtype_name}[{b.count}]; the result is "
                                   f"{spec.dtype.name}[{n}]")
        outputs = [np.empty(n, spec.dtype) for spec, n in zip(specs, elements, strict=True)]
        results = device_outs
        # The fences go on the caller's streams now, on the caller's thread.
        gpu = (submit(buffers), submit(out_buffers))
    else:
        for i, (o, spec, shape, n) in enumerate(zip(outs, specs, shapes, elements, strict=True)):
            if o is None:
                target = np.empty(shape, spec.dtype)
                results.append(_like(target, arrays[i]))
            else:
                target = _host_out(o, spec.dtype, n, f"out {i} on rank {rank}")
                results.append(o)
            flat = target.reshape(-1)
            if flat.ctypes.data % max(spec.dtype.itemsize, 1):  # the kernels load whole elements
                staging = np.empty(n, spec.dtype)
                copy_back.append((staging, flat))
                flat = staging
            outputs.append(flat)
        _check_outputs_apart([t for _, t in copy_back] + outputs, [s.host for s in specs], rank)
    layout_counts = None if all(c is None for c in explicit) else tuple(
        b if c is not None else None for b, c in zip(blocks, explicit, strict=True))
    layout = layout_of(kind, op if kind == REDUCE_SCATTER else "", dims, specs, layout_counts, codec, settings)
    return ShardRequest(kind, op, dims, settings, codec, specs, blocks, outputs, copy_back, results, single, gpu,
                       layout)


def _empty_device(array: object, shape: tuple[int, ...], index: int, rank: int) -> Any:
    """A new GPU result beside a GPU input, from the input's own library."""
    torch = torch_tensor_module(array)
    if torch is not None:
        return torch.empty(shape, dtype=array.dtype, device=array.device)  # type: ignore[attr-defined]
    module = type(array).__module__.split(".")[0]
    if module == "cupy":
        import cupy

        with cupy.cuda.Device(array.device.id):  # type: ignore[attr-defined]
            return cupy.empty(shape, dtype=array.dtype)  # type: ignore[attr-defined]
    raise DdlfastError(f"array {index} on rank {rank} is a {module} GPU array: pass out= (a GPU array of the "
                       "result's size) for its result")


def core_calls(request: ShardRequest, inputs: Sequence[np.ndarray], rank: int, world: int,
               compressed: bool) -> list[tuple[str, tuple, int]]:
    """The core calls that run a request: (method, arguments before the engine settings, bytes of the whole
    buffer it reduces or gathers). One per dtype for reduce-scatter; one for an allgather (opaque bytes, or
    float32 elements when the wire compresses)."""
    calls = []
    if request.kind == REDUCE_SCATTER:
        groups: dict[np.dtype, list[int]] = {}
        for index, spec in enumerate(request.specs):
            groups.setdefault(spec.dtype, []).append(index)
        for dtype, members in groups.items():
            itemsize = dtype.itemsize
            starts = {j: np.concatenate(([0], np.cumsum(request.counts[j]))) for j in members}
            in_pointers, in_counts = [], []
            for q in range(world):
                for j in members:
                    in_pointers.append(inputs[j].ctypes.data + int(starts[j][q]) * itemsize)
                    in_counts.append(request.counts[j][q])
            out_pointers = [request.outputs[j].ctypes.data for j in members]
            out_counts = [request.counts[j][rank] for j in members]
            by_rank = [sum(request.counts[j][q] for j in members) for q in range(world)]
            calls.append(("reduce_scatter_segments", (in_pointers, in_counts, out_pointers, out_counts, by_rank,
                                                      dtype_code(dtype, "array")), sum(by_rank) * itemsize))
        return calls
    unit = 4 if compressed else 1
    sizes = [a.nbytes // unit for a in inputs]
    out_pointers, out_counts = [], []
    for q in range(world):
        for a, n in zip(request.outputs, sizes, strict=True):
            out_pointers.append(a.ctypes.data + q * n * unit)
            out_counts.append(n)
    calls.append(("allgather_segments", ([a.ctypes.data for a in inputs], sizes, out_pointers, out_counts,
                                         [sum(sizes)] * world, unit, compressed), sum(sizes) * world * unit))
    return calls
