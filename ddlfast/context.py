"""The Python-side context: one per communicator. It owns the compiled core
context (private duplicate communicator, engines, the stall-limited poll loop),
a control communicator for the agreement and the Python-side collectives, the
persistent fused buffers, the timeline and, once asynchronous calls are used,
one communication thread. No hidden state beyond the default context for
COMM_WORLD, created on first use.

Every collective passes the per-call agreement (ddlfast/agreement.py) before
it sends anything; a rank whose input is bad takes part in that agreement with
its error, so every rank raises at once. A failure after the agreement passed
(a stall, an MPI error, an exception in a codec) leaves the context broken: the
core cancels its receives, tells the other ranks, and every later call raises
DdlfastBrokenError instead of running out of step.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, NoReturn

import numpy as np
from mpi4py import MPI

from ddlfast import _core, config, cuda, shards
from ddlfast.agreement import Agreement, allreduce_layout, arrays_of
from ddlfast.bucketing import assign_buckets
from ddlfast.buffers import HostBuffer, check_no_overlap, host_buffer
from ddlfast.compression import Codec, ErrorFeedback, run_codec, wire_by_dim
from ddlfast.config import Settings, check_variable_names, load_settings, parse_compression, parse_dims
from ddlfast.control import Control
from ddlfast.dtypes import DTYPE_CODES
from ddlfast.errors import DdlfastBrokenError, DdlfastConsistentError, DdlfastError
from ddlfast.fusion import FusedBuffers, pack, unpack
from ddlfast.ops import OPS, SUMMING_OPS, WIRE_OPS, check_op
from ddlfast.timeline import Timeline
from ddlfast.worker import CommThread, Handle

# dtypes whose NumPy arrays export a typed buffer (the fast single-array path).
_FAST_DTYPES = {np.dtype(name): code for name, code in DTYPE_CODES.items() if name != "bfloat16"}
# How long close() lets queued work finish when there is no stall limit (DDLFAST_TIMEOUT_S=0).
CLOSE_TIMEOUT_S = 60.0
# Arrays below this are packed into the fused buffer; larger ones are reduced in place. A function of the
# size alone (agreed by every rank), so every rank lays a bucket out the same way.
PACK_BELOW_BYTES = 256 << 10
# dtypes whose arithmetic for an op only the host engine does exactly (integer average without wrapping, half
# types pre-scaled or checked for overflow; min, max and product with their nan and signed-zero rules are not in
# the CUDA kernels at all); GPU arrays of these go through pinned host copies.
_ALL_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
_HOST_ARITHMETIC = {"average": ("int32", "int64", "float16", "bfloat16"), "sum": ("float16", "bfloat16"),
                    "min": _ALL_DTYPES, "max": _ALL_DTYPES, "product": _ALL_DTYPES}


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
        return allreduce_layout(self.op, self.dims, arrays_of(self.buffers), _codec_key(self.compression),
                                self.error_feedback, self.settings)


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
        return allreduce_layout(self.op, self.dims, _gpu_arrays(self.submission.buffers),
                                _codec_key(self.compression), self.error_feedback, self.settings)


def _broadcast_target(array: object, where: str) -> np.ndarray:
    """A host array broadcast() can overwrite: any fixed-size dtype (the copy is of bytes), C-contiguous,
    writable."""
    if not isinstance(array, np.ndarray) or isinstance(array, np.ma.MaskedArray):
        kind = type(array).__module__ + "." + type(array).__qualname__
        raise DdlfastError(f"{where}: the array is a {kind}, not a NumPy array (or a GPU array in a CUDA build)")
    if array.dtype.hasobject:
        raise DdlfastError(f"{where}: dtype {array.dtype} holds Python objects, which cannot be broadcast as bytes; "
                           "use ddlfast.broadcast_object")
    if not array.flags.c_contiguous:
        raise DdlfastError(f"{where}: the array is not C-contiguous (strides {array.strides}); pass "
                           "np.ascontiguousarray(...)")
    if not array.flags.writeable:
        raise DdlfastError(f"{where}: the array is read-only; broadcast overwrites it in place")
    return array


def _pickled(obj: object, where: str) -> bytes:
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:  # noqa: BLE001 (pickling calls arbitrary __reduce__ code)
        raise DdlfastError(f"{where}: the object cannot be pickled ({type(error).__name__}: {error})") from None


def _gpu_arrays(buffers: Sequence[Any]) -> tuple:
    return tuple((f"cuda {b.dtype_name}", b.shape) for b in buffers)


def _creation_layout(settings: Settings) -> tuple:
    """What every rank must share when a context is created: the engine settings and what drives the topology."""
    named = {
        "DDLFAST_BUCKET_BYTES": settings.bucket_bytes, "DDLFAST_FIRST_BUCKET_BYTES": settings.first_bucket_bytes,
        "DDLFAST_CHUNK_BYTES": settings.chunk_bytes, "DDLFAST_SMALL_BYTES": settings.small_bytes,
        "DDLFAST_RING_DIMS": settings.ring_dims, "DDLFAST_COMPRESSION": settings.compression,
    }
    named.update({"DDLFAST_PROBE": config.probe_mode(), "DDLFAST_HOSTS_PER_GROUP": config.hosts_per_group(),
                  "DDLFAST_CUDA_AWARE_MPI": config.cuda_aware_mpi()})
    return ("context", tuple(named.items()))


class Context:
    """Communication state for one MPI intracommunicator (default COMM_WORLD)."""

    def __init__(self, comm: MPI.Intracomm | None = None) -> None:
        comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(comm, MPI.Comm):
            raise DdlfastError(f"comm must be an mpi4py communicator, not {type(comm).__name__}")
        check_variable_names()
        settings = load_settings()
        self._core = _core.Engine(comm, settings.timeout_s)
        self._core_timeout_s: float | None = settings.timeout_s  # what the core was last told
        control, created = comm.Idup()  # agreement descriptions and Python-side collectives
        self._core.wait_requests([created], "the other ranks to create their ddlfast context")
        self._control = Control(control, self._core)
        self._agreement = Agreement(self._core, self._control)
        self._thread_level = MPI.Query_thread()
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
        self._cuda_path: cuda.CudaPath | None = None  # created at the first GPU collective (collective itself)
        self._lock = threading.Lock()
        self._closed = False
        # Settings that size messages or drive the topology must match on every rank; then placement detection
        # (collective) runs where every rank has just proven it is present.
        self._agreement.check(_creation_layout(settings))
        self._topology_for(settings.bucket_bytes)

    @property
    def rank(self) -> int:
        return self._core.rank

    @property
    def size(self) -> int:
        return self._core.size

    def close(self) -> None:
        """Finish submitted work, then free the private communicators.

        Handles that completed before close() keep their results; nothing can be submitted afterwards. Ends
        in bounded time even with a peer gone: queued work is itself stall-limited, and past that the core is
        told to stop waiting, so no thread is inside MPI when the communicators are freed (a broken context
        leaves them to MPI_Finalize rather than free what messages in flight still use).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        drained = True
        if self._worker is not None:
            timeout_s = load_settings().timeout_s
            drained = self._worker.close(timeout_s + 10.0 if timeout_s > 0 else CLOSE_TIMEOUT_S)
            if not drained:
                self._core.request_stop()
                drained = self._worker.close(10.0)
        if self._timeline is not None:
            self._timeline.flush()
        if drained and not MPI.Is_finalized():
            healthy = not self._core.broken
            if self._cuda_path is not None:
                self._cuda_path.close()
            self._core.close()
            if healthy:
                self._control.comm.Free()
        self._fused.clear()

    # -- helpers -----------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise DdlfastError("this ddlfast context is closed")
        if self._core.broken:
            raise DdlfastBrokenError(f"rank {self.rank}: this ddlfast context is unusable after an earlier failure "
                                     f"({self._core.broken_reason}); abort the job, or create a new Context")

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

            self._topology = build(self._control.comm, plan_bytes, every_tier)
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
        settings = load_settings()
        if self._topology is not None and not (every_tier and not self._topology_every_tier):
            return self._topology  # nothing collective to do
        return self._in_order(lambda: self._agreed(("topology", every_tier),
                                                   lambda: self._topology_for(settings.bucket_bytes, every_tier)),
                              "topology")

    def _prepare(self, arrays: Sequence[np.ndarray], op: str, dims: object, result: Any,
                 compression: object = None, error_feedback: bool = False, stream: object = None,
                 asynchronous: bool = False) -> _Request | _GpuRequest:
        """Validate on the caller's thread, so bad input raises where it was passed."""
        check_op(op, self.rank)
        if isinstance(arrays, np.ndarray) or not isinstance(arrays, Sequence):
            raise DdlfastError("fused_allreduce takes a list of arrays; use ddlfast.allreduce for one array")
        if len(arrays) == 0:
            raise DdlfastError("fused_allreduce got an empty list of arrays")
        settings = load_settings()
        ring_dims = self._resolve_dims(dims, settings)
        if cuda.any_device_array(arrays):
            gpu_buffers = cuda.device_buffers(arrays, self.rank, stream)
            check_no_overlap([(b.pointer, b.nbytes) for b in gpu_buffers], self.rank)
            codec = self._resolve_compression(compression, settings, [b.dtype_name for b in gpu_buffers])
            self._check_op_on_wire(op, codec, ring_dims, error_feedback)
            # The fences go on the caller's streams now, on the caller's thread: later work there is not waited for.
            return _GpuRequest(cuda.submit(gpu_buffers), op, ring_dims, settings,
                               list(arrays) if result is None else result, codec, bool(error_feedback),
                               asynchronous)
        if stream is not None:
            raise DdlfastError(f"stream= was given on rank {self.rank} but the arrays are in host memory; streams "
                               "order GPU arrays only")
        buffers = [host_buffer(array, f"array {i} on rank {self.rank}") for i, array in enumerate(arrays)]
        if len(buffers) > 1:
            check_no_overlap([(b.pointer, b.nbytes) for b in buffers], self.rank)
        codec = self._resolve_compression(compression, settings, [b.array.dtype.name for b in buffers])
        self._check_op_on_wire(op, codec, ring_dims, error_feedback)
        return _Request(buffers, op, ring_dims, settings, list(arrays) if result is None else result, codec,
                        bool(error_feedback))

    def _check_op_on_wire(self, op: str, codec: tuple[str, ...] | Any, ring_dims: tuple[int, ...],
                          error_feedback: object) -> None:
        """The ops a compressed wire, error feedback and user codecs can carry (ddlfast/ops.py)."""
        if not isinstance(codec, tuple):
            if op not in SUMMING_OPS:
                raise DdlfastError(f"op={op!r} on rank {self.rank} cannot run through a user codec "
                                   f"({type(codec).__name__}): codecs reduce by summing; use op='sum' or 'average', "
                                   "or compression='none'")
            return
        wire = wire_by_dim(codec, ring_dims, self._hosts_tier(ring_dims))  # raises when codecs do not fit the dims
        if wire and op not in WIRE_OPS:
            raise DdlfastError(f"op={op!r} on rank {self.rank} cannot run on the compressed wire "
                               f"(compression={','.join(codec)}): every hop would round a partial product; use "
                               f"compression='none' (ops on a compressed wire: {', '.join(WIRE_OPS)})")
        if wire and error_feedback and op not in SUMMING_OPS:
            raise DdlfastError(f"error_feedback on rank {self.rank} applies to op='sum' or 'average', not {op!r}")

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
                if self._thread_level < MPI.THREAD_MULTIPLE:
                    names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                             MPI.THREAD_SERIALIZED: "serialized"}
                    raise DdlfastError(
                        f"rank {self.rank}: asynchronous ddlfast calls run on a communication thread and need MPI "
                        f"initialized with MPI_THREAD_MULTIPLE, but MPI provides "
                        f"{names.get(self._thread_level, self._thread_level)}; unset MPI4PY_RC_THREAD_LEVEL (or "
                        "set it to 'multiple', or mpi4py.rc.thread_level = 'multiple' before importing "
                        "mpi4py.MPI), or use the blocking calls")
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

    def _agreed(self, layout: tuple, action: Callable[[], Any], digest: int | None = None) -> Any:
        """The agreement, then the collective. A failure after the agreement passed leaves the context broken
        (the other ranks are told, and fail at once rather than at their stall limit)."""
        self._agreement.check(layout, digest)
        try:
            return action()
        except DdlfastConsistentError:
            raise
        except BaseException as error:
            self._raise_after_failure(error)

    def _raise_after_failure(self, error: BaseException) -> NoReturn:
        """Called in an `except` block: a collective failed here after its agreement, so the context is broken
        (the other ranks are told). Raises a DdlfastBrokenError (so the abort hook ends the job if it goes
        uncaught), or re-raises KeyboardInterrupt and the like as they are."""
        if not self._core.broken:
            self._core.abandon(f"rank {self.rank}: {type(error).__name__}: {error}")
        if isinstance(error, DdlfastBrokenError) or not isinstance(error, Exception):
            raise  # the exception the caller is handling, as it is
        if isinstance(error, DdlfastError):
            raise DdlfastBrokenError(
                f"{error}; this context now refuses further work (the other ranks were told)") from error
        # e.g. a user codec's exception: the collective is abandoned all the same
        raise DdlfastBrokenError(f"rank {self.rank}: the collective failed here ({type(error).__name__}: {error}); "
                                 "the other ranks were told, and this context refuses further work") from error

    def _refused(self, error: DdlfastError) -> DdlfastError:
        """Bad input on this rank: join the agreement with the error (so the others raise too), return what
        to raise here."""
        if isinstance(error, DdlfastBrokenError) or self._closed:
            return error
        return self._in_order(lambda: self._agreement.refuse(error), "a refused collective")

    def _refuse_async(self, error: DdlfastError) -> None:
        """The same for an asynchronous call: the refusal takes the call's place in the queue."""
        if isinstance(error, DdlfastBrokenError) or self._closed:
            return

        def refuse() -> None:
            raise self._agreement.refuse(error)

        self._ensure_worker().submit(refuse, "a refused collective")

    def _set_core_timeout(self, seconds: float) -> None:
        if self._core_timeout_s != seconds:  # a call into the core per collective otherwise
            self._core.set_timeout(seconds)
            self._core_timeout_s = seconds

    # -- collectives ---------------------------------------------------------------------------------------------

    def allreduce(self, array: np.ndarray, *, op: str = "sum", dims: object = None,
                  compression: object = None, stream: object = None) -> np.ndarray:
        """One array: the latency-sensitive path, with the per-call Python work kept to a minimum
        (a plan per (dtype, shape, op, dims, compression) and settings, holding the layout's digest)."""
        settings = load_settings()
        plan = None
        if type(array) is np.ndarray and stream is None and self._timeline is None:
            try:
                plan = self._fast_plans.get((array.dtype, array.shape, op, dims, compression))
            except TypeError:  # unhashable dims or compression: the general path says what is wrong
                pass
            if plan is None or plan[0] is not settings:
                plan = self._fast_plan(array, op, dims, compression, settings)
        if plan is None:  # the general path: full validation and messages, compression, GPU arrays
            return self._fused_allreduce([array], op, dims, compression, False, stream)[0]
        if self._worker is None:  # _in_order's own first case, spelled out: this is the latency path
            with self._lock:
                self._check_open()
                done = self._allreduce_now(array, plan, settings)
        else:
            done = self._in_order(lambda: self._allreduce_now(array, plan, settings), "allreduce")
        if not done:  # not a plain writable C-contiguous aligned buffer: nothing ran; the general path says why
            return self._fused_allreduce([array], op, dims, compression, False, stream)[0]
        return array

    def _allreduce_now(self, array: np.ndarray, plan: tuple, settings: Settings) -> bool:
        """False when the array's buffer cannot take the latency path (nothing ran, not even the agreement)."""
        _, code, op_code, ring_dims, layout, digest = plan
        if self._core_timeout_s != settings.timeout_s:
            self._set_core_timeout(settings.timeout_s)
        try:  # the agreement and the collective in one call into the core
            outcome = self._core.allreduce_array(array, array.size, code, op_code, ring_dims, settings.chunk_bytes,
                                                 settings.receives_in_flight, settings.small_bytes,
                                                 self._rank_order, digest)
        except DdlfastConsistentError:
            raise
        except BaseException as error:
            self._raise_after_failure(error)
        if outcome == 0:
            self._agreement.disagreed(layout)
        return outcome > 0

    def _fast_plan(self, array: np.ndarray, op: str, dims: object, compression: object,
                   settings: Settings) -> tuple | None:
        """What allreduce() needs for this kind of call, or None where the general path must take it."""
        code = _FAST_DTYPES.get(array.dtype)
        # compression="none" (explicit), or nothing that compresses here: uncompressed.
        codec = (("none",) if isinstance(compression, str) and compression == "none"
                 else None if compression is not None else settings.compression)
        if (code is None or not isinstance(op, str) or op not in OPS or codec not in (("none",), ("auto",))
                or (codec == ("auto",) and self._topology.placement.hosts > 1)):
            return None
        self._check_open()
        try:
            ring_dims = self._resolve_dims(dims, settings)
        except DdlfastError:
            return None  # the general path refuses it on every rank
        layout = allreduce_layout(op, ring_dims, ((array.dtype, array.shape),), codec, False, settings)
        plan = (settings, code, OPS[op], ring_dims, layout, self._agreement.digest(layout))
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
        if type(arrays) is list and len(arrays) == 1 and stream is None and not error_feedback:
            self.allreduce(arrays[0], op=op, dims=dims, compression=compression)  # the same collective, and layout
            return arrays
        return self._fused_allreduce(arrays, op, dims, compression, error_feedback, stream)

    def _fused_allreduce(self, arrays: Sequence[np.ndarray], op: str, dims: object, compression: object,
                         error_feedback: bool, stream: object) -> list:
        self._check_open()
        try:
            request = self._prepare(arrays, op, dims, None, compression, error_feedback, stream)
        except DdlfastError as error:
            raise self._refused(error) from None
        return self._in_order(lambda: self._execute(request), "fused_allreduce")

    def fused_allreduce_async(self, arrays: Sequence[np.ndarray], *, op: str = "sum", dims: object = None,
                              compression: object = None, error_feedback: bool = False,
                              result: Any = None, stream: object = None) -> Handle:
        """Queue the collective on the communication thread; wait() returns the list (or `result`)."""
        worker = self._ensure_worker()
        try:
            request = self._prepare(arrays, op, dims, result, compression, error_feedback, stream,
                                    asynchronous=True)
        except DdlfastError as error:
            self._refuse_async(error)
            raise
        return worker.submit(lambda: self._execute(request), f"fused_allreduce of {len(arrays)} arrays")

    def allreduce_async(self, array: np.ndarray, *, op: str = "sum", dims: object = None,
                        compression: object = None, stream: object = None) -> Handle:
        """Queue one array; wait() returns the array."""
        return self.fused_allreduce_async([array], op=op, dims=dims, compression=compression, result=array,
                                          stream=stream)

    # -- reduce-scatter and allgather (ddlfast/shards.py) --------------------------------------------------------

    def reduce_scatter(self, array: Any, *, op: str = "sum", dims: object = None, counts: Sequence[int] | None = None,
                       out: Any = None, compression: object = None, stream: object = None) -> Any:
        """Rank r gets block r of the reduced array (MPI_Reduce_scatter); the input stays unchanged."""
        return self._half_now(shards.REDUCE_SCATTER, [array], op, dims, counts, out, compression, stream, True)

    def fused_reduce_scatter(self, arrays: Sequence[Any], *, op: str = "sum", dims: object = None,
                             counts: Sequence[Sequence[int] | None] | None = None, out: Sequence[Any] | None = None,
                             compression: object = None, stream: object = None) -> list:
        """reduce_scatter of many arrays in one collective; counts= and out= give one entry per array."""
        return self._half_now(shards.REDUCE_SCATTER, arrays, op, dims, counts, out, compression, stream, False)

    def allgather(self, array: Any, *, dims: object = None, out: Any = None, compression: object = None,
                  stream: object = None) -> Any:
        """The ranks' arrays concatenated along axis 0 in rank order (MPI_Allgather)."""
        return self._half_now(shards.ALLGATHER, [array], "sum", dims, None, out, compression, stream, True)

    def fused_allgather(self, arrays: Sequence[Any], *, dims: object = None, out: Sequence[Any] | None = None,
                        compression: object = None, stream: object = None) -> list:
        return self._half_now(shards.ALLGATHER, arrays, "sum", dims, None, out, compression, stream, False)

    def reduce_scatter_async(self, array: Any, *, op: str = "sum", dims: object = None,
                             counts: Sequence[int] | None = None, out: Any = None, compression: object = None,
                             stream: object = None) -> Handle:
        return self._half_async(shards.REDUCE_SCATTER, [array], op, dims, counts, out, compression, stream, True)

    def fused_reduce_scatter_async(self, arrays: Sequence[Any], *, op: str = "sum", dims: object = None,
                                   counts: Sequence[Sequence[int] | None] | None = None,
                                   out: Sequence[Any] | None = None, compression: object = None,
                                   stream: object = None) -> Handle:
        return self._half_async(shards.REDUCE_SCATTER, arrays, op, dims, counts, out, compression, stream, False)

    def allgather_async(self, array: Any, *, dims: object = None, out: Any = None, compression: object = None,
                        stream: object = None) -> Handle:
        return self._half_async(shards.ALLGATHER, [array], "sum", dims, None, out, compression, stream, True)

    def fused_allgather_async(self, arrays: Sequence[Any], *, dims: object = None, out: Sequence[Any] | None = None,
                              compression: object = None, stream: object = None) -> Handle:
        return self._half_async(shards.ALLGATHER, arrays, "sum", dims, None, out, compression, stream, False)

    def _prepare_half(self, kind: str, arrays: Any, op: str, dims: object, counts: object, out: object,
                      compression: object, stream: object, single: bool) -> shards.HalfRequest:
        """Validate on the caller's thread, so bad input raises where it was passed."""
        if kind == shards.REDUCE_SCATTER:
            check_op(op, self.rank)
        settings = load_settings()
        ring_dims = self._resolve_dims(dims, settings)
        if compression is not None and not isinstance(compression, (str, tuple, list)):
            raise DdlfastError(f"compression={compression!r} on rank {self.rank}: {kind} takes a codec name "
                               "('none', 'fp16', 'bf16', per dimension, or 'auto'), not a user codec")
        codec = self._resolve_compression(compression, settings, [])  # float32 is checked per array in prepare()
        self._check_op_on_wire(op, codec, ring_dims, False)  # also raises when codecs do not fit the dims
        return shards.prepare(kind, arrays, op, ring_dims, counts, out, codec, settings, self.rank, self.size,
                              stream, single)

    def _half_now(self, kind: str, arrays: Any, op: str, dims: object, counts: object, out: object,
                  compression: object, stream: object, single: bool) -> Any:
        self._check_open()
        try:
            request = self._prepare_half(kind, arrays, op, dims, counts, out, compression, stream, single)
        except DdlfastError as error:
            raise self._refused(error) from None
        return self._in_order(lambda: self._execute_half(request), kind)

    def _half_async(self, kind: str, arrays: Any, op: str, dims: object, counts: object, out: object,
                    compression: object, stream: object, single: bool) -> Handle:
        """Queue the collective on the communication thread; wait() returns what the blocking call returns."""
        worker = self._ensure_worker()
        try:
            request = self._prepare_half(kind, arrays, op, dims, counts, out, compression, stream, single)
        except DdlfastError as error:
            self._refuse_async(error)
            raise
        return worker.submit(lambda: self._execute_half(request), f"{kind} of {len(arrays)} arrays")

    def _execute_half(self, request: shards.HalfRequest) -> Any:
        self._set_core_timeout(request.settings.timeout_s)
        self._agreed(request.layout, lambda: self._run_half(request))
        return request.results[0] if request.single else request.results

    def _run_half(self, request: shards.HalfRequest) -> None:
        settings, dims = request.settings, request.dims
        path = self._gpu_path() if request.gpu is not None else None
        if path is not None:
            inputs = [c.reshape(-1) for c in path.to_host(request.gpu[0])]
        else:
            inputs = [s.host for s in request.specs]
        wire = wire_by_dim(request.codec, dims, self._hosts_tier(dims))
        if any(s.dtype != np.float32 for s in request.specs):
            wire = ()  # "auto" leaves other dtypes uncompressed (explicit codecs were refused for them)
        for method, arguments in shards.core_calls(request, inputs, self.rank, self.size, bool(wire)):
            extra = (OPS[request.op],) if method == "reduce_scatter_segments" else ()
            getattr(self._core, method)(*arguments, *extra, dims, settings.chunk_bytes, settings.receives_in_flight,
                                        settings.small_bytes, self._rank_order, wire)
        self._record_engine_events()
        if self._timeline is not None:
            self._timeline.flush()
        for staging, target in request.copy_back:
            target[...] = staging
        if wire:
            self._check_wire_overflows(request.codec, request.op)
        if path is not None:
            path.from_host(request.gpu[1], request.outputs, wait_on_host=True)

    def broadcast(self, array: np.ndarray, root: int = 0) -> np.ndarray:
        """Copy `root`'s array into every rank's array, in place: any fixed-size dtype (a byte copy), host or
        GPU (through a pinned host copy)."""
        self._check_open()
        try:
            work = self._broadcast_work(array, root)
        except DdlfastError as error:
            raise self._refused(error) from None
        return self._in_order(work, "broadcast")

    def broadcast_async(self, array: np.ndarray, root: int = 0) -> Handle:
        """broadcast() on the communication thread; wait() returns the array. Do not touch it until then."""
        worker = self._ensure_worker()
        try:
            work = self._broadcast_work(array, root, asynchronous=True)
        except DdlfastError as error:
            self._refuse_async(error)
            raise
        return worker.submit(work, "broadcast")

    def _broadcast_work(self, array: object, root: object, asynchronous: bool = False) -> Callable[[], Any]:
        """Validate on the caller's thread; return the collective (agreement, then the copy), which returns
        the array."""
        self._check_root(root)
        if cuda.any_device_array([array]):
            request = self._prepare([array], "sum", None, array, compression="none", asynchronous=asynchronous)
            return lambda: self._broadcast_gpu(request, int(root))
        target = _broadcast_target(array, f"broadcast on rank {self.rank}")
        arrays = ((target.dtype, target.shape),)
        return lambda: self._broadcast(target, int(root), arrays, array)

    def broadcast_bytes(self, array: np.ndarray, root: int = 0) -> np.ndarray:
        """broadcast() for any contiguous writable byte view (e.g. a tensor of any dtype)."""
        self._check_open()
        try:
            self._check_root(root)
            if not (isinstance(array, np.ndarray) and not isinstance(array, np.ma.MaskedArray)
                    and array.flags.c_contiguous and array.flags.writeable):
                raise DdlfastError(f"broadcast_bytes on rank {self.rank} needs a C-contiguous writable NumPy array")
        except DdlfastError as error:
            raise self._refused(error) from None
        arrays = (("bytes", (array.nbytes,)),)
        return self._in_order(lambda: self._broadcast(array, int(root), arrays, array), "broadcast")

    def _check_root(self, root: object) -> None:
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise DdlfastError(f"broadcast root {root!r} on rank {self.rank} is outside 0..{self.size - 1}")

    def _broadcast(self, target: np.ndarray, root: int, arrays: tuple, result: Any) -> Any:
        """The collective (on whichever thread runs it). Host and GPU broadcasts share one layout form, so a
        rank passing the other kind is named."""
        self._agreed(("broadcast", root, arrays), lambda: self._control.bcast_into(target, root, "a broadcast"))
        return result

    def _broadcast_gpu(self, request: _GpuRequest, root: int) -> Any:
        """Through a pinned host copy: broadcasts are one-offs (start-up), not worth a device path."""
        layout = ("broadcast", root, _gpu_arrays(request.submission.buffers))

        def run() -> None:
            path = self._gpu_path()
            copies = path.to_host(request.submission)
            self._control.bcast_into(copies[0], root, "a broadcast")
            path.from_host(request.submission, copies, wait_on_host=True)

        self._agreed(layout, run)
        return request.result

    # -- small collectives: barrier, Python objects ----------------------------------------------------------

    def barrier(self) -> None:
        """Return once every rank of the communicator has called barrier(). The agreement is itself the
        barrier: its allreduce completes on a rank only after every rank joined it."""
        self._check_open()
        self._in_order(lambda: self._agreed(("barrier",), lambda: None), "barrier")

    def broadcast_object(self, obj: object, root: int = 0) -> object:
        """Root's picklable object on every rank (root gets `obj` itself back)."""
        self._check_open()
        try:
            self._check_root(root)
            payload = _pickled(obj, f"broadcast_object on rank {self.rank}") if self.rank == root else b""
        except DdlfastError as error:
            raise self._refused(error) from None
        # The size is root's alone, so it is not in the layout: root broadcasts it first.
        layout = ("broadcast", int(root), ((np.dtype(object), ()),))
        return self._in_order(lambda: self._agreed(layout, lambda: self._broadcast_object(obj, payload, int(root))),
                              "broadcast_object")

    def _broadcast_object(self, obj: object, payload: bytes, root: int) -> object:
        size = np.array([len(payload)], dtype=np.int64)
        self._control.bcast_into(size, root, "the size of broadcast_object's pickle")
        data = np.frombuffer(payload, dtype=np.uint8).copy() if self.rank == root else np.empty(int(size[0]), np.uint8)
        self._control.bcast_into(data, root, "broadcast_object's pickle")
        if self.rank == root:
            return self._unpickled_everywhere(lambda: obj, "broadcast_object")
        return self._unpickled_everywhere(lambda: pickle.loads(data.tobytes()), "broadcast_object")

    def allgather_object(self, obj: object) -> list:
        """Every rank's picklable object, in rank order."""
        self._check_open()
        try:
            payload = _pickled(obj, f"allgather_object on rank {self.rank}")
        except DdlfastError as error:
            raise self._refused(error) from None

        def run() -> list:
            payloads = self._control.allgather_bytes(payload, "allgather_object's pickles")  # sizes, then bytes
            return self._unpickled_everywhere(lambda: [pickle.loads(p) for p in payloads], "allgather_object")

        return self._in_order(lambda: self._agreed(("allgather_object",), run), "allgather_object")

    def _unpickled_everywhere(self, load: Callable[[], Any], what: str) -> Any:
        """`load()` here; if it fails on any rank (a class one rank cannot import, ...), every rank raises the
        same error naming the ranks (the data has arrived everywhere: nothing is in flight)."""
        try:
            value, failure = load(), None
        except Exception as error:  # noqa: BLE001 (unpickling runs arbitrary code: any exception is possible)
            value, failure = None, f"rank {self.rank}: {type(error).__name__}: {error}"
        failures = [f for f in self._control.allgather_objects(failure, f"the outcome of {what}") if f]
        if failures:
            raise DdlfastConsistentError(f"{what} could not unpickle the object: " + "; ".join(failures))
        return value

    def _gpu_path(self) -> cuda.CudaPath:
        """The GPU side, created at the first GPU collective: every rank gets here in the same order, after
        an agreement on a GPU layout, so the collective creation cannot meet a host-only rank."""
        if self._cuda_path is None:
            self._cuda_path = cuda.CudaPath(self._core)
            self._cuda_path.record_events = self._timeline is not None
        return self._cuda_path

    # -- execution (communication thread, or inline) -----------------------------------------------------------

    def _execute(self, request: _Request | _GpuRequest) -> Any:
        self._set_core_timeout(request.settings.timeout_s)
        layout = request.layout()
        if isinstance(request, _GpuRequest):
            self._agreed(layout, lambda: self._execute_gpu(request, layout))
        else:
            self._agreed(layout, lambda: self._reduce_host(request, layout))
        return request.result

    def _execute_gpu(self, request: _GpuRequest, layout: tuple) -> None:
        """Uncompressed: the GPU ring (CUDA kernels, ddlfast's streams). Compression and user codecs: the
        host engine on pinned copies, so every codec behaves exactly as on host arrays."""
        path = self._gpu_path()
        submission = request.submission
        plain = isinstance(request.compression, tuple) and not wire_by_dim(
            request.compression, request.dims, self._hosts_tier(request.dims))
        # Integer average and the half types' checked arithmetic (docs/numerics.md) live in the host engine.
        exact = any(b.dtype_name in _HOST_ARITHMETIC.get(request.op, ()) for b in submission.buffers)
        if plain and not request.error_feedback and not exact:
            path.run(submission, request.op, request.dims, request.settings, self._rank_order,
                     request.wait_on_host)
            if self._timeline is not None:
                for name, dim, start, end, nbytes in path.take_events():
                    self._timeline.add(f"gpu {name}" if dim < 0 else f"gpu {name} dim{dim + 1}", start, end,
                                       bytes=nbytes)
                self._timeline.flush()
            return
        copies = path.to_host(submission)
        where = f"on rank {self.rank}"
        host = _Request([host_buffer(c, f"host copy of array {i} {where}") for i, c in enumerate(copies)],
                        request.op, request.dims, request.settings, None, request.compression,
                        request.error_feedback)
        self._reduce_host(host, layout)
        path.from_host(submission, copies, request.wait_on_host)

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
        run_codec(request.compression, fused, self._codec_state.setdefault(key, {}), self._control,
                  self._agreement, request.op)
        unpack(fused, members)

    def _reduce_bucket(self, members: list[HostBuffer], request: _Request, key: tuple) -> None:
        """Large arrays are reduced where they lie, as segments of one logical buffer; only the small ones
        are packed (their per-message cost would dominate). Which arrays are packed depends on sizes alone,
        so every rank lays the bucket out alike; a large array that does not start at a multiple of its
        element size (np.frombuffer at an odd offset) is reduced through an aligned copy in its own place."""
        settings, op, dims = request.settings, OPS[request.op], request.dims
        wire = wire_by_dim(request.compression, dims, self._hosts_tier(dims))
        if wire and request.error_feedback:
            name = "bf16" if "bf16" in request.compression else "fp16"  # "auto" compresses with fp16
            for position, b in enumerate(members):
                self._error_feedback.apply((key, position), b.array, name)
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
        self._core.allreduce_segments(pointers, counts, members[0].dtype_code, op, dims, settings.chunk_bytes,
                                      settings.receives_in_flight, settings.small_bytes, self._rank_order, wire)
        self._record_engine_events()
        for copy, b in staged:
            b.array.reshape(-1)[...] = copy
        if fused is not None:
            start = time.perf_counter()
            unpack(fused, small)
            if self._timeline is not None:
                self._timeline.add("unpack", start, time.perf_counter(), arrays=len(small), bytes=fused.nbytes)
        if wire:
            self._check_wire_overflows(request.compression, request.op)

    def _check_wire_overflows(self, compression: tuple[str, ...], op: str) -> None:
        """The encoders count finite values that became inf; ranks that saw none must raise too."""
        overflowed = int(self._control.allreduce_sum(np.array([self._core.take_overflows()], dtype=np.int64),
                                                     "the count of wire overflows")[0])
        if overflowed:
            raise DdlfastConsistentError(
                f"wire overflow on rank {self.rank}: {overflowed} "
                f"{'partial sums' if op in SUMMING_OPS else 'values'} exceeded the range of "
                f"{'/'.join(n for n in compression if n != 'none')} and the result holds inf; use "
                "compression='bf16'" + (" or op='average' (which pre-scales)" if op == "sum" else ""))

    def _record_engine_events(self) -> None:
        if self._timeline is not None:
            for name, dim, start, end, nbytes in self._core.take_events():
                label = name if dim < 0 else f"{name} dim{dim + 1}"
                self._timeline.add(label, start, end, bytes=nbytes)
