"""The module-level API over the default context (COMM_WORLD) or an explicit `comm=`."""

from __future__ import annotations

import atexit
import platform
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from ddlfast import _core, config, ulfm
from ddlfast.context import Context
from ddlfast.engine.agreement import Name
from ddlfast.engine.worker import Handle
from ddlfast.errors import DdlfastError
from ddlfast.topology.placement import Topology

_default: Context | None = None
# Where this process replaces lost ranks (ddlfast.elastic.run(regrow=True)), its world; it ends as survivors do.
_joined: MPI.Intracomm | None = None
# Contexts for other communicators. mpi4py 4 communicators are unhashable (and equal by handle, not identity),
# so they are keyed by id(); the weak reference beside each context tells a live entry from one whose
# communicator died and whose id() was reused. A finalizer on the communicator retires its context.
_by_comm: dict[int, tuple[weakref.ref, Context]] = {}
_retired: list[Context] = []  # contexts whose communicator went away off the main thread: closed on the next call
_lock = threading.Lock()


def default_context() -> Context:
    """The context for MPI.COMM_WORLD, created on first use."""
    global _default, _joined
    if _default is None:
        if ulfm.spawned():  # a replacement for lost ranks: its world is the survivors' and the replacements'
            _joined = ulfm.joined_parent()  # held here: a Context holds its communicator weakly
            _default = Context(_joined)
        else:
            _default = Context(MPI.COMM_WORLD)
    return _default


def _context_for(comm: MPI.Comm | None) -> Context:
    if _retired:
        _close_retired()
    if comm is None:
        return default_context()
    if not isinstance(comm, MPI.Comm):
        raise DdlfastError(f"comm must be an mpi4py communicator, not {type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise DdlfastError("comm is MPI.COMM_NULL (this rank is not in the communicator, e.g. Split with "
                           "MPI.UNDEFINED): call ddlfast only on ranks that belong to it")
    if comm.Is_inter():
        raise DdlfastError("comm is an intercommunicator; ddlfast needs an intracommunicator (see Intercomm.Merge)")
    if comm == MPI.COMM_WORLD or (_default is not None and comm == _default.comm):
        return default_context()  # also the survivors' communicator after a loss: the default context's world now
    key = id(comm)
    entry = _by_comm.get(key)
    if entry is not None and entry[0]() is comm:
        return entry[1]
    context = Context(comm)  # collective: every rank of comm gets here
    with _lock:
        stale = _by_comm.pop(key, None)
        if stale is not None:  # its communicator died and this one took its id before the finalizer ran
            _retired.append(stale[1])
        _by_comm[key] = (weakref.ref(comm), context)
    weakref.finalize(comm, _retire, key, context)
    return context


def _retire(key: int, context: Context) -> None:
    """The communicator is gone: close its context (now on the main thread, else on the next call)."""
    with _lock:
        entry = _by_comm.get(key)
        if entry is not None and entry[1] is context:
            del _by_comm[key]
        _retired.append(context)
    if threading.current_thread() is threading.main_thread():
        _close_retired()


def _close_retired() -> None:
    with _lock:
        contexts = _retired[:]
        _retired.clear()
    for context in contexts:
        context.close()


def fused_allreduce(
    arrays: Sequence[np.ndarray], *, op: str = "sum", dims: object = None, comm: MPI.Comm | None = None,
    compression: object = None, error_feedback: bool = False, stream: object = None, name: Name = None,
    reproducible: bool | None = None,
) -> list:
    """Allreduce many arrays in place, fused into buckets; returns the list.

    arrays: NumPy arrays, or GPU arrays (CuPy, PyTorch CUDA tensors, anything
    with __cuda_array_interface__ or DLPack) all on one device. stream: for GPU
    arrays, the stream whose work produced them and that will read the result
    (an int handle or an object with .ptr / .cuda_stream); default: the stream
    each array exports, else the host waits for the result.

    op: "sum", "average", "min", "max" or "product" (docs/numerics.md: nan, signed zeros, overflow; product
    cannot run on a compressed wire). dims: "flat", "4x2" or a tuple (default
    DDLFAST_RING_DIMS). compression: None (DDLFAST_COMPRESSION), "fp16",
    "bf16", "none,fp16" (per ring dimension) or a ddlfast.compression.Codec /
    hook; error_feedback keeps the wire rounding's residual per bucket. Every
    rank must pass the same shapes and dtypes in the same order; if they do
    not, every rank raises DdlfastError. name: a str or an int (e.g. the
    training step) that every rank must pass alike; every collective takes it,
    and it makes a rank that skipped a call in a loop of same-layout calls an
    error at its next named call (docs/trust.md). reproducible: True sums every element in one canonical order
    (rank order, at the element's owner), so the result's bits depend only on the inputs and the number of
    ranks, not on the dims, algorithm, chunk or bucket sizes, or fused vs separate calls; None:
    DDLFAST_REPRODUCIBLE (docs/numerics.md). Every rank must pass the same value.
    """
    context = _default if comm is None and _default is not None else _context_for(comm)
    return context.fused_allreduce(arrays, op=op, dims=dims, compression=compression, error_feedback=error_feedback,
                                   stream=stream, name=name, reproducible=reproducible)


def allreduce(array: np.ndarray, *, op: str = "sum", dims: object = None, comm: MPI.Comm | None = None,
              compression: object = None, stream: object = None, name: Name = None,
              reproducible: bool | None = None) -> np.ndarray:
    """Allreduce one array in place and return it (a NumPy or GPU array; see fused_allreduce)."""
    context = _default if comm is None and _default is not None else _context_for(comm)
    return context.allreduce(array, op=op, dims=dims, compression=compression, stream=stream, name=name,
                             reproducible=reproducible)


def fused_allreduce_async(
    arrays: Sequence[np.ndarray], *, op: str = "sum", dims: object = None, comm: MPI.Comm | None = None,
    compression: object = None, error_feedback: bool = False, stream: object = None, name: Name = None,
    reproducible: bool | None = None,
) -> Handle:
    """Like fused_allreduce, on the context's communication thread; returns a Handle.

    Do not read or write the arrays until handle.wait() returns. Several
    handles may be outstanding; they complete in submission order.
    """
    return _context_for(comm).fused_allreduce_async(arrays, op=op, dims=dims, compression=compression,
                                                    error_feedback=error_feedback, stream=stream, name=name,
                                                    reproducible=reproducible)


def allreduce_async(array: np.ndarray, *, op: str = "sum", dims: object = None,
                    comm: MPI.Comm | None = None, compression: object = None, stream: object = None,
                    name: Name = None, reproducible: bool | None = None) -> Handle:
    """Like allreduce, asynchronously; handle.wait() returns the array."""
    return _context_for(comm).allreduce_async(array, op=op, dims=dims, compression=compression, stream=stream,
                                              name=name, reproducible=reproducible)


def reduce_scatter(
    array: Any, *, op: str = "sum", dims: object = None, comm: MPI.Comm | None = None,
    counts: Sequence[int] | None = None, out: Any = None, compression: object = None, stream: object = None,
    name: Name = None, reproducible: bool | None = None,
) -> Any:
    """Rank r gets block r of the array reduced over the ranks (MPI_Reduce_scatter_block / MPI_Reduce_scatter).

    counts=None: array.size must be a multiple of the world size P; rank r gets flat elements
    [r*n/P, (r+1)*n/P), shaped (shape[0]//P, *shape[1:]) when shape[0] % P == 0, else 1-D.
    counts=[c_0, ..., c_{P-1}] (summing to array.size): rank r gets c_r elements (1-D). The input is left
    unchanged; the result is a new array, or `out` (C-contiguous, writable, same dtype, as many elements),
    filled and returned. op, dims, compression ("fp16"/"bf16": float32 on the wire as fp16/bf16, accumulated
    in float32) and stream as for fused_allreduce. NumPy arrays, torch tensors (CPU through their NumPy view),
    CuPy/torch CUDA arrays (through pinned host copies). reproducible as for fused_allreduce.
    """
    return _context_for(comm).reduce_scatter(array, op=op, dims=dims, counts=counts, out=out,
                                             compression=compression, stream=stream, name=name,
                                             reproducible=reproducible)


def allgather(array: Any, *, dims: object = None, comm: MPI.Comm | None = None, out: Any = None,
              compression: object = None, stream: object = None, name: Name = None) -> Any:
    """The ranks' arrays concatenated along axis 0 in rank order (MPI_Allgather); a 0-d array gives shape (P,).

    Every rank passes the same shape and dtype (any fixed-size dtype; compression only for float32, and then
    every rank holds identical bits). out: C-contiguous, writable, same dtype, P * array.size elements.
    """
    return _context_for(comm).allgather(array, dims=dims, out=out, compression=compression, stream=stream, name=name)


def fused_reduce_scatter(
    arrays: Sequence[Any], *, op: str = "sum", dims: object = None, comm: MPI.Comm | None = None,
    counts: Sequence[Sequence[int] | None] | None = None, out: Sequence[Any] | None = None,
    compression: object = None, stream: object = None, name: Name = None, reproducible: bool | None = None,
) -> list:
    """reduce_scatter of many arrays (e.g. parameter shards) in one collective; counts= and out= take one entry
    per array (or None). Returns the list of results."""
    return _context_for(comm).fused_reduce_scatter(arrays, op=op, dims=dims, counts=counts, out=out,
                                                   compression=compression, stream=stream, name=name,
                                                   reproducible=reproducible)


def fused_allgather(arrays: Sequence[Any], *, dims: object = None, comm: MPI.Comm | None = None,
                    out: Sequence[Any] | None = None, compression: object = None, stream: object = None,
                    name: Name = None) -> list:
    """allgather of many arrays in one collective; out= takes one entry per array (or None)."""
    return _context_for(comm).fused_allgather(arrays, dims=dims, out=out, compression=compression, stream=stream,
                        name=name)


def reduce_scatter_async(
    array: Any, *, op: str = "sum", dims: object = None, comm: MPI.Comm | None = None,
    counts: Sequence[int] | None = None, out: Any = None, compression: object = None, stream: object = None,
    name: Name = None, reproducible: bool | None = None,
) -> Handle:
    """Like reduce_scatter, on the context's communication thread; handle.wait() returns the result. Do not
    touch the input or out= until then."""
    return _context_for(comm).reduce_scatter_async(array, op=op, dims=dims, counts=counts, out=out,
                                                   compression=compression, stream=stream, name=name,
                                                   reproducible=reproducible)


def allgather_async(array: Any, *, dims: object = None, comm: MPI.Comm | None = None, out: Any = None,
                    compression: object = None, stream: object = None, name: Name = None) -> Handle:
    """Like allgather, asynchronously; handle.wait() returns the result."""
    return _context_for(comm).allgather_async(array, dims=dims, out=out, compression=compression, stream=stream,
                        name=name)


def fused_reduce_scatter_async(
    arrays: Sequence[Any], *, op: str = "sum", dims: object = None, comm: MPI.Comm | None = None,
    counts: Sequence[Sequence[int] | None] | None = None, out: Sequence[Any] | None = None,
    compression: object = None, stream: object = None, name: Name = None, reproducible: bool | None = None,
) -> Handle:
    """Like fused_reduce_scatter, asynchronously; handle.wait() returns the list."""
    return _context_for(comm).fused_reduce_scatter_async(arrays, op=op, dims=dims, counts=counts, out=out,
                                                         compression=compression, stream=stream, name=name,
                                                         reproducible=reproducible)


def fused_allgather_async(arrays: Sequence[Any], *, dims: object = None, comm: MPI.Comm | None = None,
                          out: Sequence[Any] | None = None, compression: object = None,
                          stream: object = None, name: Name = None) -> Handle:
    """Like fused_allgather, asynchronously; handle.wait() returns the list."""
    return _context_for(comm).fused_allgather_async(arrays, dims=dims, out=out, compression=compression,
                                                    stream=stream, name=name)


def alltoall(array: Any, splits: Sequence[int] | None = None, *, comm: MPI.Comm | None = None,
             receive_splits: Sequence[int] | None = None, out: Any = None,
             name: Name = None) -> tuple[Any, list[int]]:
    """MPI_Alltoallv along the first dimension: rank r sends its rows [sum(splits[:d]), sum(splits[:d+1])) to rank
    d (splits=None: equal blocks, the first dimension a multiple of the world size). Returns (received, splits
    received): the blocks from ranks 0..P-1 concatenated along the first dimension, and the rows that came from
    each rank. Any fixed-size dtype, NumPy or torch CPU; every rank passes the same dtype and trailing shape.
    receive_splits= (the rows expected from each rank) makes a block whose sender and receiver disagree an error on
    every rank, and sizes out= (C-contiguous, writable, the input's dtype), which then receives the result."""
    return _context_for(comm).alltoall(array, splits, receive_splits=receive_splits, out=out, name=name)


def fused_alltoall(arrays: Sequence[Any], splits: Sequence[Sequence[int] | None] | None = None, *,
                   comm: MPI.Comm | None = None, receive_splits: Sequence[Sequence[int] | None] | None = None,
                   out: Sequence[Any] | None = None, name: Name = None) -> tuple[list, list[list[int]]]:
    """alltoall of many arrays in one exchange; splits=, receive_splits= and out= take one entry per array.
    Returns (the received arrays, their received splits)."""
    return _context_for(comm).fused_alltoall(arrays, splits, receive_splits=receive_splits, out=out, name=name)


def alltoall_async(array: Any, splits: Sequence[int] | None = None, *, comm: MPI.Comm | None = None,
                   receive_splits: Sequence[int] | None = None, out: Any = None, name: Name = None) -> Handle:
    """Like alltoall, on the context's communication thread; handle.wait() returns (received, splits)."""
    return _context_for(comm).alltoall_async(array, splits, receive_splits=receive_splits, out=out, name=name)


def fused_alltoall_async(arrays: Sequence[Any], splits: Sequence[Sequence[int] | None] | None = None, *,
                         comm: MPI.Comm | None = None, receive_splits: Sequence[Sequence[int] | None] | None = None,
                         out: Sequence[Any] | None = None, name: Name = None) -> Handle:
    """Like fused_alltoall, asynchronously."""
    return _context_for(comm).fused_alltoall_async(arrays, splits, receive_splits=receive_splits, out=out,
                                                   name=name)


def allgatherv(array: Any, *, comm: MPI.Comm | None = None, name: Name = None) -> Any:
    """The ranks' arrays concatenated along the first dimension in rank order, where the first dimension may differ
    per rank (MPI_Allgatherv; Horovod's allgather). Every rank passes the same dtype and trailing shape."""
    return _context_for(comm).allgatherv(array, name=name)


def fused_allgatherv(arrays: Sequence[Any], *, comm: MPI.Comm | None = None, name: Name = None) -> list:
    """allgatherv of many arrays in one exchange."""
    return _context_for(comm).fused_allgatherv(arrays, name=name)


def allgatherv_async(array: Any, *, comm: MPI.Comm | None = None, name: Name = None) -> Handle:
    """Like allgatherv, asynchronously; handle.wait() returns the result."""
    return _context_for(comm).allgatherv_async(array, name=name)


def fused_allgatherv_async(arrays: Sequence[Any], *, comm: MPI.Comm | None = None, name: Name = None) -> Handle:
    """Like fused_allgatherv, asynchronously; handle.wait() returns the list."""
    return _context_for(comm).fused_allgatherv_async(arrays, name=name)


def join(comm: MPI.Comm | None = None) -> int:
    """This rank has run out of data (Horovod's hvd.join(), DDP's Join): until every rank has called join(), it
    takes part in the other ranks' allreduces (sum or average, host arrays) with zeros, so theirs complete (an
    average still divides by the whole world); any other collective the others call meanwhile raises DdlfastError
    on them. Returns the last rank to join, the same on every rank. Stall-limited like every wait: the others must
    reach a collective within DDLFAST_TIMEOUT_S."""
    return _context_for(comm).join()


def broadcast(array: np.ndarray, root: int = 0, comm: MPI.Comm | None = None, name: Name = None) -> np.ndarray:
    """Overwrite every rank's array with root's, in place (same shape and dtype on all ranks).

    Host arrays: any fixed-size dtype (bool, uint8, complex64, structured, ...: the copy is of bytes). GPU arrays
    (through a pinned host copy): the dtypes ddlfast reduces. Arrays of Python objects: use broadcast_object.
    """
    return _context_for(comm).broadcast(array, root=root, name=name)


def broadcast_async(array: np.ndarray, root: int = 0, comm: MPI.Comm | None = None, name: Name = None) -> Handle:
    """Like broadcast, on the context's communication thread; handle.wait() returns the array."""
    return _context_for(comm).broadcast_async(array, root=root, name=name)


def barrier(comm: MPI.Comm | None = None, name: Name = None) -> None:
    """Return once every rank of the communicator has called barrier() (stall-limited, like every call)."""
    _context_for(comm).barrier(name=name)


def stragglers(comm: MPI.Comm | None = None, last: int = 100) -> list[dict]:
    """Collective: who the others waited for in the last `last` collectives (at most 4096), the same list on every
    rank, one dict per rank sorted by held_s (most first): {"rank", "host", "last_arrivals": how many of them it
    arrived at last, "held_s": how long in total it held the others}. Costs no message beyond its own agreement:
    each rank's wait rides in the next collective's agreement (docs/observe.md)."""
    return _context_for(comm).stragglers(last=last)


def dump_flight_record(comm: MPI.Comm | None = None, directory: str | None = None) -> str | None:
    """Rank-local: write this rank's flight record (its last DDLFAST_FLIGHT_RECORDS collectives) to `directory` or
    DDLFAST_FLIGHT_DIR now; returns the path (None, with a FlightWarning, if it could not be written).
    `python -m ddlfast.flight DIR` merges the ranks' files."""
    return _context_for(comm).dump_flight_record(directory)


def broadcast_object(obj: object, root: int = 0, comm: MPI.Comm | None = None, name: Name = None) -> object:
    """Root's picklable object on every rank (e.g. a config, optimizer state); other ranks' `obj` is ignored."""
    return _context_for(comm).broadcast_object(obj, root=root, name=name)


def allgather_object(obj: object, comm: MPI.Comm | None = None, name: Name = None) -> list:
    """Every rank's picklable object (sizes may differ), as a list in rank order (e.g. metrics)."""
    return _context_for(comm).allgather_object(obj, name=name)


def topology(comm: MPI.Comm | None = None, *, probe_every_tier: bool = False) -> Topology:
    """What ddlfast detected and chose for `comm` (default COMM_WORLD).

    Collective on the first call for a communicator (it is what the first allreduce would do anyway): call it
    on every rank. `probe_every_tier` measures links even where auto would not need them (one host); it only
    matters when this is the communicator's first collective.
    """
    return _context_for(comm).topology(probe_every_tier)


def rank(comm: MPI.Comm | None = None) -> int:
    """This process's rank in `comm` (default COMM_WORLD, or the survivors of it after a RanksLostError); not
    collective."""
    return _world(comm).Get_rank()


def size(comm: MPI.Comm | None = None) -> int:
    """The number of ranks in `comm` (default COMM_WORLD, or the survivors of it after a RanksLostError); not
    collective."""
    return _world(comm).Get_size()


def _world(comm: MPI.Comm | None) -> MPI.Comm:
    if comm is not None:  # not `comm or`: COMM_NULL is falsy
        return comm
    if _default is None and ulfm.spawned():
        return default_context().comm  # a replacement: joins the survivors first (collective with them)
    return MPI.COMM_WORLD if _default is None else _default.comm


def local_rank(comm: MPI.Comm | None = None) -> int:
    """This rank's index among the ranks of `comm` (default COMM_WORLD) on its host (MPI's shared-memory split),
    e.g. to pick a GPU: `torch.cuda.set_device(ddlfast.local_rank())`. Collective on the first call for a
    communicator, like topology() (it creates the context): call it on every rank."""
    context = _context_for(comm)
    return context.topology().placement.local_rank(context.rank)


def local_size(comm: MPI.Comm | None = None) -> int:
    """How many ranks of `comm` (default COMM_WORLD) run on this rank's host; collective like local_rank()."""
    context = _context_for(comm)
    return context.topology().placement.local_size(context.rank)


def has_cuda() -> bool:
    """Whether the loaded build carries the CUDA kernels."""
    return bool(_core.build_facts()["cuda"])


def build_info() -> dict:
    """What this build is: compiler, CPU kernel paths, CUDA, MPI library, engine defaults."""
    facts = _core.build_facts()
    facts.update({
        "compiler": _core.compiler(),
        "python": platform.python_version(),
        "mpi4py_vendor": "{} {}".format(MPI.get_vendor()[0], ".".join(map(str, MPI.get_vendor()[1]))),
        "small_message_handoff": (
            f"buffers <= DDLFAST_SMALL_BYTES (default {config.DEFAULT_SMALL_BYTES} bytes) go to MPI_Allreduce"
        ),
        "chunk_bytes_default": config.DEFAULT_CHUNK_BYTES,
        "bucket_bytes_default": config.DEFAULT_BUCKET_BYTES,
    })
    return facts


@atexit.register
def _close_contexts() -> None:
    # Free the private communicators before mpi4py finalizes MPI.
    _close_retired()
    with _lock:
        contexts = [context for _, context in _by_comm.values()]
        _by_comm.clear()
    if _default is not None:
        contexts.append(_default)
    # After a loss, and in a replacement (it ends with the survivors): without MPI_Finalize.
    survivors = [context.comm for context in contexts
                 if context.lost_ranks or (context is _default and _joined is not None)]
    for context in contexts:
        context.close()
    if survivors:
        ulfm.leave(survivors[-1])  # after a loss: without MPI_Finalize (ddlfast/ulfm.py says why)
