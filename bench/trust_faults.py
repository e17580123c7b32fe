"""The trust issue's agreement faults, injected on rank 1: the time from the fault to the error on every rank
(each rank's time inside the failing call; every rank enters it right after a barrier). A report, not a test
(tests/mpi/test_trust_agreement.py asserts).

    .venv/bin/mpiexec -n 2 .venv/bin/python bench/trust_faults.py
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

import ddlfast

comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()

class BadOp(str):
    """An op whose validation raises `failure` (a str subclass: it passes isinstance(op, str))."""

    failure: BaseException = RuntimeError("injected")

    def __hash__(self) -> int:
        raise self.failure

    def __eq__(self, other: object) -> bool:
        raise self.failure


def timed(action) -> tuple[float, str]:
    comm.Barrier()
    start = time.perf_counter()
    try:
        action()
        what = "no error"
    except BaseException as error:  # noqa: BLE001 - reported
        what = type(error).__name__
    return (time.perf_counter() - start) * 1e3, what


results = {}
x = np.ones(70_000, np.float32)
for label, size in (("4KiB", 1024), ("64MiB", 16 << 20)):
    y = np.ones(size, np.float32)
    ddlfast.allreduce(y, name=0)
    results[f"named skip, allreduce {label}"] = timed(lambda y=y: ddlfast.allreduce(y, name=2 if rank == 1 else 1))
    results[f"RuntimeError while validating, allreduce {label}"] = timed(
        lambda y=y: ddlfast.allreduce(y, op=BadOp("sum") if rank == 1 else "sum"))
BadOp.failure = KeyboardInterrupt()
results["KeyboardInterrupt while validating, fused 2x280KB"] = timed(
    lambda: ddlfast.fused_allreduce([x, x.copy()], op=BadOp("sum") if rank == 1 else "sum"))
rows = comm.gather(results, root=0)
if rank == 0:
    for key in results:
        print(f"P={world} {key}: " + ", ".join(f"rank {r} {rows[r][key][0]:.2f} ms ({rows[r][key][1]})"
                                               for r in range(world)))
