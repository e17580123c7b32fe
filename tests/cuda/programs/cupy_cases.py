"""Runs on every rank with CuPy: arrays produced on a non-default CuPy stream, reduced by the GPU executor
(DeviceExecutor) with that stream as the caller's, then consumed on the same stream without any host
synchronization: the fences must order producer -> ddlfast -> consumer. Also a bfloat16-free DLPack round trip
(torch, if installed, is not needed)."""

from __future__ import annotations

import faulthandler
import sys

import cupy as cp
from mpi4py import MPI

from ddlfast import _core
from ddlfast.buffers import device as device_arrays
from ddlfast.config import load_settings
from ddlfast.engine import device as gpu_executor

# A hang prints every thread's stack and ends this rank, so the test fails with a trace, not pytest's timeout.
faulthandler.dump_traceback_later(150, exit=True)

comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
cp.cuda.Device(rank % cp.cuda.runtime.getDeviceCount()).use()
failures: list[str] = []
path = gpu_executor.DeviceExecutor(_core.Core(comm, 120.0))
stream = cp.cuda.Stream(non_blocking=True)
for repeat in range(5):
    with stream:
        # A slow producer, so a missing fence would let ddlfast read unfinished data.
        a = cp.full(1 << 22, rank + 1, dtype=cp.float32)
        for _ in range(20):
            a = a * 1.0 + 0.0
        b = cp.arange(1000, dtype=cp.int64) * (rank + 1)
    submission = gpu_executor.submit(device_arrays.device_buffers([a, b], rank, stream=stream))
    path.run(submission, "sum", (world,), load_settings())
    expected = world * (world + 1) / 2
    # Consumers and checks all on the caller's stream, ordered by the fence alone. (A check on the legacy default
    # stream is not ordered after a non-blocking stream's work: on an H100 such a check read `doubled` unfinished.)
    with stream:
        doubled = a * 2
        float_ok = cp.all(doubled == 2 * expected).get()
        int_ok = cp.all(b == cp.arange(1000, dtype=cp.int64) * int(expected)).get()
    if not bool(float_ok):
        failures.append(f"rank {rank} repeat {repeat}: float32 result not ordered or wrong")
    if not bool(int_ok):
        failures.append(f"rank {rank} repeat {repeat}: int64 result wrong")
path.close()
total = comm.allreduce(len(failures))
for failure in failures[:20]:
    print(failure, flush=True)
if rank == 0:
    print(f"{total} failures", flush=True)
sys.exit(1 if total else 0)
