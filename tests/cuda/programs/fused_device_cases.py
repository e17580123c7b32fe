"""Runs on every rank (ranks may share one GPU): ddlfast.engine.device.DeviceExecutor end to end on GPU arrays (the
tests' own __cuda_array_interface__ arrays, no CuPy needed): fences, buckets, the fused pack into an
aligned bucket, large arrays reduced in place, unpack, and the caller stream ordered after the result.
Checked against NumPy (floats to a tolerance, ints exactly) and for identical bits on every rank; then
the host path (pinned copies reduced by the host engine with fp16 wire compression) the same way.

With --emulated (no GPU needed): host memory stands in for device memory and the GPU ring runs on
emulated lanes (tests/cuda/emulated_gpu.py), which checks DeviceExecutor's own logic."""

from __future__ import annotations

import faulthandler
import hashlib
import os
import sys

import numpy as np

from ddlfast import _core
from ddlfast.buffers import device as device_arrays
from ddlfast.config import load_settings
from ddlfast.engine import device as gpu_executor
from tests.mpi.programs.harness import comm, failures, rank, report_and_exit, world

# A hang prints every thread's stack and ends this rank, so the test fails with a trace, not pytest's timeout.
faulthandler.dump_traceback_later(150, exit=True)

if "--emulated" in sys.argv:
    from tests.cuda import emulated_gpu
    from tests.cuda.emulated_gpu import HostArray as DeviceArray

    emulated_gpu.install()
else:
    from tests.cuda.device_array import DeviceArray

device = rank % device_arrays.device_count()
DTYPES = [np.float32, np.float64, np.int32, np.int64, np.float16]


def arrays_for(owner: int, case: int) -> list[np.ndarray]:
    layout = np.random.default_rng(case)
    values = np.random.default_rng([owner, case])
    result = []
    dtype = DTYPES[int(layout.integers(0, len(DTYPES)))] if case % 2 else None
    for _ in range(int(layout.integers(1, 12))):
        kind = dtype or DTYPES[int(layout.integers(0, len(DTYPES)))]
        size = int(layout.choice([0, 1, 7, 100, 5000, 70_000, 300_001]))
        if np.dtype(kind).kind == "i":
            result.append(values.integers(-50, 50, size).astype(kind))
        else:
            result.append((values.standard_normal(size) * 3).astype(kind))
    return result


def ring_arrays(owner: int, case: int, op: str) -> list[np.ndarray]:
    """arrays_for, with an average's integer and float16 arrays made float64 and float32: the GPU ring averages
    those two only (the others' exact averages are the host engine's, engine/device.py, and the ring refuses them)."""
    if op != "average":
        return arrays_for(owner, case)
    return [a.astype(np.float64 if a.dtype.kind == "i" else np.float32) if a.dtype not in (np.float32, np.float64)
            else a for a in arrays_for(owner, case)]


def check(case: int, op: str, got: list[np.ndarray], label: str) -> None:
    for i, value in enumerate(got):
        inputs = [ring_arrays(r, case, op)[i] for r in range(world)]
        total = np.sum([a.astype(np.float64) for a in inputs], axis=0)
        want = total / world if op == "average" else total
        if value.dtype.kind == "i":
            want = np.sum([a.astype(np.int64) for a in inputs], axis=0)
            ok = np.array_equal(value.astype(np.int64), want.astype(np.int64))
        else:
            tolerance = 2e-2 if value.dtype == np.float16 else 1e-4
            ok = np.allclose(value.astype(np.float64), want, rtol=tolerance, atol=tolerance)
        if not ok:
            failures.append(f"rank {rank} {label} array {i} ({value.dtype}, {value.size}) is wrong")
    digest = hashlib.sha256(b"".join(v.tobytes() for v in got)).hexdigest()
    if len(set(comm.allgather(digest))) != 1:
        failures.append(f"rank {rank} {label}: ranks hold different bits")


host = _core.Core(comm, 120.0)
path = gpu_executor.DeviceExecutor(host)
settings_list = [("64KiB", "4KiB"), ("1MiB", "64KiB"), ("64MiB", "512KiB"), ("300000", "5000")]
for case in range(12):
    bucket, chunk = settings_list[case % len(settings_list)]
    os.environ["DDLFAST_BUCKET_BYTES"] = bucket
    os.environ["DDLFAST_FIRST_BUCKET_BYTES"] = "16KiB"
    os.environ["DDLFAST_CHUNK_BYTES"] = chunk
    op = "average" if case % 3 == 0 else "sum"
    arrays = [DeviceArray(a, device, offset=8 * (i % 3)) for i, a in enumerate(ring_arrays(rank, case, op))]
    buffers = device_arrays.device_buffers(arrays, rank)
    submission = gpu_executor.submit(buffers)
    path.run(submission, op, (world,), load_settings(), wait_on_host=case % 2 == 0)
    check(case, op, [a.get() for a in arrays], f"device path case {case} ({bucket}, {chunk}, {op})")

# The host path: float32 arrays with fp16 wire compression, through pinned copies.
for case in (1, 3, 5):
    arrays = [DeviceArray(a.astype(np.float32), device) for a in arrays_for(rank, case)]
    submission = gpu_executor.submit(device_arrays.device_buffers(arrays, rank))
    copies = path.to_host(submission)
    live = [c for c in copies if c.size]
    if live:
        host.allreduce_segments([c.ctypes.data for c in live], [c.size for c in live], 0, 0,
                                _core.CallOptions((world,), 1 << 20, 4, 0, (), (0,)))
    path.from_host(submission, copies)
    got = [a.get() for a in arrays]
    for i, value in enumerate(got):
        want = np.sum([arrays_for(r, case)[i].astype(np.float32) for r in range(world)], axis=0)
        if not np.allclose(value, want, rtol=2e-2, atol=5e-2):
            failures.append(f"rank {rank} host path case {case}: array {i} is wrong")

path.close()
host.close()
report_and_exit()
