"""Across emulated hosts: what topology detection saw, and exact results for auto, flat, explicit dims and MPI.

Prints one JSON line (rank 0) and "<n> failures". With --straddle DIMS, also expects those dims to be refused.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from mpi4py import MPI

import ddlfast
import ddlfast.api
from ddlfast import topology
from ddlfast.errors import DdlfastError

parser = argparse.ArgumentParser()
parser.add_argument("--count", type=int, default=1_000_003)
parser.add_argument("--dims", default="auto,flat")
parser.add_argument("--straddle", default="")
args = parser.parse_args()
comm = MPI.COMM_WORLD
info = topology()
failures = []
for dims in [d for d in args.dims.split(",") if d] + ["mpi"]:
    for dtype in (np.float32, np.int64):
        data = ((np.arange(args.count) % 5) * (comm.rank + 1)).astype(dtype)
        expected = ((np.arange(args.count) % 5) * (comm.size * (comm.size + 1) // 2)).astype(dtype)
        if dims == "mpi":
            comm.Allreduce(MPI.IN_PLACE, data)
        else:
            ddlfast.fused_allreduce([data, data[:3].copy()], dims=dims)
        if not np.array_equal(data, expected):
            failures.append(f"rank {comm.rank}: dims {dims} {np.dtype(dtype).name} wrong")
if args.straddle:
    try:
        ddlfast.allreduce(np.ones(8, np.float32), dims=args.straddle)
        failures.append(f"rank {comm.rank}: dims {args.straddle} were accepted")
    except DdlfastError as error:
        if "would split hosts" not in str(error):
            failures.append(f"rank {comm.rank}: unexpected error {error}")
failures = [f for per_rank in comm.allgather(failures) for f in per_rank]
names = comm.allgather(MPI.Get_processor_name())
spins = comm.allgather(ddlfast.api.default_context()._state.core.spin_us)
if comm.rank == 0:
    print(json.dumps({**info.as_dict(), "processor_names": names, "spin_us": spins}))
    print(f"{len(failures)} failures", failures)
