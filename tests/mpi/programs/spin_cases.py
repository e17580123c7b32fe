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


def expected_spin_us(comm: MPI.Intracomm) -> float:
    """DDLFAST_SPIN_US when set, else 200 us unless this host's ranks outnumber its cores (then 0), worked out
    here from MPI and the affinity mask, independently of the core."""
    if os.environ.get("DDLFAST_SPIN_US", "").strip():
        return float(os.environ["DDLFAST_SPIN_US"])
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    ranks_here = local.Get_size()
    local.Free()
    return 0.0 if ranks_here > len(os.sched_getaffinity(0)) else AUTOMATIC_SPIN_US


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--expect-error", action="store_true")
    args, rest = parser.parse_known_args()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if args.expect_error:
        try:
            ddlfast.api.default_context()
        except ddlfast.DdlfastError as error:
            print(f"rank {rank} raised: {error}")
            return 0
        print(f"rank {rank}: no error")
        return 1
    spin_us, expected = ddlfast.api.default_context()._state.core.spin_us, expected_spin_us(comm)
    wrong = comm.allgather(f"rank {rank} spins {spin_us:g} us, expected {expected:g}" if spin_us != expected else "")
    if any(wrong):
        if rank == 0:
            print("\n".join(line for line in wrong if line))
        return 1
    if rank == 0:
        print(f"every rank spins {spin_us:g} us")
    sys.argv[1:] = rest
    return allreduce_cases.main()


if __name__ == "__main__":
    sys.exit(main())
