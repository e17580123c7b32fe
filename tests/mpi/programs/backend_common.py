"""What the "ddlfast" backend's test programs share: the process group on ddlfast, failures collected per rank,
and the report ("<n> failures" on rank 0, exit status 1 on every rank if any rank failed)."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from mpi4py import MPI

import ddlfast.torch as dt

comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
failures: list[str] = []
torch.set_num_threads(1)
dt.init_process_group(backend="ddlfast")


def fail(case: str, message: str) -> None:
    failures.append(f"rank {rank} [{case}]: {message}")


def case(function: Callable[[], None]) -> Callable[[], None]:
    """Run a case now (as a decorator); an exception it raises is reported as its failure."""
    try:
        function()
    except Exception as error:  # noqa: BLE001 - reported as this case's failure
        fail(function.__name__, f"raised {type(error).__name__}: {error}")
    return function


def report_and_exit() -> None:
    everyone = [f for per_rank in comm.allgather(failures) for f in per_rank]
    if rank == 0:
        print(f"{len(everyone)} failures")
        print("\n".join(everyone[:40]))
    dist.destroy_process_group()
    sys.exit(1 if everyone else 0)
