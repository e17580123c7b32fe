"""Runs on every rank, each rank an emulated host (DDLFAST_EMULATED_HOSTS = the rank count): a latency path that
reaches past the capacity the context was created with (cost_model.latency_plan across hosts, up to
config.MAX_LATENCY_REACH_BYTES; EngineState.topology_for grows the agreement's messages alike on every rank).

A first context probes the links between the emulated hosts and caches them (DDLFAST_CACHE_DIR); rank 0 then
rewrites the cache with a high-latency network, so the second context (on a duplicate of the communicator) plans
with it and takes allreduces up to MAX_LATENCY_REACH_BYTES to the latency path.

1. The capacity grew to the topology's on every rank, and a call of the reach's size rode in the agreement's
   messages (its flight record ends when the agreement did), one past the reach did not.
2. Every op x every dtype, allreduce and fused_allreduce([x]), just above the old capacity; sum and average at
   half the reach, at the reach and one element past it; against NumPy and bit-identical on every rank.
3. Disagreements on one rank, after the layout was cached: another count (both within the reach), a call past
   the reach against ones within it, another op. Every rank raises, no array is written, the context works on.

With --crossing (8 ranks): a network on which the model's latency path wins at 128 KiB, loses to the ring at
256 KiB and wins again at 512 KiB, its reach. The engine takes each size as the topology says (Topology.latency_takes):
in the agreement's messages, on the ring, in them; sum, min and average against NumPy through allreduce and
fused_allreduce([x]); one rank at the ring's size against the others at a latency size, after the layout was
cached: every rank raises, no array is written.

Prints "N cases on P ranks, F failures"; exits non-zero on any failure.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
from harness import report_results
from latency_cases import op_results, untouched_after_error
from mpi4py import MPI
from ops_cases import DTYPES, OPS

import ddlfast
from ddlfast.api import _context_for
from ddlfast.config import CREATION_AGREEMENT_BYTES, MAX_LATENCY_BYTES, MAX_LATENCY_REACH_BYTES, load_settings

SLOW_NETWORK = [2e-3, 1e-10]  # 2 ms per message, 10 GB/s: the latency path wins up to its farthest reach
REACH = MAX_LATENCY_REACH_BYTES


# 8 hosts of a rank (tests/unit/test_topology.py's CROSSING): the latency path wins at 128 KiB and 512 KiB, not 256.
CROSSING_NETWORK = {"inter": [1.47e-6, 1.0e-9], "gamma": 1e-11}


def plant_network(comm: MPI.Intracomm, links: dict) -> None:
    ddlfast.allreduce(np.ones(4, np.float32), comm=comm)  # the first context probes and writes the cache
    if comm.Get_rank() == 0:
        (cache,) = Path(os.environ["DDLFAST_CACHE_DIR"]).glob("probe-*.json")
        data = json.loads(cache.read_text())
        data.update(links)
        cache.write_text(json.dumps(data))
    comm.Barrier()


def rode_in_agreement(comm: MPI.Intracomm, count: int) -> bool:
    """Whether a float32 sum of `count` elements ended when its agreement did (the latency path)."""
    x = np.ones(count, np.float32)
    ddlfast.allreduce(x, comm=comm)
    _, _, _, _, agreed_s, ended_s, _, _ = _context_for(comm)._state.core.flight_entries(1)[0]
    return ended_s == agreed_s


def capacity_cases(comm: MPI.Intracomm) -> list[tuple[str, str | None]]:
    state = _context_for(comm)._state
    capacity = state.core.agreement_capacity
    topology = state.topology.agreement_capacity(state.halving_bytes)
    everyone = comm.allgather(capacity)
    results = [("the capacity grew to the topology's on every rank",
                None if everyone == [REACH] * len(everyone) and topology == REACH
                else f"capacities {everyone}, topology's {topology}")]
    for count, latency in ((MAX_LATENCY_BYTES, True), (REACH // 4, True), (REACH // 4 + 1, False)):
        rode = comm.allgather(rode_in_agreement(comm, count))
        results.append((f"float32[{count}] {'on' if latency else 'off'} the latency path",
                        None if rode == [latency] * len(rode) else f"rode in the agreement: {rode}"))
    return results


def op_cases(comm: MPI.Intracomm) -> list[tuple[str, str | None]]:
    """Every op x dtype just past the creation capacity; sum and average (an integer average carries twice its
    bytes: past the capacity at the reach, so on the ring) at the reach's edge and one element past it."""
    cases = []
    for name, dtype in DTYPES.items():
        edge = REACH // dtype.itemsize
        for op in OPS:
            cases.append((name, op, CREATION_AGREEMENT_BYTES // dtype.itemsize + 3))
            if op in ("sum", "average"):
                cases += [(name, op, count) for count in (edge // 2 - 1, edge, edge + 1)]
    return op_results(comm, cases, 20_000)


def disagreements_at_reach(comm: MPI.Intracomm, count: int, other: int, past: int) -> list[tuple[str, str | None]]:
    """After float32[count] sums were cached: one rank passes float32[other] (also within the reach), one passes
    float32[past] (past the reach), one another op. Every rank raises, no array is written, the context works on."""
    rank, world = comm.Get_rank(), comm.Get_size()
    odd = world - 1
    x = np.arange(count, dtype=np.float32) + rank
    for _ in range(3):
        ddlfast.allreduce(x.copy(), comm=comm)
    another = np.arange(other, dtype=np.float32)
    beyond = np.ones(past, np.float32)
    results = [
        untouched_after_error(comm, "another count on one rank, both within the reach", {"x": x, "other": another},
                              lambda: ddlfast.allreduce(another if rank == odd else x, comm=comm), "disagree"),
        untouched_after_error(comm, "one rank past the reach, the others within", {"x": x, "past": beyond},
                              lambda: ddlfast.allreduce(beyond if rank == odd else x, comm=comm), "disagree"),
        untouched_after_error(comm, "another op on one rank", {"x": x},
                              lambda: ddlfast.allreduce(x, op="max" if rank == odd else "min", comm=comm),
                              "disagree"),
    ]
    after = np.full(count, rank + 1.0, np.float32)
    ddlfast.allreduce(after, comm=comm)
    want = np.full(count, world * (world + 1) / 2, np.float32)
    results.append(("the context works after the disagreements", None if np.array_equal(after, want) else "wrong"))
    return results


def disagreement_cases(comm: MPI.Intracomm) -> list[tuple[str, str | None]]:
    # 128 KiB calls (above the creation capacity) against 512 KiB ones, and one rank one element past the reach
    return disagreements_at_reach(comm, REACH // 8, REACH // 4, REACH // 4 + 1)


def crossing_cases(comm: MPI.Intracomm) -> list[tuple[str, str | None]]:
    state = _context_for(comm)._state
    sizes = (128 << 10, 256 << 10, 512 << 10)
    settings = load_settings()
    takes = [state.latency_takes(n, settings) for n in sizes]
    results: list[tuple[str, str | None]] = [
        ("the planted network crosses twice", None if takes == [True, False, True] else f"latency path at {takes}")]
    for n, latency in zip(sizes, takes, strict=True):
        rode = comm.allgather(rode_in_agreement(comm, n // 4))
        results.append((f"float32[{n // 4}] {'on' if latency else 'off'} the latency path",
                        None if rode == [latency] * len(rode) else f"rode in the agreement: {rode}"))
    cases = [("float32", op, n // 4) for n in sizes for op in ("sum", "min", "average")]
    results += op_results(comm, cases, 30_000)
    # After 512 KiB sums were cached (the latency path), one rank passes 256 KiB (the ring's size).
    return results + disagreements_at_reach(comm, (512 << 10) // 4, (256 << 10) // 4, (512 << 10) // 4 + 1)


def main() -> int:
    world = MPI.COMM_WORLD
    if "--crossing" in sys.argv:
        plant_network(world, CROSSING_NETWORK)
        comm = world.Dup()
        return report_results(world, crossing_cases(comm))
    if world.Get_size() == 1:  # one host: nothing to probe, no latency path; the same sizes on the ring
        return report_results(world, op_cases(world))
    plant_network(world, {"inter": SLOW_NETWORK})
    comm = world.Dup()  # a second context, planned with the rewritten cache
    return report_results(world, capacity_cases(comm) + op_cases(comm) + disagreement_cases(comm))


if __name__ == "__main__":
    sys.exit(main())
