"""EngineState: what the executors of one Context share, handed to them explicitly.

The Context (ddlfast/context.py) owns communicators, lifecycle and ordering; everything a collective needs once
it runs is here: the compiled core (one transport, the host and GPU engine caches), the control communicator's
collectives, the per-call agreement, the topology and the rank order the rings are renumbered with, the
timeline, the host's fused buffers and compression state, and the GPU executor once a GPU collective ran.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from ddlfast import _core, config
from ddlfast.compression.wire import ErrorFeedback
from ddlfast.config import ALGORITHMS, MAX_LATENCY_BYTES, MAX_SMALL_BYTES, Settings, parse_dims
from ddlfast.engine.agreement import Agreement, describe, warn_straggler
from ddlfast.engine.control import Control
from ddlfast.engine.flight import FlightRecorder, install_signal_handler, layout_text
from ddlfast.engine.timeline import Timeline
from ddlfast.errors import DdlfastBrokenError, DdlfastConsistentError, DdlfastError
from ddlfast.fusion.buffer_pool import FusedBufferPool
from ddlfast.topology.cost_model import Algorithm, PlanError, power_of_two_dims
from ddlfast.topology.placement import Topology, build

MAX_CACHED_ALGORITHMS = 4096


def reproducible_wire(wire: tuple[int, ...], rank: int) -> tuple[int, ...]:
    """The wire of reproducible=True's one flat ring: the one wire type the per-dimension wire uses anywhere
    (every contribution is rounded to it once, docs/numerics.md), or () uncompressed. Two wire types cannot
    both hold: refused."""
    types = sorted({code for code in wire if code >= 0})
    if len(types) > 1:
        raise DdlfastError(f"reproducible=True on rank {rank} runs one flat ring, so it takes one wire type, not "
                           "fp16 in one ring dimension and bf16 in another; pass compression='fp16' or 'bf16'")
    return (types[0],) if types else ()


HALF_DTYPES = ("float16", "bfloat16")


def is_half_sum(dtype: np.dtype, op: str) -> bool:
    """fp16/bf16 data summed: each ring hop rounds the partial sum to 16 bits; the direct reduce-scatter adds in
    float32 and rounds once (sums_halves_in_float32 in src/engine/direct_phase.h)."""
    return dtype.name in HALF_DTYPES and op in ("sum", "average")


def compressed_dims(dims: tuple[int, ...], wire: tuple[int, ...], half_sum: bool) -> tuple[bool, ...]:
    """Per ring dimension, whether its values travel as 16 bits (the cost model's `compressed`)."""
    return (True,) * len(dims) if half_sum else tuple(code >= 0 for code in wire)


class EngineState:
    def __init__(self, core: Any, control: Control, timeout_s: float) -> None:
        self.core = core
        self.control = control
        self.rank, self.size = core.rank, core.size
        self.timeline = Timeline.from_env(core.rank)
        core.record_events = self.timeline is not None
        warn_s = config.straggler_warn_s()
        if warn_s is not None:
            core.set_straggler_warning(warn_s, config.STRAGGLER_NOISE_S)
        self.agreement = Agreement(core, control, None, warn_s is not None and self.rank == 0)
        records = config.flight_records()
        # The timeline's collective slices come from the flight entries, so it keeps at least the latest.
        self.flight = (FlightRecorder(core, max(records, 1), config.flight_dir(), self.agreement.known_layouts)
                       if records or self.timeline is not None else None)
        self.agreement.flight = self.flight
        if self.flight is not None and self.flight.directory:
            install_signal_handler()
        self.fused = FusedBufferPool()
        self.error_feedback = ErrorFeedback()
        self.codec_state: dict[tuple, dict] = {}
        self.topology: Topology | None = None  # built once, at creation (collective)
        self.rank_order: tuple[int, ...] = ()  # torus position -> rank; () is identity
        self._every_tier = False  # the topology was probed on every tier, even on one host
        self._dims_cache: dict[tuple, tuple[int, ...]] = {}
        self._algorithm_cache: dict[tuple, Algorithm] = {}
        self._options_cache: dict[tuple, _core.CallOptions] = {}
        self.halving_bytes = 0  # the latency path halves from this payload up (Topology.halving_bytes), at creation
        self.core_timeout_s = timeout_s  # what the core was last told
        self.device_executor: Any = None  # ddlfast.engine.device.DeviceExecutor, from its first GPU collective

    # -- topology and dims ---------------------------------------------------------------------------------------

    def topology_for(self, plan_bytes: int, every_tier: bool = False) -> Topology:
        """Detect placement, probe, plan: collective, so only where every rank gets in the same order (creation,
        or an agreed topology() call). Sets the rank order the engine renumbers its rings with."""
        if self.topology is None or (every_tier and not self._every_tier):
            self.topology = dataclasses.replace(build(self.control.comm, plan_bytes, every_tier),
                                                shared_memory=self.core.shared_memory)
            self._every_tier = every_tier
            self.rank_order = self.topology.order
            self.halving_bytes = self.topology.halving_bytes(config.halving_bytes())
            # Every rank builds the same topology here: the agreement's messages grow alike where auto's latency
            # path reaches past the capacity the core was created with.
            self.core.grow_agreement_capacity(self.topology.agreement_capacity(self.halving_bytes))
            if self.flight is not None:
                self.flight.hosts = self.hosts()
        return self.topology

    def hosts(self) -> tuple[str, ...]:
        """Each rank's host name (MPI's processor name), in rank order; () before the topology is known."""
        if self.topology is None:
            return ()
        placement = self.topology.placement
        return tuple(placement.host_names[h] for h in placement.host_of_rank)

    def dump_flight_record(self, reason: str, directory: str | None = None) -> str | None:
        """This rank's flight record to DDLFAST_FLIGHT_DIR or `directory` (rank-local); its path, or None."""
        if self.flight is None:
            raise DdlfastError("the flight recorder is off here (DDLFAST_FLIGHT_RECORDS=0)")
        if not (directory or self.flight.directory):
            raise DdlfastError("dump_flight_record(): name a directory, or set DDLFAST_FLIGHT_DIR")
        return self.flight.dump(reason, directory)

    def topology_known(self, every_tier: bool) -> bool:
        return self.topology is not None and (self._every_tier or not every_tier)

    def resolve_dims(self, dims: object, settings: Settings) -> tuple[int, ...]:
        try:
            return self._dims_cache[(dims, settings.ring_dims)]
        except (KeyError, TypeError):  # TypeError: unhashable dims such as a list
            pass
        chosen = settings.ring_dims if dims is None else parse_dims(dims)
        resolved = self.topology_for(settings.bucket_bytes).resolve(chosen)
        try:
            self._dims_cache[(dims, settings.ring_dims)] = resolved
        except TypeError:
            pass
        return resolved

    def algorithm_for(self, nbytes: int, dims: tuple[int, ...], settings: Settings,
                      compressed: tuple[bool, ...] = ()) -> Algorithm:
        """The algorithm one core call of `nbytes` runs with (DDLFAST_ALGORITHM; auto: the cost model per size).
        A pure function of agreed values (the size, the dims, the settings, the topology every rank shares), so
        every rank of a call chooses the same; the plain ring at or below DDLFAST_SMALL_BYTES, where the core
        runs its small-message path whatever the choice. `compressed`: per dimension, whether the wire is."""
        key = (nbytes, dims, settings.algorithm, settings.small_bytes, settings.ring_dims, compressed)
        try:
            return self._algorithm_cache[key]
        except KeyError:
            pass
        if settings.algorithm == "rabenseifner" and power_of_two_dims(self.size) is None and self.size > 1:
            self.check_algorithm(settings, dims, False, 0, False)  # raises, at every size: no such dims here
        try:
            choice = self.topology_for(settings.bucket_bytes).algorithm(
                nbytes, dims, settings.algorithm, settings.small_bytes, settings.ring_dims, compressed)
        except PlanError as error:
            raise DdlfastError(f"DDLFAST_ALGORITHM={settings.algorithm} cannot run on rank {self.rank}: {error}; "
                               f"choices: {', '.join(ALGORITHMS)}") from None
        if len(self._algorithm_cache) >= MAX_CACHED_ALGORITHMS:
            self._algorithm_cache.clear()
        self._algorithm_cache[key] = choice
        return choice

    def latency_reach(self, settings: Settings) -> int:
        """The largest uncompressed allreduce the latency path takes (Topology.latency_reach): DDLFAST_SMALL_BYTES,
        more under auto on an oversubscribed placement or where the latency path halves. Agreed values only, so
        every rank reaches as far."""
        if settings.reproducible:
            return 0
        return self.topology.latency_reach(settings.small_bytes, settings.algorithm, self.halving_bytes)

    def latency_takes(self, nbytes: int, settings: Settings) -> bool:
        """Whether the latency path takes an uncompressed allreduce of `nbytes` (Topology.latency_takes): at most
        latency_reach, and across hosts only where the cost model predicts it faster. Agreed values only."""
        if settings.reproducible:
            return False
        return self.topology.latency_takes(nbytes, settings.small_bytes, settings.algorithm, self.halving_bytes)

    def call_options(self, nbytes: int, dims: tuple[int, ...], settings: Settings,
                     wire: tuple[int, ...] = (), half_sum: bool = False, latency: bool = False, chain: bool = True
                     ) -> _core.CallOptions:
        """The core's options for one call of `nbytes` (one object across the binding, cached per kind of call):
        DDLFAST_ALGORITHM's choice for that size (algorithm_for) with the settings that size messages. `mpi` hands
        every size to MPI's own allreduce, after the agreement; every other choice leaves buffers of at most
        DDLFAST_SMALL_BYTES to the latency path. `half_sum` (is_half_sum): fp16/bf16 data summed, which the ring
        rounds at every hop, is chosen for as a 16-bit wire is (the direct step adds in float32, rounds once).
        `latency`: an allreduce the latency path takes (latency_takes). `chain`: reproducible=True may run the
        canonical chain across hosts."""
        if settings.reproducible:
            return self.reproducible_options(settings, wire, chain)
        if latency and settings.small_bytes < nbytes and not wire:
            return self.latency_options(dims, settings, self.latency_reach(settings))
        choice = self.algorithm_for(nbytes, dims, settings, compressed_dims(dims, wire, half_sum))
        key = (choice, settings, wire, self.rank_order)
        try:
            return self._options_cache[key]
        except KeyError:
            pass
        mpi = choice.name == "mpi"
        options = _core.CallOptions(choice.dims, settings.chunk_bytes, settings.receives_in_flight,
                                    MAX_SMALL_BYTES if mpi else settings.small_bytes, self.rank_order, wire,
                                    choice.direct, mpi, halving_bytes=self.halving_bytes)
        return self._keep_options(key, options)

    def _keep_options(self, key: tuple, options: _core.CallOptions) -> _core.CallOptions:
        """Remember `options` under `key` (one bounded cache for every kind of call's options)."""
        if len(self._options_cache) >= MAX_CACHED_ALGORITHMS:
            self._options_cache.clear()
        self._options_cache[key] = options
        return options

    def latency_options(self, dims: tuple[int, ...], settings: Settings, reach: int) -> _core.CallOptions:
        """An allreduce above DDLFAST_SMALL_BYTES that the latency path takes (call_options' `latency`): the core's
        small-message limit raised to `reach` (latency_reach), so the latency path takes it."""
        key = ("latency", reach, dims, settings, self.rank_order)
        try:
            return self._options_cache[key]
        except KeyError:
            pass
        options = _core.CallOptions(dims, settings.chunk_bytes, settings.receives_in_flight, reach, self.rank_order,
                                    halving_bytes=self.halving_bytes)
        return self._keep_options(key, options)

    def reproducible_options(self, settings: Settings, wire: tuple[int, ...], chain: bool = True
                             ) -> _core.CallOptions:
        """reproducible=True: whatever the dims, algorithm and size, every element summed in rank order at its
        owner and no small-message path (its tree's order depends on the rank count's shape), so the bits
        depend only on the inputs and the rank count. On one host (or where `chain` is False: reduce_scatter on
        the 16-bit wire, 16-bit data on the GPU executor), one flat ring of every rank in rank order whose
        reduce-scatter is direct (src/engine/direct_phase.h: each element's owner adds the P contributions in rank
        order). Across hosts of the same number of consecutive ranks, the same order host by host
        (chain_hosts): ring dims (ranks per host, hosts) and the chain phase (src/engine/chain_phase.h), the
        ring's bytes on the host link. A compressed wire carries its one wire type everywhere
        (reproducible_wire)."""
        flat = reproducible_wire(wire, self.rank)
        hosts = self.chain_hosts(settings) if chain else 1
        key = ("reproducible", settings, flat, hosts)
        try:
            return self._options_cache[key]
        except KeyError:
            pass
        if hosts > 1:
            per_host = self.size // hosts
            options = _core.CallOptions((per_host, hosts), settings.chunk_bytes, settings.receives_in_flight, 0,
                                        (), flat * 2, (1, 1), False, True, reproducible=True)
        else:
            options = _core.CallOptions((self.size,), settings.chunk_bytes, settings.receives_in_flight, 0, (),
                                        flat, (1,), False, reproducible=True)
        return self._keep_options(key, options)

    def chain_hosts(self, settings: Settings) -> int:
        """How many hosts reproducible=True's canonical chain runs across: the topology's hosts where each holds
        the same number (at least 2) of consecutive ranks, so rank order goes host by host; 1 (the flat order)
        otherwise."""
        placement = self.topology_for(settings.bucket_bytes).placement  # known: every call resolved its dims
        if placement.hosts < 2 or not placement.regular or not placement.contiguous:
            return 1
        return placement.hosts if placement.ranks_per_host[0] >= 2 else 1

    def check_algorithm(self, settings: Settings, dims: tuple[int, ...], compressed: bool, largest_call: int,
                        gpu: bool) -> None:
        """Before the agreement: a DDLFAST_ALGORITHM that cannot run this call raises on this rank (and the
        rank joins the agreement with the error). `largest_call`: the bytes of the largest core call."""
        algorithm = settings.algorithm
        problem = None
        if algorithm == "latency" and largest_call > settings.small_bytes:
            problem = (f"the latency path takes calls of at most DDLFAST_SMALL_BYTES ({settings.small_bytes} "
                       f"bytes), and this one moves {largest_call} bytes in one call")
        elif gpu and algorithm in ("direct", "rabenseifner"):
            problem = "GPU arrays run the ring reduce-scatter on the topology's dims only"
        elif gpu and algorithm == "mpi" and largest_call > settings.small_bytes:
            problem = (f"the GPU path hands only calls of at most DDLFAST_SMALL_BYTES ({settings.small_bytes} bytes) "
                       f"to MPI, and this one moves {largest_call} bytes in one call")
        elif algorithm == "rabenseifner" and compressed:
            problem = "a compressed wire keeps the ring dims its codecs were given for"
        elif algorithm == "rabenseifner" and power_of_two_dims(self.size) is None and self.size > 1:
            problem = f"rabenseifner needs a power-of-two rank count, not {self.size}"
        if problem is not None:
            raise DdlfastError(f"DDLFAST_ALGORITHM={algorithm} cannot run this call on rank {self.rank}: {problem}; "
                               f"choices: {', '.join(ALGORITHMS)}")

    def hosts_tier(self, dims: tuple[int, ...]) -> int | None:
        """Index of the first ring dimension whose rings cross hosts (None on one host)."""
        placement = self.topology.placement
        if placement.hosts <= 1:
            return None
        per_host = placement.ranks_per_host[0] if placement.regular else 1
        covered = 1
        for index, d in enumerate(dims):
            covered *= d
            if covered > per_host:
                return index
        return None

    # -- running a collective ------------------------------------------------------------------------------------

    def set_core_timeout(self, seconds: float) -> None:
        if self.core_timeout_s != seconds:  # a call into the core per collective otherwise
            self.core.set_timeout(seconds)
            self.core_timeout_s = seconds

    def agreed(self, layout: tuple, action: Callable[[], Any], digest: int | None = None) -> Any:
        """The agreement, then the collective. A failure after the agreement passed leaves the context broken
        (the other ranks are told, and fail at once rather than at their stall limit)."""
        self.agreement.check(layout, digest)
        try:
            result = action()
        except DdlfastConsistentError:
            raise
        except BaseException as error:
            self.raise_after_failure(error)
        if self.flight is not None:
            self.finished()
        return result

    def agreed_in_core(self, layout: tuple, action: Callable[[int], bool]) -> None:
        """The agreement inside the collective's one call into the core: `action(fingerprint)` runs both and
        returns False, having written nothing, when the ranks disagree; every rank then raises the same error.
        A failure is handled as agreed()'s."""
        if self.flight is not None:
            self.core.set_flight_site(self.flight.site())
        while True:
            try:
                agreed = action(self.agreement.fingerprint(layout, None, self.agreement.name))
            except DdlfastConsistentError:
                raise
            except BaseException as error:
                self.raise_after_failure(error)
            if self.agreement.warn_stragglers and self.core.straggler_warning_pending:
                warn_straggler(self.core)
            if agreed:
                break
            self.agreement.disagreed(layout, self.agreement.name)  # returned: joined ranks take part; again
        if self.flight is not None:
            self.finished()

    def finished(self, entries: int = 1) -> None:
        """The latest collective completed here (its flight entry marked done); on the timeline, as one labelled
        slice with its wait for the other ranks."""
        core = self.core
        core.flight_end(True)
        if self.timeline is not None:
            for sequence, fingerprint, _, arrived, _, ended, wait, _ in core.flight_entries(entries):
                layout, name = self.agreement.layout_of(fingerprint)
                label = layout_text(describe(layout, sequence, name)) if layout is not None else "collective"
                self.timeline.collective(sequence, label, arrived, ended, wait)

    def folds(self, nbytes: int, settings: Settings) -> bool:
        """Whether a broadcast or allgather of `nbytes` (the whole result) rides in the agreement's own messages
        (small.carried_broadcast_options, shards.carried_options): sizes the latency path takes."""
        return 0 < nbytes <= min(settings.small_bytes, MAX_LATENCY_BYTES) and settings.algorithm != "mpi"

    def raise_after_failure(self, error: BaseException) -> NoReturn:
        """Called in an `except` block: a collective failed here after its agreement, so the context is broken
        (the other ranks are told). Raises a DdlfastBrokenError (so the abort hook ends the job if it goes
        uncaught), or re-raises KeyboardInterrupt and the like as they are."""
        if self.flight is not None:
            self.flight.failed(error)
        if not self.core.broken:
            if isinstance(error, KeyboardInterrupt):  # Ctrl-C between two steps of the collective, in Python
                self.core.abandon(f"rank {self.rank} was interrupted (KeyboardInterrupt) between two steps of "
                                  f"collective #{self.core.sequence}", True)
            else:
                self.core.abandon(f"rank {self.rank}: {type(error).__name__}: {error}")
        if isinstance(error, DdlfastBrokenError) or not isinstance(error, Exception):
            raise  # the exception the caller is handling, as it is
        if isinstance(error, DdlfastError):
            raise DdlfastBrokenError(
                f"{error}; this context now refuses further work (the other ranks were told)") from error
        # e.g. a user codec's exception: the collective is abandoned all the same
        raise DdlfastBrokenError(f"rank {self.rank}: the collective failed here ({type(error).__name__}: {error}); "
                                 "the other ranks were told, and this context refuses further work") from error

    def record_events(self, take_events: Callable[[], list], prefix: str = "") -> None:
        """An engine's events (name, ring dimension or -1, start, end, bytes) into the timeline, when there is
        one (the engines record nothing otherwise, and take_events is not called)."""
        if self.timeline is None:
            return
        for name, dim, start, end, nbytes in take_events():
            label = name if dim < 0 else f"{name} dim{dim + 1}"
            self.timeline.add(prefix + label, start, end, bytes=nbytes)

    def flush_timeline(self) -> None:
        if self.timeline is not None:
            self.timeline.flush()

    def close(self) -> None:
        """Free the engines and, when healthy, the control communicator (a broken context leaves it to
        MPI_Finalize: messages in flight may still use it)."""
        healthy = not self.core.broken
        if self.device_executor is not None:
            self.device_executor.close()
        self.core.close()
        if healthy:
            self.control.comm.Free()
