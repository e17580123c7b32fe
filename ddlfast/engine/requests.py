"""Allreduce requests: validated on the caller's thread (so bad input raises where it was passed, and joins the
agreement as an error on every rank), then executed, on whichever thread, by the host or the GPU executor after
the per-call agreement."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ddlfast.buffers.device import any_device_array, device_buffers
from ddlfast.buffers.host import check_no_overlap, host_buffer
from ddlfast.compression.codecs import Codec
from ddlfast.compression.wire import wire_by_dim
from ddlfast.config import Settings, load_settings, parse_compression, with_reproducible
from ddlfast.engine import device, host
from ddlfast.engine.device import DeviceRequest, submit
from ddlfast.engine.host import HostRequest
from ddlfast.engine.state import EngineState, reproducible_wire
from ddlfast.errors import DdlfastError
from ddlfast.fusion.pack_policy import bucket_indices
from ddlfast.ops import SUMMING_OPS, WIRE_OPS, check_op


def prepare(state: EngineState, arrays: Sequence[Any], op: str, dims: object, result: Any,
            compression: object = None, error_feedback: bool = False, stream: object = None,
            asynchronous: bool = False, reproducible: object = None) -> HostRequest | DeviceRequest:
    rank = state.rank
    op = check_op(op, rank)  # ddlfast's name (also for MPI.SUM, torch's ReduceOp.SUM, ...)
    if isinstance(arrays, np.ndarray) or not isinstance(arrays, Sequence):
        raise DdlfastError("fused_allreduce takes a list of arrays; use ddlfast.allreduce for one array")
    if len(arrays) == 0:
        raise DdlfastError("fused_allreduce got an empty list of arrays")
    settings = with_reproducible(load_settings(), reproducible, rank)
    ring_dims = state.resolve_dims(dims, settings)
    if any_device_array(arrays):
        gpu_buffers = device_buffers(arrays, rank, stream)
        check_no_overlap([(b.pointer, b.nbytes) for b in gpu_buffers], rank)
        codec = resolve_compression(compression, settings, [b.dtype_name for b in gpu_buffers], rank)
        check_op_on_wire(state, op, codec, ring_dims, error_feedback)
        check_reproducible(state, settings, codec, ring_dims)
        if settings.algorithm != "auto" and not settings.reproducible:
            state.check_algorithm(settings, ring_dims, False, largest_bucket(
                [b.dtype_name for b in gpu_buffers], [b.nbytes for b in gpu_buffers], settings), gpu=True)
        # The fences go on the caller's streams now, on the caller's thread: later work there is not waited for.
        return DeviceRequest(submit(gpu_buffers), op, ring_dims, settings, list(arrays) if result is None else result,
                             codec, bool(error_feedback), asynchronous)
    if stream is not None:
        raise DdlfastError(f"stream= was given on rank {rank} but the arrays are in host memory; streams order GPU "
                           "arrays only")
    buffers = [host_buffer(array, f"array {i} on rank {rank}") for i, array in enumerate(arrays)]
    if len(buffers) > 1:
        check_no_overlap([(b.pointer, b.nbytes) for b in buffers], rank)
    codec = resolve_compression(compression, settings, [b.array.dtype.name for b in buffers], rank)
    check_op_on_wire(state, op, codec, ring_dims, error_feedback)
    check_reproducible(state, settings, codec, ring_dims)
    if settings.algorithm != "auto" and not settings.reproducible:
        compressed = isinstance(codec, tuple) and bool(wire_by_dim(codec, ring_dims, state.hosts_tier(ring_dims)))
        largest = largest_bucket([b.array.dtype for b in buffers], [b.nbytes for b in buffers], settings)
        state.check_algorithm(settings, ring_dims, compressed, largest, gpu=False)
    return HostRequest(buffers, op, ring_dims, settings, list(arrays) if result is None else result, codec,
                       bool(error_feedback))


def largest_bucket(dtypes: list, nbytes: list[int], settings: Settings) -> int:
    """Bytes of the largest core call the buckets of these arrays make (ddlfast/fusion/pack_policy.py)."""
    buckets = bucket_indices(dtypes, nbytes, settings.bucket_bytes, settings.first_bucket_bytes)
    return max((sum(nbytes[i] for i in bucket) for bucket in buckets), default=0)


def execute(state: EngineState, request: HostRequest | DeviceRequest) -> Any:
    """The agreement, then the executor; returns the request's result."""
    state.set_core_timeout(request.settings.timeout_s)
    layout = request.layout()
    if isinstance(request, DeviceRequest):
        state.agreed(layout, lambda: device.reduce(state, request, layout))
    else:
        host.run(state, request, layout)
    return request.result


def check_op_on_wire(state: EngineState, op: str, codec: tuple[str, ...] | Any, ring_dims: tuple[int, ...],
                     error_feedback: object) -> None:
    """The ops a compressed wire, error feedback and user codecs can carry (ddlfast/ops.py)."""
    rank = state.rank
    if not isinstance(codec, tuple):
        if op not in SUMMING_OPS:
            raise DdlfastError(f"op={op!r} on rank {rank} cannot run through a user codec "
                               f"({type(codec).__name__}): codecs reduce by summing; use op='sum' or 'average', "
                               "or compression='none'")
        return
    wire = wire_by_dim(codec, ring_dims, state.hosts_tier(ring_dims))  # raises when codecs do not fit the dims
    if wire and op not in WIRE_OPS:
        raise DdlfastError(f"op={op!r} on rank {rank} cannot run on the compressed wire "
                           f"(compression={','.join(codec)}): every hop would round a partial product; use "
                           f"compression='none' (ops on a compressed wire: {', '.join(WIRE_OPS)})")
    if wire and error_feedback and op not in SUMMING_OPS:
        raise DdlfastError(f"error_feedback on rank {rank} applies to op='sum' or 'average', not {op!r}")


def check_reproducible(state: EngineState, settings: Settings, codec: tuple[str, ...] | Any,
                       ring_dims: tuple[int, ...]) -> None:
    """reproducible=True runs wire codecs only: a user codec (TopKCodec, a hook) sums in its own order."""
    if not settings.reproducible:
        return
    if not isinstance(codec, tuple):
        raise DdlfastError(f"reproducible=True on rank {state.rank} cannot run through a user codec "
                           f"({type(codec).__name__}): it reduces in its own order, which ddlfast cannot make "
                           "canonical; use compression='none', 'fp16' or 'bf16' (DDLFAST_REPRODUCIBLE)")
    reproducible_wire(wire_by_dim(codec, ring_dims, state.hosts_tier(ring_dims)), state.rank)


def resolve_compression(compression: object, settings: Settings, dtype_names: list[str],
                        rank: int) -> tuple[str, ...] | Any:
    """Codec names (the argument, else DDLFAST_COMPRESSION), or a user codec as it is."""
    if compression is None:
        names = settings.compression
    elif isinstance(compression, (str, tuple, list)):
        names = parse_compression(compression)
    elif isinstance(compression, Codec) or callable(compression):
        # A user codec runs after the agreement (a failure there breaks the context); the dtypes it declares
        # (`dtypes`, e.g. TopKCodec's float32) are checked now, so a mismatch is refused like any bad input.
        accepted = getattr(compression, "dtypes", None)
        for i, name in enumerate(dtype_names if accepted is not None else ()):
            if name not in accepted:
                raise DdlfastError(f"array {i} on rank {rank} is {name}, but {type(compression).__name__} takes "
                                   f"{', '.join(accepted)} arrays")
        return compression  # otherwise checked when it runs
    else:
        raise DdlfastError(f"compression={compression!r} is not a codec name, a Codec or a hook")
    if names not in (("none",), ("auto",)):
        for i, name in enumerate(dtype_names):
            if name != "float32":
                raise DdlfastError(f"array {i} on rank {rank} is {name}: wire compression "
                                   f"({','.join(names)}) applies to float32 arrays only")
    return names
