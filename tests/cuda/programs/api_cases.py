"""Runs on every rank: the public API (ddlfast.fused_allreduce, allreduce, their _async forms, broadcast)
on GPU arrays, through the Context's dispatch to the GPU path; checked against NumPy and for identical
bits on every rank. Then the bad inputs the GPU path must refuse on every rank with a clear DdlfastError.

With --emulated (no GPU needed): host memory stands in for device memory (tests/cuda/emulated_gpu.py) and
the GPU ring runs on emulated lanes, which checks the Context wiring; on a GPU the same cases run for real.
Prints "<n> failures" on rank 0."""

from __future__ import annotations

import faulthandler
import hashlib
import os
import sys
from collections.abc import Callable

import numpy as np

import ddlfast
from ddlfast.buffers import device as device_arrays
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


def inputs(owner: int, case: int, dtype: type, sizes: list[int]) -> list[np.ndarray]:
    values = np.random.default_rng([owner, case])
    if np.dtype(dtype).kind == "i":
        return [values.integers(-100, 100, n).astype(dtype) for n in sizes]
    return [values.standard_normal(n).astype(dtype) for n in sizes]


def expect(case: int, dtype: type, sizes: list[int], op: str, got: list[np.ndarray], label: str,
           tolerance: float = 1e-5) -> None:
    for i, value in enumerate(got):
        per_rank = [inputs(r, case, dtype, sizes)[i] for r in range(world)]
        if np.dtype(dtype).kind == "i":
            want = np.sum([a.astype(np.int64) for a in per_rank], axis=0)
            want = want // world if op == "average" else want  # floor of the exact sum (docs/numerics.md)
            ok = np.array_equal(value.astype(np.int64), want.astype(np.int64))
        else:
            want = np.sum([a.astype(np.float64) for a in per_rank], axis=0)
            want = want / world if op == "average" else want
            ok = np.allclose(value.astype(np.float64), want, rtol=tolerance, atol=tolerance)
        if not ok:
            failures.append(f"rank {rank} {label}: array {i} ({value.dtype}[{value.size}]) differs from NumPy")
    digest = hashlib.sha256(b"".join(v.tobytes() for v in got)).hexdigest()
    if len(set(comm.allgather(digest))) != 1:
        failures.append(f"rank {rank} {label}: ranks hold different bits")


SIZES = [0, 1, 7, 1000, 70_001, 300_000]
for case, (dtype, op) in enumerate([(np.float32, "sum"), (np.float64, "average"), (np.int32, "sum"),
                                    (np.int64, "average"), (np.float16, "sum")]):
    arrays = [DeviceArray(a, device) for a in inputs(rank, case, dtype, SIZES)]
    result = ddlfast.fused_allreduce(arrays, op=op)
    if result is not None and [id(a) for a in result] != [id(a) for a in arrays]:
        failures.append(f"rank {rank}: fused_allreduce did not return the list it was given")
    expect(case, dtype, SIZES, op, [a.get() for a in arrays], f"fused_allreduce {np.dtype(dtype)} {op}",
           2e-2 if dtype == np.float16 else 1e-5)

# A broadcast before any asynchronous call: it runs on the caller's thread (no communication thread yet).
early = DeviceArray(np.full(77, rank, np.float64), device)
ddlfast.broadcast(early, root=0)
if not np.array_equal(early.get(), np.zeros(77)):
    failures.append(f"rank {rank}: broadcast of a GPU array before any async call did not copy root's values")

# One array, and asynchronous handles outstanding together (completion in submission order).
single = DeviceArray(inputs(rank, 10, np.float32, [5000])[0], device)
if ddlfast.allreduce(single) is not single:
    failures.append(f"rank {rank}: allreduce did not return its array")
expect(10, np.float32, [5000], "sum", [single.get()], "allreduce")
first = [DeviceArray(a, device) for a in inputs(rank, 11, np.float32, [100, 200_000])]
second = DeviceArray(inputs(rank, 12, np.float64, [3333])[0], device)
handles = [ddlfast.fused_allreduce_async(first, op="average"), ddlfast.allreduce_async(second)]
if handles[1].wait() is not second:
    failures.append(f"rank {rank}: allreduce_async's handle did not return its array")
handles[0].wait()
expect(11, np.float32, [100, 200_000], "average", [a.get() for a in first], "fused_allreduce_async")
expect(12, np.float64, [3333], "sum", [second.get()], "allreduce_async")

# Compression runs on the host engine through pinned copies.
compressed = [DeviceArray(a, device) for a in inputs(rank, 13, np.float32, [10, 100_000])]
ddlfast.fused_allreduce(compressed, compression="fp16")
expect(13, np.float32, [10, 100_000], "sum", [a.get() for a in compressed], "fp16 wire", 2e-2)

# Broadcast: root's values everywhere.
target = DeviceArray(np.full(999, rank, np.float32), device)
ddlfast.broadcast(target, root=world - 1)
if not np.array_equal(target.get(), np.full(999, world - 1, np.float32)):
    failures.append(f"rank {rank}: broadcast of a GPU array did not copy root's values")

# Bad input, raised on the caller's rank before anything is sent (every rank passes the same bad call).
bad_calls = {
    "host and GPU arrays mixed": (lambda: ddlfast.fused_allreduce([DeviceArray(np.ones(4, np.float32), device),
                                                                   np.ones(4, np.float32)]),
                                  "host memory"),
    "stream with host arrays": (lambda: ddlfast.fused_allreduce([np.ones(4, np.float32)], stream=1),
                                "streams order GPU arrays only"),
    "not a stream": (lambda: ddlfast.fused_allreduce([DeviceArray(np.ones(4, np.float32), device)],
                                                     stream="fast"), "not a CUDA stream"),
    "compression of int32": (lambda: ddlfast.fused_allreduce([DeviceArray(np.ones(4, np.int32), device)],
                                                             compression="fp16"), "float32 arrays only"),
}

def with_algorithm(value: str, call: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        os.environ["DDLFAST_ALGORITHM"] = value
        try:
            call()
        finally:
            del os.environ["DDLFAST_ALGORITHM"]
    return run


# The GPU ring runs the ring reduce-scatter only (the direct step runs in its executor, but not yet from here).
bad_calls["DDLFAST_ALGORITHM=direct on GPU arrays"] = (
    with_algorithm("direct", lambda: ddlfast.allreduce(DeviceArray(np.ones(4096, np.float32), device))),
    "DDLFAST_ALGORITHM=direct")
for label, (call, words) in bad_calls.items():
    try:
        call()
        failures.append(f"rank {rank}: {label}: no error")
    except ddlfast.DdlfastError as error:
        if words not in str(error) or f"rank {rank}" not in str(error) and label != "not a stream":
            failures.append(f"rank {rank}: {label}: unclear error {error!r}")

# Rank 0 passes host memory where the others pass GPU arrays: every rank raises, naming who passed what.
mixed = [np.ones(10, np.float32)] if rank == 0 else [DeviceArray(np.ones(10, np.float32), device)]
try:
    ddlfast.fused_allreduce(mixed)
    failures.append(f"rank {rank}: host on rank 0, GPU elsewhere: no error")
except ddlfast.DdlfastError as error:
    if "rank 0 passed float32[10]" not in str(error) or "cuda float32[10]" not in str(error):
        failures.append(f"rank {rank}: host on rank 0, GPU elsewhere: unclear error {error!r}")

# The context still works after the refused calls.
after = DeviceArray(inputs(rank, 14, np.float32, [64])[0], device)
ddlfast.allreduce(after)
expect(14, np.float32, [64], "sum", [after.get()], "allreduce after refused calls")

report_and_exit()
