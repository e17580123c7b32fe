"""Topology on one host, under mpiexec: detection, auto, explicit dims, topology() after async work."""

from __future__ import annotations

import json
import sys

import numpy as np
from harness import comm, expect, report_and_exit

import ddlfast
from ddlfast import topology
from ddlfast.errors import DdlfastError

check = expect


mode = sys.argv[1] if len(sys.argv) > 1 else "sync"
array = np.arange(1000, dtype=np.float32)
if mode == "async":  # the communication thread exists before topology() is asked for
    ddlfast.allreduce_async(array, dims="auto").wait()
else:
    ddlfast.allreduce(array, dims="auto")
check(np.array_equal(array, np.arange(1000, dtype=np.float32) * comm.size), "auto allreduce result")
info = topology()
check(info.placement.hosts == 1, f"one host expected, got {info.placement.hosts}")
check(info.auto_dims == (comm.size,), f"auto on one host should be flat, got {info.auto_dims}")
check(info.order == (), "one host needs no renumbering")
check(topology() is info, "topology() is decided once per context")
for dims in ("flat", (comm.size,), (1, comm.size)):
    other = np.ones(17, np.float64)
    ddlfast.allreduce(other, dims=dims)
    check(np.all(other == comm.size), f"dims {dims}")
try:
    ddlfast.allreduce(np.ones(4, np.float32), dims=(comm.size + 1,))
    check(False, "wrong product accepted")
except DdlfastError as error:
    check("multiply to" in str(error), f"wrong product message: {error}")
if comm.rank == 0:
    print(json.dumps(info.as_dict()), flush=True)
report_and_exit()
