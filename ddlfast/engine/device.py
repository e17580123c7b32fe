"""The GPU executor: fused allreduces on device memory through the compiled GPU side of the core
(ddlfast._cuda over src/engine/device_ring_allreduce.*), the twin of the host executor (ddlfast/engine/host.py)
over the same transport and the same phase loop.

Ordering, never a device-wide synchronization: when a collective is submitted
(on the caller's thread), a fence (CUDA event) is recorded on the caller's
stream: an explicit `stream=`, else the stream the array exports. ddlfast's own
stream waits for that fence before it packs or sends anything. When the
collective is done, the caller's stream waits for ddlfast's stream (an event
wait, the host does not block); an asynchronous collective's handle completes
only after the host has waited for that one event.

A bucket runs on one of two paths:
  device  the GPU ring: chunks are staged through pinned host memory, or
          handed to MPI as device pointers when MPI is CUDA-aware; the
          reductions are CUDA kernels.
  host    the bucket is copied to pinned host memory, reduced by the host
          engine with all its features (wire compression, codecs, exact
          integer and half-type arithmetic), and copied back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ddlfast import _core, config
from ddlfast.buffers.device import DeviceBuffer, cuda_module
from ddlfast.buffers.dtypes import ELEMENT_SIZES, numpy_dtype
from ddlfast.buffers.host import host_buffer
from ddlfast.compression.wire import wire_by_dim
from ddlfast.config import Settings
from ddlfast.engine import host
from ddlfast.engine.agreement import allreduce_layout
from ddlfast.engine.host import codec_key
from ddlfast.engine.state import HALF_DTYPES, EngineState
from ddlfast.errors import DdlfastError
from ddlfast.fusion.pack_policy import DEVICE_ALIGN_BYTES, aligned_offsets, bucket_indices, packed_positions
from ddlfast.ops import OPS

# Pinned host copies start on cache-line boundaries, so every copy meets the host kernels aligned.
HOST_COPY_ALIGN_BYTES = 64


def use_direct_transfers(setting: str, mpi_reports_cuda: bool) -> bool:
    return setting == "on" or (setting == "auto" and mpi_reports_cuda)


def takes_gpu_ring(total_bytes: int, direct: bool, ring_min_bytes: int) -> bool:
    """Whether a plain GPU call runs on the GPU ring, or through pinned host copies and the host engine: a staged
    ring below DDLFAST_GPU_RING_MIN_BYTES pays 2(P-1) latency-bound steps where the host pays one copy each way
    (config.DEFAULT_GPU_RING_MIN_BYTES has the measurement). Every rank decides the same: the sizes are agreed."""
    return direct or total_bytes >= ring_min_bytes


class Submission(NamedTuple):
    """A GPU collective as submitted on the caller's thread."""

    buffers: list[DeviceBuffer]
    device: int | None  # None: every array is empty
    fences: list[Any]  # _cuda.StreamFence recorded on each caller stream at submission
    streams: list[int]  # the caller streams that wait for the result


def submit(buffers: list[DeviceBuffer]) -> Submission:
    """Record a fence on every stream the arrays' producers work on (on the caller's thread, so that work
    enqueued later on those streams is not waited for)."""
    device = next((b.device for b in buffers if b.device is not None), None)
    streams = sorted({b.stream for b in buffers if b.stream is not None})
    fences = [] if device is None else [cuda_module().StreamFence.record(device, s) for s in streams]
    return Submission(buffers, device, fences, streams)


class DeviceExecutor:
    """The GPU side of one ddlfast Context, on its core Engine (one transport for host and GPU collectives).
    The Context creates it at the first GPU collective."""

    def __init__(self, core: Any) -> None:
        cuda = cuda_module()
        if cuda is None:
            raise DdlfastError("this ddlfast build has no CUDA support")
        self._gpu = cuda.DeviceCore(core)
        self._pinned: Any = None  # _cuda.PinnedMemory for the host path, grown as needed
        self.mpi_reports_cuda, self.mpi_cuda_query = cuda.mpi_cuda_support()

    @property
    def record_events(self) -> bool:
        return self._gpu.record_events

    @record_events.setter
    def record_events(self, value: bool) -> None:
        self._gpu.record_events = value

    def take_events(self) -> list:
        return self._gpu.take_events()

    def stream(self, device: int) -> int:
        """ddlfast's stream on `device`, for callers that want to order against it themselves."""
        return self._gpu.stream(device)

    def close(self) -> None:
        self._gpu.close()
        self._pinned = None

    def run(self, submission: Submission, op: str, dims: tuple[int, ...], settings: Any,
            order: Sequence[int] = (), wait_on_host: bool = False,
            canonical: Callable[[bool], Any] | None = None) -> None:
        """Allreduce the submission's arrays in place, bucket by bucket, on the device path.

        Afterwards the caller streams wait for the result; with wait_on_host (asynchronous handles, or
        arrays that named no stream) the host waits for it too. canonical(half): reproducible=True's options
        for a bucket of 16-bit data or not (EngineState.reproducible_options; None: one flat ring).
        """
        device = submission.device
        if device is None:
            return  # nothing but empty arrays
        self._gpu.set_timeout(settings.timeout_s)
        for fence in submission.fences:
            self._gpu.wait_for(device, fence)
        direct = use_direct_transfers(config.cuda_aware_mpi(), self.mpi_reports_cuda)
        buffers = submission.buffers
        for indices in bucket_indices([b.dtype_name for b in buffers], [b.nbytes for b in buffers],
                                      settings.bucket_bytes, settings.first_bucket_bytes):
            self._reduce_bucket(device, [buffers[j] for j in indices], OPS[op], dims, settings, tuple(order), direct,
                                canonical)
        self.finish(submission, wait_on_host)

    def finish(self, submission: Submission, wait_on_host: bool) -> None:
        """Order the caller streams after everything ddlfast enqueued for this submission."""
        if submission.device is None:
            return
        done = self._gpu.record(submission.device)
        for stream in submission.streams:
            done.make_wait(stream)
        if wait_on_host or not submission.streams:
            done.synchronize()

    def _reduce_bucket(self, device: int, members: list[DeviceBuffer], op: int, dims: tuple[int, ...],
                       settings: Any, order: tuple[int, ...], direct: bool,
                       canonical: Callable[[bool], Any] | None = None) -> None:
        """Large arrays are reduced where they lie; the small ones are packed (one kernel) into the bucket."""
        code, esize = members[0].dtype_code, ELEMENT_SIZES[members[0].dtype_name]
        small = [members[i] for i in packed_positions([b.nbytes for b in members])]
        pointers, counts = [], []
        slots: list[int] = []
        if small:
            offsets, total = aligned_offsets([b.nbytes for b in small], DEVICE_ALIGN_BYTES)
            bucket = self._gpu.bucket(device, code, total)
            slots = [bucket + offset for offset in offsets]
            self._gpu.copy_batch(device, slots, [b.pointer for b in small], [b.nbytes for b in small])
            pointers.append(bucket)
            counts.append(total // esize)
        packed = {id(b) for b in small}
        for b in members:
            if id(b) not in packed:
                pointers.append(b.pointer)
                counts.append(b.count)
        if settings.reproducible and canonical is not None:  # the flat order, or the chain across hosts
            options = canonical(members[0].dtype_name in HALF_DTYPES)
        elif settings.reproducible:  # one flat ring, direct reduce-scatter, no small path
            options = _core.CallOptions((math.prod(dims),), settings.chunk_bytes, settings.receives_in_flight, 0, (),
                                        (), (1,), reproducible=True)
        else:
            options = _core.CallOptions(dims, settings.chunk_bytes, settings.receives_in_flight, settings.small_bytes,
                                        order)
        self._gpu.allreduce_segments(device, pointers, counts, code, op, options, direct)
        if small:
            self._gpu.copy_batch(device, [b.pointer for b in small], slots, [b.nbytes for b in small])

    # -- the host path: compression and user codecs run on host copies ------------------------------------------

    def to_host(self, submission: Submission) -> list[np.ndarray]:
        """Pinned host copies of the arrays, complete when this returns (ddlfast's stream only is waited for)."""
        buffers, device = submission.buffers, submission.device
        offsets, total = aligned_offsets([b.nbytes for b in buffers], HOST_COPY_ALIGN_BYTES)
        if self._pinned is None or self._pinned.nbytes < total:
            if self._pinned is not None and device is not None:
                self._gpu.synchronize(device)  # copies from the old block may still be pending
            self._pinned = cuda_module().PinnedMemory(max(total, 1))
        memory = np.frombuffer(self._pinned, dtype=np.uint8)
        if device is not None:
            for fence in submission.fences:
                self._gpu.wait_for(device, fence)
        copies = []
        for b, offset in zip(buffers, offsets, strict=True):
            host = memory[offset:offset + b.nbytes].view(numpy_dtype(b.dtype_name)).reshape(b.shape)
            if b.nbytes:
                self._gpu.copy(device, host.ctypes.data, b.pointer, b.nbytes)
            copies.append(host)
        if device is not None:
            self._gpu.synchronize(device)
        return copies

    def from_host(self, submission: Submission, copies: Sequence[np.ndarray], wait_on_host: bool = False) -> None:
        """Copy reduced host copies back into the GPU arrays, ordered as run() orders its result."""
        if submission.device is None:
            return
        for b, copy in zip(submission.buffers, copies, strict=True):
            if b.nbytes:
                self._gpu.copy(submission.device, b.pointer, copy.ctypes.data, b.nbytes)
        self.finish(submission, wait_on_host)


# dtypes whose arithmetic for an op only the host engine does exactly (integer average without wrapping, half
# types pre-scaled or checked for overflow; min, max and product with their nan and signed-zero rules are not in
# the CUDA kernels at all); GPU arrays of these go through pinned host copies.
_ALL_DTYPES = tuple(ELEMENT_SIZES)
_HOST_ARITHMETIC = {"average": ("int32", "int64", "float16", "bfloat16"), "sum": ("float16", "bfloat16"),
                    "min": _ALL_DTYPES, "max": _ALL_DTYPES, "product": _ALL_DTYPES}


def layout_arrays(buffers: Sequence[DeviceBuffer]) -> tuple:
    """GPU arrays as they enter an agreement layout (a rank passing host arrays instead is named)."""
    return tuple((f"cuda {b.dtype_name}", b.shape) for b in buffers)


class DeviceRequest(NamedTuple):
    """A validated allreduce of GPU arrays; its fences were recorded on the caller's streams at submission."""

    submission: Submission
    op: str
    dims: tuple[int, ...]
    settings: Settings
    result: Any
    compression: tuple[str, ...] | Any
    error_feedback: bool
    wait_on_host: bool  # asynchronous handles complete only when the result is on the device

    def layout(self) -> tuple:
        return allreduce_layout(self.op, self.dims, layout_arrays(self.submission.buffers),
                                codec_key(self.compression), self.error_feedback, self.settings)


def executor(state: EngineState) -> DeviceExecutor:
    """The context's GPU executor, created at its first GPU collective: every rank gets here in the same order,
    after an agreement on a GPU layout, so the collective creation cannot meet a host-only rank."""
    if state.device_executor is None:
        state.device_executor = DeviceExecutor(state.core)
        state.device_executor.record_events = state.timeline is not None
    return state.device_executor


def reduce(state: EngineState, request: DeviceRequest, layout: tuple) -> None:
    """Uncompressed: the GPU ring (CUDA kernels, ddlfast's streams). Compression, user codecs, the host's exact
    arithmetic and small staged calls (takes_gpu_ring): the host executor on pinned copies, so every codec behaves
    exactly as on host arrays."""
    gpu = executor(state)
    submission = request.submission
    plain = isinstance(request.compression, tuple) and not wire_by_dim(
        request.compression, request.dims, state.hosts_tier(request.dims))
    exact = any(b.dtype_name in _HOST_ARITHMETIC.get(request.op, ()) for b in submission.buffers)
    direct = use_direct_transfers(config.cuda_aware_mpi(), gpu.mpi_reports_cuda)
    ring = takes_gpu_ring(sum(b.nbytes for b in submission.buffers), direct, config.gpu_ring_min_bytes())
    if plain and not request.error_feedback and not exact and ring:
        settings = request.settings
        gpu.run(submission, request.op, request.dims, settings, state.rank_order, request.wait_on_host,
                lambda half: state.reproducible_options(settings, (), chain=not half))
        state.record_events(gpu.take_events, prefix="gpu ")
        state.flush_timeline()
        return
    copies = gpu.to_host(submission)
    where = f"on rank {state.rank}"
    host_request = host.HostRequest([host_buffer(c, f"host copy of array {i} {where}") for i, c in enumerate(copies)],
                                    request.op, request.dims, request.settings, None, request.compression,
                                    request.error_feedback)
    host.reduce(state, host_request, layout)
    gpu.from_host(submission, copies, request.wait_on_host)
