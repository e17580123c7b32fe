"""Runs on every rank: new_group(timeout=2 s) on the "ddlfast" backend, with DDLFAST_TIMEOUT_S at 120 s. Rank 0
alone calls an allreduce above the small-message limit (argv[1]: "allreduce") or a barrier ("barrier") on that
group; it must raise DdlfastTimeoutError worded as torch's backends word it ("Timed out", naming the group's
timeout), after 2 s and long before DDLFAST_TIMEOUT_S. The others wait in an MPI barrier of their own."""

from __future__ import annotations

import datetime
import sys
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

import ddlfast.torch as dt
from ddlfast.errors import DdlfastTimeoutError

dt.init_process_group(backend="ddlfast")
rank = dist.get_rank()
control = MPI.COMM_WORLD.Dup()
group = dist.new_group(list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=2))
before = torch.ones(64 * 1024)  # 256 KiB: above DDLFAST_SMALL_BYTES
dist.all_reduce(before, group=group)  # the group works
ok = bool((before == dist.get_world_size()).all())
if rank == 0:
    start = time.monotonic()
    try:
        if sys.argv[1] == "barrier":
            dist.barrier(group=group)
        else:
            dist.all_reduce(torch.ones(64 * 1024), group=group)
        print("rank 0: FAIL the lone collective returned", flush=True)
    except DdlfastTimeoutError as error:
        elapsed = time.monotonic() - start
        worded = " Timed out (2 s, the group's timeout=)" in str(error)
        print(f"rank 0: {'ok' if worded and 2.0 <= elapsed < 60 and ok else 'FAIL'} after {elapsed:.1f} s: "
              f"{str(error)[:300]}", flush=True)
control.Barrier()
