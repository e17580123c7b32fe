"""A probe whose peer does not answer raises DdlfastTimeoutError on time instead of hanging."""

from __future__ import annotations

import time

from mpi4py import MPI

from ddlfast.errors import DdlfastTimeoutError
from ddlfast.topology import probe

comm = MPI.COMM_WORLD.Dup()
LIMIT_S = 1.5
if comm.rank == 1:
    time.sleep(2 * LIMIT_S)  # "unreachable" until rank 0 has given up
start = time.monotonic()
try:
    probe.measure(comm, {"intra": (0, 1)}, LIMIT_S)
    outcome = "no error"
except DdlfastTimeoutError as error:
    outcome = f"timeout after {time.monotonic() - start:.1f}s: {error}"
print(f"rank {comm.rank}: {outcome}", flush=True)
