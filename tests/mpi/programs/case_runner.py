"""What the torch test programs share: every rank's failures collected per case, and the report ("<n> failures"
on rank 0, exit status 1 on every rank if any rank failed)."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
failures: list[str] = []
torch.set_num_threads(1)


def fail(case: str, message: str) -> None:
    failures.append(f"rank {rank} [{case}]: {message}")


def case(function: Callable[[], None]) -> Callable[[], None]:
    """Run a case now (as a decorator); an exception it raises is reported as its failure."""
    try:
        function()
    except Exception as error:  # noqa: BLE001 - reported as this case's failure
        fail(function.__name__, f"raised {type(error).__name__}: {error}")
    return function


def report_and_exit(before_exit: Callable[[], None] = lambda: None) -> None:
    everyone = [f for per_rank in comm.allgather(failures) for f in per_rank]
    if rank == 0:
        print(f"{len(everyone)} failures")
        print("\n".join(everyone[:40]))
    before_exit()
    sys.exit(1 if everyone else 0)
