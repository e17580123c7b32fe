"""The host executor: a validated allreduce of host arrays, bucket by bucket, on the core's host engine.

Per bucket (ddlfast/fusion/pack_policy.py decides the layout from sizes alone): the small arrays are packed into
the pooled fused buffer, the large ones are reduced where they lie, all as segments of one logical buffer in one
call into the core (src/engine/ring_allreduce.*). Wire compression, error feedback and user codecs
(ddlfast/compression/) apply per bucket; the GPU executor sends its compressed and exact-arithmetic buckets here
through pinned host copies.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ddlfast.buffers.host import HostBuffer
from ddlfast.compression.codecs import Codec, HookContext
from ddlfast.compression.wire import wire_by_dim
from ddlfast.config import Settings
from ddlfast.engine.agreement import Agreement, allreduce_layout, arrays_of
from ddlfast.engine.control import Control
from ddlfast.engine.state import EngineState, is_half_sum
from ddlfast.errors import DdlfastConsistentError, DdlfastError
from ddlfast.fusion.buffer_pool import pack, unpack
from ddlfast.fusion.pack_policy import bucket_indices, packed_positions
from ddlfast.ops import OPS, SUMMING_OPS


def run_codec(codec: Any, bucket: np.ndarray, state: dict, control: Control, agreement: Agreement,
              op: str) -> None:
    """One bucket through a user Codec or CollectiveHook; validates what the codec returns."""
    hook_context = HookContext(control, state)
    if not isinstance(codec, Codec):
        codec(bucket, hook_context)
    else:
        payloads = codec.compress(bucket, state)
        if isinstance(payloads, np.ndarray) or not isinstance(payloads, Sequence):
            raise DdlfastError(f"{type(codec).__name__}.compress must return a list of arrays")
        for i, payload in enumerate(payloads):
            if not isinstance(payload, np.ndarray):
                raise DdlfastError(f"{type(codec).__name__}.compress returned a {type(payload).__name__} "
                                   f"as payload {i}, not a NumPy array")
        layout = ("codec", type(codec).__name__, tuple((p.dtype, p.shape) for p in payloads))
        agreement.check(layout)  # mismatched payload sizes across ranks: an error, not garbage
        gathered = [hook_context.allgather(p) for p in payloads]
        by_rank = [[g[r] for g in gathered] for r in range(control.size)]
        shape_before = bucket.shape
        codec.decompress(by_rank, bucket, state)
        if bucket.shape != shape_before:
            raise DdlfastError(f"{type(codec).__name__}.decompress changed the bucket's shape")
    if op == "average":
        bucket /= control.size


def codec_key(compression: object) -> object:
    """How a request's compression enters its agreement layout: codec names, or a user codec's type name."""
    return compression if isinstance(compression, tuple) else type(compression).__name__


class HostRequest(NamedTuple):
    """A validated allreduce of host arrays, ready to run on any thread."""

    buffers: list[HostBuffer]
    op: str
    dims: tuple[int, ...]
    settings: Settings
    result: Any
    compression: tuple[str, ...] | Any  # codec names, or a user Codec / CollectiveHook
    error_feedback: bool

    def layout(self) -> tuple:
        return allreduce_layout(self.op, self.dims, arrays_of(self.buffers), codec_key(self.compression),
                                self.error_feedback, self.settings)


def _buckets(request: HostRequest) -> list[list[int]]:
    """The request's buckets (fusion/pack_policy.bucket_indices: a pure function of dtypes and sizes)."""
    settings, buffers = request.settings, request.buffers
    return bucket_indices([b.array.dtype for b in buffers], [b.nbytes for b in buffers], settings.bucket_bytes,
                          settings.first_bucket_bytes)


def run(state: EngineState, request: HostRequest, layout: tuple) -> None:
    """The agreement, then the request: for one uncompressed bucket, the agreement runs inside that bucket's one
    call into the core (on the latency path, inside the same messages)."""
    buckets = _buckets(request)
    if (len(buckets) == 1 and isinstance(request.compression, tuple)
            and not wire_by_dim(request.compression, request.dims, state.hosts_tier(request.dims))):
        state.agreed_in_core(layout, lambda fingerprint: reduce(state, request, layout, fingerprint, buckets))
    else:
        state.agreed(layout, lambda: reduce(state, request, layout, buckets=buckets))


def reduce(state: EngineState, request: HostRequest, layout: tuple, fingerprint: int | None = None,
           buckets: list[list[int]] | None = None) -> bool:
    """Run an agreed request (`layout` keys the per-bucket codec and error-feedback state). With `fingerprint`
    (one uncompressed bucket, see run), run its agreement in the core call too: False when the ranks disagree."""
    buffers = request.buffers
    agreed = True
    for index, indices in enumerate(_buckets(request) if buckets is None else buckets):
        members = [buffers[j] for j in indices]
        if isinstance(request.compression, tuple):
            agreed = _reduce_bucket(state, members, request, (layout, index), fingerprint)
        else:
            _run_user_codec(state, members, request, (layout, index))
    state.flush_timeline()
    return agreed


def _run_user_codec(state: EngineState, members: list[HostBuffer], request: HostRequest, key: tuple) -> None:
    fused = state.fused.get(members[0].array.dtype, sum(b.count for b in members))
    pack(fused, members)
    run_codec(request.compression, fused, state.codec_state.setdefault(key, {}), state.control, state.agreement,
              request.op)
    unpack(fused, members)


def _reduce_bucket(state: EngineState, members: list[HostBuffer], request: HostRequest, key: tuple,
                   fingerprint: int | None = None) -> bool:
    """Small arrays packed, large ones in place; a large array that does not start at a multiple of its element
    size (np.frombuffer at an odd offset) is reduced through an aligned copy in its own place. False (nothing
    unpacked) when the agreement on `fingerprint` failed."""
    settings, dims, timeline = request.settings, request.dims, state.timeline
    wire = wire_by_dim(request.compression, dims, state.hosts_tier(dims))
    if wire and request.error_feedback:
        name = "bf16" if "bf16" in request.compression else "fp16"  # "auto" compresses with fp16
        for position, b in enumerate(members):
            state.error_feedback.apply((key, position), b.array, name)
    small = [members[i] for i in packed_positions([b.nbytes for b in members])]
    pointers, counts = [], []
    fused = None
    if small:
        fused = state.fused.get(members[0].array.dtype, sum(b.count for b in small))
        start = time.perf_counter()
        pack(fused, small)
        if timeline is not None:
            timeline.add("pack", start, time.perf_counter(), arrays=len(small), bytes=fused.nbytes)
        pointers.append(fused.ctypes.data)
        counts.append(fused.size)
    packed = {id(b) for b in small}
    staged: list[tuple[np.ndarray, HostBuffer]] = []
    for b in members:
        if id(b) in packed:
            continue
        if not b.aligned:
            copy = b.array.reshape(-1).copy()  # NumPy allocates it aligned
            staged.append((copy, b))
            pointers.append(copy.ctypes.data)
        else:
            pointers.append(b.pointer)
        counts.append(b.count)
    dtype = members[0].array.dtype
    nbytes = sum(counts) * dtype.itemsize
    options = state.call_options(nbytes, dims, settings, wire, is_half_sum(dtype, request.op),
                                 state.latency_takes(nbytes, settings))
    agreed = state.core.allreduce_segments(pointers, counts, members[0].dtype_code, OPS[request.op], options,
                                           fingerprint)
    state.record_events(state.core.take_events)
    if not agreed:
        return False
    for copy, b in staged:
        b.array.reshape(-1)[...] = copy
    if fused is not None:
        start = time.perf_counter()
        unpack(fused, small)
        if timeline is not None:
            timeline.add("unpack", start, time.perf_counter(), arrays=len(small), bytes=fused.nbytes)
    if wire:
        check_wire_overflows(state, request.compression, request.op)
    return True


def check_wire_overflows(state: EngineState, compression: tuple[str, ...], op: str, gathers: bool = False) -> None:
    """The encoders count finite values that became inf; ranks that saw none must raise too. `gathers`: an
    allgather, which sums nothing, so only its values themselves can be out of the wire type's range."""
    overflowed = int(state.control.allreduce_sum(np.array([state.core.take_overflows()], dtype=np.int64),
                                                 "the count of wire overflows")[0])
    if overflowed:
        codecs = [n for n in compression if n != "none"]
        remedy = "compression='none'" if set(codecs) == {"bf16"} else "compression='bf16' or compression='none'"
        if gathers:
            raise DdlfastConsistentError(
                f"wire overflow on rank {state.rank}: {overflowed} values are out of the range of "
                f"{'/'.join(codecs)} on the wire and the gathered result holds inf there; use {remedy}")
        raise DdlfastConsistentError(
            f"wire overflow on rank {state.rank}: {overflowed} "
            f"{'partial sums' if op in SUMMING_OPS else 'values'} exceeded the range of "
            f"{'/'.join(codecs)} and the result holds inf; use {remedy}"
            + (" or op='average' (which pre-scales)" if op == "sum" else ""))
