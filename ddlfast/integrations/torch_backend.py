"""A torch.distributed backend named "ddlfast": a `dist.ProcessGroup` subclass on ddlfast's collectives.

    import ddlfast.torch as dt
    dt.init_process_group(backend="ddlfast")     # under mpiexec; ranks from MPI
    ddp = DistributedDataParallel(model)          # unchanged

allreduce (sum, average, min, max, product), allreduce_coalesced, broadcast, reduce, allgather,
all_gather_single and reduce_scatter(_single) run on ddlfast's collectives; barrier, send/recv, alltoall, gather
and scatter on MPI through mpi4py, on a communicator of the backend's own; dist.monitored_barrier (gloo's alone
in torch) on another, on the caller's thread. Every other operation, of either kind, is a
work item on the ddlfast context's communication thread, queued in the order torch issues them, so every rank
runs one sequence and a blocking MPI call never stands between two of ddlfast's asynchronous ones.

Errors: a bad input on any rank (a tensor on a device ddlfast does not take, an op it has no kernel for, shapes
that differ across ranks) makes every rank raise DdlfastError at the same operation: through the per-call
agreement, and from `Work.wait()` (which raises rather than returning) and from the Work's future (whose failure
is a real error of the C++ future, so DDP's backward raises too). Stalls end in DdlfastTimeoutError as anywhere in
ddlfast. docs/torch.md lists what a Python process group cannot do in torch 2.13.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch._C._distributed_c10d import ReduceOp
from torch.distributed.constants import default_pg_timeout

import ddlfast
from ddlfast import abort, api
from ddlfast.config import MAX_TIMEOUT_S, MIN_TIMEOUT_S, load_settings, stall_limit
from ddlfast.engine.worker import Handle
from ddlfast.errors import DdlfastConsistentError, DdlfastError, DdlfastTimeoutError
from ddlfast.integrations.tensors import broadcast_bytes, collective_view, for_backward, nbytes, numpy_view, stream_of
from ddlfast.integrations.torch_ddp import _address_of, _free_port, complete_future, raise_if_failed

BACKEND = "ddlfast"
_OPS = {ReduceOp.SUM: "sum", ReduceOp.AVG: "average", ReduceOp.MIN: "min", ReduceOp.MAX: "max",
        ReduceOp.PRODUCT: "product"}
# MPI_Comm_create_group's tag: torch creates groups one at a time, in the same order on every member.
_CREATE_GROUP_TAG = 0x7D1F
_HEADER = 4  # int64s ahead of each point-to-point message: sender's rank, byte count, dtype, the user's tag
# What a point-to-point wait is, for the stall census (MpiTransport::kWaitReceive, kWaitSend).
_WAIT_RECEIVE, _WAIT_SEND = 1, 2


# How long destroy_process_group waits for queued work when there is no stall limit (DDLFAST_TIMEOUT_S=0).
SHUTDOWN_TIMEOUT_S = 60.0
# DDP's buffer broadcasts go out in one ddlfast broadcast per this many bytes (see _broadcast_coalesced).
PACK_BYTES = 64 << 20
_torch_broadcast_coalesced = dist._broadcast_coalesced
_torch_monitored_barrier = dist.monitored_barrier
# How often a monitored barrier tests its messages while it waits (it runs on the caller's thread, as gloo's).
_MONITOR_POLL_S = 0.001


def register() -> None:
    """Register "ddlfast" with torch.distributed (idempotent), and route DDP's coalesced broadcasts on ddlfast
    groups through one collective (_broadcast_coalesced)."""
    if BACKEND.upper() in dist.Backend._plugins:
        return
    devices = ["cpu", "cuda"] if ddlfast.has_cuda() else ["cpu"]
    dist.Backend.register_backend(BACKEND, _create_backend, extended_api=True, devices=devices)
    dist._broadcast_coalesced = _broadcast_coalesced
    dist.monitored_barrier = _monitored_barrier
    abort.when_broken(_broken_group)


_groups: weakref.WeakSet[ProcessGroupDdlfast] = weakref.WeakSet()


def _broken_group() -> str | None:
    """Registered with ddlfast/abort.py's hook: a stall that reaches the user through torch's C++ (DDP's backward)
    arrives as torch's RuntimeError, not as DdlfastTimeoutError; any exception uncaught while a ddlfast group's
    context is broken then ends the job the same way (DDLFAST_ABORT_ON_STALL=0 turns it off)."""
    broken = [g for g in list(_groups) if g._context.broken_reason is not None]
    return f"the ddlfast process group is broken ({broken[0]._context.broken_reason})" if broken else None


def _broadcast_coalesced(group: Any, tensors: list[torch.Tensor], buffer_size: int, src: int = 0) -> None:
    """torch.distributed._broadcast_coalesced, which DDP calls for its buffers before every forward (and for the
    module's state at construction). torch's C++ version sends one broadcast per dtype bucket (BatchNorm: float
    statistics, int64 counters), and each ddlfast broadcast costs an agreement besides the broadcast itself; on a
    ddlfast group every CPU tensor goes in one packed broadcast per PACK_BYTES instead (the ranks' tensors were
    checked alike by DDP, so every rank packs them alike). Any other group: torch's own."""
    if not isinstance(group, ProcessGroupDdlfast) or any(t.device.type != "cpu" for t in tensors):
        return _torch_broadcast_coalesced(group, tensors, buffer_size, src)
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    works, chunk, chunk_bytes = [], [], 0
    for t in tensors:
        if chunk and chunk_bytes + nbytes(t) > PACK_BYTES:
            works.append(group.broadcast(chunk, opts))
            chunk, chunk_bytes = [], 0
        chunk.append(t)
        chunk_bytes += nbytes(t)
    if chunk:
        works.append(group.broadcast(chunk, opts))
    for work in works:
        work.wait()
    return None


def _monitored_barrier(group: Any = None, timeout: datetime.timedelta | float | None = None,
                       wait_all_ranks: bool = False) -> None:
    """dist.monitored_barrier, which torch implements for gloo alone ("only implemented for GLOO backend"): on a
    ddlfast group (a member of it) ProcessGroupDdlfast.monitored_barrier; anything else: torch's own."""
    from torch.distributed import distributed_c10d

    target = distributed_c10d._get_default_group() if group is None else group
    if not isinstance(target, ProcessGroupDdlfast) or distributed_c10d._rank_not_in_group(group):
        return _torch_monitored_barrier(group, timeout, wait_all_ranks)  # type: ignore[arg-type]
    target.monitored_barrier(timeout, wait_all_ranks)
    return None


def _create_backend(options: Any, backend_options: Any = None) -> ProcessGroupDdlfast:
    """torch calls this on the members of a new group only (non-members return before it): so the group's MPI
    communicator comes from MPI_Comm_create_group, collective over the members alone. The world is COMM_WORLD,
    or the survivors' communicator once ranks were lost (rebuild_process_group)."""
    world: MPI.Intracomm = api._world(None)  # type: ignore[assignment]  # the default context's: an intracomm
    ranks = list(options.global_ranks_in_group)
    if not ranks or ranks == list(range(world.Get_size())):
        comm = world
    else:
        comm = world.Create_group(world.Get_group().Incl(ranks), _CREATE_GROUP_TAG)
    if (comm.Get_rank(), comm.Get_size()) != (options.group_rank, options.group_size):
        raise DdlfastError(f"torch made this process rank {options.group_rank} of {options.group_size} in group "
                           f"{options.group_id!r} but MPI rank {comm.Get_rank()} of {comm.Get_size()}: launch with "
                           "mpiexec and use ddlfast.torch.init_process_group(backend='ddlfast')")
    group = ProcessGroupDdlfast(comm, timeout_s=_stall_limit_of(getattr(options, "timeout", None)))
    group.setGroupName(str(options.group_id))
    return group


def rebuild_process_group(timeout_s: float = 300.0) -> bool:
    """After ranks were lost (ddlfast.RanksLostError under `mpirun --with-ft ulfm`, docs/elastic.md): replace
    torch's default process group, when it is a "ddlfast" one of the world before the loss, by a new one on the
    survivors (ranks and size from ddlfast.rank()/ddlfast.size(); a new TCPStore served by the new rank 0).
    Collective over the survivors; `ddlfast.elastic.run` calls it after each loss. A DistributedDataParallel
    built on the old group must be built again. Returns whether it rebuilt."""
    if not dist.is_initialized() or dist.get_backend() != BACKEND:
        return False
    group = dist.distributed_c10d._get_default_group()
    context = api.default_context()
    if getattr(group, "_ddlfast_generation", 0) == context.generation:
        return False
    rank, size = context.rank, context.size
    # Where the new rank 0 serves the store, through ddlfast's object collectives: a loss meanwhile raises
    # RanksLostError (and elastic.run starts over) instead of an MPI error.
    hosts = api.allgather_object(MPI.Get_processor_name())
    where = None
    if rank == 0:
        where = ("127.0.0.1" if len(set(hosts)) == 1 else _address_of(hosts[0]), _free_port())
    agreed: tuple[str, int] = api.broadcast_object(where, root=0)  # type: ignore[assignment]
    address, port = agreed
    if not address:
        raise DdlfastError(f"rank 0's host name {hosts[0]!r} does not resolve: torch's store cannot be served there")
    store = dist.TCPStore(address, port, size, is_master=rank == 0, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    dist.destroy_process_group()
    dist.init_process_group(BACKEND, store=store, rank=rank, world_size=size)
    return True


def _stall_limit_of(timeout: datetime.timedelta | None) -> float | None:
    """The group's stall limit from init_process_group/new_group's timeout=, or None (DDLFAST_TIMEOUT_S) where
    none was given: torch passes its default (30 minutes) then, and DDLFAST_TIMEOUT_S is the user's choice."""
    if timeout is None or timeout == default_pg_timeout:
        return None
    seconds = timeout.total_seconds()
    if seconds <= 0:
        raise DdlfastError(f"timeout={timeout!r}: a process group's timeout must be more than 0 seconds")
    return min(max(seconds, MIN_TIMEOUT_S), MAX_TIMEOUT_S)  # the range DDLFAST_TIMEOUT_S accepts


def _tensors(tensors: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """DDP's join hook passes a bare tensor where torch's API takes a list."""
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _reduce_op(opts: Any) -> str:
    """AllreduceOptions / ReduceOptions / ReduceScatterOptions, a ReduceOp or its RedOpType, or None (sum)."""
    op = getattr(opts, "reduceOp", opts)
    if op is None:
        return "sum"
    kind = getattr(op, "op", op)
    name = _OPS.get(kind)
    if name is None:
        raise DdlfastError(f"the ddlfast backend has no {getattr(kind, 'name', kind)} reduction (it has SUM, AVG, "
                           "MIN, MAX, PRODUCT)")
    return name


def _flat_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes (any dtype), sharing its memory (read detached when it requires grad)."""
    return tensor.detach().view(-1).view(torch.uint8).numpy() if tensor.numel() else np.empty(0, np.uint8)


class DdlfastWork(dist.Work):
    """One operation queued on the context's communication thread.

    wait() returns True once it completed and raises its DdlfastError otherwise; get_future() gives a future
    that completes with the output tensors, or fails (a real error of the C++ future that DDP waits on)."""

    def __init__(self, handle: Handle, result: list[torch.Tensor], source_rank: Callable[[], int] | None = None
                 ) -> None:
        super().__init__()
        self._handle = handle
        self._result = result
        self._future: torch.futures.Future | None = None
        self._future_lock = threading.Lock()
        self._source_rank = source_rank
        self._stall_limit_s: float | None = None  # the group's timeout=, for the wording of a stall

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else 0.0
        with _torch_wording(self._stall_limit_s):
            self._handle.wait(seconds if seconds > 0 else None)
        return True

    def is_completed(self) -> bool:
        return self._handle.done()

    def is_success(self) -> bool:
        return self._handle.done() and self._handle._error is None

    def exception(self) -> BaseException | None:
        return self._handle._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._result

    def synchronize(self) -> None:
        self.wait()

    def source_rank(self) -> int:
        self.wait()
        if self._source_rank is None:
            raise DdlfastError("source_rank() is defined for a recv from any source only")
        return self._source_rank()

    def _source_rank(self) -> int:
        return self.source_rank()

    def get_future(self) -> torch.futures.Future:
        with self._future_lock:
            if self._future is None:
                future: torch.futures.Future = torch.futures.Future()
                self._handle.add_done_callback(complete_future(future, self._result))
                # set_exception alone leaves the C++ future successful: a callback that raises fails it.
                self._future = future.then(raise_if_failed)
            return self._future


@contextlib.contextmanager
def _torch_wording(limit_s: float | None) -> Any:
    """A stall raised as torch's backends word it ("Timed out", which torch's tests and users' handlers look
    for), with ddlfast's census of who waited for whom after it."""
    try:
        yield
    except DdlfastTimeoutError as error:
        limit = f"{limit_s:g} s, the group's timeout=" if limit_s is not None else \
            f"{load_settings().timeout_s:g} s, DDLFAST_TIMEOUT_S"
        raise DdlfastTimeoutError(f"ddlfast process group: Timed out ({limit}): {error}") from error


class _PointToPointWork(DdlfastWork):
    """A send or recv: posted in order on the communication thread; completed there when waited for (not when
    posted: two ranks that each send before they receive must not block each other)."""

    def __init__(self, handle: Handle, result: list[torch.Tensor], complete: Callable[[], Any],
                 group: ProcessGroupDdlfast, description: str, source_rank: Callable[[], int] | None = None) -> None:
        super().__init__(handle, result, source_rank)
        self._complete = complete
        self._group = group
        self._description = description
        self._completion: Handle | None = None
        self._lock = threading.Lock()

    def _completion_handle(self) -> Handle:
        with self._lock:
            if self._completion is None:
                self._handle.wait()  # posted (raises if posting failed)
                self._completion = self._group._submit(self._complete, self._description)
            return self._completion

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else 0.0
        with _torch_wording(self._stall_limit_s):
            self._completion_handle().wait(seconds if seconds > 0 else None)
        return True

    def is_completed(self) -> bool:
        return self._completion is not None and self._completion.done()

    def is_success(self) -> bool:
        return self.is_completed() and self._completion.exception() is None

    def exception(self) -> BaseException | None:
        return None if self._completion is None else self._completion._error

    def get_future(self) -> torch.futures.Future:
        with self._future_lock:
            if self._future is None:
                future: torch.futures.Future = torch.futures.Future()
                self._completion_handle().add_done_callback(complete_future(future, self._result))
                self._future = future.then(raise_if_failed)
            return self._future


class ProcessGroupDdlfast(dist.ProcessGroup):
    """The "ddlfast" torch.distributed backend over one MPI communicator (COMM_WORLD for the default group)."""

    def __init__(self, comm: MPI.Intracomm, timeout_s: float | None = None) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size())
        self._comm = comm
        self._timeout_s = timeout_s  # the stall limit of this group's work; None: DDLFAST_TIMEOUT_S
        self._context = api._context_for(comm)  # the default context for COMM_WORLD: one thread, one order
        # MPI-side operations on a communicator of their own, completed through the core's stall-limited wait.
        self._mpi = self._context.control_on(comm.Dup())
        self._data = comm.Dup()  # point-to-point data messages (headers go on self._mpi.comm)
        self._monitor = comm.Dup()  # monitored_barrier's messages
        self._monitor_left: list[Any] = []  # sends of monitored barriers that failed: kept until the group goes
        self._tag_bound = int(self._data.Get_attr(MPI.TAG_UB))
        self._sends: list[tuple[list[Any], tuple]] = []  # posted sends: requests, and buffers kept until done
        self._recvs: list[dict[str, Any]] = []  # posted recvs whose data receive is not posted yet, in order
        self._group_name = ""
        self._group_desc = ""
        self._ddlfast_generation = self._context.generation  # the world it was made for (rebuild_process_group)
        _groups.add(self)

    # -- identity --------------------------------------------------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - torch's C++ name
        return BACKEND

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    @property
    def group_name(self) -> str:
        return self._group_name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def __repr__(self) -> str:
        return f"ProcessGroupDdlfast(rank={self.rank()}, size={self.size()}, name={self._group_name!r})"

    # -- plumbing --------------------------------------------------------------------------------------------------

    def _submit(self, work: Callable[[], Any], description: str) -> Handle:
        if self._timeout_s is None:
            return self._context.submit(work, description)
        with stall_limit(self._timeout_s):
            return self._context.submit(work, description)

    def _refuse(self, error: Exception) -> DdlfastError:
        """Bad input here, or any exception while the arguments were checked: the refusal takes this operation's
        place in the queue (the other ranks' agreement meets it and they raise too); the caller raises the
        returned DdlfastError at once."""
        return self._context.refuse_async(error, "a call of the ddlfast backend")

    def _agreed_work(self, layout: tuple, action: Callable[[], Any], description: str,
                     result: list[torch.Tensor]) -> DdlfastWork:
        """An MPI-side collective: the ranks agree on its layout first (so a mismatch raises on every rank
        instead of hanging or truncating), then it runs, both on the communication thread, in order."""
        return DdlfastWork(self._context.submit_agreed(("torch " + description, *layout), action, description),
                           result)

    def _check(self, tensors: Sequence[torch.Tensor], what: str, same_dtype: bool = True) -> None:
        """What the NumPy/CUDA adapters cannot take, named with the rank (ddlfast checks dtype and layout)."""
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise DdlfastError(f"{what} on rank {self.rank()} got {type(t).__name__}, not a torch.Tensor")
            if t.device.type == "cuda" and not ddlfast.has_cuda():
                raise DdlfastError(f"{what} on rank {self.rank()} got a tensor on {t.device}, but this ddlfast "
                                   "build has no CUDA support: rebuild with DDLFAST_CUDA=on or move it to the CPU")
            if t.device.type not in ("cpu", "cuda"):
                raise DdlfastError(f"{what} on rank {self.rank()} got a tensor on {t.device}: the ddlfast backend "
                                   "takes CPU tensors (and CUDA tensors in a CUDA build)")
            if t.layout != torch.strided:
                raise DdlfastError(f"{what} on rank {self.rank()} got a {t.layout} tensor: the ddlfast backend "
                                   "takes dense tensors")
            if t.is_complex():
                raise DdlfastError(f"{what} on rank {self.rank()} got a {t.dtype} tensor: the ddlfast backend "
                                   "takes real dtypes (view complex tensors with torch.view_as_real)")
        if len({str(t.device) for t in tensors}) > 1:
            raise DdlfastError(f"{what} on rank {self.rank()} got tensors on "
                               f"{', '.join(sorted({str(t.device) for t in tensors}))}: one device per call")
        if same_dtype and len({t.dtype for t in tensors}) > 1:
            raise DdlfastError(f"{what} on rank {self.rank()} got tensors of dtypes "
                               f"{', '.join(sorted({str(t.dtype) for t in tensors}))}: one dtype per call")

    def _host_only(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        for t in tensors:
            if t.device.type != "cpu":
                raise DdlfastError(f"{what} on rank {self.rank()} got a tensor on {t.device}: the ddlfast backend "
                                   f"runs {what} on MPI with CPU tensors only")
            if not t.is_contiguous():
                raise DdlfastError(f"{what} on rank {self.rank()} got a non-contiguous tensor of shape "
                                   f"{tuple(t.shape)}: call .contiguous() first")

    # -- ddlfast's collectives ---------------------------------------------------------------------------------------

    def allreduce(self, tensors: torch.Tensor | list[torch.Tensor], opts: Any = None) -> DdlfastWork:
        tensors = _tensors(tensors)
        if any(getattr(t, "layout", None) == torch.sparse_coo for t in tensors):
            return self._sparse_allreduce(tensors, opts)
        try:
            op = _reduce_op(opts)
            self._check(tensors, "allreduce")
            views = [collective_view(t) for t in tensors]
        except Exception as error:  # noqa: BLE001 - any exception on one rank must reach every rank (_refuse)
            raise self._refuse(error) from error
        with for_backward(self._context):  # DDP's reducer calls it in backward, maybe on an autograd thread
            handle = self._context.fused_allreduce_async(views, op=op, result=tensors, stream=stream_of(tensors[0]))
        return DdlfastWork(handle, tensors)

    def _sparse_allreduce(self, tensors: list[torch.Tensor], opts: Any) -> DdlfastWork:
        """Sparse COO tensors summed as gloo sums them: every rank's (indices, values) allgathered, concatenated in
        rank order and coalesced (duplicates summed), so every rank computes the same bits; the result replaces
        each tensor's contents in place."""
        try:
            op = _reduce_op(opts)
            if op != "sum":
                raise DdlfastError(f"allreduce on rank {self.rank()} of a sparse tensor takes ReduceOp.SUM, not "
                                   f"{op} (as gloo)")
            for t in tensors:
                if t.layout != torch.sparse_coo or t.device.type != "cpu":
                    raise DdlfastError(f"allreduce on rank {self.rank()} mixes a sparse tensor with a "
                                       f"{t.layout} tensor on {t.device}: sparse allreduce takes CPU sparse COO "
                                       "tensors only")
        except Exception as error:  # noqa: BLE001 - any exception on one rank must reach every rank (_refuse)
            raise self._refuse(error) from error

        def run() -> None:
            for i, t in enumerate(tensors):
                mine = t.detach().coalesce()
                everyone = self._context.allgather_object((tuple(mine.shape), str(mine.dtype), mine.indices(),
                                                           mine.values()))
                kinds = sorted({f"{dtype}{list(shape)}" for shape, dtype, _, _ in everyone})
                if len(kinds) > 1:  # every rank sees the same gathered list: every rank raises this
                    raise DdlfastConsistentError(f"sparse allreduce of tensor {i}: the ranks passed tensors of "
                                                 f"different sizes or dtypes ({', '.join(kinds)})")
                total = torch.sparse_coo_tensor(torch.cat([p[2] for p in everyone], dim=1),
                                                torch.cat([p[3] for p in everyone]), mine.shape).coalesce()
                with torch.no_grad():
                    t.copy_(total)

        return DdlfastWork(self._context.submit_collective(run, "sparse allreduce"), tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> DdlfastWork:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: torch.Tensor | list[torch.Tensor], opts: Any = None) -> DdlfastWork:
        """All of a call's tensors in one ddlfast broadcast (their bytes packed on the host when there are several,
        as DDP's buffer broadcasts of several dtypes would otherwise cost one collective each)."""
        tensors = _tensors(tensors)
        root = int(getattr(opts, "rootRank", 0) if not isinstance(opts, int) else opts)
        context = self._context
        try:
            self._check(tensors, "broadcast", same_dtype=False)
            context.check_root(root)
            if len(tensors) == 1 and tensors[0].device.type == "cuda":
                tensor = tensors[0]
                return DdlfastWork(context.broadcast_async(tensor, root=root), tensors)
            self._host_only(tensors, "broadcast of several tensors" if len(tensors) > 1 else "broadcast")
        except Exception as error:  # noqa: BLE001 - any exception on one rank must reach every rank (_refuse)
            raise self._refuse(error) from error
        mpi = self._mpi
        if len(tensors) == 1:
            target = _flat_bytes(tensors[0])
            run: Callable[[], None] = lambda: mpi.bcast_into(target, root, "a torch broadcast")  # noqa: E731
        else:
            what = f"a torch broadcast of {len(tensors)} tensors"
            run = lambda: broadcast_bytes(tensors, lambda flat: mpi.bcast_into(flat, root, what))  # noqa: E731

        # Every tensor's dtype and shape, in order, are in the agreement (not only the byte count): float32[4] on
        # the root and int32[4] elsewhere, or a coalesced broadcast in another dtype order, raise on every rank.
        layout = ("broadcast", root, tuple((_dtype_text(t.dtype), tuple(t.shape)) for t in tensors))
        description = "broadcast" if len(tensors) == 1 else f"broadcast of {len(tensors)} tensors"
        return DdlfastWork(context.submit_agreed(layout, run, description), tensors)

    def reduce(self, tensors: torch.Tensor | list[torch.Tensor], opts: Any = None) -> DdlfastWork:
        """ddlfast's allreduce, kept on the root only (other ranks reduce a copy: their tensors stay as they are)."""
        tensors = _tensors(tensors)
        root = int(getattr(opts, "rootRank", 0))
        try:
            op = _reduce_op(opts)
            self._check(tensors, "reduce")
            self._context.check_root(root)
            work = tensors if self.rank() == root else [t.clone() for t in tensors]
            views = [collective_view(t) for t in work]
        except Exception as error:  # noqa: BLE001 - any exception on one rank must reach every rank (_refuse)
            raise self._refuse(error) from error
        handle = self._context.fused_allreduce_async(views, op=op, result=tensors, stream=stream_of(tensors[0]))
        return DdlfastWork(handle, tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> DdlfastWork:
        """ddlfast.allgather into one buffer, then copied into torch's list of outputs (on the thread)."""
        outputs, source = output_tensors[0], input_tensors[0]
        try:
            self._check([source, *outputs], "allgather")
            self._host_only([source], "allgather")
            if len(outputs) != self.size() or any(o.shape != source.shape for o in outputs):
                raise DdlfastError(f"allgather on rank {self.rank()} got {len(outputs)} outputs of shapes "
                                   f"{sorted({tuple(o.shape) for o in outputs})} for an input of shape "
                                   f"{tuple(source.shape)}: it takes {self.size()} outputs of the input's shape")
        except Exception as error:  # noqa: BLE001 - any exception on one rank must reach every rank (_refuse)
            raise self._refuse(error) from error
        gathered = torch.empty((self.size(), *source.shape), dtype=source.dtype)

        def run() -> None:
            self._allgather_into(source, gathered)
            for r, o in enumerate(outputs):
                o.copy_(gathered[r])

        return DdlfastWork(self._context.submit_collective(run, "allgather"), outputs)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> DdlfastWork:  # noqa: A002
        """dist.all_gather_into_tensor: the ranks' inputs concatenated along dim 0, by ddlfast.allgather."""
        try:
            self._check([output, input], "all_gather_into_tensor")
            self._host_only([output, input], "all_gather_into_tensor")
            if output.numel() != input.numel() * self.size():
                raise DdlfastError(f"all_gather_into_tensor on rank {self.rank()} got an output of "
                                   f"{output.numel()} elements for {self.size()} inputs of {input.numel()}")
        except Exception as error:  # noqa: BLE001 - any exception on one rank must reach every rank (_refuse)
            raise self._refuse(error) from error
        return DdlfastWork(self._context.submit_collective(lambda: self._allgather_into(input, output),
                                                           "all_gather_into_tensor"), [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> DdlfastWork:
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return works[-1] if works else self.barrier()

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> DdlfastWork:  # noqa: A002
        """dist.reduce_scatter_tensor: rank r gets the reduction of the inputs' r-th block along dim 0."""
        try:
            op = _reduce_op(opts)
            self._check([output, input], "reduce_scatter_tensor")
            self._host_only([output, input], "reduce_scatter_tensor")
            if input.numel() != output.numel() * self.size():
                raise DdlfastError(f"reduce_scatter_tensor on rank {self.rank()} got an input of {input.numel()} "
                                   f"elements for {self.size()} outputs of {output.numel()}")
        except Exception as error:  # noqa: BLE001 - any exception on one rank must reach every rank (_refuse)
            raise self._refuse(error) from error
        context = self._context
        run = lambda: context.reduce_scatter(numpy_view(input), op=op,  # noqa: E731
                                             out=numpy_view(output).reshape(-1))
        return DdlfastWork(self._context.submit_collective(run, "reduce_scatter_tensor"), [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> DdlfastWork:
        """dist.reduce_scatter (a list of inputs): packed into one buffer, then reduce_scatter_single's path."""
        output, inputs = output_tensors[0], input_tensors[0]
        try:
            self._check([output, *inputs], "reduce_scatter")
            if len(inputs) != self.size() or any(i.shape != output.shape for i in inputs):
                raise DdlfastError(f"reduce_scatter on rank {self.rank()} got {len(inputs)} inputs of shapes "
                                   f"{sorted({tuple(i.shape) for i in inputs})} for an output of shape "
                                   f"{tuple(output.shape)}: it takes {self.size()} inputs of the output's shape")
        except Exception as error:  # noqa: BLE001 - any exception on one rank must reach every rank (_refuse)
            raise self._refuse(error) from error
        return self.reduce_scatter_single(output, torch.stack(inputs), opts)

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> DdlfastWork:
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return works[-1] if works else self.barrier()

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> DdlfastWork:
        """dist.all_gather_coalesced: output_lists[r][i] gets rank r's inputs[i]; one fused ddlfast allgather (one
        agreement over every input's shape and dtype), then copied into torch's outputs on the thread."""
        try:
            self._check([*inputs, *(o for outputs in output_lists for o in outputs)], "all_gather_coalesced",
                        same_dtype=False)
            self._host_only([*inputs, *(o for outputs in output_lists for o in outputs)], "all_gather_coalesced")
            shapes = [tuple(t.shape) for t in inputs]
            wanted = [(tuple(t.shape), t.dtype) for t in inputs]
            if len(output_lists) != self.size() or any([(tuple(o.shape), o.dtype) for o in outputs] != wanted
                                                       for outputs in output_lists):
                raise DdlfastError(f"all_gather_coalesced on rank {self.rank()} takes {self.size()} output lists, "
                                   f"each of tensors shaped and typed as the inputs {shapes}")
        except Exception as error:  # noqa: BLE001 - any exception on one rank must reach every rank (_refuse)
            raise self._refuse(error) from error
        outputs_flat = [o for outputs in output_lists for o in outputs]

        def run() -> None:
            gathered = self._context.fused_allgather([numpy_view(t).reshape(-1) for t in inputs])
            for i, full in enumerate(gathered):  # rank r's inputs[i] is block r of full
                for r, block in enumerate(np.split(full, self.size())):
                    numpy_view(output_lists[r][i]).reshape(-1)[...] = block

        return DdlfastWork(self._context.submit_collective(run, "all_gather_coalesced"), outputs_flat)

    def _allgather_into(self, source: torch.Tensor, output: torch.Tensor) -> None:
        """On the communication thread: the ranks' `source` tensors, in rank order, into `output`'s memory."""
        self._context.allgather(numpy_view(source), out=numpy_view(output).reshape(-1))

    # -- MPI through mpi4py ----------------------------------------------------------------------------------------

    def barrier(self, opts: Any = None) -> DdlfastWork:
        mpi = self._mpi
        return self._agreed_work(("barrier",), lambda: mpi.barrier("a torch barrier"), "barrier", [])

    def monitored_barrier(self, timeout: datetime.timedelta | float | None = None, wait_all_ranks: bool = False
                          ) -> None:
        """dist.monitored_barrier as gloo's: every other rank reports to rank 0, which waits for them in rank order
        within `timeout` (default: the group's timeout=, else DDLFAST_TIMEOUT_S) and then releases them. Raises
        DdlfastError on rank 0 naming the first rank that did not arrive (every such rank with wait_all_ranks),
        and on the others when rank 0 did not release them in time. On the caller's thread, on a communicator of
        its own, outside the collectives' order: a debugging barrier that must answer while they hang."""
        seconds = (timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
                   if timeout is not None else self._timeout_s or load_settings().timeout_s)
        milliseconds = round(seconds * 1000)
        comm, rank, size = self._monitor, self.rank(), self.size()
        deadline = time.monotonic() + seconds
        if rank != 0:
            token, release = np.zeros(1, np.uint8), np.zeros(1, np.uint8)
            send, receive = comm.Isend(token, 0), comm.Irecv(release, 0)
            if not _arrived(receive, deadline):
                self._monitor_left.append((send, token))
                raise DdlfastError(f"Rank {rank} successfully reached monitoredBarrier, but received errors while "
                                   f"waiting for send/recv from rank 0 (no release within {milliseconds} ms). "
                                   "Please check rank 0 logs for faulty rank.")
            send.Wait()
            return
        tokens = np.zeros(size, np.uint8)
        receives = {r: comm.Irecv(tokens[r:r + 1], r) for r in range(1, size)}
        if seconds <= 0:
            _cancel(receives.values())
            raise DdlfastError(f"Rank 0 timed out in monitoredBarrier after {milliseconds} ms")
        failed = []
        for r, receive in receives.items():
            if not _arrived(receive, deadline):
                failed.append(r)
                if not wait_all_ranks:
                    break
        if failed:
            _cancel(receives.values())
            which = (f"Ranks {', '.join(map(str, failed))}" if wait_all_ranks else f"Rank {failed[0]}")
            raise DdlfastError(f"{which} failed to pass monitoredBarrier in {milliseconds} ms")
        release = np.ones(1, np.uint8)
        MPI.Request.Waitall([comm.Isend(release, r) for r in range(1, size)])

    # Point to point. Each message is a header (_HEADER int64s: sender, byte count, dtype, the user's tag) on the
    # group's MPI communicator, then the data on a communicator of its own (self._data), both under the MPI tag
    # _mpi_tag(tag): the user's tag itself up to MPI_TAG_UB, so a recv matches the sends MPI would match for
    # that tag, headers and data alike in posting order; a larger tag (gloo takes any) is folded into that
    # range and the header's copy of it is checked, so a fold that meets another tag's message raises.

    def _mpi_tag(self, tag: object, what: str) -> int:
        if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or tag < 0:
            raise DdlfastError(f"{what} on rank {self.rank()}: tag {tag!r} is not an int >= 0")
        return int(tag) % (self._tag_bound + 1)

    def _reap_sends(self) -> None:
        """Forget sends that completed without being waited for (dist.isend's Work dropped): their requests
        and buffers were kept here until MPI was done with them."""
        if self._sends:
            self._sends = [entry for entry in self._sends if not MPI.Request.Testall(entry[0])]

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> DdlfastWork:
        tensors = _tensors(tensors)
        self._check(tensors, "send")
        self._host_only(tensors, "send")
        self._check_peer(dst, "send to")
        mpi_tag = self._mpi_tag(tag, "send")
        tensor = tensors[0]
        header = np.array([self.rank(), tensor.numel() * tensor.element_size(), _dtype_code(tensor.dtype), tag],
                          np.int64)
        data = _flat_bytes(tensor)
        comm, data_comm = self._mpi.comm, self._data
        entry: tuple[list[Any], tuple] = ([], (header, data, tensor))

        def post() -> None:
            self._reap_sends()
            entry[0].extend([comm.Isend(header, dst, mpi_tag), data_comm.Isend([data, MPI.BYTE], dst, mpi_tag)])
            self._sends.append(entry)

        def complete() -> None:
            self._wait_all(entry[0], entry[1], f"a send to rank {dst} (tag {tag})", (_WAIT_SEND, dst, tag))
            self._reap_sends()

        description = f"send to rank {dst} (tag {tag})"
        return _PointToPointWork(self._submit(post, description), tensors, complete, self, description)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> DdlfastWork:
        tensors = _tensors(tensors)
        self._check(tensors, "recv")
        self._host_only(tensors, "recv")
        if src != MPI.ANY_SOURCE:
            self._check_peer(src, "recv from")
        mpi_tag = self._mpi_tag(tag, "recv")
        tensor = tensors[0]
        header = np.zeros(_HEADER, np.int64)
        comm = self._mpi.comm
        box: dict[str, Any] = {}
        where = f"a recv from {'any rank' if src == MPI.ANY_SOURCE else f'rank {src}'} (tag {tag})"
        peer = -1 if src == MPI.ANY_SOURCE else src

        box.update(header_array=header, tensor=tensor, tag=tag, mpi_tag=mpi_tag)

        def post() -> None:
            box["header"] = comm.Irecv(header, src, mpi_tag)
            self._recvs.append(box)

        def complete() -> None:
            box["completing"] = True
            self._wait_all([box["header"]], (header,), where, (_WAIT_RECEIVE, peer, tag))
            self._post_data_receives()  # this recv's too: its header has arrived
            sender, nbytes, code, sent_tag = (int(v) for v in header)
            expected = tensor.numel() * tensor.element_size()
            self._wait_all([box["data"]], (box["target"], tensor), where, (_WAIT_RECEIVE, sender, tag))
            if sent_tag != tag:
                raise DdlfastError(f"{where} on rank {self.rank()} got rank {sender}'s message with tag {sent_tag}: "
                                   f"tags above MPI_TAG_UB={self._tag_bound} share MPI tags (tag modulo "
                                   f"{self._tag_bound + 1}), and these two met; use tags that differ below that")
            if nbytes != expected or code != _dtype_code(tensor.dtype):
                raise DdlfastError(f"{where} on rank {self.rank()}: rank {sender} sent {nbytes} bytes of "
                                   f"{_dtype_name(code)}, this rank expected {expected} bytes of {tensor.dtype} "
                                   f"(shape {tuple(tensor.shape)})")
            box["sender"] = sender

        description = f"recv from rank {src} (tag {tag})"
        work = _PointToPointWork(self._submit(post, description), tensors, complete, self, description,
                                 source_rank=lambda: box["sender"])
        # Not at interpreter exit: the contexts close then, and nothing more is received.
        weakref.finalize(work, self._drop_recv, box, header, mpi_tag).atexit = False
        return work

    def _post_data_receives(self) -> None:
        """On the communication thread: post the data receive of every posted recv whose header has arrived, in
        posting order. Data messages from one sender with one tag arrive in the order of their headers, which MPI
        matched to recvs in posting order, so a recv waited for before an earlier one with the same sender and tag
        does not take the earlier one's data (an earlier recv whose header has not arrived cannot be waiting for
        an earlier message)."""
        still = []
        for box in self._recvs:
            if box["header"].Test():
                self._post_data(box)
            else:
                still.append(box)
        self._recvs = still

    def _post_data(self, box: dict[str, Any]) -> None:
        """The data receive for a recv whose header arrived: into the tensor when it fits, else into scratch
        (the data message is received even when it does not fit, so it cannot match a later recv)."""
        sender, nbytes, _, sent_tag = (int(v) for v in box["header_array"])
        tensor = box["tensor"]
        fits = nbytes == tensor.numel() * tensor.element_size() and sent_tag == box["tag"]
        box["target"] = _flat_bytes(tensor) if fits else np.empty(nbytes, np.uint8)
        box["data"] = self._data.Irecv([box["target"], MPI.BYTE], sender, box["mpi_tag"])

    def _drop_recv(self, box: dict[str, Any], header: np.ndarray, mpi_tag: int) -> None:
        """A recv's Work was dropped without wait(): its posted header receive must not take the header of a
        message meant for a later recv. Cancelled on the communication thread (in order, after its post); if a
        header had already arrived, its data message is received and discarded, so later data stays matched."""
        if box.get("completing") or self._context.broken_reason is not None:
            return

        def drop() -> None:
            request = box.get("header")
            if request is None or box.get("completing"):
                return
            if "data" not in box:
                if not request.Test():
                    request.Cancel()
                    status = MPI.Status()
                    request.Wait(status)
                    if status.Is_cancelled():
                        self._recvs = [b for b in self._recvs if b is not box]
                        return
                self._post_data_receives()
            self._mpi.complete(box["data"], (box["target"], box["tensor"]), "the data of a dropped recv's message")

        with contextlib.suppress(DdlfastError):  # a closed context: nothing more will be received
            self._submit(drop, "a dropped recv")

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> DdlfastWork:
        return self.recv(tensors, MPI.ANY_SOURCE, tag)

    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self.size() or peer == self.rank():
            raise DdlfastError(f"{what} rank {peer} on rank {self.rank()}: the peer must be another rank of this "
                               f"group of {self.size()}")

    def _wait_all(self, requests: list[Any], keep: tuple, what: str, waiting: tuple[int, int, int]) -> None:
        """Stall-limited completion; a failure leaves the context broken (the other ranks are told). `waiting`
        (kind, peer, tag) is what a stall census reports of this rank's wait."""
        try:
            for request in requests:
                self._mpi.complete(request, keep, what, waiting)
        except BaseException as error:
            self._context.raise_after_failure(error)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> DdlfastWork:
        outputs, inputs = list(output_tensors), list(input_tensors)
        try:
            self._check([*outputs, *inputs], "alltoall")
            self._host_only([*outputs, *inputs], "alltoall")
            if len(outputs) != self.size() or len(inputs) != self.size():
                raise DdlfastError(f"alltoall on rank {self.rank()} got {len(inputs)} inputs and {len(outputs)} "
                                   f"outputs: it takes {self.size()} of each")
        except Exception as error:  # noqa: BLE001 - any exception on one rank must reach every rank (_refuse)
            raise self._refuse(error) from error
        dtype = inputs[0].dtype
        send = torch.cat([t.reshape(-1) for t in inputs]) if inputs else torch.empty(0, dtype=dtype)
        send_counts = [t.numel() for t in inputs]
        recv_counts = [t.numel() for t in outputs]
        receive = torch.empty(sum(recv_counts), dtype=dtype)

        def finish() -> None:
            offset = 0
            for t, n in zip(outputs, recv_counts, strict=True):
                t.copy_(receive[offset:offset + n].view_as(t))
                offset += n

        return self._alltoallv(send, send_counts, receive, recv_counts, finish, outputs, "alltoall")

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> DdlfastWork:
        """dist.all_to_all_single: splits along dim 0 (equal blocks when the split sizes are empty)."""
        size = self.size()
        try:
            self._check([output, input], "all_to_all_single")
            self._host_only([output, input], "all_to_all_single")
            row_out = output[0].numel() if output.dim() and output.shape[0] else 0
            row_in = input[0].numel() if input.dim() and input.shape[0] else 0
            send_rows = list(input_split_sizes) or self._equal_splits(input, "input")
            recv_rows = list(output_split_sizes) or self._equal_splits(output, "output")
            if len(send_rows) != size or len(recv_rows) != size or sum(send_rows) != input.shape[0] \
                    or sum(recv_rows) != output.shape[0]:
                raise DdlfastError(f"all_to_all_single on rank {self.rank()}: split sizes {send_rows} / {recv_rows} "
                                   f"do not cut the input of {input.shape[0]} and output of {output.shape[0]} rows "
                                   f"into {size} blocks")
        except Exception as error:  # noqa: BLE001 - any exception on one rank must reach every rank (_refuse)
            raise self._refuse(error) from error
        return self._alltoallv(input.reshape(-1), [r * row_in for r in send_rows], output.reshape(-1),
                               [r * row_out for r in recv_rows], None, [output], "all_to_all_single")

    alltoall_base = all_to_all_single

    def _equal_splits(self, tensor: torch.Tensor, what: str) -> list[int]:
        rows = tensor.shape[0] if tensor.dim() else 0
        if rows % self.size():
            raise DdlfastError(f"all_to_all_single on rank {self.rank()}: the {what}'s {rows} rows do not split "
                               f"into {self.size()} equal blocks; pass split sizes")
        return [rows // self.size()] * self.size()

    def _alltoallv(self, send: torch.Tensor, send_counts: list[int], receive: torch.Tensor, recv_counts: list[int],
                   finish: Callable[[], None] | None, result: list[torch.Tensor], what: str) -> DdlfastWork:
        """ddlfast.alltoall of elements: the receivers name their block sizes, so a block whose sender and
        receiver disagree raises on every rank (MPI never truncates or waits forever)."""

        def run() -> None:
            self._context.alltoall(numpy_view(send), send_counts, receive_splits=recv_counts,
                                   out=numpy_view(receive))
            if finish is not None:
                finish()

        return DdlfastWork(self._context.submit_collective(run, what), result)

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any = None) -> DdlfastWork:
        root = int(getattr(opts, "rootRank", 0))
        source = input_tensors[0]
        outputs = output_tensors[0] if output_tensors else []
        try:
            self._context.check_root(root)
            self._check([source, *outputs], "gather")
            self._host_only([source, *outputs], "gather")
            if self.rank() == root and (len(outputs) != self.size()
                                        or any(o.shape != source.shape for o in outputs)):
                raise DdlfastError(f"gather on root rank {root} got {len(outputs)} outputs for {self.size()} "
                                   f"ranks' inputs of shape {tuple(source.shape)}")
        except Exception as error:  # noqa: BLE001 - any exception on one rank must reach every rank (_refuse)
            raise self._refuse(error) from error
        mpi, size = self._mpi, self.size()
        send = _flat_bytes(source.contiguous())
        receive = np.empty(send.nbytes * size if self.rank() == root else 0, np.uint8)

        def run() -> None:
            request = mpi.comm.Igather([send, MPI.BYTE], [receive, MPI.BYTE] if self.rank() == root else None,
                                       root=root)
            mpi.complete(request, (send, receive), "a gather")
            if self.rank() == root:
                for r, o in enumerate(outputs):
                    o.copy_(torch.from_numpy(receive[r * send.nbytes:(r + 1) * send.nbytes].copy())
                            .view(o.dtype).view_as(o))

        layout = ("gather", root, str(source.dtype), tuple(source.shape))
        return self._agreed_work(layout, run, "gather", outputs)

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> DdlfastWork:
        root = int(getattr(opts, "rootRank", 0))
        output = output_tensors[0]
        inputs = input_tensors[0] if input_tensors else []
        try:
            self._context.check_root(root)
            self._check([output, *inputs], "scatter")
            self._host_only([output, *inputs], "scatter")
            if self.rank() == root and (len(inputs) != self.size()
                                        or any(i.shape != output.shape for i in inputs)):
                raise DdlfastError(f"scatter on root rank {root} got {len(inputs)} inputs for {self.size()} "
                                   f"ranks' outputs of shape {tuple(output.shape)}")
        except Exception as error:  # noqa: BLE001 - any exception on one rank must reach every rank (_refuse)
            raise self._refuse(error) from error
        mpi = self._mpi
        send = (_flat_bytes(torch.cat([i.reshape(-1) for i in inputs])) if self.rank() == root
                else np.empty(0, np.uint8))
        receive = _flat_bytes(output)

        def run() -> None:
            request = mpi.comm.Iscatter([send, MPI.BYTE] if self.rank() == root else None, [receive, MPI.BYTE],
                                        root=root)
            mpi.complete(request, (send, receive, output), "a scatter")

        layout = ("scatter", root, str(output.dtype), tuple(output.shape))
        return self._agreed_work(layout, run, "scatter", [output])

    def shutdown(self) -> None:
        """Finish what was queued (destroy_process_group calls it); the contexts close at exit.

        Teardown is quiet and bounded: after a failure (a broken or closed context) there is nothing left to
        finish and nothing is raised (the failure was raised where it happened); otherwise queued work gets the
        stall limit plus 10 s (work queued behind a stall fails at its own limit), and a failure of that work
        was, or will be, raised by its own Work."""
        context = self._context
        if context.broken_reason is not None:
            return
        try:
            handle = self._submit(lambda: None, "shutdown")
            timeout_s = load_settings().timeout_s
            handle.wait(timeout_s + 10.0 if timeout_s > 0 else SHUTDOWN_TIMEOUT_S)
        except DdlfastError:
            pass


# What torch calls on a group; each issues its work under the group's timeout= (_with_stall_limit).
_OPERATIONS = ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "all_gather_single",
               "_allgather_base", "all_gather_single_coalesced", "allgather_into_tensor_coalesced",
               "reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter", "reduce_scatter_single_coalesced",
               "reduce_scatter_tensor_coalesced", "allgather_coalesced", "barrier", "send", "recv",
               "recv_anysource", "alltoall", "all_to_all_single", "alltoall_base", "gather", "scatter")


def _with_stall_limit(operation: Callable[..., DdlfastWork]) -> Callable[..., DdlfastWork]:
    """`operation` of a group created with timeout=: its work is issued (validated, queued, its settings loaded)
    under config.stall_limit(that timeout), which the context hands to the communication thread; the Work words
    a stall as torch's backends do."""

    @functools.wraps(operation)
    def limited(self: ProcessGroupDdlfast, *args: Any, **kwargs: Any) -> DdlfastWork:
        if self._timeout_s is None:
            return operation(self, *args, **kwargs)
        with stall_limit(self._timeout_s):
            work = operation(self, *args, **kwargs)
        work._stall_limit_s = self._timeout_s
        return work

    return limited


for _name in _OPERATIONS:
    setattr(ProcessGroupDdlfast, _name, _with_stall_limit(ProcessGroupDdlfast.__dict__[_name]))

def _arrived(request: Any, deadline: float) -> bool:
    """Whether `request` completes before `deadline` (time.monotonic())."""
    while not request.Test():
        if time.monotonic() >= deadline:
            return False
        time.sleep(_MONITOR_POLL_S)
    return True


def _cancel(receives: Any) -> None:
    """Cancel receives that have not completed, so no later message matches them."""
    for request in receives:
        if not request.Test():
            request.Cancel()
            request.Wait()


_DTYPE_CODES: dict[torch.dtype, int] = {}


def _dtype_code(dtype: torch.dtype) -> int:
    """A number for a torch dtype, the same in every process (its position in torch's dtype list)."""
    if not _DTYPE_CODES:
        names = sorted(n for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype))
        for name in names:
            _DTYPE_CODES.setdefault(getattr(torch, name), len(_DTYPE_CODES))
    return _DTYPE_CODES.get(dtype, -1)


def _dtype_text(dtype: torch.dtype) -> str:
    """A torch dtype as an agreement layout names it ("float32", as a NumPy array's; "bool", "bfloat16")."""
    return str(dtype).removeprefix("torch.")


def _dtype_name(code: int) -> str:
    _dtype_code(torch.float32)
    return next((str(d) for d, c in _DTYPE_CODES.items() if c == code), f"dtype #{code}")


__all__ = ["BACKEND", "DdlfastWork", "ProcessGroupDdlfast", "register"]
