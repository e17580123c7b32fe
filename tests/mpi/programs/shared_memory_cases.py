"""Runs on every rank, all on this host: the agreement and the latency path in memory the ranks share
(src/transport/shared_agreement.cc, DDLFAST_SHARED_MEMORY).

1. It is on for every context of more than one rank here, the same on every rank; DDLFAST_SHARED_MEMORY=0 on one
   rank only turns it off on every rank (the creation agrees on it, as on a segment a rank could not map), and
   that context still gives the right numbers through the butterfly's messages.
2. The reach this host's policy gives (cost_model.latency_plan: 4 MiB where ranks outnumber cores, the latency
   limit with a core per rank): the capacity grew to it on every rank and the segment was mapped anew at it (still
   on); a call of the reach's size rode in the agreement (its flight record ends when the agreement did), one
   element more did not; sum, average, min and product at the reach, halving and whole, against NumPy and
   bit-identical on every rank.
3. Disagreements on one rank at the reach, after the layout was cached: another count, another op, one rank past
   the reach. Every rank raises, no array is written, the context works on.

With --slots-cannot-grow (tests/mpi/test_latency.py runs it on one core, so the reach is past the creation
capacity, with a /dev/shm too small for the reach's slots): every rank keeps its slots at the creation capacity,
still in shared memory; a call of that capacity rides in the agreement, one element more does not, and calls from
there to the reach give the right numbers on the ring.

Prints "N cases on P ranks, F failures"; exits non-zero on any failure.
"""

from __future__ import annotations

import os
import sys

import numpy as np
from harness import report_results
from latency_cases import op_results
from latency_reach_cases import disagreements_at_reach
from mpi4py import MPI

import ddlfast
from ddlfast.api import _context_for
from ddlfast.config import CREATION_AGREEMENT_BYTES, load_settings


def state_of(comm: MPI.Intracomm):
    ddlfast.allreduce(np.ones(4, np.float32), comm=comm)  # creates the context and learns the topology
    return _context_for(comm)._state


def rode_in_agreement(comm: MPI.Intracomm, count: int) -> bool:
    """Whether a float32 sum of `count` elements ended when its agreement did (the latency path)."""
    ddlfast.allreduce(np.ones(count, np.float32), comm=comm)
    _, _, _, _, agreed_s, ended_s, _, _ = _context_for(comm)._state.core.flight_entries(1)[0]
    return ended_s == agreed_s


def switch_cases(comm: MPI.Intracomm) -> list[tuple[str, str | None]]:
    rank, world = comm.Get_rank(), comm.Get_size()
    everyone = comm.allgather(state_of(comm).core.shared_memory)
    results = [("on for every rank of one host", None if everyone == [world > 1] * world else f"{everyone}")]
    if rank == world - 1:
        os.environ["DDLFAST_SHARED_MEMORY"] = "0"
    off = comm.Dup()
    everyone = comm.allgather(state_of(off).core.shared_memory)
    os.environ.pop("DDLFAST_SHARED_MEMORY", None)
    results.append(("off on every rank when one rank turns it off",
                    None if not any(everyone) else f"{everyone}"))
    x = np.arange(5000, dtype=np.float64) * (rank + 1)
    ddlfast.allreduce(x, comm=off)
    want = np.arange(5000, dtype=np.float64) * (world * (world + 1) // 2)
    results.append(("right numbers without it", None if np.array_equal(x, want) else "wrong"))
    return results


def capacity_cases(comm: MPI.Intracomm, want_capacity: int, reach: int) -> list[tuple[str, str | None]]:
    """Every rank's capacity is `want_capacity`, still in shared memory; a float32 call of the reach or the
    capacity, whichever is smaller, rides in the agreement, one element more does not."""
    state = state_of(comm)
    capacity = comm.allgather(state.core.agreement_capacity)
    shared = comm.allgather(state.core.shared_memory)
    count = min(want_capacity, reach) // 4
    on = comm.allgather(rode_in_agreement(comm, count))
    off = comm.allgather(rode_in_agreement(comm, count + 1))
    return [
        (f"capacity {want_capacity} on every rank (reach {reach})",
         None if capacity == [want_capacity] * comm.Get_size() else f"{capacity}"),
        ("still in shared memory", None if all(shared) else f"{shared}"),
        (f"float32[{count}] on the latency path", None if all(on) else f"{on}"),
        (f"float32[{count + 1}] off it", None if not any(off) else f"{off}"),
    ]


def reach_cases(comm: MPI.Intracomm) -> list[tuple[str, str | None]]:
    reach = state_of(comm).latency_reach(load_settings())
    results = capacity_cases(comm, max(reach, CREATION_AGREEMENT_BYTES), reach)
    cases = [(name, op, reach // size) for name, size in (("float32", 4), ("float64", 8), ("bfloat16", 2))
             for op in ("sum", "average", "min", "product")]
    cases += [("int32", "sum", reach // 4 - 3), ("float16", "max", 1001)]
    results += op_results(comm, cases, 30_000)
    count = reach // 4
    return results + disagreements_at_reach(comm, count, count - 1, count + 1)


def slots_kept_cases(comm: MPI.Intracomm) -> list[tuple[str, str | None]]:
    reach = state_of(comm).latency_reach(load_settings())
    kept = CREATION_AGREEMENT_BYTES
    results = [("the reach is past the creation capacity", None if reach > kept else f"reach {reach}")]
    results += capacity_cases(comm, kept, reach)
    cases = [("float32", op, kept // 4 + 1) for op in ("sum", "average", "min", "product")]
    cases += [("float64", "sum", reach // 8), ("bfloat16", "max", reach // 2)]
    return results + op_results(comm, cases, 40_000)


def main() -> int:
    world = MPI.COMM_WORLD
    if "--slots-cannot-grow" in sys.argv:
        return report_results(world, slots_kept_cases(world.Dup()))
    results = switch_cases(world)
    if world.Get_size() > 1:
        results += reach_cases(world.Dup())
    return report_results(world, results)


if __name__ == "__main__":
    sys.exit(main())
