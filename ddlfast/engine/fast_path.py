"""allreduce()'s latency path: the per-call Python work kept to a minimum.

Per kind of call (dtype, shape, op, dims, compression) and settings a plan holds the layout's digest, so the
agreement and the collective are one call into the core (`allreduce_array`), with the buffer checks done in
Cython before it: a refused array falls back to the general path having done nothing. Anything the plan cannot
take (GPU arrays, compression, bfloat16, bad arguments) goes to the general path, which validates and explains.

reduce_scatter() and allgather() of one array (equal blocks) have plans of their own (ShardPlan): the agreement
and the collective in one call into the core (`shard_array`), carried inside the agreement's messages where the
general path carries them too (engine/shards.py, carried_options), so ranks on either path exchange the same
messages. A broadcast() (BroadcastPlan) is such an allgather with root's block only, carried or along the ring
where the general path takes them (engine/small.broadcast_route).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ddlfast.buffers.dtypes import DTYPE_CODES
from ddlfast.compression.wire import wire_by_dim
from ddlfast.config import Settings
from ddlfast.engine.agreement import allreduce_layout, warn_straggler
from ddlfast.engine.requests import resolve_compression
from ddlfast.engine.shards import REDUCE_SCATTER, Spec, carried_options, layout_of, result_shape
from ddlfast.engine.small import broadcast_layout, broadcast_route
from ddlfast.engine.state import EngineState, compressed_dims, is_half_sum
from ddlfast.errors import DdlfastConsistentError, DdlfastError
from ddlfast.ops import OPS

# dtypes whose NumPy arrays export a typed buffer (the latency path's buffer check).
_FAST_DTYPES = {np.dtype(name): code for name, code in DTYPE_CODES.items() if name != "bfloat16"}
# Calls with ever new shapes must not grow memory.
MAX_PLANS = 256


class Plan(NamedTuple):
    """What one kind of call needs in the core, worked out once: valid while `settings` is the current one."""

    settings: Settings
    dtype_code: int
    op_code: int
    options: Any  # _core.CallOptions
    layout: tuple  # what the agreement compares (engine/agreement.allreduce_layout)
    digest: int  # the layout's digest


class ShardPlan(NamedTuple):
    """What one kind of reduce_scatter() or allgather() call needs in the core (as Plan)."""

    settings: Settings
    reduce: bool  # reduce-scatter; else allgather
    size: int  # the input's elements (reduce-scatter) or bytes (allgather)
    dtype_code: int
    op_code: int
    options: Any  # _core.CallOptions
    carried: bool  # inside the agreement's messages (shards.carried_options)
    result_shape: tuple[int, ...]
    layout: tuple  # shards.layout_of's, as the general path builds it
    digest: int


class BroadcastPlan(NamedTuple):
    """What one kind of broadcast() call needs in the core (as Plan)."""

    settings: Settings
    root: int
    size: int  # bytes
    options: Any  # _core.CallOptions
    carried: bool  # in the agreement's messages, else along the ring
    layout: tuple
    digest: int


class FastPath:
    def __init__(self, state: EngineState) -> None:
        self._state = state
        self._plans: dict[tuple, Plan] = {}
        self._shard_plans: dict[tuple, ShardPlan] = {}
        self._broadcast_plans: dict[tuple, BroadcastPlan] = {}
        # The last plan with what chose it: a loop of one kind of call compares objects, hashing nothing.
        self._last: tuple = (None, None, None, None, None, None)
        self._last_shard: tuple = (None, None, None, None, None, None, None)

    def plan(self, array: np.ndarray, op: str, dims: object, compression: object, settings: Settings) -> Plan | None:
        """The plan for this kind of call, or None where the general path must take it."""
        dtype, last_shape, last_op, last_dims, last_compression, plan = self._last
        if (plan is not None and array.dtype is dtype and op is last_op and dims is last_dims
                and compression is last_compression and plan.settings is settings and array.shape == last_shape):
            return plan
        try:
            plan = self._plans.get((array.dtype, array.shape, op, dims, compression, settings.reproducible))
        except Exception:  # noqa: BLE001 (unhashable dims, an op whose __hash__ raises): the general path says
            return None  # what is wrong, on every rank
        if plan is not None and plan.settings is settings:
            self._last = (array.dtype, array.shape, op, dims, compression, plan)
            return plan
        state = self._state
        code = _FAST_DTYPES.get(array.dtype)
        # compression="none" (explicit), or nothing that compresses here: uncompressed.
        codec = (("none",) if isinstance(compression, str) and compression == "none"
                 else None if compression is not None else settings.compression)
        if (code is None or not isinstance(op, str) or op not in OPS or codec not in (("none",), ("auto",))
                or (codec == ("auto",) and state.topology.placement.hosts > 1)):
            return None
        try:
            ring_dims = state.resolve_dims(dims, settings)
            # DDLFAST_ALGORITHM's choice for this size (the general path makes the same): a shape and a direct
            # reduce-scatter per dimension run here; mpi (MPI's collective at every size) and latency (refused
            # above DDLFAST_SMALL_BYTES) take the general path. reproducible=True runs its own plan at any
            # DDLFAST_ALGORITHM (state.reproducible_options).
            half_sum = is_half_sum(array.dtype, op)
            latency = state.latency_takes(array.nbytes, settings)  # a size it takes runs the latency path here
            if not settings.reproducible and not latency and state.algorithm_for(
                    array.nbytes, ring_dims, settings, compressed_dims(ring_dims, (), half_sum)).name in (
                    "mpi", "latency"):
                return None
        except DdlfastError:
            return None  # the general path refuses it on every rank
        layout = allreduce_layout(op, ring_dims, ((array.dtype, array.shape),), codec, False, settings)
        options = state.call_options(array.nbytes, ring_dims, settings, (), half_sum, latency)
        plan = Plan(settings, code, OPS[op], options, layout, state.agreement.digest(layout))
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        self._plans[(array.dtype, array.shape, op, dims, compression, settings.reproducible)] = plan
        self._last = (array.dtype, array.shape, op, dims, compression, plan)
        return plan

    def run(self, array: np.ndarray, plan: Plan | ShardPlan | BroadcastPlan, settings: Settings,
            name: str | int | None = None, out: np.ndarray | None = None) -> bool:
        """False when a buffer cannot take the fast path (nothing ran, not even the agreement). `name` (a str or
        an int, checked by the caller) enters the fingerprint (Agreement.fingerprint). `out`: a shard plan's
        result. One loop for every kind of plan, each a direct call (a closure per call cost a tenth of a 4 KiB
        reduce_scatter's Python)."""
        layout, digest = plan.layout, plan.digest
        state = self._state
        if name is not None:
            digest = state.agreement.fingerprint(layout, digest, name)
        if state.core_timeout_s != settings.timeout_s:  # set_core_timeout's own test, spelled out: the latency path
            state.set_core_timeout(settings.timeout_s)
        core = state.core
        kind = type(plan)
        while True:
            try:  # the agreement and the collective in one call into the core (which keeps its flight entry and
                # finds the call site: site=-2)
                if kind is Plan:
                    outcome = core.allreduce_array(array, array.size, plan.dtype_code, plan.op_code, plan.options,
                                                   digest, -2)
                elif kind is ShardPlan:
                    outcome = core.shard_array(plan.reduce, array, out, plan.size, plan.dtype_code, plan.op_code,
                                               plan.options, digest, plan.carried, -2)
                else:
                    outcome = core.broadcast_array(array, plan.size, plan.root, plan.options, plan.carried, digest,
                                                   -2)
            except DdlfastConsistentError:
                raise
            except BaseException as error:
                self._failed(error)
            if self._ended(outcome, layout, name):
                return outcome > 0

    def _failed(self, error: BaseException) -> None:
        """Called in an `except` block around the one call into the core."""
        if not isinstance(error, Exception) and not self._state.core.broken:
            # Ctrl-C (a signal handler's exception) that Python raised once the one call into the core had
            # returned: the collective completed on every rank, and stands; the core abandons it itself (the
            # context is then broken) when the signal comes during a wait.
            raise  # noqa: PLE0704 (re-raises the exception being handled)
        self._state.raise_after_failure(error)

    def _ended(self, outcome: int, layout: tuple, name: str | int | None) -> bool:
        """After the core call returned `outcome`: False when the ranks disagreed and ranks inside join() take
        part now (call again); raises the disagreement everywhere else."""
        state = self._state
        if state.agreement.warn_stragglers and state.core.straggler_warning_pending:
            warn_straggler(state.core)
        if outcome != 0:
            return True
        state.agreement.disagreed(layout, name)  # returned: ranks inside join() take part now; again
        return False

    def shard_plan(self, kind: str, array: np.ndarray, op: str, dims: object, compression: object,
                   settings: Settings) -> ShardPlan | None:
        """The plan for a reduce_scatter() (equal blocks) or allgather() of one host array, or None where the
        general path must take it."""
        last_kind, dtype, last_shape, last_op, last_dims, last_compression, plan = self._last_shard
        if (plan is not None and kind is last_kind and array.dtype is dtype and op is last_op and dims is last_dims
                and compression is last_compression and plan.settings is settings and array.shape == last_shape):
            return plan
        key = (kind, array.dtype, array.shape, op, dims, compression)
        try:
            plan = self._shard_plans.get(key)
        except Exception:  # noqa: BLE001 (unhashable dims, an op whose __hash__ raises): the general path says
            return None
        if plan is not None and plan.settings is settings:
            self._last_shard = (*key, plan)
            return plan
        state = self._state
        reduce = kind == REDUCE_SCATTER
        code = _FAST_DTYPES.get(array.dtype)
        if (code is None or settings.reproducible or settings.algorithm != "auto"
                or (reduce and (not isinstance(op, str) or op not in OPS or array.size % state.size))):
            return None
        try:
            ring_dims = state.resolve_dims(dims, settings)
            codec = resolve_compression(compression, settings, [], state.rank)
            if codec not in (("none",), ("auto",)) or (array.dtype == np.float32 and wire_by_dim(
                    codec, ring_dims, state.hosts_tier(ring_dims))):
                return None  # a wire: the general path
        except DdlfastError:
            return None  # the general path refuses it on every rank
        spec = Spec(None, array.dtype, array.shape, array.dtype)
        world = state.size
        blocks = (array.size // world,) * world if reduce else (array.size,) * world
        shape = result_shape(kind, array.shape, blocks, False, state.rank, world)
        half_sum = reduce and is_half_sum(array.dtype, op)
        nbytes = array.nbytes * (1 if reduce else world)  # what the core reduces or gathers
        options = carried_options(state, kind, nbytes, ring_dims, settings, (), half_sum)
        carried = options is not None
        if not carried:
            options = state.call_options(nbytes, ring_dims, settings, (), half_sum, chain=False)
        layout = layout_of(kind, op if reduce else "", ring_dims, (spec,), None, codec, settings)
        plan = ShardPlan(settings, reduce, array.size if reduce else array.nbytes, code, OPS[op] if reduce else 0,
                         options, carried, shape, layout, state.agreement.digest(layout))
        if len(self._shard_plans) >= MAX_PLANS:
            self._shard_plans.clear()
        self._shard_plans[key] = plan
        self._last_shard = (*key, plan)
        return plan

    def broadcast_plan(self, array: np.ndarray, root: int, settings: Settings) -> BroadcastPlan | None:
        """The plan for a broadcast() of one host array on the route the general path takes in the core
        (engine/small.broadcast_route: in the agreement's messages or along the ring), or None."""
        key = (array.dtype, array.shape, root)
        plan = self._broadcast_plans.get(key)
        if plan is not None and plan.settings is settings:
            return plan
        state = self._state
        nbytes = array.nbytes
        if array.dtype.hasobject or not 0 <= root < state.size:
            return None
        route = broadcast_route(state, nbytes, settings)
        if route is None:
            return None
        layout = broadcast_layout(root, ((array.dtype, array.shape),))
        broadcast = BroadcastPlan(settings, root, nbytes, *route, layout, state.agreement.digest(layout))
        if len(self._broadcast_plans) >= MAX_PLANS:
            self._broadcast_plans.clear()
        self._broadcast_plans[key] = broadcast
        return broadcast
