"""The Python-side context: one per communicator. It owns the compiled core
context (private duplicate communicator, engines), the persistent fused
buffers, the agreement cache, the timeline and, once asynchronous calls are
used, one communication thread. No hidden state beyond the default context
for COMM_WORLD, created on first use."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from ddlfast import _core
from ddlfast.agreement import Agreement, layout_of
from ddlfast.bucketing import assign_buckets
from ddlfast.buffers import HostBuffer, host_buffer
from ddlfast.config import Settings, load_settings, parse_dims
from ddlfast.dtypes import DTYPE_CODES
from ddlfast.errors import DdlfastError
from ddlfast.fusion import FusedBuffers, pack, unpack
from ddlfast.timeline import Timeline
from ddlfast.worker import CommThread, Handle

OPS = {"sum": 0, "average": 1}
# dtypes whose NumPy arrays export a typed buffer (the fast single-array path).
_FAST_DTYPES = {np.dtype(name): code for name, code in DTYPE_CODES.items() if name != "bfloat16"}
CLOSE_TIMEOUT_S = 60.0
# Arrays below this are packed into the fused buffer; larger ones are reduced in place.
PACK_BELOW_BYTES = 256 << 10


class _Request(NamedTuple):
    """A validated collective, ready to run on any thread."""

    buffers: list[HostBuffer]
    op: str
    dims: tuple[int, ...]
    settings: Settings
    result: Any


class Context:
    """Communication state for one MPI intracommunicator (default COMM_WORLD)."""

    def __init__(self, comm: MPI.Intracomm | None = None) -> None:
        comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(comm, MPI.Comm):
            raise DdlfastError(f"comm must be an mpi4py communicator, not {type(comm).__name__}")
        self._core = _core.CoreContext(comm)
        self._control = comm.Dup()  # small agreement messages, apart from the data path
        self._agreement = Agreement(self._control)
        self._fused = FusedBuffers()
        self._dims_cache: dict[tuple, tuple[int, ...]] = {}
        self._rank_order: tuple[int, ...] = ()  # torus position -> rank; () is identity
        self._timeline = Timeline.from_env(self._core.rank)
        self._core.record_events = self._timeline is not None
        self._worker: CommThread | None = None
        self._lock = threading.Lock()
        self._closed = False

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
        if chosen in ("flat", "auto"):  # auto == flat until topology detection lands
            return (self.size,)
        product = int(np.prod(chosen))
        if product != self.size:
            shape = "x".join(map(str, chosen))
            raise DdlfastError(f"ring dims {shape} multiply to {product} but the communicator has {self.size} ranks")
        return chosen

    def _prepare(self, arrays: Sequence[np.ndarray], op: str, dims: object, result: Any) -> _Request:
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
        buffers = [host_buffer(array, f"array {i} on rank {self.rank}") for i, array in enumerate(arrays)]
        return _Request(buffers, op, ring_dims, settings, list(arrays) if result is None else result)

    def _ensure_worker(self) -> CommThread:
        with self._lock:
            self._check_open()
            if self._worker is None:
                self._worker = CommThread(f"ddlfast-comm-rank{self.rank}")
            return self._worker

    def _run_now_or_in_order(self, request: _Request) -> Any:
        """Synchronous calls run inline until a communication thread exists, then
        queue behind the asynchronous ones so every rank keeps one order."""
        if self._worker is not None and not self._worker.on_thread():
            return self._wait(self._worker.submit(lambda: self._execute(request), "fused_allreduce"))
        with self._lock:
            self._check_open()
            return self._execute(request)

    def _wait(self, handle: Handle) -> Any:
        if self._timeline is None:
            return handle.wait()
        start = time.perf_counter()
        try:
            return handle.wait()
        finally:
            self._timeline.add("wait", start, time.perf_counter(), thread="caller")

    # -- collectives ---------------------------------------------------------------------------------------------

    def allreduce(self, array: np.ndarray, *, op: str = "sum", dims: object = None) -> np.ndarray:
        """One array: the latency-sensitive path, with the per-call Python work kept to a minimum."""
        code = _FAST_DTYPES.get(array.dtype) if type(array) is np.ndarray else None
        if code is None or op not in OPS or self._worker is not None or self._timeline is not None:
            return self.fused_allreduce([array], op=op, dims=dims)[0]  # general path, full error messages
        self._check_open()
        settings = load_settings()
        ring_dims = self._resolve_dims(dims, settings)
        layout = (op, ring_dims, ((array.dtype, array.shape),))
        with self._lock:
            self._check_open()
            if not self._agreement.known(layout):
                self._agreement.check(layout)
            self._core.set_timeout(settings.timeout_s)
            try:
                self._core.allreduce_array(array, array.size, code, OPS[op], ring_dims, settings.chunk_bytes,
                                           settings.receives_in_flight, settings.small_bytes, self._rank_order)
            except BufferError:
                host_buffer(array, f"array 0 on rank {self.rank}")  # raises the precise DdlfastError
                raise
        return array

    def fused_allreduce(self, arrays: Sequence[np.ndarray], *, op: str = "sum", dims: object = None) -> list:
        return self._run_now_or_in_order(self._prepare(arrays, op, dims, None))

    def fused_allreduce_async(self, arrays: Sequence[np.ndarray], *, op: str = "sum", dims: object = None,
                              result: Any = None) -> Handle:
        """Queue the collective on the communication thread; wait() returns the list (or `result`)."""
        request = self._prepare(arrays, op, dims, result)
        return self._ensure_worker().submit(lambda: self._execute(request), f"fused_allreduce of {len(arrays)} arrays")

    def allreduce_async(self, array: np.ndarray, *, op: str = "sum", dims: object = None) -> Handle:
        """Queue one array; wait() returns the array."""
        return self.fused_allreduce_async([array], op=op, dims=dims, result=array)

    def broadcast(self, array: np.ndarray, root: int = 0) -> np.ndarray:
        """Copy `root`'s array into every rank's array, in place (MPI_Bcast)."""
        if not 0 <= root < self.size:
            raise DdlfastError(f"broadcast root {root} is outside 0..{self.size - 1}")
        spec = self._prepare([array], "sum", None, array).buffers[0]
        return self._broadcast(spec.array, root, array)

    def broadcast_bytes(self, array: np.ndarray, root: int = 0) -> np.ndarray:
        """broadcast() for any contiguous writable byte view (e.g. a tensor of any dtype)."""
        if not 0 <= root < self.size:
            raise DdlfastError(f"broadcast root {root} is outside 0..{self.size - 1}")
        self._check_open()
        if not (isinstance(array, np.ndarray) and array.flags.c_contiguous and array.flags.writeable):
            raise DdlfastError("broadcast_bytes needs a C-contiguous writable NumPy array")
        return self._broadcast(array, root, array)

    def _broadcast(self, target: np.ndarray, root: int, result: Any) -> Any:
        def run() -> Any:
            self._agreement.check(("broadcast", root, ((target.dtype, target.shape),)))
            self._control.Bcast([target.reshape(-1).view(np.uint8), MPI.BYTE], root=root)
            return result

        if self._worker is not None and not self._worker.on_thread():
            return self._wait(self._worker.submit(run, "broadcast"))
        with self._lock:
            self._check_open()
            return run()

    # -- execution (communication thread, or inline) -----------------------------------------------------------

    def _execute(self, request: _Request) -> Any:
        settings, buffers = request.settings, request.buffers
        self._core.set_timeout(settings.timeout_s)
        self._agreement.check(layout_of(buffers, request.op, request.dims))
        if len(buffers) == 1:
            self._reduce_bucket(buffers, OPS[request.op], request.dims, settings)
        else:
            buckets = assign_buckets(
                [b.array.dtype for b in buffers], [b.nbytes for b in buffers],
                settings.bucket_bytes, settings.first_bucket_bytes,
            )
            for bucket in buckets:
                self._reduce_bucket([buffers[i] for i in bucket.indices], OPS[request.op], request.dims, settings)
        if self._timeline is not None:
            self._timeline.flush()
        return request.result

    def _reduce_bucket(self, members: list[HostBuffer], op: int, dims: tuple[int, ...], settings: Settings) -> None:
        """Large arrays are reduced where they lie, as segments of one logical buffer;
        only the small ones are packed (their per-message cost would dominate)."""
        small = [b for b in members if b.nbytes < PACK_BELOW_BYTES]
        if len(small) == 1:
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
        self._core.allreduce_segments(pointers, counts, members[0].dtype_code, op, dims, settings.chunk_bytes,
                                      settings.receives_in_flight, settings.small_bytes, self._rank_order)
        self._record_engine_events()
        if fused is not None:
            start = time.perf_counter()
            unpack(fused, small)
            if self._timeline is not None:
                self._timeline.add("unpack", start, time.perf_counter(), arrays=len(small), bytes=fused.nbytes)

    def _record_engine_events(self) -> None:
        if self._timeline is not None:
            for name, dim, start, end, nbytes in self._core.take_events():
                label = name if dim < 0 else f"{name} dim{dim + 1}"
                self._timeline.add(label, start, end, bytes=nbytes)
