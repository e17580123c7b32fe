"""The Context facade: one per communicator. It owns the communicators and the lifecycle (creation, close),
and keeps one order of collectives on every rank (the caller's thread, or the communication thread once
asynchronous calls are used). Everything a collective does once it runs lives in ddlfast/engine/, which gets
the context's EngineState explicitly; docs/architecture.md walks a call through.

Every collective passes the per-call agreement (ddlfast/engine/agreement.py) before it sends anything; a rank
whose input is bad takes part in that agreement with its error, so every rank raises at once. A failure after
the agreement passed (a stall, an MPI error, an exception in a codec) leaves the context broken: the core
cancels its receives, tells the other ranks, and every later call raises DdlfastBrokenError.

Who may call: one issuing thread per Context, in the process that created it (Context's docstring says why and
how); every entry point checks that first, with one compare.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

import numpy as np
from mpi4py import MPI

from ddlfast import _core, config, launch, process, ulfm
from ddlfast.config import (
    CREATION_AGREEMENT_BYTES,
    STALL_LIMITS,
    current_stall_limit,
    format_size,
    load_settings,
    with_reproducible,
)
from ddlfast.engine import exchange, join, requests, shards, small
from ddlfast.engine.agreement import Agreement, Name, check_name, creation_layout
from ddlfast.engine.control import Control
from ddlfast.engine.fast_path import BroadcastPlan, FastPath, Plan, ShardPlan
from ddlfast.engine.state import EngineState
from ddlfast.engine.worker import CommThread, Handle
from ddlfast.errors import DdlfastBrokenError, DdlfastError, RanksLostError
from ddlfast.ops import canonical_op
from ddlfast.profiling import PROFILER, recording_range, traced
from ddlfast.topology.placement import Topology

# How long close() lets queued work finish when there is no stall limit (DDLFAST_TIMEOUT_S=0).
CLOSE_TIMEOUT_S = 60.0
_THREAD_LEVELS = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled", MPI.THREAD_SERIALIZED: "serialized"}
Work = Callable[[], Any]
_FORKED = -1  # no thread's ident: every call in a fork() child takes the refusing side of the check
_get_ident = threading.get_ident  # one lookup less on the latency path
_modules_get = sys.modules.get
_delegate = threading.local()  # .context: the Context this thread issues for, inside Context.delegated()
_CREATED, _NO_DEAD_RANK = 1, 2  # the flag bits of a creation's agreement under MPI's fault tolerance


class Context:
    """Communication state for one MPI intracommunicator (default COMM_WORLD).

    One issuing thread. The ranks pair their collectives on a context by order alone, so two threads issuing
    on one context would pair different threads' calls across ranks (wrong sums, no error). So a Context has
    one issuing thread: the first thread that issues a collective on it (blocking or `*_async`, also through
    `submit`); a call from any other thread raises DdlfastError at once, naming both threads. Use one Context
    per thread instead: `ddlfast.Context(comm.Dup())`. Work running on the context's own communication thread
    (asynchronous calls, `submit`) may issue, and `hand_over()` moves the role explicitly, e.g. to a training
    thread; `delegated()` lets a thread issue while the issuing thread is blocked waiting for it (autograd's
    device threads run gradient hooks while the thread that called backward() waits). `close()` may be called
    from any thread; a submit that loses the race with it raises DdlfastError.

    One process. A fork() child must not use its parent's contexts (their MPI state is the parent's): every
    collective there raises DdlfastError, and close() and the exit hooks do nothing in the child.
    """

    def __init__(self, comm: MPI.Intracomm | None = None) -> None:
        comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(comm, MPI.Comm):
            raise DdlfastError(f"comm must be an mpi4py communicator, not {type(comm).__name__}")
        # Every DDLFAST_* variable, also those read only later (ddlfast/config.py); a bad one fails the creation
        # agreement below, so every rank raises, naming it and this rank.
        settings, bad_setting = config.settings_or_problem()
        launch.check_world()  # MPI alone where the launcher started several: how to launch, not a job of 1 rank
        # The communicator the context runs on, held weakly: ddlfast.api's table closes a context once its
        # communicator is gone. After ranks were lost, the survivors' communicator (ddlfast's own), held here.
        self._comm_ref = weakref.ref(comm)
        self._survivors: MPI.Intracomm | None = None
        self._ulfm = ulfm.enabled()  # MPI's fault tolerance is on: survivors of a dead rank go on (_recovered)
        self._generation = 0  # how many times ranks were lost; work prepared before the last loss is refused
        self._last_loss: RanksLostError | None = None
        self._pending_loss: RanksLostError | None = None  # ranks lost while the context was created
        self._creation_saw_failure = False  # a rank died during the last creation (_agreed_creation)
        try:
            self._state = self._created_on(comm, settings, bad_setting)
        except Exception as error:  # any: a collective may even return without a dead rank's part (_agreed_creation)
            if not (self._ulfm and self._creation_saw_failure):
                raise
            self._pending_loss = self._lost(comm, *self._on_survivors(comm, settings), error)
        self._fast = FastPath(self._state)
        self._thread_level = MPI.Query_thread()
        self._worker: CommThread | None = None
        self._lock = threading.Lock()
        self._closed = False
        # The thread allowed to issue collectives: bound by the first one (None until then), _FORKED in a child.
        self._issuer: int | None = None
        self._issuer_name = ""
        self._issuer_lock = threading.Lock()  # not _lock: that one is held for a whole inline collective
        self._pid = process.track(self._forked)
        if _core.deferred_interrupts:
            raise _core.deferred_interrupts.pop()

    def _created_on(self, comm: MPI.Intracomm, settings: Any, bad_setting: DdlfastError | None = None) -> EngineState:
        """The engine on `comm` (collective over it). Under MPI's fault tolerance the ranks end it with a
        fault-tolerant agreement on how it went (_agreed_creation), which sets _creation_saw_failure when a rank
        died meanwhile: then every rank raises and shrinks (__init__, _on_survivors)."""
        core = control = None
        try:
            # A private duplicate: the one transport. Its agreement messages can carry the latency path's data (the
            # same capacity on every rank, whatever DDLFAST_SMALL_BYTES says now or later; grown alike where the
            # topology takes the latency path farther: EngineState.topology_for).
            core = _core.Core(comm, settings.timeout_s, CREATION_AGREEMENT_BYTES)
            duplicate, created = comm.Idup()  # agreement descriptions and Python-side collectives
            core.wait_requests([created], "the other ranks to create their ddlfast context")
            control = duplicate  # complete: only now may it be revoked (Open MPI crashes on a communicator under way)
            if bad_setting is not None:  # takes part in the creation agreement with its error: every rank raises it
                raise Agreement(core, Control(control, core)).refuse(bad_setting)
            state = EngineState(core, Control(control, core), settings.timeout_s)
            # Settings that size messages or drive the topology must match on every rank; then placement detection
            # (collective) runs where every rank has just proven it is present.
            state.agreement.check(creation_layout(settings))
            state.core.number_from_here()  # the user's first collective is #1 (the creation agreement was not theirs)
            topology = state.topology_for(settings.bucket_bytes)
        except BaseException:
            if self._ulfm:
                self._agreed_creation(comm, core, control, created_here=False)
            raise
        if self._ulfm:
            self._agreed_creation(comm, core, control, created_here=True)
        if state.rank == 0 and config.debug():  # DDLFAST_DEBUG: the plan, once
            sys.stderr.write(f"ddlfast (DDLFAST_DEBUG=1): {state.size} ranks: {topology.describe()}; buckets: "
                             f"DDLFAST_BUCKET_BYTES={format_size(settings.bucket_bytes)}, first "
                             f"{format_size(settings.first_bucket_bytes)}, chunks {format_size(settings.chunk_bytes)}, "
                             f"small-message limit {format_size(settings.small_bytes)}, algorithm "
                             f"{settings.algorithm}, timeout {settings.timeout_s:g} s\n")
        return state

    def _agreed_creation(self, comm: MPI.Intracomm, core: Any, control: MPI.Intracomm | None,
                         created_here: bool) -> None:
        """Under MPI's fault tolerance, the end of every creation on `comm`, on every rank, whether it created
        its engine or failed: one agreement that completes despite dead ranks (MPIX_Comm_agree). A rank that
        died during the creation makes it fail, or is known to a rank that tells of it; then every rank, also one
        whose creation went through or failed otherwise (a survivor may get its own steps' error, or another
        rank's revoke, before MPI tells it of the dead rank, or even a collective's result without the dead
        rank's part), sets _creation_saw_failure and raises, and all of them shrink. Where no rank died, but
        another failed (its error says why), this one raises too. Returns where every rank created its engine."""
        flag = _CREATED * created_here | _NO_DEAD_RANK * (not ulfm.failure_known(comm))
        if not created_here or flag != _CREATED | _NO_DEAD_RANK:
            self._revoke(core, control)  # nothing of this creation goes on: no rank may wait for this one in it
        try:
            everyone = ulfm.agree(comm, flag)
        except MPI.Exception:  # MPI_ERR_PROC_FAILED: a rank of `comm` is dead
            everyone = 0
        self._creation_saw_failure = not everyone & _NO_DEAD_RANK
        if everyone == _CREATED | _NO_DEAD_RANK or not created_here:
            return  # created everywhere, or this rank raises its own error
        self._revoke(core, control)
        rank = comm.Get_rank()
        if self._creation_saw_failure:
            raise DdlfastError(f"rank {rank}: a rank died while the ddlfast context was created")
        raise DdlfastError(f"rank {rank}: another rank failed to create its ddlfast context (its error says why)")

    @staticmethod
    def _revoke(core: Any, control: MPI.Intracomm | None) -> None:
        """Revoke a creation's private communicators (those that exist): every rank's waits on them fail."""
        if core is not None:
            core.revoke()
        if control is not None:
            ulfm.revoke(control)

    @property
    def lost_ranks(self) -> bool:
        """Whether this context lost ranks (and goes on with the survivors)."""
        return self._generation > 0

    @property
    def generation(self) -> int:
        """How many times this context lost ranks (0 while its world is whole)."""
        return self._generation

    @property
    def last_loss(self) -> RanksLostError | None:
        """The RanksLostError of the newest loss, None before any."""
        return self._last_loss

    @property
    def comm(self) -> MPI.Intracomm:
        """The communicator this context runs on: the one it was created with, or the survivors' after a
        RanksLostError."""
        return self._survivors if self._survivors is not None else self._comm_ref()

    @property
    def rank(self) -> int:
        return self._state.rank

    @property
    def size(self) -> int:
        return self._state.size

    @property
    def collectives_started(self) -> int:
        """How many collectives this rank has started on this context (every rank counts alike): an integration's
        view of where the ranks are (the Horovod drop-in's watch over ranks waiting on different process sets)."""
        return int(self._state.core.sequence)

    @property
    def broken_reason(self) -> str | None:
        """Why this context refuses work after a failure; None while it is healthy."""
        core = self._state.core
        return core.broken_reason if core.broken else None

    def close(self) -> None:
        """Finish submitted work, then free the private communicators.

        Handles that completed before close() keep their results; nothing can be submitted afterwards. Ends
        in bounded time even with a peer gone: queued work is itself stall-limited, and past that the core is
        told to stop waiting, so no thread is inside MPI when the communicators are freed.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._issuer == _FORKED:
            return  # a fork() child: the MPI state, the thread and the communicators are the parent's
        drained = True
        if self._worker is not None:
            timeout_s = load_settings().timeout_s
            drained = self._worker.close(timeout_s + 10.0 if timeout_s > 0 else CLOSE_TIMEOUT_S)
            if not drained:
                self._state.core.request_stop()
                drained = self._worker.close(10.0)
        self._state.flush_timeline()
        if drained and not MPI.Is_finalized():
            self._state.close()
        self._state.fused.clear()

    # -- who may issue: one thread, one process --------------------------------------------------------------------

    def _check_caller(self) -> None:
        """Every entry point's first step (the latency path spells out the compare)."""
        if _get_ident() != self._issuer:
            self._other_caller()

    def _other_caller(self) -> None:
        """The slow side of the check: bind the first issuing thread, let the communication thread and a
        delegate through, refuse any other thread and every call in a fork() child."""
        if self._issuer == _FORKED or process.in_child(self._pid):
            raise DdlfastError(
                f"rank {self.rank}: this ddlfast context was created in process {self._pid}, and process "
                f"{os.getpid()} is a fork() child of it: the context's MPI state belongs to the parent, so no "
                "collective may run here. Communicate from the parent, or start workers with the 'spawn' or "
                "'forkserver' start method and give each its own MPI job")
        worker = self._worker
        if worker is not None and worker.on_thread():
            return
        if getattr(_delegate, "context", None) is self:
            return
        me = threading.current_thread()
        with self._issuer_lock:
            if self._issuer is None:
                self._issuer, self._issuer_name = me.ident, me.name
                return
        raise DdlfastError(
            f"rank {self.rank}: thread {me.name!r} called a collective on a ddlfast context whose issuing thread "
            f"is {self._issuer_name!r}: the ranks pair collectives by order, and two threads' calls would pair "
            "differently on different ranks. Use one Context per thread (e.g. ddlfast.Context(comm.Dup()) in "
            "each), or move the context with hand_over() once the other thread stopped issuing")

    def hand_over(self) -> None:
        """Make the calling thread this context's issuing thread (e.g. a context created on the main thread,
        used by a training thread). Call it only once the previous issuing thread issues no more: ddlfast cannot
        see that, and two threads issuing at once would pair different calls across ranks."""
        if self._issuer == _FORKED or process.in_child(self._pid):
            self._other_caller()  # raises
        me = threading.current_thread()
        with self._issuer_lock:
            self._issuer, self._issuer_name = me.ident, me.name

    @contextmanager
    def delegated(self) -> Iterator[None]:
        """Inside the block the calling thread may issue on this context for its issuing thread, which must be
        blocked waiting for it meanwhile (autograd runs gradient hooks on device threads while the thread that
        called backward() waits; ddlfast.torch's hooks issue through this)."""
        previous = getattr(_delegate, "context", None)
        _delegate.context = self
        try:
            yield
        finally:
            _delegate.context = previous

    def _forked(self) -> None:
        """In a fork() child (ddlfast/process.py): refuse every call, make close() do nothing."""
        self._issuer = _FORKED
        self._worker = None  # the communication thread did not survive the fork

    # -- ordering: one order of collectives on every rank ----------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise DdlfastError("this ddlfast context is closed")
        if self._state.core.broken and not (self._ulfm and self._state.core.failure_known):  # else: _recovered
            raise DdlfastBrokenError(f"rank {self.rank}: this ddlfast context is unusable after an earlier failure "
                                     f"({self._state.core.broken_reason}); abort the job, or create a new Context")

    def _ensure_worker(self) -> CommThread:
        with self._lock:
            self._check_open()
            if self._worker is None:
                if self._thread_level < MPI.THREAD_MULTIPLE:
                    raise DdlfastError(
                        f"rank {self.rank}: asynchronous ddlfast calls run on a communication thread and need MPI "
                        f"initialized with MPI_THREAD_MULTIPLE, but MPI provides "
                        f"{_THREAD_LEVELS.get(self._thread_level, self._thread_level)}; unset "
                        "MPI4PY_RC_THREAD_LEVEL (or set it to 'multiple', or mpi4py.rc.thread_level = 'multiple' "
                        "before importing mpi4py.MPI), or use the blocking calls")
                self._worker = CommThread(f"ddlfast-comm-rank{self.rank}")
            return self._worker

    def _in_order(self, work: Work, description: str) -> Any:
        """Run a blocking collective on the caller's thread, unless asynchronous ones are queued or running on
        the communication thread: then queue behind them, so every rank keeps one order of collectives."""
        if self._ulfm:
            work = self._elastic(work)
        if self._worker is not None and not self._worker.on_thread():
            ran, result = self._worker.run_if_idle(lambda: self._locked(work))
            if ran:
                return result
            return self._wait(self._worker.submit(work, description))
        return self._locked(work)

    def _locked(self, work: Work) -> Any:
        with self._lock:
            self._check_open()
            try:
                return work()
            finally:
                if _core.deferred_interrupts:  # Ctrl-C that came as a call into the core completed: raised now,
                    raise _core.deferred_interrupts.pop()  # with the collective done (the context stays usable)

    def _wait(self, handle: Handle) -> Any:
        timeline = self._state.timeline
        if timeline is None:
            return handle.wait()
        start = time.perf_counter()
        try:
            return handle.wait()
        finally:
            timeline.add("wait", start, time.perf_counter(), thread="caller")

    def _now(self, prepare: Callable[[], Work], description: str, name: object = None) -> Any:
        """Validate on the caller's thread (bad input joins the agreement as an error), then run in order."""
        self._check_caller()
        self._check_open()
        try:
            work = self._prepared(prepare, description, name)
        except DdlfastError as error:
            raise self._refused(error) from error.__cause__
        except BaseException as error:  # KeyboardInterrupt and the like: the others still meet a refusal
            self._refused(self._interruption(error, description))
            raise
        return self._in_order(work, description)

    def _queued(self, prepare: Callable[[], Work], description: Callable[[], str], name: object = None) -> Handle:
        """Validate on the caller's thread, then queue on the communication thread."""
        self._check_caller()
        worker = self._ensure_worker()
        try:
            work = self._prepared(prepare, "an asynchronous collective", name)
        except DdlfastError as error:
            self.refuse_async(error)
            raise
        except BaseException as error:  # KeyboardInterrupt and the like: the refusal is queued, then it propagates
            self.refuse_async(self._interruption(error, "an asynchronous collective"))
            raise
        text = description()
        if STALL_LIMITS:
            work = self._stall_limited(work)
        flight = self._state.flight
        if flight is not None:  # the flight record names the line that submitted it, not the thread's
            work = flight.sited(work, flight.site(), text)
        return worker.submit(self._elastic(work) if self._ulfm else work, text)

    # -- going on without dead ranks (MPI's fault tolerance, ddlfast/ulfm.py; docs/elastic.md) ------------------

    def _elastic(self, work: Work) -> Work:
        """`work` that, when ranks die under it, rebuilds the context on the survivors and raises RanksLostError;
        work prepared before an earlier loss raises that loss's RanksLostError without running."""
        generation = self._generation

        def guarded() -> Any:
            if generation != self._generation:
                raise self._stale()
            if self._pending_loss is not None:  # ranks were lost while the context was created: raised once
                loss, self._pending_loss = self._pending_loss, None
                raise loss
            try:
                return work()
            except DdlfastError as error:
                if generation != self._generation:
                    raise self._stale() from error
                if not self._state.core.failure_known:
                    raise
                raise self._recovered(error) from error

        return guarded

    def _stale(self) -> RanksLostError:
        loss = self._last_loss
        assert loss is not None  # a generation changed only with a loss
        return RanksLostError(f"{loss}; this collective was issued before the loss and did not run",
                              loss.lost, loss.size, loss.rank, loss.old_size)

    def _recovered(self, failure: DdlfastError) -> RanksLostError:
        """A rank died (MPI reports it): revoke, shrink to the survivors, rebuild the engine there (ring dims
        planned anew for the new size, the probe cache reused), and return the RanksLostError to raise."""
        before, old_state = self.comm, self._state
        old_state.core.revoke()  # fails every survivor's waits at once (a no-op when done already)
        ulfm.revoke(old_state.control.comm)
        old_state.fused.clear()
        return self._lost(before, *self._on_survivors(before, load_settings()), failure)

    def _on_survivors(self, comm: MPI.Intracomm, settings: Any) -> tuple[MPI.Intracomm, EngineState]:
        """Shrink `comm` to the survivors and create the engine there; a rank that dies meanwhile is shrunk away
        too."""
        for attempt in range(comm.Get_size()):
            survivors = ulfm.shrink(comm)
            try:
                return survivors, self._created_on(survivors, settings)
            except Exception:
                if attempt == comm.Get_size() - 1 or not self._creation_saw_failure:
                    raise
                comm = survivors
        raise AssertionError("unreachable")

    def grow(self, merged: MPI.Intracomm) -> None:
        """Go on with `merged`: this context's ranks first, in order, then replacement processes
        (ulfm.spawn_replacements; collective over `merged`, the replacements creating their context on it). Work
        prepared before is refused as after a loss."""
        with self._lock:
            self._check_open()
            state = self._created_on(merged, load_settings())
            self._state.fused.clear()
            self._go_on_with(merged, state)

    def _go_on_with(self, comm: MPI.Intracomm, state: EngineState) -> None:
        """The world changed (ranks lost, or replacements merged): collectives run on `comm` through `state`."""
        self._survivors, self._state = comm, state
        self._fast = FastPath(state)
        self._generation += 1

    def _lost(self, before: MPI.Intracomm, survivors: MPI.Intracomm, state: EngineState,
              failure: BaseException) -> RanksLostError:
        """Go on with `state` on `survivors`; the RanksLostError that says so."""
        self._go_on_with(survivors, state)
        lost = ulfm.lost_ranks(before, survivors)
        self._last_loss = RanksLostError(
            f"rank {before.Get_rank()} (now rank {state.rank}): rank{'s' if len(lost) != 1 else ''} "
            f"{', '.join(map(str, lost))} of {before.Get_size()} died; the survivors go on as {state.size} ranks "
            f"(the interrupted collective did not complete here; first error: {failure})",
            lost, state.size, state.rank, before.Get_size())
        return self._last_loss

    def _prepared(self, prepare: Callable[[], Work], description: str, name: object) -> Work:
        """`prepare()`, with any exception it raises made a refusal: whatever goes wrong on one rank before the
        data moves, the other ranks must hear of it at this call, or every later call would pair call k here
        with call k+1 there. An Exception becomes a DdlfastError (it joins the agreement). KeyboardInterrupt and
        the like propagate from here; _now and _queued still put a refusal in the call's place, in order (on
        the thread that runs collectives, never beside it), and then re-raise them."""
        try:
            check_name(name, self._state.rank)
            work = prepare()
        except Exception as error:
            refusal = self._before_data(error, description)
            if refusal is error:
                raise
            raise refusal from error
        return work if name is None else self._named(work, name)

    def _before_data(self, error: Exception, description: str) -> DdlfastError:
        """What a rank refuses with when `error` came before any data moved: a DdlfastError as it is, any other
        exception named in one."""
        if isinstance(error, DdlfastError):
            return error
        return DdlfastError(f"rank {self._state.rank}: {description} failed before any data moved "
                            f"({type(error).__name__}: {error})")

    def _interruption(self, error: BaseException, description: str) -> DdlfastError:
        return DdlfastError(f"rank {self._state.rank}: {type(error).__name__} while {description} was prepared, "
                            "before any data moved")

    def _named(self, work: Work, name: str | int) -> Work:
        """`work` with its name in the agreement's fingerprint (name= of the public collectives)."""
        agreement = self._state.agreement

        def named() -> Any:
            agreement.name = name
            try:
                return work()
            finally:
                agreement.name = None

        return named

    def _settings(self) -> config.Settings:
        """load_settings() for a collective about to run: a DDLFAST_* value made bad on this rank since creation
        joins the agreement as a refusal, so every rank raises at this call, not this rank alone."""
        try:
            return load_settings()
        except DdlfastError as error:
            raise self._refused(error) from None

    def _refused(self, error: DdlfastError) -> DdlfastError:
        """Bad input on this rank: join the agreement with the error (so the others raise too), return what
        to raise here."""
        if isinstance(error, DdlfastBrokenError) or self._closed:
            return error
        return self._in_order(lambda: self._state.agreement.refuse(error), "a refused collective")

    # -- for integrations that run collectives of their own in this context's order (ddlfast/integrations/) ----

    def submit(self, work: Work, description: str) -> Handle:
        """Run `work` on the communication thread, in this context's one order of collectives (under the
        caller's config.stall_limit(), where one is in force)."""
        self._check_caller()
        if STALL_LIMITS:
            work = self._stall_limited(work)
        return self._ensure_worker().submit(self._elastic(work) if self._ulfm else work, description)

    def _stall_limited(self, work: Work) -> Work:
        """`work` under the caller's config.stall_limit() (a torch group's timeout=), which the communication
        thread takes over: for the settings it loads and for the core's waits (agreement, MPI-side operations);
        the core's limit is DDLFAST_TIMEOUT_S again afterwards."""
        limit = current_stall_limit()
        if limit is None:
            return work
        state = self._state

        def limited() -> Any:
            try:
                with config.stall_limit(limit):
                    state.set_core_timeout(limit)
                    return work()
            finally:
                if not state.core.broken:
                    state.set_core_timeout(load_settings().timeout_s)

        return limited

    def submit_collective(self, work: Work, description: str) -> Handle:
        """`submit` for work that is one collective of this context (it calls a Context collective, or agrees
        through `submit_agreed`'s path): an exception the work raises before its agreement ran (an integration's
        own conversion of its arguments, say) joins the agreement as a refusal, so the other ranks raise at this
        collective instead of pairing their next call with it."""
        state = self._state

        def guarded() -> Any:
            before = state.core.sequence
            try:
                return work()
            except Exception as error:
                if state.core.sequence != before or state.core.broken or isinstance(error, DdlfastBrokenError):
                    raise  # the collective's own agreement ran: every rank already knows
                raise state.agreement.refuse(self._before_data(error, description)) from error

        return self.submit(guarded, description)

    def submit_agreed(self, layout: tuple, action: Work, description: str) -> Handle:
        """A collective of the caller's own: the ranks agree on `layout` first (a mismatch raises on every rank
        instead of hanging or truncating), then `action` runs; both on the communication thread, in order."""
        state = self._state
        return self.submit(lambda: state.agreed(layout, action), description)

    def refuse_async(self, error: Exception, description: str = "an asynchronous collective") -> DdlfastError:
        """Bad input for an asynchronous call, or any exception while its arguments were checked: the refusal
        takes the call's place in the queue. Returns the DdlfastError to raise here."""
        self._check_caller()
        refusal = self._before_data(error, description)
        if isinstance(refusal, DdlfastBrokenError) or self._closed:
            return refusal

        def refuse() -> None:
            raise self._state.agreement.refuse(refusal)

        self._ensure_worker().submit(refuse, "a refused collective")
        return refusal

    def raise_after_failure(self, error: BaseException) -> NoReturn:
        """In an `except` block of a collective that failed after its agreement: the context is broken and the
        other ranks are told; raises DdlfastBrokenError."""
        self._state.raise_after_failure(error)

    def check_root(self, root: object) -> None:
        small.check_root(self._state, root)

    def control_on(self, comm: MPI.Intracomm) -> Control:
        """Stall-limited MPI operations on `comm`, completed through this context's core."""
        return Control(comm, self._state.core)

    def topology(self, every_tier: bool = False) -> Topology:
        """ddlfast.topology(): on the communication thread when there is one, so collectives stay ordered."""
        state, settings = self._state, self._settings()
        if state.topology_known(every_tier):
            return state.topology  # nothing collective to do
        self._check_caller()
        return self._in_order(lambda: state.agreed(("topology", every_tier),
                                                   lambda: state.topology_for(settings.bucket_bytes, every_tier)),
                              "topology")

    # -- allreduce ---------------------------------------------------------------------------------------------------

    def allreduce(self, array: np.ndarray, *, op: str = "sum", dims: object = None,
                  compression: object = None, stream: object = None, name: Name = None,
                  reproducible: bool | None = None) -> np.ndarray:
        """One array: the latency path (ddlfast/engine/fast_path.py) where it applies."""
        if _modules_get(PROFILER) is not None:  # traced()'s test, spelled out: the latency path
            span = recording_range("ddlfast:allreduce")
            if span is not None:
                with span:
                    return self._allreduce(array, op, dims, compression, stream, name, reproducible)
        return self._allreduce(array, op, dims, compression, stream, name, reproducible)

    def _allreduce(self, array: np.ndarray, op: object, dims: object, compression: object, stream: object,
                   name: Name, reproducible: bool | None = None) -> np.ndarray:
        if _get_ident() != self._issuer:  # _check_caller's compare, spelled out: the latency path
            self._other_caller()
        if type(op) is not str:
            op = canonical_op(op)  # MPI.SUM, torch's ReduceOp.SUM, ...: their names take the latency path too
        try:  # _settings(), spelled out: the latency path
            settings = load_settings()
        except DdlfastError as error:
            raise self._refused(error) from None
        if reproducible is not None:
            settings = with_reproducible(settings, reproducible, self._state.rank) if type(reproducible) is bool \
                else None  # not a bool: the general path refuses it on every rank
        plan = None
        if (settings is not None and type(array) is np.ndarray and stream is None and self._state.timeline is None
                and (name is None or type(name) in (str, int))):
            plan = self._fast.plan(array, op, dims, compression, settings)
        if plan is not None:
            if self._worker is None and not self._ulfm:  # _in_order's own first case, spelled out: the latency path
                with self._lock:
                    self._check_open()
                    done = self._fast.run(array, plan, settings, name)
            else:
                done = self._fast_in_order(array, plan, settings, name)
            if done:
                return array
        # The general path (full validation and messages, compression, GPU arrays), also for a buffer the latency
        # path could not take (nothing ran there).
        return self._fused_allreduce([array], op, dims, compression, False, stream, name, reproducible)[0]

    def _fast_in_order(self, array: np.ndarray, plan: Plan | ShardPlan | BroadcastPlan, settings: config.Settings,
                       name: Name, kind: str = "allreduce", out: np.ndarray | None = None) -> bool:
        """A fast path's run behind queued asynchronous work, or under MPI's fault tolerance (its own method: the
        closure's cells would cost every fast-path call)."""
        fast = self._fast
        return self._in_order(lambda: fast.run(array, plan, settings, name, out), kind)

    def _fast_run(self, array: np.ndarray, plan: ShardPlan | BroadcastPlan, settings: config.Settings, name: Name,
                  kind: str, out: np.ndarray | None = None) -> bool:
        """A reduce_scatter(), allgather() or broadcast() fast-path plan (ddlfast/engine/fast_path.py) in this
        context's order: False where it did not run."""
        if self._worker is None and not self._ulfm:  # _in_order's own first case, spelled out
            with self._lock:
                self._check_open()
                return self._fast.run(array, plan, settings, name, out)
        return self._fast_in_order(array, plan, settings, name, kind, out)

    def fused_allreduce(self, arrays: Sequence[np.ndarray], *, op: str = "sum", dims: object = None,
                        compression: object = None, error_feedback: bool = False, stream: object = None,
                        name: Name = None, reproducible: bool | None = None) -> list:
        """GPU arrays: ordered after `stream` (default: the stream each array exports, else the host waits)."""
        # traced()'s test spelled out, as in allreduce: its *args/**kwargs wrapper cost fused_allreduce([x]) about
        # 8,000 instructions a call more than allreduce(x) on the latency path.
        if _modules_get(PROFILER) is not None:
            span = recording_range("ddlfast:fused_allreduce")
            if span is not None:
                with span:
                    return self._fused_or_one(arrays, op, dims, compression, error_feedback, stream, name,
                                              reproducible)
        return self._fused_or_one(arrays, op, dims, compression, error_feedback, stream, name, reproducible)

    def _fused_or_one(self, arrays: Sequence[Any], op: str, dims: object, compression: object,
                      error_feedback: bool, stream: object, name: Name, reproducible: bool | None) -> list:
        if type(arrays) is list and len(arrays) == 1 and stream is None and not error_feedback:
            # the same collective, and layout
            self._allreduce(arrays[0], op, dims, compression, None, name, reproducible)
            return arrays
        return self._fused_allreduce(arrays, op, dims, compression, error_feedback, stream, name, reproducible)

    def _fused_allreduce(self, arrays: Sequence[Any], op: str, dims: object, compression: object,
                         error_feedback: bool, stream: object, name: object,
                         reproducible: bool | None = None) -> list:
        return self._now(lambda: self._allreduce_work(arrays, op, dims, None, compression, error_feedback, stream,
                                                      reproducible=reproducible),
                         "fused_allreduce", name)

    def _allreduce_work(self, arrays: Sequence[Any], op: str, dims: object, result: Any, compression: object,
                        error_feedback: bool, stream: object, asynchronous: bool = False,
                        reproducible: bool | None = None) -> Work:
        state = self._state
        request = requests.prepare(state, arrays, op, dims, result, compression, error_feedback, stream,
                                   asynchronous, reproducible)
        return lambda: requests.execute(state, request)

    @traced("fused_allreduce_async")
    def fused_allreduce_async(self, arrays: Sequence[np.ndarray], *, op: str = "sum", dims: object = None,
                              compression: object = None, error_feedback: bool = False,
                              result: Any = None, stream: object = None, name: Name = None,
                              reproducible: bool | None = None) -> Handle:
        """Queue the collective on the communication thread; wait() returns the list (or `result`)."""
        return self._queued(lambda: self._allreduce_work(arrays, op, dims, result, compression, error_feedback,
                                                         stream, asynchronous=True, reproducible=reproducible),
                            lambda: f"fused_allreduce of {len(arrays)} arrays", name)

    @traced("allreduce_async")
    def allreduce_async(self, array: np.ndarray, *, op: str = "sum", dims: object = None,
                        compression: object = None, stream: object = None, name: Name = None,
                        reproducible: bool | None = None) -> Handle:
        """Queue one array; wait() returns the array."""
        return self.fused_allreduce_async([array], op=op, dims=dims, compression=compression, result=array,
                                          stream=stream, name=name, reproducible=reproducible)

    # -- reduce-scatter and allgather (ddlfast/engine/shards.py) -----------------------------------------------------

    def reduce_scatter(self, array: Any, *, op: str = "sum", dims: object = None, counts: Sequence[int] | None = None,
                       out: Any = None, compression: object = None, stream: object = None, name: Name = None,
                       reproducible: bool | None = None) -> Any:
        """Rank r gets block r of the reduced array (MPI_Reduce_scatter); the input stays unchanged. One host
        array in equal blocks takes the fast path (ddlfast/engine/fast_path.py) where it applies."""
        if _modules_get(PROFILER) is not None:  # traced()'s test, spelled out: the fast path
            span = recording_range("ddlfast:reduce_scatter")
            if span is not None:
                with span:
                    return self._reduce_scatter(array, op, dims, counts, out, compression, stream, name, reproducible)
        return self._reduce_scatter(array, op, dims, counts, out, compression, stream, name, reproducible)

    def _reduce_scatter(self, array: Any, op: object, dims: object, counts: object, out: Any, compression: object,
                        stream: object, name: Name, reproducible: bool | None) -> Any:
        if counts is None and stream is None and reproducible is None:
            if type(op) is not str:
                op = canonical_op(op)
            result = self._shard_fast(shards.REDUCE_SCATTER, array, op, dims, out, compression, name)
            if result is not None:
                return result
        return self._shard(shards.REDUCE_SCATTER, [array], op, dims, counts, out, compression, stream, True, name=name,
                           reproducible=reproducible)

    def _shard_fast(self, kind: str, array: Any, op: str, dims: object, out: Any, compression: object,
                    name: Name) -> Any:
        """A reduce_scatter() or allgather() of one host array on the fast path; None where it did not run
        (nothing ran: the general path validates, explains, and runs it)."""
        if (type(array) is not np.ndarray or (out is not None and type(out) is not np.ndarray)
                or self._state.timeline is not None or (name is not None and type(name) not in (str, int))):
            return None
        if _get_ident() != self._issuer:
            self._other_caller()
        settings = self._settings()
        plan = self._fast.shard_plan(kind, array, op, dims, compression, settings)
        if plan is None:
            return None
        if out is None:
            result = np.empty(plan.result_shape, array.dtype)
        elif out.dtype is array.dtype:
            result = out
        else:
            return None
        return result if self._fast_run(array, plan, settings, name, kind, result) else None

    @traced("fused_reduce_scatter")
    def fused_reduce_scatter(self, arrays: Sequence[Any], *, op: str = "sum", dims: object = None,
                             counts: Sequence[Sequence[int] | None] | None = None, out: Sequence[Any] | None = None,
                             compression: object = None, stream: object = None, name: Name = None,
                             reproducible: bool | None = None) -> list:
        """reduce_scatter of many arrays in one collective; counts= and out= give one entry per array."""
        return self._shard(shards.REDUCE_SCATTER, arrays, op, dims, counts, out, compression, stream, False, name=name,
                          reproducible=reproducible)

    def allgather(self, array: Any, *, dims: object = None, out: Any = None, compression: object = None,
                  stream: object = None, name: Name = None) -> Any:
        """The ranks' arrays concatenated along axis 0 in rank order (MPI_Allgather); one host array takes the
        fast path where it applies."""
        if _modules_get(PROFILER) is not None:  # traced()'s test, spelled out: the fast path
            span = recording_range("ddlfast:allgather")
            if span is not None:
                with span:
                    return self._allgather(array, dims, out, compression, stream, name)
        return self._allgather(array, dims, out, compression, stream, name)

    def _allgather(self, array: Any, dims: object, out: Any, compression: object, stream: object, name: Name) -> Any:
        if stream is None:
            result = self._shard_fast(shards.ALLGATHER, array, "sum", dims, out, compression, name)
            if result is not None:
                return result
        return self._shard(shards.ALLGATHER, [array], "sum", dims, None, out, compression, stream, True, name=name)

    @traced("fused_allgather")
    def fused_allgather(self, arrays: Sequence[Any], *, dims: object = None, out: Sequence[Any] | None = None,
                        compression: object = None, stream: object = None, name: Name = None) -> list:
        return self._shard(shards.ALLGATHER, arrays, "sum", dims, None, out, compression, stream, False, name=name)

    @traced("reduce_scatter_async")
    def reduce_scatter_async(self, array: Any, *, op: str = "sum", dims: object = None,
                             counts: Sequence[int] | None = None, out: Any = None, compression: object = None,
                             stream: object = None, name: Name = None, reproducible: bool | None = None) -> Handle:
        return self._shard(shards.REDUCE_SCATTER, [array], op, dims, counts, out, compression, stream, True, True,
                          name=name, reproducible=reproducible)

    @traced("fused_reduce_scatter_async")
    def fused_reduce_scatter_async(self, arrays: Sequence[Any], *, op: str = "sum", dims: object = None,
                                   counts: Sequence[Sequence[int] | None] | None = None,
                                   out: Sequence[Any] | None = None, compression: object = None,
                                   stream: object = None, name: Name = None,
                                   reproducible: bool | None = None) -> Handle:
        return self._shard(shards.REDUCE_SCATTER, arrays, op, dims, counts, out, compression, stream, False, True,
                          name=name, reproducible=reproducible)

    @traced("allgather_async")
    def allgather_async(self, array: Any, *, dims: object = None, out: Any = None, compression: object = None,
                        stream: object = None, name: Name = None) -> Handle:
        return self._shard(shards.ALLGATHER, [array], "sum", dims, None, out, compression, stream, True, True,
                           name=name)

    @traced("fused_allgather_async")
    def fused_allgather_async(self, arrays: Sequence[Any], *, dims: object = None, out: Sequence[Any] | None = None,
                              compression: object = None, stream: object = None, name: Name = None) -> Handle:
        return self._shard(shards.ALLGATHER, arrays, "sum", dims, None, out, compression, stream, False, True,
                           name=name)

    def _shard(self, kind: str, arrays: Any, op: str, dims: object, counts: object, out: object,
              compression: object, stream: object, single: bool, queued: bool = False, name: object = None,
              reproducible: bool | None = None) -> Any:
        state = self._state

        def prepare() -> Work:
            request = shards.prepare(state, kind, arrays, op, dims, counts, out, compression, stream, single,
                                     reproducible)
            return lambda: shards.execute(state, request)

        if queued:  # wait() returns what the blocking call returns
            return self._queued(prepare, lambda: f"{kind} of {len(arrays)} arrays", name)
        return self._now(prepare, kind, name)

    # -- all-to-all and allgather of per-rank first dimensions (ddlfast/engine/exchange.py) ---------------------------

    @traced("alltoall")
    def alltoall(self, array: Any, splits: Sequence[int] | None = None, *, receive_splits: Sequence[int] | None = None,
                 out: Any = None, name: Name = None) -> tuple[Any, list[int]]:
        """Rank r sends rows [sum(splits[:d]), sum(splits[:d+1])) of `array` to rank d (equal blocks without
        splits=); returns (the received blocks concatenated in rank order, the rows received from each rank)."""
        return self._exchange(exchange.ALLTOALL, array, splits, receive_splits, out, True, False, name)

    @traced("fused_alltoall")
    def fused_alltoall(self, arrays: Sequence[Any], splits: Sequence[Sequence[int] | None] | None = None, *,
                       receive_splits: Sequence[Sequence[int] | None] | None = None, out: Sequence[Any] | None = None,
                       name: Name = None) -> tuple[list, list[list[int]]]:
        return self._exchange(exchange.ALLTOALL, arrays, splits, receive_splits, out, False, False, name)

    @traced("alltoall_async")
    def alltoall_async(self, array: Any, splits: Sequence[int] | None = None, *,
                       receive_splits: Sequence[int] | None = None, out: Any = None, name: Name = None) -> Handle:
        return self._exchange(exchange.ALLTOALL, array, splits, receive_splits, out, True, True, name)

    @traced("fused_alltoall_async")
    def fused_alltoall_async(self, arrays: Sequence[Any], splits: Sequence[Sequence[int] | None] | None = None, *,
                             receive_splits: Sequence[Sequence[int] | None] | None = None,
                             out: Sequence[Any] | None = None, name: Name = None) -> Handle:
        return self._exchange(exchange.ALLTOALL, arrays, splits, receive_splits, out, False, True, name)

    @traced("allgatherv")
    def allgatherv(self, array: Any, *, name: Name = None) -> Any:
        """The ranks' arrays concatenated along axis 0 in rank order; first dimensions may differ per rank."""
        return self._exchange(exchange.ALLGATHERV, array, None, None, None, True, False, name)

    @traced("fused_allgatherv")
    def fused_allgatherv(self, arrays: Sequence[Any], *, name: Name = None) -> list:
        return self._exchange(exchange.ALLGATHERV, arrays, None, None, None, False, False, name)

    @traced("allgatherv_async")
    def allgatherv_async(self, array: Any, *, name: Name = None) -> Handle:
        return self._exchange(exchange.ALLGATHERV, array, None, None, None, True, True, name)

    @traced("fused_allgatherv_async")
    def fused_allgatherv_async(self, arrays: Sequence[Any], *, name: Name = None) -> Handle:
        return self._exchange(exchange.ALLGATHERV, arrays, None, None, None, False, True, name)

    def _exchange(self, kind: str, arrays: Any, splits: object, expected: object, out: object, single: bool,
                  queued: bool, name: object) -> Any:
        state = self._state

        def prepare() -> Work:
            request = exchange.prepare(state, kind, arrays, splits, expected, out, single)
            return lambda: exchange.execute(state, request)

        if queued:  # wait() returns what the blocking call returns
            return self._queued(prepare, lambda: kind, name)
        return self._now(prepare, kind, name)

    @traced("join")
    def join(self) -> int:
        """This rank has no more data: take part in the others' allreduces with zeros until every rank has joined
        (ddlfast/engine/join.py); returns the last rank to join, the same on every rank."""
        return self._now(lambda: join.join(self._state), "join")

    # -- the small collectives (ddlfast/engine/small.py) --------------------------------------------------------------

    def broadcast(self, array: np.ndarray, root: int = 0, name: Name = None) -> np.ndarray:
        """Copy `root`'s array into every rank's array, in place: any fixed-size dtype (a byte copy), host or
        GPU (through a pinned host copy). A small NumPy array takes the fast path where it applies."""
        if _modules_get(PROFILER) is not None:  # traced()'s test, spelled out: the fast path
            span = recording_range("ddlfast:broadcast")
            if span is not None:
                with span:
                    return self._broadcast(array, root, name)
        return self._broadcast(array, root, name)

    def _broadcast(self, array: np.ndarray, root: int, name: Name) -> np.ndarray:
        if (type(array) is np.ndarray and type(root) is int and self._state.timeline is None
                and (name is None or type(name) in (str, int))):
            if _get_ident() != self._issuer:
                self._other_caller()
            settings = self._settings()
            plan = self._fast.broadcast_plan(array, root, settings)
            if plan is not None and self._fast_run(array, plan, settings, name, "broadcast"):
                return array
        return self._now(lambda: small.broadcast(self._state, array, root), "broadcast", name)

    @traced("broadcast_async")
    def broadcast_async(self, array: np.ndarray, root: int = 0, name: Name = None) -> Handle:
        """broadcast() on the communication thread; wait() returns the array. Do not touch it until then."""
        return self._queued(lambda: small.broadcast(self._state, array, root, asynchronous=True), lambda: "broadcast",
                            name)

    def broadcast_bytes(self, array: np.ndarray, root: int = 0, name: Name = None) -> np.ndarray:
        """broadcast() for any contiguous writable byte view (e.g. a tensor of any dtype)."""
        return self._now(lambda: small.broadcast_bytes(self._state, array, root), "broadcast", name)

    @traced("barrier")
    def barrier(self, name: Name = None) -> None:
        """Return once every rank of the communicator has called barrier()."""
        self._now(lambda: small.barrier(self._state), "barrier", name)

    @traced("stragglers")
    def stragglers(self, last: int = 100) -> list[dict]:
        """Collective: per rank (the same list on every rank), how many of the last `last` collectives it arrived
        at last and how long in total it held the others; most held first (docs/observe.md)."""
        return self._now(lambda: small.stragglers(self._state, last), "stragglers")

    def dump_flight_record(self, directory: str | None = None) -> str | None:
        """Rank-local: write this rank's flight record now (docs/observe.md); returns the file's path."""
        return self._state.dump_flight_record("dump_flight_record()", directory)

    @traced("broadcast_object")
    def broadcast_object(self, obj: object, root: int = 0, name: Name = None) -> object:
        """Root's picklable object on every rank (root gets `obj` itself back)."""
        return self._now(lambda: small.broadcast_object(self._state, obj, root), "broadcast_object", name)

    @traced("allgather_object")
    def allgather_object(self, obj: object, name: Name = None) -> list:
        """Every rank's picklable object, in rank order."""
        return self._now(lambda: small.allgather_object(self._state, obj), "allgather_object", name)
