"""Runs on every rank: DDP on the "ddlfast" backend, and the last rank never runs backward. The others' backward
stalls, raises through DDP's C++ reducer (as torch's RuntimeError), goes uncaught, and the job must end (MPI_Abort)
within the stall limit plus a margin: no rank left waiting."""

from __future__ import annotations

import sys
import time

import torch
from backend_common import rank, world
from torch.nn.parallel import DistributedDataParallel as DDP

ddp = DDP(torch.nn.Linear(8, 3))
if rank == world - 1:
    time.sleep(float(sys.argv[1]) * 20)  # never joins; MPI_Abort from the others ends this process
    sys.exit(0)
print(f"rank {rank}: backward at {time.time():.1f}", flush=True)
ddp(torch.ones(4, 8)).sum().backward()
print(f"rank {rank}: FAIL backward returned", flush=True)
