"""`ddlfast.horovod`: Horovod's API (`import horovod.torch as hvd` becomes `import ddlfast.horovod.torch as hvd`)
written on ddlfast's public API; this module holds what does not depend on a framework (init, ranks, ops,
process sets, handles and the name negotiation) and the collectives for NumPy arrays. docs/horovod.md lists what
differs from Horovod.

Names. Horovod matches tensors across ranks by name, so ranks may submit named asynchronous calls in different
orders. Here a named asynchronous call on the global process set is held until a handle of one is waited for
(synchronize, poll, join, DistributedOptimizer.step); the ranks then negotiate: one small allreduce says which
ranks take part, how many names each holds and a digest of them; where every active rank holds the same names
(the steady state of a training loop) that is all, else a second allreduce carries every rank's names as 63-bit
hashes. The names every active rank holds then go to ddlfast in one order (sorted by hash). A rank inside join()
takes part in those allreduces with zeros, so the
others go on without it. A name already held or in flight on this rank raises ValueError at once; a name some
ranks never submit stays held, and waiting for it ends at the stall limit (DDLFAST_TIMEOUT_S) with a DdlfastError
naming it. Unnamed calls go to ddlfast at once, in call order, as Horovod's unnamed calls pair by order too.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

import ddlfast
from ddlfast.config import load_settings
from ddlfast.errors import DdlfastError, ranks_text

# Horovod's op constants (horovod.common.basics), the same values.
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Average: "average", Sum: "sum", Min: "min", Max: "max", Product: "product"}


class HorovodInternalError(DdlfastError, ValueError):
    """What the drop-in raises where ddlfast raised DdlfastError: a RuntimeError (as Horovod's
    HorovodInternalError and torch.FatalError-era scripts catch) that is also a ValueError (Horovod raises
    ValueError for some bad arguments), raised on every rank alike."""


class HostsUpdatedInterrupt(RuntimeError):  # noqa: N818 (Horovod's name)
    """Horovod's elastic interrupt; never raised here (elastic training is not supported)."""


def translated(call: Callable[[], Any]) -> Any:
    """`call()`, with ddlfast's errors raised as HorovodInternalError (the message kept)."""
    try:
        return call()
    except HorovodInternalError:
        raise
    except DdlfastError as error:
        raise HorovodInternalError(str(error)) from error


class ProcessSet:
    """A subset of the ranks (Horovod's ProcessSet): collectives with process_set= run on an MPI communicator of
    those ranks only. Made collectively by add_process_set() (or init(process_sets=...))."""

    def __init__(self, ranks_or_comm: Sequence[int] | MPI.Comm) -> None:
        self.process_set_id: int | None = None
        self.comm: MPI.Comm | None = None
        self.context: Any = None  # ddlfast's Context on comm, on the set's members, from add_process_set()
        if isinstance(ranks_or_comm, MPI.Comm):
            self.comm = ranks_or_comm
            self.ranks = sorted(ranks_or_comm.group.Translate_ranks(
                list(range(ranks_or_comm.Get_size())), MPI.COMM_WORLD.group))
        else:
            self.ranks = sorted(int(r) for r in ranks_or_comm)

    def included(self) -> bool:
        return MPI.COMM_WORLD.Get_rank() in self.ranks

    def rank(self) -> int:
        return self.ranks.index(MPI.COMM_WORLD.Get_rank()) if self.included() else -1

    def size(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet(range(MPI.COMM_WORLD.Get_size()))
global_process_set.process_set_id = 0
global_process_set.comm = MPI.COMM_WORLD


class _Runtime:
    """Process-wide state: initialization, process sets, and the asynchronous calls by handle."""

    def __init__(self) -> None:
        self.initialized = False
        self.lock = threading.RLock()
        self.process_sets: dict[int, ProcessSet] = {0: global_process_set}
        self.next_set_id = 1
        self.next_handle = 1
        self.entries: dict[int, _Entry] = {}
        self.held: dict[str, int] = {}  # name -> handle of named calls not yet given to ddlfast
        self.flying: dict[str, int] = {}  # name -> handle of named calls given to ddlfast, not yet waited for
        self.watch: MPI.Comm | None = None  # where waiting ranks tell each other where they wait (_watched_wait)
        self.refused: set[tuple[int, int]] = set()  # (set id, collective) this rank refused to end a cross wait
        self.outbox: list[tuple[MPI.Request, np.ndarray]] = []  # watch messages being sent, with their buffers


class _Entry:
    """One asynchronous call: `submit()` gives it to ddlfast (a ddlfast Handle), `finish(result)` makes what
    synchronize() returns."""

    def __init__(self, name: str | None, submit: Callable[[], Any], finish: Callable[[Any], Any],
                 set_id: int = 0) -> None:
        self.name = name
        self.submit = submit
        self.finish = finish
        self.set_id = set_id  # the process set it runs on (0: the global one)
        self.handle: Any = None
        self.output: Any = None
        self.done = False


_runtime = _Runtime()


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | None = None) -> None:
    """Horovod's init(): ddlfast needs none beyond MPI (mpi4py initialized it); comm= must be COMM_WORLD or
    omitted. process_sets= adds those sets, collectively."""
    if comm is not None and not (isinstance(comm, MPI.Comm) and comm == MPI.COMM_WORLD) and comm != []:
        raise HorovodInternalError("ddlfast.horovod.init(comm=...) supports MPI.COMM_WORLD only; use process "
                                   "sets for subsets of ranks")
    global_process_set.context = translated(ddlfast.default_context)  # collective: every rank's hvd.init() meets here
    _local_comm()  # collective too: local_rank() and cross_rank() must not be (a joined rank calls local_rank())
    _runtime.initialized = True
    _cross_comm()
    if _runtime.watch is None:
        _runtime.watch = MPI.COMM_WORLD.Dup()  # collective, as init() is
    for process_set in process_sets or ():
        if process_set.process_set_id is None:
            add_process_set(process_set)


def shutdown() -> None:
    """Horovod's shutdown(): waits for held and in-flight calls; the MPI job goes on (ddlfast's contexts close at
    exit)."""
    _runtime.initialized = False


def is_initialized() -> bool:
    return _runtime.initialized


def _check_initialized() -> None:
    if not _runtime.initialized:
        raise ValueError("Horovod has not been initialized; use hvd.init().")


def rank() -> int:
    _check_initialized()
    return MPI.COMM_WORLD.Get_rank()


def size() -> int:
    _check_initialized()
    return MPI.COMM_WORLD.Get_size()


def _local_comm() -> MPI.Comm:
    if not hasattr(_local_comm, "comm"):
        _local_comm.comm = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)  # type: ignore[attr-defined]
    return _local_comm.comm  # type: ignore[attr-defined]


def local_rank() -> int:
    _check_initialized()
    return _local_comm().Get_rank()


def local_size() -> int:
    _check_initialized()
    return _local_comm().Get_size()


def cross_rank() -> int:
    """This rank's host's index among the hosts (the ranks of the same local rank, in rank order)."""
    _check_initialized()
    return _cross_comm().Get_rank()


def cross_size() -> int:
    _check_initialized()
    return _cross_comm().Get_size()


def _cross_comm() -> MPI.Comm:
    if not hasattr(_cross_comm, "comm"):
        _cross_comm.comm = MPI.COMM_WORLD.Split(local_rank(), MPI.COMM_WORLD.Get_rank())  # type: ignore[attr-defined]
    return _cross_comm.comm  # type: ignore[attr-defined]


def is_homogeneous() -> bool:
    return len(set(MPI.COMM_WORLD.allgather(local_size()))) == 1


def mpi_threads_supported() -> bool:
    _check_initialized()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> int:
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return ddlfast.has_cuda()


def rocm_built() -> bool:
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Horovod's timeline: ddlfast writes its own (DDLFAST_TIMELINE); accepted and ignored here."""


def stop_timeline() -> None:
    """See start_timeline."""


# -- process sets ------------------------------------------------------------------------------------------------------


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Collective on every rank: a process set of those ranks (ValueError, on every rank, for a duplicate or a rank
    outside the job)."""
    _check_initialized()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    world = MPI.COMM_WORLD.Get_size()
    everyone = translated(lambda: ddlfast.allgather_object(process_set.ranks))  # stall-limited
    problem = None
    if any(ranks != everyone[0] for ranks in everyone):
        problem = f"ranks passed different process sets: {everyone}"
    elif not process_set.ranks or any(not 0 <= r < world for r in process_set.ranks) or \
            len(set(process_set.ranks)) != len(process_set.ranks):
        problem = f"process set {process_set.ranks} is not a set of ranks of 0..{world - 1}"
    elif any(existing.ranks == process_set.ranks for existing in _runtime.process_sets.values()):
        problem = f"a process set with ranks {process_set.ranks} exists already"
    if problem is not None:
        raise ValueError(problem)
    comm = MPI.COMM_WORLD.Create(MPI.COMM_WORLD.group.Incl(process_set.ranks))
    process_set.comm = comm if comm != MPI.COMM_NULL else None
    if process_set.comm is not None:  # created here, collectively, never by a rank's first call on the set alone
        process_set.context = translated(lambda: ddlfast.api._context_for(process_set.comm))
    process_set.process_set_id = _runtime.next_set_id
    _runtime.process_sets[_runtime.next_set_id] = process_set
    _runtime.next_set_id += 1
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Collective on every rank; the global process set cannot be removed."""
    _check_initialized()
    if process_set.process_set_id in (None, 0) or process_set.process_set_id not in _runtime.process_sets:
        return False
    translated(ddlfast.barrier)  # stall-limited
    del _runtime.process_sets[process_set.process_set_id]
    if process_set.comm is not None:
        process_set.comm.Free()
    process_set.comm, process_set.process_set_id, process_set.context = None, None, None
    return True


def comm_of(process_set: ProcessSet | None) -> MPI.Comm | None:
    """The communicator for process_set= (None: COMM_WORLD); raises on a rank outside the set."""
    _check_initialized()
    if process_set is None or process_set.process_set_id == 0:
        return None
    if process_set.process_set_id not in _runtime.process_sets:
        raise ValueError(f"{process_set!r} has not been added (add_process_set) or was removed")
    if process_set.comm is None:
        raise ValueError(f"rank {MPI.COMM_WORLD.Get_rank()} is not in {process_set!r}")
    return process_set.comm


# -- ops ------------------------------------------------------------------------------------------------------------


def resolve_op(op: int | None, average: bool | None, where: str = "allreduce") -> int:
    """Horovod's op= / average= pair: average= (deprecated) wins when given; the default op is Average."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average; please provide only one of them.")
    if average is not None:
        return Average if average else Sum
    if op is None:
        return Average
    if op == Adasum:
        raise HorovodInternalError(f"{where}: op=Adasum is not supported by ddlfast.horovod (docs/horovod.md)")
    if op not in _OP_NAMES:
        raise ValueError(f"{where}: unknown op {op!r}")
    return op


def op_name(op: int) -> str:
    return _OP_NAMES[op]


_OP_TITLES = {Average: "Average", Sum: "Sum", Min: "Min", Max: "Max", Product: "Product"}


def agreed_settings(kind: str, op: int, prescale_factor: float, postscale_factor: float) -> str:
    """The settings of a reduction that change its result but are applied here, not by ddlfast (Horovod's integer
    average, the scale factors): ddlfast's collective carries them as its name=, so they are part of what the
    ranks agree on, and a rank that passed others raises on every rank (as in Horovod) instead of ending with
    other numbers."""
    return (f"hvd.{kind}(op={_OP_TITLES[op]}, prescale_factor={float(prescale_factor)!r}, "
            f"postscale_factor={float(postscale_factor)!r})")


def fused_settings(settings: Sequence[str]) -> str:
    """One name for several calls fused into one ddlfast call: each call's settings, in order, runs counted."""
    runs: list[list] = []
    for text in settings:
        if runs and runs[-1][0] == text:
            runs[-1][1] += 1
        else:
            runs.append([text, 1])
    return "; ".join(text if count == 1 else f"{count} x {text}" for text, count in runs)


# -- asynchronous calls by handle ---------------------------------------------------------------------------------


def submit(name: str | None, start: Callable[[], Any], finish: Callable[[Any], Any],
           process_set: ProcessSet | None = None) -> int:
    """Register an asynchronous call; returns its handle (an int). Named calls on the global set are held for
    the negotiation (the module docstring); others go to ddlfast now."""
    _check_initialized()
    with _runtime.lock:
        if name is not None and (name in _runtime.held or name in _runtime.flying):
            raise ValueError(f"a call named {name!r} is already in flight on rank {MPI.COMM_WORLD.Get_rank()}: "
                             "Horovod names must be unique among outstanding calls")
        handle = _runtime.next_handle
        _runtime.next_handle += 1
        entry = _Entry(name, start, finish, process_set.process_set_id or 0 if process_set is not None else 0)
        _runtime.entries[handle] = entry
        if name is not None and (process_set is None or process_set.process_set_id == 0):
            _runtime.held[name] = handle
            return handle
        if name is not None:
            _runtime.flying[name] = handle
    try:
        entry.handle = translated(start)
    except BaseException:
        _forget(handle)
        raise
    return handle


def _forget(handle: int) -> None:
    with _runtime.lock:
        entry = _runtime.entries.pop(handle, None)
        if entry is not None and entry.name is not None:
            for table in (_runtime.held, _runtime.flying):
                if table.get(entry.name) == handle:
                    del table[entry.name]


@functools.lru_cache(maxsize=4096)  # every step hashes the same names and settings again
def name_hash(name: str) -> int:
    """63 bits of a name, never zero (zero stands for a joined rank's nothing)."""
    value = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 1
    return value or 1


def negotiate(giving_up: bool = False) -> None:
    """Collective over the job: submit the held names every active rank holds (the module docstring). A rank
    `giving_up` (it has waited past the stall limit for a name) makes every rank raise, each naming its own held
    names and the ranks that never submitted them; those calls then fail. A name whose call some rank made with
    other settings (its op, scale factors, or another kind of call) fails on every rank at once (_mismatched):
    the held calls decide how ddlfast's calls are fused, so they must be the same calls on every rank before any
    goes to ddlfast."""
    world, me = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    with _runtime.lock:
        mine = {name_hash(name): name for name in _runtime.held}
        kinds = {key: name_hash(_signature(_runtime.entries[_runtime.held[name]])) for key, name in mine.items()}
    order = sorted(mine)
    # Per rank: taking part (a joined rank's zeros say no), how many names it holds, a digest of them, one of their
    # calls' signatures, giving up.
    head = np.zeros(5 * world, np.int64)
    head[5 * me:5 * me + 5] = (1, len(mine), name_hash(",".join(map(str, order))),
                               name_hash(",".join(str(kinds[key]) for key in order)), int(giving_up))
    translated(lambda: ddlfast.allreduce(head, op="sum"))
    active, counts, digests, signatures, quitting = (head[i::5] for i in range(5))
    widest = int(counts.max(initial=0))
    if widest == 0:
        return
    if not quitting.any() and len({(int(d), int(s)) for d, s, a in zip(digests, signatures, active, strict=True)
                                   if a}) == 1:
        _submit_held(mine, set(mine))  # the steady state: every active rank holds the same names, the same calls
        return
    table = np.zeros(2 * world * widest, np.int64)  # per rank: its names' hashes, then their calls' signatures
    table[2 * me * widest:2 * me * widest + len(mine)] = order
    table[(2 * me + 1) * widest:(2 * me + 1) * widest + len(mine)] = [kinds[key] for key in order]
    translated(lambda: ddlfast.allreduce(table, op="sum"))
    held_by = {r: dict(zip(table[2 * r * widest:2 * r * widest + int(counts[r])].tolist(),
                           table[(2 * r + 1) * widest:(2 * r + 1) * widest + int(counts[r])].tolist(), strict=True))
               for r in range(world) if active[r]}
    common = set.intersection(*(set(keys) for keys in held_by.values())) if held_by else set()
    differing = {key for key in common if len({keys[key] for keys in held_by.values()}) > 1}
    _submit_held(mine, common - differing)
    if differing:
        _mismatched(mine, kinds, differing, held_by)
    if quitting.any():
        _give_up(mine, common, held_by, [r for r in range(world) if quitting[r]])


def _signature(entry: _Entry) -> str:
    """What must match across ranks for a held call to be fused alike on every rank: a fusable allreduce's ddlfast
    op and settings; any other call goes to ddlfast alone (ddlfast's agreement checks the rest)."""
    fusion = getattr(entry.submit, "fusion", None)
    return f"{fusion[0]} {fusion[4]}" if fusion else "alone"


def _mismatched(mine: dict[int, str], kinds: dict[int, int], differing: set[int],
                held_by: dict[int, dict[int, int]]) -> None:
    """The named calls some rank made with other settings fail on every rank, each naming the ranks that differ."""
    with _runtime.lock:
        for key in differing:
            name = mine[key]
            handle = _runtime.held.pop(name)
            entry = _runtime.entries[handle]
            groups: dict[int, list[int]] = {}
            for r, keys in held_by.items():
                groups.setdefault(keys[key], []).append(r)
            mark = f" (this rank: {_signature(entry)})"
            who = "; ".join(ranks_text(ranks) + (mark if kind == kinds[key] else "") for kind, ranks in groups.items())
            entry.handle = _Failed(HorovodInternalError(
                f"rank {MPI.COMM_WORLD.Get_rank()}: the ranks submitted the call named {name!r} with different "
                f"arguments (op, scale factors or the kind of collective): {who}"))


def _give_up(mine: dict[int, str], common: set[int], held_by: dict[int, dict[int, int]], quitting: list[int]) -> None:
    """Every rank raises at the same negotiation: the calls this rank holds that some rank never submitted fail."""
    unmatched = {key: [r for r, keys in held_by.items() if key not in keys] for key in mine if key not in common}
    what = "; ".join(f"{mine[key]!r} (not submitted by {ranks_text(m)})"
                     for key, m in sorted(unmatched.items(), key=lambda kv: mine[kv[0]]))
    error = HorovodInternalError(
        f"rank {MPI.COMM_WORLD.Get_rank()}: named calls were not submitted on every rank within the stall limit "
        f"(DDLFAST_TIMEOUT_S; {ranks_text(quitting)} stopped "
        f"waiting): {what or 'none held here'}")
    with _runtime.lock:
        for key in unmatched:
            handle = _runtime.held.pop(mine[key])
            _runtime.entries[handle].handle = _Failed(error)
    raise error


def _submit_held(mine: dict[int, str], common: set[int]) -> None:
    """Give ddlfast the held calls every active rank holds, in one order on every rank (by hash); allreduces of
    one op on one communicator go as one fused allreduce (a DistributedOptimizer's gradients: one call)."""
    entries = []
    for key in sorted(common):
        name = mine[key]
        with _runtime.lock:
            handle = _runtime.held.pop(name)
            _runtime.flying[name] = handle
            entries.append(_runtime.entries[handle])
    groups: dict[tuple, list[_Entry]] = {}
    for entry in entries:  # the same grouping on every rank: the same calls, in the same order
        fusion = getattr(entry.submit, "fusion", None)
        groups.setdefault(fusion[:2] if fusion else (id(entry),), []).append(entry)
    for group in groups.values():
        fusion = getattr(group[0].submit, "fusion", None)
        try:
            if fusion is None or len(group) == 1:
                group[0].handle = translated(group[0].submit)
                continue
            ddl_op, _, comm, _, _ = fusion
            works = [e.submit.fusion[3] for e in group]  # type: ignore[attr-defined]
            name = fused_settings([e.submit.fusion[4] for e in group])  # type: ignore[attr-defined]
            fused = translated(functools.partial(ddlfast.fused_allreduce_async, works, op=ddl_op, comm=comm,
                                                 name=name))
            for index, entry in enumerate(group):
                entry.handle = _Part(fused, index)
        except BaseException as error:  # noqa: BLE001 - waiting for these calls raises it
            for entry in group:
                entry.handle = _Failed(error)


class _Part:
    """One array's share of a fused ddlfast handle."""

    def __init__(self, handle: Any, index: int) -> None:
        self.handle, self.index = handle, index

    def wait(self) -> Any:
        return self.handle.wait()[self.index]

    def done(self) -> bool:
        return bool(self.handle.done())


class _Failed:
    """A call whose submission raised: waiting for it raises that error."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def wait(self) -> Any:
        raise self.error

    def done(self) -> bool:
        return True


def _entry(handle: int) -> _Entry:
    entry = _runtime.entries.get(handle)
    if entry is None:
        raise ValueError(f"handle {handle!r} was not created or has been cleared")
    return entry


def poll(handle: int) -> bool:
    """Whether synchronize(handle) would return without waiting. A held (named) call is negotiated first, which
    is collective: every rank polls or synchronizes at the same point."""
    entry = _entry(handle)
    if entry.handle is None:
        negotiate()
        return False
    return bool(entry.handle.done())


def synchronize(handle: int) -> Any:
    """Wait for the call and return its output (negotiating held named calls first, collectively)."""
    entry = _entry(handle)
    if entry.done:
        _forget(handle)
        return entry.output
    started = time.monotonic()
    while entry.handle is None:  # every round is collective; past the stall limit this rank gives up, with all
        limit = load_settings().timeout_s
        negotiate(giving_up=limit > 0 and time.monotonic() - started > limit)
    try:
        _watched_wait(entry)
        result = translated(entry.handle.wait)
        entry.output, entry.done = entry.finish(result), True
    finally:
        _forget(handle)
    return entry.output


# -- ranks waiting on different process sets ---------------------------------------------------------------------
# Each process set's calls run on a communicator of its own, so no agreement sees a rank that calls on set X while
# another calls on set Y: each waits for the other. A rank whose wait lasts WATCH_AFTER_S tells the members of its
# set, every WATCH_AFTER_S, where it waits: its set, and per process set it belongs to, how many collectives its
# context there has started and whether it has work in flight. Rank r, itself waiting on set X (inside collective
# #m there), that learns that rank q waits on set Y inside collective #n, which r has not started with nothing in
# flight on Y, while q has not started r's #m with nothing in flight on X, knows that neither can ever go on
# (each waits for the other, and each rank's one issuing thread is inside its wait), however old the report: q is
# still stuck while r has not started #n. Both collectives must then end in an error on every rank, with both
# contexts in step: q takes part in X's #m with a refusal, r in Y's #n. r tells q so (a notice, on the watch
# communicator) and refuses on Y only once its own wait has ended (q's refusal ends it), so q cannot miss the
# notice: q's wait on Y goes on until r refuses there. Both may find it at once; each refusal is made once.
WATCH_AFTER_S = 1.0
_REPORT_TAG, _NOTICE_TAG = 0x4856, 0x4857


def _waiter(waitable: Any) -> Callable[[float], bool]:
    """`finished(seconds)`: whether `waitable` (a ddlfast Handle, or one of this module's wrappers) is done within
    `seconds`; made once per wait (a ddlfast Handle gets one done-callback, however often it is asked)."""
    if waitable.done():
        return lambda seconds: True
    if isinstance(waitable, _Several):
        parts = [_waiter(handle) for handle in waitable.handles]

        def all_finished(seconds: float) -> bool:
            end = time.monotonic() + seconds
            return all(finished(max(0.0, end - time.monotonic())) for finished in parts)

        return all_finished
    inner = waitable.handle if isinstance(waitable, _Part) else waitable
    if not hasattr(inner, "add_done_callback"):
        def polled(seconds: float) -> bool:
            time.sleep(min(seconds, 0.01))
            return bool(waitable.done())

        return polled
    event = threading.Event()
    inner.add_done_callback(lambda _: event.set())
    return event.wait


def _progress() -> dict[int, tuple[int, bool]]:
    """Per process set this rank belongs to: (collectives its context started, work of it in flight)."""
    with _runtime.lock:
        busy = {e.set_id for e in _runtime.entries.values() if e.handle is not None and not e.handle.done()}
        sets = dict(_runtime.process_sets)
    return {set_id: (process_set.context.collectives_started, set_id in busy)
            for set_id, process_set in sets.items() if process_set.context is not None}


def _watched_wait(entry: _Entry) -> None:
    """Returns once entry's ddlfast call is done (it may have failed); see the section's comment."""
    finished = _waiter(entry.handle)
    if finished(WATCH_AFTER_S) or _runtime.watch is None:
        return
    process_set = _runtime.process_sets.get(entry.set_id)
    members = [r for r in (process_set.ranks if process_set else ()) if r != MPI.COMM_WORLD.Get_rank()]
    promised: list[tuple[int, int, str]] = []  # (set, collective, why) this rank refuses once its wait ended
    try:
        while True:
            report = [MPI.COMM_WORLD.Get_rank(), entry.set_id]
            for set_id, (started, busy) in _progress().items():
                report += [set_id, started, int(busy)]
            for member in members:
                _send(np.array(report, np.int64), member, _REPORT_TAG)
            for _ in range(round(WATCH_AFTER_S / 0.05)):
                _read_watch(entry.set_id, promised)
                if finished(0.05):
                    return
    finally:
        for set_id, collective, why in promised:
            _refuse_once(set_id, collective, why)


def _read_watch(waiting_on: int, promised: list[tuple[int, int, str]]) -> None:
    """Every report and notice that arrived (the section's comment)."""
    watch, status = _runtime.watch, MPI.Status()
    assert watch is not None  # _watched_wait reads only where init() made it
    me = MPI.COMM_WORLD.Get_rank()
    while watch.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
        message = np.empty(status.Get_count(MPI.INT64_T), np.int64)
        sender, tag = status.Get_source(), status.Get_tag()
        watch.Recv(message, source=sender, tag=tag)
        if tag == _NOTICE_TAG:  # the sender found us waiting for each other: this rank refuses where it waits
            _refuse_once(int(message[0]), int(message[1]), _crossed(sender, int(message[0]), me, int(message[2])))
            continue
        their_set = int(message[1])
        theirs = {int(message[i]): (int(message[i + 1]), bool(message[i + 2])) for i in range(2, len(message), 3)}
        mine = _progress()
        if their_set == waiting_on or their_set not in mine or waiting_on not in theirs:
            continue
        at, inside = theirs[their_set][0], mine[waiting_on][0]  # the collectives each is inside
        if mine[their_set][1] or mine[their_set][0] >= at or theirs[waiting_on][1] or theirs[waiting_on][0] >= inside:
            continue
        why = _crossed(me, waiting_on, sender, their_set)
        if (waiting_on, inside) not in _runtime.refused:
            _send(np.array([waiting_on, inside, their_set], np.int64), sender, _NOTICE_TAG)
        promised.append((their_set, at, why))


def _send(message: np.ndarray, rank: int, tag: int) -> None:
    """A watch message, never waited for (its receiver may never read it): kept alive until MPI sent it."""
    assert _runtime.watch is not None
    _runtime.outbox = [(request, data) for request, data in _runtime.outbox if not request.Test()]
    _runtime.outbox.append((_runtime.watch.Isend(message, dest=rank, tag=tag), message))


def _crossed(rank: int, its_set: int, other: int, other_set: int) -> str:
    return (f"rank {rank} waits in a collective on {_set_text(its_set)} while rank {other} waits in one on "
            f"{_set_text(other_set)}: the ranks called collectives on different process sets")


def _refuse_once(set_id: int, collective: int, why: str) -> None:
    """This rank's refusal of collective #`collective` on the set, once, where it has not started it."""
    process_set = _runtime.process_sets.get(set_id)
    if (set_id, collective) in _runtime.refused or process_set is None or process_set.context is None or \
            process_set.context.collectives_started >= collective:
        return
    _runtime.refused.add((set_id, collective))
    refuse(DdlfastError(why), process_set)


def _set_text(set_id: int) -> str:
    process_set = _runtime.process_sets.get(set_id)
    return "the global process set" if set_id == 0 or process_set is None else \
        f"process set {set_id} (ranks {process_set.ranks})"


def flush_held() -> None:
    """Negotiate once if this rank holds named calls (join, the optimizer's step)."""
    negotiate()


def join(device: int = -1) -> int:
    """Horovod's join(): this rank's held named calls are negotiated first, then ddlfast.join(): this rank takes
    part in the others' allreduces (and their negotiations) with zeros until every rank has joined. Returns the
    last rank to join."""
    _check_initialized()
    started = time.monotonic()
    while _runtime.held:  # this rank's held named calls first (the others negotiate them in synchronize)
        limit = load_settings().timeout_s
        negotiate(giving_up=limit > 0 and time.monotonic() - started > limit)
    return int(translated(ddlfast.join))


def barrier(process_set: ProcessSet | None = None) -> None:
    translated(lambda: ddlfast.barrier(comm=comm_of(process_set)))


def broadcast_object(obj: object, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet | None = None) -> object:
    return translated(lambda: ddlfast.broadcast_object(obj, root=root_in(process_set, root_rank),
                                                       comm=comm_of(process_set)))


def allgather_object(obj: object, name: str | None = None, process_set: ProcessSet | None = None) -> list:
    return translated(lambda: ddlfast.allgather_object(obj, comm=comm_of(process_set)))


def env_flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


# -- the collectives on NumPy arrays (ddlfast.horovod.torch converts tensors to these and back) ------------------------

# dtypes ddlfast reduces; others are reduced in a wider one and cast back (Horovod reduces int8/uint8/int16 too).
_REDUCIBLE = {np.dtype(t) for t in (np.float16, np.float32, np.float64, np.int32, np.int64)}


def _wide(dtype: np.dtype) -> np.dtype:
    if dtype in _REDUCIBLE or dtype.name == "bfloat16":
        return dtype
    if dtype.kind in "biu":
        return np.dtype(np.int64)
    return np.dtype(np.float64)


def _scaled(array: np.ndarray, factor: float) -> np.ndarray:
    """array * factor as Horovod scales: integers in float64, float16 in float32, cast back."""
    if factor == 1.0:
        return array
    if array.dtype.kind in "biu":
        return (array.astype(np.float64) * factor).astype(array.dtype)
    if array.dtype.itemsize < 4:
        return (array.astype(np.float32) * np.float32(factor)).astype(array.dtype)
    return (array * array.dtype.type(factor)).astype(array.dtype)


def _divided(array: np.ndarray, count: int) -> np.ndarray:
    """Horovod's integer average: toward zero (ddlfast's own rounds toward minus infinity)."""
    return (np.sign(array) * (np.abs(array) // count)).astype(array.dtype)


def root_in(process_set: ProcessSet | None, root_rank: int) -> int:
    """Horovod names a process set's root by its rank in the job; ddlfast by its rank in the set's communicator."""
    if process_set is None or process_set.process_set_id == 0 or root_rank not in process_set.ranks:
        return root_rank  # ddlfast refuses a root outside the set, on every rank of it
    return process_set.ranks.index(root_rank)


def _group_size(process_set: ProcessSet | None) -> int:
    comm = comm_of(process_set)
    return (comm or MPI.COMM_WORLD).Get_size()


def refuse(error: Exception, process_set: ProcessSet | None = None) -> HorovodInternalError:
    """Bad arguments seen here, before ddlfast: the refusal takes the call's place in ddlfast's order, so the other
    ranks' call raises too; returns the error to raise here."""
    message = error if isinstance(error, DdlfastError) else DdlfastError(
        f"rank {MPI.COMM_WORLD.Get_rank()}: {error}")
    comm = process_set.comm if process_set is not None and process_set.process_set_id else None
    context = ddlfast.api._context_for(comm)  # the context ddlfast's module functions use for comm
    return HorovodInternalError(str(context.refuse_async(message)))


def allreduce_parts(array: np.ndarray, op: int, prescale_factor: float, postscale_factor: float,
                    process_set: ProcessSet | None, out: np.ndarray | None) -> tuple[Callable[[], Any],
                                                                                    Callable[[Any], Any]]:
    """(start, finish) of one allreduce: start() gives ddlfast a working copy, finish() makes the output."""
    comm = comm_of(process_set)
    members = _group_size(process_set)
    dtype = array.dtype
    work = _scaled(np.array(array, dtype=_wide(dtype), copy=True), prescale_factor)
    integer_average = op == Average and dtype.kind in "biu"
    ddl_op = "sum" if integer_average else op_name(op)
    settings = agreed_settings("allreduce", op, prescale_factor, postscale_factor)

    def start() -> Any:
        return ddlfast.allreduce_async(work, op=ddl_op, comm=comm, name=settings)

    start.fusion = (ddl_op, id(comm), comm, work, settings)  # type: ignore[attr-defined]  # negotiated calls fuse

    def finish(result: np.ndarray) -> np.ndarray:
        if integer_average:
            result = _divided(result, members)
        result = _scaled(result.astype(dtype, copy=False), postscale_factor)
        if out is not None:
            out[...] = result
            return out
        return result

    return start, finish


def grouped_allreduce_parts(arrays: Sequence[np.ndarray], op: int, prescale_factor: float,
                            postscale_factor: float, process_set: ProcessSet | None,
                            outs: Sequence[np.ndarray | None]) -> tuple[Callable[[], Any], Callable[[Any], Any]]:
    """One fused ddlfast allreduce for a group (Horovod's grouped_allreduce)."""
    parts = [allreduce_parts(a, op, prescale_factor, postscale_factor, process_set, o)
             for a, o in zip(arrays, outs, strict=True)]
    comm = comm_of(process_set)
    members = _group_size(process_set)
    copies = [_scaled(np.array(a, dtype=_wide(a.dtype), copy=True), prescale_factor) for a in arrays]
    kinds = {("sum" if op == Average and a.dtype.kind in "biu" else op_name(op)) for a in arrays}
    if len(kinds) > 1:  # integer and float arrays under Average: two ddlfast ops, one call each
        def start_each() -> Any:
            return _Several([p[0]() for p in parts])

        return start_each, lambda results: [p[1](r) for p, r in zip(parts, results, strict=True)]
    ddl_op = kinds.pop()
    settings = agreed_settings("grouped_allreduce", op, prescale_factor, postscale_factor)

    def start() -> Any:
        return ddlfast.fused_allreduce_async(copies, op=ddl_op, comm=comm, name=settings)

    def finish(results: list) -> list:
        done = []
        for array, result, out in zip(arrays, results, outs, strict=True):
            if op == Average and array.dtype.kind in "biu":
                result = _divided(result, members)
            result = _scaled(result.astype(array.dtype, copy=False), postscale_factor)
            if out is not None:
                out[...] = result
                result = out
            done.append(result)
        return done

    return start, finish


class _Several:
    """Several ddlfast handles waited for as one."""

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def wait(self) -> list:
        return [h.wait() for h in self.handles]

    def done(self) -> bool:
        return all(h.done() for h in self.handles)


def allreduce_async(array: np.ndarray, average: bool | None = None, name: str | None = None, op: int | None = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    start, finish = allreduce_parts(np.asarray(array), resolve_op(op, average), prescale_factor, postscale_factor,
                                    process_set, None)
    return submit(name, start, finish, process_set)


def allreduce(array: np.ndarray, average: bool | None = None, name: str | None = None, op: int | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    return synchronize(allreduce_async(array, average, name, op, prescale_factor, postscale_factor, process_set))


def grouped_allreduce(arrays: Sequence[np.ndarray], average: bool | None = None, name: str | None = None,
                      op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list:
    start, finish = grouped_allreduce_parts([np.asarray(a) for a in arrays], resolve_op(op, average),
                                            prescale_factor, postscale_factor, process_set, [None] * len(arrays))
    return synchronize(submit(name, start, finish, process_set))


def allgather_async(array: np.ndarray, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    comm = comm_of(process_set)
    array = np.ascontiguousarray(array)
    return submit(name, lambda: ddlfast.allgatherv_async(array, comm=comm), lambda r: r, process_set)


def allgather(array: np.ndarray, name: str | None = None, process_set: ProcessSet = global_process_set) -> np.ndarray:
    return synchronize(allgather_async(array, name, process_set))


def broadcast_async(array: np.ndarray, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set, inplace: bool = False) -> int:
    comm = comm_of(process_set)
    target = array if inplace else np.array(array, copy=True)
    root = root_in(process_set, root_rank)
    return submit(name, lambda: ddlfast.broadcast_async(target, root=root, comm=comm), lambda r: r, process_set)


def broadcast(array: np.ndarray, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    return synchronize(broadcast_async(array, root_rank, name, process_set))


def alltoall_async(array: np.ndarray, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    comm = comm_of(process_set)
    array = np.ascontiguousarray(array)
    if splits is not None:
        splits = np.asarray(splits)
        if splits.dtype.kind not in "iu":
            splits = splits.tolist()  # ddlfast refuses them on every rank, naming the values
        else:
            splits = splits.reshape(-1).tolist()
    return submit(name, lambda: ddlfast.alltoall_async(array, splits, comm=comm),
                  lambda r: (r[0], np.asarray(r[1], np.int32)), process_set)


def alltoall(array: np.ndarray, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """(received, received splits as int32); without splits, as Horovod: the received rows alone."""
    received, received_splits = synchronize(alltoall_async(array, splits, name, process_set))
    return received if splits is None else (received, received_splits)


def reducescatter_counts(shape: tuple[int, ...], members: int) -> list[int]:
    """Horovod's split of the first dimension: the first (rows % members) ranks get one row more."""
    rows = shape[0]
    return [rows // members + (1 if r < rows % members else 0) for r in range(members)]


def reducescatter_parts(arrays: Sequence[np.ndarray], op: int, prescale_factor: float, postscale_factor: float,
                        process_set: ProcessSet | None) -> tuple[Callable[[], Any], Callable[[Any], Any]]:
    comm = comm_of(process_set)
    group = comm or MPI.COMM_WORLD
    members, me = group.Get_size(), group.Get_rank()
    if op not in (Average, Sum, Min, Max, Product):
        raise refuse(ValueError(f"reducescatter: op {op!r} is not supported"), process_set)
    copies, counts, shapes = [], [], []
    for array in arrays:
        if array.ndim == 0:
            raise refuse(DdlfastError(f"reducescatter on rank {MPI.COMM_WORLD.Get_rank()}: a 0-d tensor cannot be "
                                      "scattered along its first dimension"), process_set)
        rows = reducescatter_counts(array.shape, members)
        row = int(np.prod(array.shape[1:], dtype=np.int64))
        counts.append([n * row for n in rows])
        shapes.append((rows[me], *array.shape[1:]))
        copies.append(_scaled(np.array(array, dtype=_wide(array.dtype), copy=True), prescale_factor))
    integer = [a.dtype.kind in "biu" for a in arrays]
    ddl_op = "sum" if op == Average else op_name(op)  # Average: summed, then divided as Horovod divides
    settings = agreed_settings("reducescatter", op, prescale_factor, postscale_factor)

    def start() -> Any:
        return ddlfast.fused_reduce_scatter_async(copies, op=ddl_op, counts=counts, comm=comm, name=settings)

    def finish(results: list) -> list:
        done = []
        for array, result, shape, is_int in zip(arrays, results, shapes, integer, strict=True):
            result = np.asarray(result).reshape(shape)
            if op == Average:
                result = _divided(result, members) if is_int else result / result.dtype.type(members)
            done.append(_scaled(result.astype(array.dtype, copy=False), postscale_factor))
        return done

    return start, finish


def reducescatter(array: np.ndarray, op: int = Average, name: str | None = None,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> np.ndarray:
    start, finish = reducescatter_parts([np.asarray(array)], op, prescale_factor, postscale_factor, process_set)
    return synchronize(submit(name, start, lambda r: finish(r)[0], process_set))


def grouped_reducescatter(arrays: Sequence[np.ndarray], op: int = Average, name: str | None = None,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list:
    start, finish = reducescatter_parts([np.asarray(a) for a in arrays], op, prescale_factor, postscale_factor,
                                        process_set)
    return synchronize(submit(name, start, finish, process_set))
