"""The Python-side context: one per communicator. It owns the compiled core
context (private duplicate communicator, engines), the persistent fused
buffers, the agreement cache, the timeline and, once asynchronous calls are
used, one communication thread. No hidden state beyond the default context
for COMM_WORLD, created on first use."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from ddlfast import _core, cuda
from ddlfast.agreement import Agreement, layout_of, wait_all
from ddlfast.bucketing import assign_buckets
from ddlfast.buffers import HostBuffer, host_buffer
from ddlfast.compression import Codec, ErrorFeedback, run_codec, wire_by_dim
from ddlfast.config import Settings, check_variable_names, load_settings, parse_compression, parse_dims
from ddlfast.dtypes import DTYPE_CODES
from ddlfast.errors import DdlfastError, DdlfastTimeoutError
from ddlfast.fusion import FusedBuffers, pack, unpack
from ddlfast.timeline import Timeline
from ddlfast.worker import CommThread, Handle

OPS = {"sum": 0, "average": 1}
# dtypes whose NumPy arrays export a typed buffer (the fast single-array path).
_FAST_DTYPES = {np.dtype(name): code for name, code in DTYPE_CODES.items() if name != "bfloat16"}
CLOSE_TIMEOUT_S = 60.0
# Arrays below this are packed into the fused buffer; larger ones are reduced in place.
PACK_BELOW_BYTES = 256 << 10


def _codec_key(compression: object) -> object:
    """How a request's compression enters its agreement layout: codec names, or a user codec's type name."""
    return compression if isinstance(compression, tuple) else type(compression).__name__


class _Request(NamedTuple):
    """A validated collective, ready to run on any thread."""

    buffers: list[HostBuffer]
    op: str
    dims: tuple[int, ...]
    settings: Settings
    result: Any
    compression: tuple[str, ...] | Any  # codec names, or a user Codec / CollectiveHook
    error_feedback: bool

    def layout(self) -> tuple:
        return (*layout_of(self.buffers, self.op, self.dims), _codec_key(self.compression), self.error_feedback)


class _GpuRequest(NamedTuple):
    """A validated collective on GPU arrays; its fences were recorded on the caller's streams at submission."""

    submission: Any  # ddlfast.cuda.Submission
    op: str
    dims: tuple[int, ...]
    settings: Settings
    result: Any
    compression: tuple[str, ...] | Any
    error_feedback: bool
    wait_on_host: bool  # asynchronous handles complete only when the result is on the device

    def layout(self) -> tuple:
        return (*cuda.layout_of(self.submission.buffers, self.op, self.dims), _codec_key(self.compression),
                self.error_feedback)


def _dup_with_timeout(comm: MPI.Intracomm, timeout_s: float) -> MPI.Intracomm:
    duplicate, request = comm.Idup()
    if not wait_all([request], timeout_s)[0]:
        raise DdlfastTimeoutError(f"rank {comm.Get_rank()} waited {timeout_s:g} s for the other ranks to create "
                                  "their ddlfast context; some rank never called ddlfast (DDLFAST_TIMEOUT_S)")
    return duplicate


class Context:
    """Communication state for one MPI intracommunicator (default COMM_WORLD)."""

    def __init__(self, comm: MPI.Intracomm | None = None) -> None:
        comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(comm, MPI.Comm):
            raise DdlfastError(f"comm must be an mpi4py communicator, not {type(comm).__name__}")
        check_variable_names()
        timeout_s = load_settings().timeout_s
        self._core = _core.CoreContext(comm, timeout_s)
        self._control = _dup_with_timeout(comm, timeout_s)  # agreement messages, apart from the data path
        self._agreement = Agreement(self._control)
        self._fused = FusedBuffers()
        self._dims_cache: dict[tuple, tuple[int, ...]] = {}
        self._rank_order: tuple[int, ...] = ()  # torus position -> rank; () is identity
        self._error_feedback = ErrorFeedback()
        self._codec_state: dict[tuple, dict] = {}
        self._topology: Any = None  # ddlfast.topology.Topology, built below
        self._topology_every_tier = False
        self._timeline = Timeline.from_env(self._core.rank)
        self._core.record_events = self._timeline is not None
        self._worker: CommThread | None = None
        self._fast_plans: dict[tuple, tuple] = {}  # allreduce()'s per-kind-of-call plans
        self._core_timeout_s: float | None = None  # what the core was last told (set before its first run)
        self._cuda_path: cuda.CudaPath | None = None  # created at the first GPU collective (collective itself)
        self._lock = threading.Lock()
        self._closed = False
        # Placement detection is collective; do it here, where every rank has
        # just proven it is present (the dups above time out otherwise).
        self._topology_for(load_settings().bucket_bytes)

    @property
    def rank(self) -> int:
        return self._core.rank

    @property
    def size(self) -> int:
        return self._core.size

    def close(self) -> None:
        """Finish submitted work, then free the private communicators.

        Handles that completed before close() keep their results; nothing can
        be submitted afterwards.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        drained = self._worker.close(CLOSE_TIMEOUT_S) if self._worker is not None else True
        if self._timeline is not None:
            self._timeline.flush()
        if drained and not MPI.Is_finalized():
            if self._cuda_path is not None:
                self._cuda_path.close()
            self._core.close()
            self._control.Free()
        self._fused.clear()

    # -- helpers -----------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise DdlfastError("this ddlfast context is closed")

    def _resolve_dims(self, dims: object, settings: Settings) -> tuple[int, ...]:
        try:
            return self._dims_cache[(dims, settings.ring_dims)]
        except (KeyError, TypeError):  # TypeError: unhashable dims such as a list
            pass
        resolved = self._resolve_dims_uncached(dims, settings)
        try:
            self._dims_cache[(dims, settings.ring_dims)] = resolved
        except TypeError:
            pass
        return resolved

    def _resolve_dims_uncached(self, dims: object, settings: Settings) -> tuple[int, ...]:
        chosen = settings.ring_dims if dims is None else parse_dims(dims)
        return self._topology_for(settings.bucket_bytes).resolve(chosen)

    def _topology_for(self, plan_bytes: int, every_tier: bool = False) -> Any:
        """Detect placement, probe, plan: collective, once, when the context is created (before any
        communication thread exists). Sets the rank order the engine renumbers its rings with."""
        if self._topology is None or (every_tier and not self._topology_every_tier):
            from ddlfast.topology import build

            self._topology = build(self._control, plan_bytes, every_tier)
            self._topology_every_tier = every_tier  # the planner asks for every tier probed, even on one host
            self._rank_order = self._topology.order
        return self._topology

    def _hosts_tier(self, dims: tuple[int, ...]) -> int | None:
        """Index of the first ring dimension whose rings cross hosts (None on one host)."""
        placement = self._topology.placement
        if placement.hosts <= 1:
            return None
        per_host = placement.ranks_per_host[0] if placement.regular else 1
        covered = 1
        for index, d in enumerate(dims):
            covered *= d
            if covered > per_host:
                return index
        return None

    def _topology_info(self, every_tier: bool = False) -> Any:
        """ddlfast.topology(): on the communication thread when there is one, so collectives stay ordered."""
        return self._in_order(lambda: self._topology_for(load_settings().bucket_bytes, every_tier), "topology")

    def _prepare(self, arrays: Sequence[np.ndarray], op: str, dims: object, result: Any,
                 compression: object = None, error_feedback: bool = False, stream: object = None,
                 asynchronous: bool = False) -> _Request | _GpuRequest:
        """Validate on the caller's thread, so bad input raises where it was passed."""
        self._check_open()
        if op not in OPS:
            raise DdlfastError(f"op={op!r} is not one of {', '.join(OPS)}")
        if isinstance(arrays, np.ndarray) or not isinstance(arrays, Sequence):
            raise DdlfastError("fused_allreduce takes a list of arrays; use ddlfast.allreduce for one array")
        if len(arrays) == 0:
            raise DdlfastError("fused_allreduce got an empty list of arrays")
        settings = load_settings()
        ring_dims = self._resolve_dims(dims, settings)
        if cuda.any_device_array(arrays):
            gpu_buffers = cuda.device_buffers(arrays, self.rank, stream)
            codec = self._resolve_compression(compression, settings, [b.dtype_name for b in gpu_buffers])
            # The fences go on the caller's streams now, on the caller's thread: later work there is not waited for.
            return _GpuRequest(cuda.submit(gpu_buffers), op, ring_dims, settings,
                               list(arrays) if result is None else result, codec, bool(error_feedback),
                               asynchronous)
        if stream is not None:
            raise DdlfastError(f"stream= was given on rank {self.rank} but the arrays are in host memory; streams "
                               "order GPU arrays only")
        buffers = [host_buffer(array, f"array {i} on rank {self.rank}") for i, array in enumerate(arrays)]
        codec = self._resolve_compression(compression, settings, [b.array.dtype.name for b in buffers])
        return _Request(buffers, op, ring_dims, settings, list(arrays) if result is None else result, codec,
                        bool(error_feedback))

    def _resolve_compression(self, compression: object, settings: Settings,
                             dtype_names: list[str]) -> tuple[str, ...] | Any:
        if compression is None:
            names = settings.compression
        elif isinstance(compression, (str, tuple, list)):
            names = parse_compression(compression)
        elif isinstance(compression, Codec) or callable(compression):
            return compression  # a user codec: checked when it runs
        else:
            raise DdlfastError(f"compression={compression!r} is not a codec name, a Codec or a hook")
        if names not in (("none",), ("auto",)):
            for i, name in enumerate(dtype_names):
                if name != "float32":
                    raise DdlfastError(f"array {i} on rank {self.rank} is {name}: wire compression "
                                       f"({','.join(names)}) applies to float32 arrays only")
        return names

    def _ensure_worker(self) -> CommThread:
        with self._lock:
            self._check_open()
            if self._worker is None:
                self._worker = CommThread(f"ddlfast-comm-rank{self.rank}")
            return self._worker

    def _in_order(self, work: Callable[[], Any], description: str) -> Any:
        """Run a blocking collective on the caller's thread, unless asynchronous ones are queued or running on
        the communication thread: then queue behind them, so every rank keeps one order of collectives."""
        if self._worker is not None and not self._worker.on_thread():
            ran, result = self._worker.run_if_idle(lambda: self._locked(work))
            if ran:
                return result
            return self._wait(self._worker.submit(work, description))
        return self._locked(work)

    def _locked(self, work: Callable[[], Any]) -> Any:
        with self._lock:
            self._check_open()
            return work()

    def _wait(self, handle: Handle) -> Any:
        if self._timeline is None:
            return handle.wait()
        start = time.perf_counter()
        try:
            return handle.wait()
        finally:
            self._timeline.add("wait", start, time.perf_counter(), thread="caller")

    # -- collectives ---------------------------------------------------------------------------------------------

    def allreduce(self, array: np.ndarray, *, op: str = "sum", dims: object = None,
                  compression: object = None, stream: object = None) -> np.ndarray:
        """One array: the latency-sensitive path, with the per-call Python work kept to a minimum
        (a plan per (dtype, shape, op, dims, compression) and settings; the layout agreement is cached)."""
        settings = load_settings()
        plan = None
        if type(array) is np.ndarray and stream is None and self._timeline is None:
            try:
                plan = self._fast_plans.get((array.dtype, array.shape, op, dims, compression))
            except TypeError:  # unhashable dims or compression: the general path says what is wrong
                pass
            if plan is None or plan[0] is not settings:
                plan = self._fast_plan(array, op, dims, compression, settings)
        if plan is None or not array.flags.aligned:
            # The general path: full error messages, compression, GPU arrays.
            return self.fused_allreduce([array], op=op, dims=dims, compression=compression, stream=stream)[0]
        if self._worker is None:  # _in_order's own first case, spelled out: this is the latency path
            with self._lock:
                self._check_open()
                return self._allreduce_now(array, plan, settings)
        return self._in_order(lambda: self._allreduce_now(array, plan, settings), "allreduce")

    def _allreduce_now(self, array: np.ndarray, plan: tuple, settings: Settings) -> np.ndarray:
        _, code, op_code, ring_dims, layout = plan
        if not self._agreement.known(layout):
            self._agreement.timeout_s = settings.timeout_s
            self._agreement.check(layout)
        self._set_core_timeout(settings.timeout_s)
        try:
            self._core.allreduce_array(array, array.size, code, op_code, ring_dims, settings.chunk_bytes,
                                       settings.receives_in_flight, settings.small_bytes, self._rank_order)
        except DdlfastTimeoutError as stalled:
            raise self._agreement.name_missing(stalled) from stalled
        except (BufferError, ValueError):  # NumPy refuses a non-contiguous or read-only buffer
            host_buffer(array, f"array 0 on rank {self.rank}")  # raises the precise DdlfastError
            raise
        return array

    def _set_core_timeout(self, seconds: float) -> None:
        if self._core_timeout_s != seconds:  # a call into the core per collective otherwise
            self._core.set_timeout(seconds)
            self._core_timeout_s = seconds

    def _fast_plan(self, array: np.ndarray, op: str, dims: object, compression: object,
                   settings: Settings) -> tuple | None:
        """What allreduce() needs for this kind of call, or None where the general path must take it."""
        code = _FAST_DTYPES.get(array.dtype)
        # compression="none" (explicit), or nothing that compresses here: uncompressed.
        codec = (("none",) if isinstance(compression, str) and compression == "none"
                 else None if compression is not None else settings.compression)
        if (code is None or op not in OPS or codec not in (("none",), ("auto",))
                or (codec == ("auto",) and self._topology.placement.hosts > 1)):
            return None
        self._check_open()
        ring_dims = self._resolve_dims(dims, settings)
        layout = (op, ring_dims, ((array.dtype, array.shape),), codec, False)  # as the general path's layout
        plan = (settings, code, OPS[op], ring_dims, layout)
        if len(self._fast_plans) >= 256:  # calls with ever new shapes must not grow memory
            self._fast_plans.clear()
        try:
            self._fast_plans[(array.dtype, array.shape, op, dims, compression)] = plan
        except TypeError:
            pass
        return plan

    def fused_allreduce(self, arrays: Sequence[np.ndarray], *, op: str = "sum", dims: object = None,
                        compression: object = None, error_feedback: bool = False, stream: object = None) -> list:
        """GPU arrays: ordered after `stream` (default: the stream each array exports, else the host waits)."""
        request = self._prepare(arrays, op, dims, None, compression, error_feedback, stream)
        return self._in_order(lambda: self._execute(request), "fused_allreduce")

    def fused_allreduce_async(self, arrays: Sequence[np.ndarray], *, op: str = "sum", dims: object = None,
                              compression: object = None, error_feedback: bool = False,
                              result: Any = None, stream: object = None) -> Handle:
        """Queue the collective on the communication thread; wait() returns the list (or `result`)."""
        request = self._prepare(arrays, op, dims, result, compression, error_feedback, stream, asynchronous=True)
        return self._ensure_worker().submit(lambda: self._execute(request), f"fused_allreduce of {len(arrays)} arrays")

    def allreduce_async(self, array: np.ndarray, *, op: str = "sum", dims: object = None,
                        compression: object = None, stream: object = None) -> Handle:
        """Queue one array; wait() returns the array."""
        return self.fused_allreduce_async([array], op=op, dims=dims, compression=compression, result=array,
                                          stream=stream)

    def broadcast(self, array: np.ndarray, root: int = 0) -> np.ndarray:
        """Copy `root`'s array into every rank's array, in place (MPI_Bcast)."""
        if not 0 <= root < self.size:
            raise DdlfastError(f"broadcast root {root} is outside 0..{self.size - 1}")
        request = self._prepare([array], "sum", None, array)
        if isinstance(request, _GpuRequest):
            return self._broadcast_gpu(request, root)
        return self._broadcast(request.buffers[0].array, root, array)

    def broadcast_bytes(self, array: np.ndarray, root: int = 0) -> np.ndarray:
        """broadcast() for any contiguous writable byte view (e.g. a tensor of any dtype)."""
        if not 0 <= root < self.size:
            raise DdlfastError(f"broadcast root {root} is outside 0..{self.size - 1}")
        self._check_open()
        if not (isinstance(array, np.ndarray) and array.flags.c_contiguous and array.flags.writeable):
            raise DdlfastError("broadcast_bytes needs a C-contiguous writable NumPy array")
        return self._broadcast(array, root, array)

    def _broadcast_gpu(self, request: _GpuRequest, root: int) -> Any:
        """Through a pinned host copy: broadcasts are one-offs (start-up), not worth a device path."""
        buffer = request.submission.buffers[0]

        def run() -> Any:
            self._agree_on_broadcast(root, ((f"cuda {buffer.dtype_name}", buffer.shape),))
            path = self._gpu_path()
            copies = path.to_host(request.submission)
            self._control.Bcast([copies[0].reshape(-1).view(np.uint8), MPI.BYTE], root=root)
            path.from_host(request.submission, copies, wait_on_host=True)
            return request.result

        return self._in_order(run, "broadcast")

    def _gpu_path(self) -> cuda.CudaPath:
        """The GPU side, created at the first GPU collective: every rank gets here in the same order, after
        an agreement on a GPU layout, so the collective creation cannot meet a host-only rank."""
        if self._cuda_path is None:
            self._cuda_path = cuda.CudaPath(self._control, load_settings().timeout_s)
            self._cuda_path.record_events = self._timeline is not None
        return self._cuda_path

    def _broadcast(self, target: np.ndarray, root: int, result: Any) -> Any:
        def run() -> Any:
            self._agree_on_broadcast(root, ((target.dtype, target.shape),))
            self._control.Bcast([target.reshape(-1).view(np.uint8), MPI.BYTE], root=root)
            return result

        return self._in_order(run, "broadcast")

    def _agree_on_broadcast(self, root: int, arrays: tuple) -> None:
        """Host and GPU broadcasts share one layout form, so a rank passing the other kind is named."""
        self._agreement.timeout_s = load_settings().timeout_s
        self._agreement.check(("broadcast", root, arrays))

    # -- execution (communication thread, or inline) -----------------------------------------------------------

    def _execute(self, request: _Request | _GpuRequest) -> Any:
        settings = request.settings
        self._set_core_timeout(settings.timeout_s)
        self._agreement.timeout_s = settings.timeout_s
        layout = request.layout()
        self._agreement.check(layout)
        if isinstance(request, _GpuRequest):
            return self._execute_gpu(request, layout)
        self._reduce_host(request, layout)
        return request.result

    def _execute_gpu(self, request: _GpuRequest, layout: tuple) -> Any:
        """Uncompressed: the GPU ring (CUDA kernels, ddlfast's streams). Compression and user codecs: the
        host engine on pinned copies, so every codec behaves exactly as on host arrays."""
        path = self._gpu_path()
        submission = request.submission
        plain = isinstance(request.compression, tuple) and not wire_by_dim(
            request.compression, request.dims, self._hosts_tier(request.dims))
        try:
            if plain and not request.error_feedback:
                path.run(submission, request.op, request.dims, request.settings, self._rank_order,
                         request.wait_on_host)
                if self._timeline is not None:
                    for name, dim, start, end, nbytes in path.take_events():
                        self._timeline.add(f"gpu {name}" if dim < 0 else f"gpu {name} dim{dim + 1}", start, end,
                                           bytes=nbytes)
                    self._timeline.flush()
                return request.result
        except DdlfastTimeoutError as stalled:
            raise self._agreement.name_missing(stalled) from stalled
        copies = path.to_host(submission)
        where = f"on rank {self.rank}"
        host = _Request([host_buffer(c, f"host copy of array {i} {where}") for i, c in enumerate(copies)],
                        request.op, request.dims, request.settings, None, request.compression,
                        request.error_feedback)
        self._reduce_host(host, layout)
        path.from_host(submission, copies, request.wait_on_host)
        return request.result

    def _reduce_host(self, request: _Request, layout: tuple) -> None:
        settings, buffers = request.settings, request.buffers
        if len(buffers) == 1:
            buckets = [(0, buffers)]
        else:
            assigned = assign_buckets(
                [b.array.dtype for b in buffers], [b.nbytes for b in buffers],
                settings.bucket_bytes, settings.first_bucket_bytes,
            )
            buckets = [(i, [buffers[j] for j in bucket.indices]) for i, bucket in enumerate(assigned)]
        for index, members in buckets:
            if isinstance(request.compression, tuple):
                self._reduce_bucket(members, request, (layout, index))
            else:
                self._run_user_codec(members, request, (layout, index))
        if self._timeline is not None:
            self._timeline.flush()

    def _run_user_codec(self, members: list[HostBuffer], request: _Request, key: tuple) -> None:
        fused = self._fused.get(members[0].array.dtype, sum(b.count for b in members))
        pack(fused, members)
        run_codec(request.compression, fused, self._codec_state.setdefault(key, {}), self, request.op)
        unpack(fused, members)

    def _reduce_bucket(self, members: list[HostBuffer], request: _Request, key: tuple) -> None:
        """Large arrays are reduced where they lie, as segments of one logical buffer;
        only the small ones are packed (their per-message cost would dominate)."""
        settings, op, dims = request.settings, OPS[request.op], request.dims
        wire = wire_by_dim(request.compression, dims, self._hosts_tier(dims))
        if wire and request.error_feedback:
            names = [n for n in request.compression if n in ("fp16", "bf16")]
            for position, b in enumerate(members):
                self._error_feedback.apply((key, position), b.array, names[0])
        # Small arrays are packed (their per-message cost would dominate), and so are arrays that do not start
        # at a multiple of their element size (np.frombuffer at an odd offset): packing copies bytes.
        small = [b for b in members if b.nbytes < PACK_BELOW_BYTES or not b.aligned]
        if len(small) == 1 and small[0].aligned:
            small = []
        pointers, counts = [], []
        fused = None
        if small:
            fused = self._fused.get(members[0].array.dtype, sum(b.count for b in small))
            start = time.perf_counter()
            pack(fused, small)
            if self._timeline is not None:
                self._timeline.add("pack", start, time.perf_counter(), arrays=len(small), bytes=fused.nbytes)
            pointers.append(fused.ctypes.data)
            counts.append(fused.size)
        packed = {id(b) for b in small}
        for b in members:
            if id(b) not in packed:
                pointers.append(b.pointer)
                counts.append(b.count)
        try:
            self._core.allreduce_segments(pointers, counts, members[0].dtype_code, op, dims, settings.chunk_bytes,
                                          settings.receives_in_flight, settings.small_bytes, self._rank_order, wire)
        except DdlfastTimeoutError as stalled:
            raise self._agreement.name_missing(stalled) from stalled
        self._record_engine_events()
        if fused is not None:
            start = time.perf_counter()
            unpack(fused, small)
            if self._timeline is not None:
                self._timeline.add("unpack", start, time.perf_counter(), arrays=len(small), bytes=fused.nbytes)
        if wire:
            # The encoders count finite values that became inf; ranks that saw none must raise too.
            overflowed = self._control.allreduce(self._core.take_overflows(), op=MPI.SUM)
            if overflowed:
                raise DdlfastError(
                    f"wire overflow on rank {self.rank}: {overflowed} partial sums exceeded the range of "
                    f"{'/'.join(n for n in request.compression if n != 'none')} and the result holds inf; use "
                    "compression='bf16' or op='average' (which pre-scales)")

    def _record_engine_events(self) -> None:
        if self._timeline is not None:
            for name, dim, start, end, nbytes in self._core.take_events():
                label = name if dim < 0 else f"{name} dim{dim + 1}"
                self._timeline.add(label, start, end, bytes=nbytes)
