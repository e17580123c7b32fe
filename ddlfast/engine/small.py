"""The small collectives: broadcast (host arrays as bytes, GPU arrays through a pinned host copy), barrier,
the pickled-object collectives and stragglers(). Each function validates on the caller's thread and returns the
collective (agreement, then the data) as a callable the Context runs in order."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import numpy as np

from ddlfast.buffers.device import any_device_array
from ddlfast.buffers.host import broadcast_target
from ddlfast.config import MAX_CARRIED_SHARD_BYTES, load_settings
from ddlfast.engine import device, requests
from ddlfast.engine.device import DeviceRequest, layout_arrays
from ddlfast.engine.flight import MAX_STRAGGLER_WINDOW, straggler_table
from ddlfast.engine.state import EngineState
from ddlfast.errors import DdlfastConsistentError, DdlfastError

Work = Callable[[], Any]


def check_root(state: EngineState, root: object) -> None:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < state.size:
        raise DdlfastError(f"broadcast root {root!r} on rank {state.rank} is outside 0..{state.size - 1}")


def broadcast(state: EngineState, array: object, root: object, asynchronous: bool = False) -> Work:
    """Root's array into every rank's, in place: the collective returns the array."""
    check_root(state, root)
    if any_device_array([array]):
        request = requests.prepare(state, [array], "sum", None, array, compression="none",
                                   asynchronous=asynchronous)
        return lambda: _broadcast_device(state, request, int(root))
    target = broadcast_target(array, f"broadcast on rank {state.rank}")
    return lambda: _broadcast_host(state, target, int(root), ((target.dtype, target.shape),), array)


def broadcast_bytes(state: EngineState, array: object, root: object) -> Work:
    """broadcast() of any contiguous writable byte view (e.g. a tensor of any dtype)."""
    check_root(state, root)
    if not (isinstance(array, np.ndarray) and not isinstance(array, np.ma.MaskedArray)
            and array.flags.c_contiguous and array.flags.writeable):
        raise DdlfastError(f"broadcast_bytes on rank {state.rank} needs a C-contiguous writable NumPy array")
    return lambda: _broadcast_host(state, array, int(root), (("bytes", (array.nbytes,)),), array)


def _broadcast_host(state: EngineState, target: np.ndarray, root: int, arrays: tuple, result: Any) -> Any:
    """Host and GPU broadcasts share one layout form (broadcast_layout), so a rank passing the other kind is
    named. The route (broadcast_route): in the agreement's own messages or along the ring, either in one call into
    the core with the agreement; else, once the ranks agreed, MPI's broadcast."""
    layout = broadcast_layout(root, arrays)
    settings = load_settings()
    route = broadcast_route(state, target.nbytes, settings)
    if route is None:
        state.agreed(layout, lambda: state.control.bcast_into(target, root, "a broadcast"))
        return result
    options, carried = route
    flat = target.reshape(-1).view(np.uint8)
    core = state.core
    state.agreed_in_core(layout, lambda fingerprint: _broadcast_in_core(core, flat, root, options, carried,
                                                                        fingerprint))
    return result


def _broadcast_in_core(core: Any, flat: np.ndarray, root: int, options: Any, carried: bool, fingerprint: int) -> bool:
    """The broadcast with its agreement (Core.broadcast_array, as the fast path runs it): False where the ranks
    disagreed, having written nothing."""
    outcome = core.broadcast_array(flat, flat.nbytes, root, options, carried, fingerprint)
    if outcome < 0:  # `flat` is a writable C-contiguous byte view: nothing ran, on this rank only
        raise DdlfastError(f"broadcast: the core refused a {flat.nbytes}-byte buffer")
    return outcome > 0


def broadcast_layout(root: int, arrays: tuple) -> tuple:
    """What the ranks of a broadcast agree on: the root and ((dtype, shape),) of the arrays (the fast path's too)."""
    return ("broadcast", root, arrays)


def broadcast_route(state: EngineState, nbytes: int, settings: Any) -> tuple[Any, bool] | None:
    """How a host broadcast of `nbytes` runs: (the core's options, carried) for Core.broadcast_array, carried in
    the agreement's messages (carried_broadcast_options) or along the ring (ring_broadcasts); None for MPI's
    broadcast through a staging buffer. Agreed values only: the general path and the fast path
    (ddlfast/engine/fast_path.py) both ask here, so ranks on either exchange the same messages."""
    options = carried_broadcast_options(state, nbytes, settings)
    if options is not None:
        return options, True
    if ring_broadcasts(state.size, nbytes, settings):
        return state.call_options(nbytes, state.resolve_dims(None, settings), settings), False
    return None


def carried_broadcast_options(state: EngineState, nbytes: int, settings: Any) -> Any:
    """The core's options for a host broadcast of `nbytes` carried in the agreement's messages (root's bytes in
    int64 words, zeros elsewhere, summed), or None. Up to the small-message limit (EngineState.folds), and where
    the ranks share the agreement's memory as far as the latency path reaches, up to MAX_CARRIED_SHARD_BYTES
    (2 cores, busbw / MPI_Bcast's: P=2 16-64 KiB 1.15-1.18 against 0.46-0.58 staged; P=4 16 KiB-1 MiB
    0.83-1.35 against 0.40-0.61). Agreed values only: broadcast_route asks here for both paths."""
    words = -(-nbytes // 8) * 8
    dims = state.resolve_dims(None, settings)
    if state.folds(nbytes, settings):
        return state.call_options(words, dims, settings)
    if (0 < nbytes and settings.algorithm != "mpi" and not settings.reproducible and words <= MAX_CARRIED_SHARD_BYTES
            and state.core.shared_memory and state.latency_takes(words, settings)):
        return state.call_options(words, dims, settings, latency=True)
    return None


def ring_broadcasts(world: int, nbytes: int, settings: Any) -> bool:
    """Whether a host broadcast of `nbytes` runs on the ring (the ring's allgather with root's block only,
    received in place): from (P - 1) chunks up, where its pipeline of c chunks over P - 1 hops, c + P - 2 chunk
    times, beats MPI's broadcast, which moves the data about twice (scatter, then allgather) or log2(P) times (a
    tree), and stages it; at P = 2 at every size, where the ring is root's bytes sent straight to the other rank
    (2 cores, busbw / MPI_Bcast's at 256 KiB: 0.60-0.70 staged, 0.89-0.91 on the ring). Not with
    DDLFAST_ALGORITHM=mpi. Agreed values only."""
    return (settings.algorithm != "mpi" and world > 1
            and (world == 2 or nbytes >= (world - 1) * settings.chunk_bytes))


def _broadcast_device(state: EngineState, request: DeviceRequest, root: int) -> Any:
    """Through a pinned host copy: broadcasts are one-offs (start-up), not worth a device path."""
    layout = broadcast_layout(root, layout_arrays(request.submission.buffers))

    def run() -> None:
        gpu = device.executor(state)
        copies = gpu.to_host(request.submission)
        state.control.bcast_into(copies[0], root, "a broadcast")
        gpu.from_host(request.submission, copies, wait_on_host=True)

    state.agreed(layout, run)
    return request.result


def barrier(state: EngineState) -> Work:
    """The agreement is itself the barrier: its allreduce completes on a rank only after every rank joined it."""
    return lambda: state.agreed(("barrier",), lambda: None)


def stragglers(state: EngineState, last: object) -> Work:
    """ddlfast.stragglers(): its own agreement carries the previous collective's waits, so the rows cover every
    collective before this call; the log they come from is the same on every rank (transport/arrivals.h)."""
    if isinstance(last, bool) or not isinstance(last, int | np.integer) or not 1 <= last <= MAX_STRAGGLER_WINDOW:
        raise DdlfastError(f"stragglers(last={last!r}) on rank {state.rank}: last must be an int from 1 to "
                           f"{MAX_STRAGGLER_WINDOW} (the collectives each rank's arrival log keeps)")
    count = int(last)
    return lambda: state.agreed(("stragglers", count), lambda: straggler_table(state.core, state.hosts(), count))


def broadcast_object(state: EngineState, obj: object, root: object) -> Work:
    check_root(state, root)
    payload = _pickled(obj, f"broadcast_object on rank {state.rank}") if state.rank == root else b""
    # The size is root's alone, so it is not in the layout: root broadcasts it first.
    layout = ("broadcast", int(root), ((np.dtype(object), ()),))
    return lambda: state.agreed(layout, lambda: _broadcast_object(state, obj, payload, int(root)))


def _broadcast_object(state: EngineState, obj: object, payload: bytes, root: int) -> object:
    size = np.array([len(payload)], dtype=np.int64)
    state.control.bcast_into(size, root, "the size of broadcast_object's pickle")
    is_root = state.rank == root
    data = np.frombuffer(payload, dtype=np.uint8).copy() if is_root else np.empty(int(size[0]), np.uint8)
    state.control.bcast_into(data, root, "broadcast_object's pickle")
    if is_root:
        return _unpickled_everywhere(state, lambda: obj, "broadcast_object")
    return _unpickled_everywhere(state, lambda: pickle.loads(data.tobytes()), "broadcast_object")


def allgather_object(state: EngineState, obj: object) -> Work:
    payload = _pickled(obj, f"allgather_object on rank {state.rank}")

    def run() -> list:
        payloads = state.control.allgather_bytes(payload, "allgather_object's pickles")  # sizes, then bytes
        return _unpickled_everywhere(state, lambda: [pickle.loads(p) for p in payloads], "allgather_object")

    return lambda: state.agreed(("allgather_object",), run)


def _pickled(obj: object, where: str) -> bytes:
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:  # noqa: BLE001 (pickling calls arbitrary __reduce__ code)
        raise DdlfastError(f"{where}: the object cannot be pickled ({type(error).__name__}: {error})") from None


def _unpickled_everywhere(state: EngineState, load: Callable[[], Any], what: str) -> Any:
    """`load()` here; if it fails on any rank (a class one rank cannot import, ...), every rank raises the same
    error naming the ranks (the data has arrived everywhere: nothing is in flight)."""
    try:
        value, failure = load(), None
    except Exception as error:  # noqa: BLE001 (unpickling runs arbitrary code: any exception is possible)
        value, failure = None, f"rank {state.rank}: {type(error).__name__}: {error}"
    failures = [f for f in state.control.allgather_values(failure, f"the outcome of {what}") if f]
    if failures:
        raise DdlfastConsistentError(f"{what} could not unpickle the object: " + "; ".join(failures))
    return value
