"""Runs on every rank, all on this host: the agreement and the latency path in memory the ranks share
(src/transport/shared_agreement.cc, DDLFAST_SHARED_MEMORY).

1. It is on for every context of more than one rank here, the same on every rank; DDLFAST_SHARED_MEMORY=0 on one
   rank only turns it off on every rank (the creation agrees on it, as on a segment a rank could not map), and
   that context still gives the right numbers through the butterfly's messages.
2. The reach this host's policy gives (cost_model.latency_plan: 1 MiB where ranks outnumber cores, the latency
   limit with a core per rank): the capacity grew to it on every rank and the segment was mapped anew at it (still
   on); a call of the reach's size rode in the agreement (its flight record ends when the agreement did), one
   element more did not; sum, average, min and product at the reach, halving and whole, against NumPy and
   bit-identical on every rank.
3. Disagreements on one rank at the reach, after the layout was cached: another count, another op, one rank past
   the reach. Every rank raises, no array is written, the context works on.

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
from ddlfast.config import MAX_LATENCY_BYTES, load_settings


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


def reach_cases(comm: MPI.Intracomm) -> list[tuple[str, str | None]]:
    world = comm.Get_size()
    state = state_of(comm)
    reach = state.latency_reach(load_settings())
    capacity = comm.allgather(state.core.agreement_capacity)
    shared = comm.allgather(state.core.shared_memory)
    results = [
        ("the capacity is the reach's on every rank",
         None if capacity == [max(reach, 2 * MAX_LATENCY_BYTES)] * world else f"{capacity}, {reach}"),
        ("still in shared memory after growing", None if all(shared) else f"{shared}"),
    ]
    count = reach // 4
    rode = comm.allgather(rode_in_agreement(comm, count))
    results.append((f"float32[{count}] on the latency path", None if all(rode) else f"{rode}"))
    rode = comm.allgather(rode_in_agreement(comm, count + 1))
    results.append((f"float32[{count + 1}] off it", None if not any(rode) else f"{rode}"))
    cases = [(name, op, reach // size) for name, size in (("float32", 4), ("float64", 8), ("bfloat16", 2))
             for op in ("sum", "average", "min", "product")]
    cases += [("int32", "sum", reach // 4 - 3), ("float16", "max", 1001)]
    results += op_results(comm, cases, 30_000)
    return results + disagreements_at_reach(comm, count, count - 1, count + 1)


def main() -> int:
    world = MPI.COMM_WORLD
    results = switch_cases(world)
    if world.Get_size() > 1:
        results += reach_cases(world.Dup())
    return report_results(world, results)


if __name__ == "__main__":
    sys.exit(main())
