"""ddlfast: topology-aware multi-dimensional ring allreduce over MPI.

    import ddlfast
    ddlfast.fused_allreduce([grad_a, grad_b], op="average")
"""

# ruff: noqa: E402  (the MPI check runs before the modules that load the core)
from __future__ import annotations

__version__ = "0.1.0"  # the one place: pyproject.toml reads it (CHANGELOG.md has its history)

from ddlfast import mpi_check as _mpi_check

_mpi_check.verify()  # before the core is loaded: ddlfast and mpi4py must use one MPI library

from ddlfast import abort as _abort
from ddlfast.api import (
    allgather,
    allgather_async,
    allgather_object,
    allgatherv,
    allgatherv_async,
    allreduce,
    allreduce_async,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_async,
    broadcast_object,
    build_info,
    default_context,
    dump_flight_record,
    fused_allgather,
    fused_allgather_async,
    fused_allgatherv,
    fused_allgatherv_async,
    fused_allreduce,
    fused_allreduce_async,
    fused_alltoall,
    fused_alltoall_async,
    fused_reduce_scatter,
    fused_reduce_scatter_async,
    has_cuda,
    join,
    local_rank,
    local_size,
    rank,
    reduce_scatter,
    reduce_scatter_async,
    size,
    stragglers,
    topology,
)
from ddlfast.context import Context
from ddlfast.engine.agreement import StragglerWarning
from ddlfast.engine.flight import FlightWarning
from ddlfast.engine.worker import Handle
from ddlfast.errors import (
    DdlfastBrokenError,
    DdlfastConsistentError,
    DdlfastError,
    DdlfastTimeoutError,
    RanksLostError,
)
from ddlfast.fused_buffer import FusedBuffer
from ddlfast.topology.placement import TopologyWarning

_abort.install()

__all__ = [
    "join",
    "fused_allgatherv_async",
    "fused_allgatherv",
    "allgatherv_async",
    "allgatherv",
    "fused_alltoall_async",
    "fused_alltoall",
    "alltoall_async",
    "alltoall",
    "Context",
    "DdlfastError",
    "DdlfastBrokenError",
    "DdlfastConsistentError",
    "DdlfastTimeoutError",
    "FlightWarning",
    "RanksLostError",
    "FusedBuffer",
    "Handle",
    "StragglerWarning",
    "TopologyWarning",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_async",
    "barrier",
    "broadcast",
    "broadcast_async",
    "broadcast_object",
    "build_info",
    "default_context",
    "dump_flight_record",
    "fused_allreduce",
    "fused_allreduce_async",
    "fused_allgather",
    "fused_allgather_async",
    "fused_reduce_scatter",
    "fused_reduce_scatter_async",
    "has_cuda",
    "local_rank",
    "local_size",
    "rank",
    "reduce_scatter",
    "reduce_scatter_async",
    "size",
    "stragglers",
    "topology",
]
