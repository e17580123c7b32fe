"""Runs on every rank: the last rank never joins a collective. The others must
raise DdlfastTimeoutError naming it within DDLFAST_TIMEOUT_S (plus a margin),
both when the layout is new (agreement) and when it is cached (the ring, or the latency path's butterfly)."""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI

import ddlfast

comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
missing = world - 1
mode = sys.argv[1]  # "new-context", "new-layout", "cached-layout", "cached-latency" or "cached-halving"
if mode != "new-context":
    ddlfast.default_context()  # every rank creates its context
array = np.ones(100 if mode in ("cached-latency", "cached-halving") else 300_000, np.float32)
if mode.startswith("cached"):
    ddlfast.allreduce(array)  # every rank agrees on this layout once
comm.Barrier()
if rank == missing:
    time.sleep(float(sys.argv[2]) + 3)  # never joins
    print(f"rank {rank}: skipped the collective")
    sys.exit(0)
start = time.monotonic()
try:
    ddlfast.allreduce(array)
    print(f"rank {rank}: FAIL no error")
    sys.exit(1)
except ddlfast.DdlfastTimeoutError as error:
    elapsed = time.monotonic() - start
    print(f"rank {rank}: after {elapsed:.1f} s: {error}")
    named = str(missing) in str(error) or mode == "new-context"  # a dup cannot tell who is missing
    sys.exit(0 if named else 1)
