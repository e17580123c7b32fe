"""Runs on every rank: checks that DDLFAST_SPIN_US (or its absence: the automatic rule) reached the core's poll
loop on every rank, then runs allreduce_cases.py's cases (NumPy reference, identical bits on every rank) with the
remaining arguments. With --expect-error (a bad DDLFAST_SPIN_US) each rank prints the error it raised instead."""

from __future__ import annotations

import argparse
import os
import sys

import allreduce_cases
from mpi4py import MPI

import ddlfast.api

AUTOMATIC_SPIN_US = 200.0  # PollBackoff::kDefaultSpinUs


def crowded(comm: MPI.Intracomm) -> bool:
    """Whether more ranks of this machine run on exactly this rank's cores than there are of them, worked out
    here from every rank's boot id and affinity mask, independently of ddlfast."""
    with open("/proc/sys/kernel/random/boot_id") as file:
        mine = (file.read().strip(), sorted(os.sched_getaffinity(0)))
    return comm.allgather(mine).count(mine) > len(mine[1])


def expected_spin_us(comm: MPI.Intracomm) -> float:
    """DDLFAST_SPIN_US when set, else 200 us unless this rank's cores are crowded (then 0)."""
    if os.environ.get("DDLFAST_SPIN_US", "").strip():
        return float(os.environ["DDLFAST_SPIN_US"])
    return 0.0 if crowded(comm) else AUTOMATIC_SPIN_US


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--expect-error", action="store_true")
    parser.add_argument("--pin", action="store_true",
                        help="pin rank r to core r mod (cores) first, as mpiexec --bind-to core does")
    args, rest = parser.parse_known_args()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if args.pin:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    if args.expect_error:
        try:
            ddlfast.api.default_context()
        except ddlfast.DdlfastError as error:
            print(f"rank {rank} raised: {error}")
            return 0
        print(f"rank {rank}: no error")
        return 1
    state = ddlfast.api.default_context()._state
    spin_us, expected = state.core.spin_us, expected_spin_us(comm)
    wrong = comm.allgather(f"rank {rank} spins {spin_us:g} us, expected {expected:g}" if spin_us != expected else "")
    oversubscribed, any_crowded = state.topology.placement.oversubscribed, any(comm.allgather(crowded(comm)))
    if oversubscribed != any_crowded and rank == 0:
        wrong.append(f"the plan sees oversubscribed={oversubscribed}, expected {any_crowded}")
    if any(wrong):
        if rank == 0:
            print("\n".join(line for line in wrong if line))
        return 1
    if rank == 0:
        print(f"every rank spins {spin_us:g} us; oversubscribed={oversubscribed}")
    sys.argv[1:] = rest
    return allreduce_cases.main()


if __name__ == "__main__":
    sys.exit(main())
