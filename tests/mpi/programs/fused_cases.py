"""Runs on every rank: fused_allreduce over lists of arrays of mixed sizes and
dtypes (small ones packed, large ones reduced in place as segments), under
bucket and chunk sizes that force many buckets and chunks split at array
boundaries; every array is checked against a NumPy reference and for
identical bits on all ranks."""

from __future__ import annotations

import hashlib
import os

import numpy as np
from harness import comm, failures, rank, report_and_exit, world

import ddlfast

DTYPES = [np.float32, np.float64, np.int32, np.int64, np.float16]


def arrays_for(owner: int, case: int) -> list[np.ndarray]:
    layout = np.random.default_rng(case)  # the same layout on every rank
    values = np.random.default_rng([owner, case])
    result = []
    for _ in range(int(layout.integers(1, 12))):
        dtype = DTYPES[int(layout.integers(0, len(DTYPES)))]
        size = int(layout.choice([0, 1, 7, 100, 5000, 70_000, 300_001]))
        if np.dtype(dtype).kind == "i":
            result.append(values.integers(-50, 50, size).astype(dtype))
        else:
            result.append((values.standard_normal(size) * 3).astype(dtype))
    return result


settings = [("64KiB", "4KiB"), ("1MiB", "64KiB"), ("64MiB", "512KiB"), ("300000", "5000")]
for case in range(12):
    bucket, chunk = settings[case % len(settings)]
    os.environ["DDLFAST_BUCKET_BYTES"] = bucket
    os.environ["DDLFAST_FIRST_BUCKET_BYTES"] = "16KiB"
    os.environ["DDLFAST_CHUNK_BYTES"] = chunk
    op = "average" if case % 3 == 0 else "sum"
    mine = arrays_for(rank, case)
    ddlfast.fused_allreduce(mine, op=op)
    for i, got in enumerate(mine):
        inputs = [arrays_for(r, case)[i] for r in range(world)]
        if got.dtype.kind == "i":
            total = np.sum([a.astype(np.int64) for a in inputs], axis=0)
            expected = total // world if op == "average" else total  # floor of the exact sum
            ok = np.array_equal(got.astype(np.int64), expected)
        else:
            stacked = np.stack([a.astype(np.float64) for a in inputs])
            expected = stacked.sum(0) / (world if op == "average" else 1)
            tolerance = (2e-3 if got.dtype == np.float16 else 1e-5) * (np.abs(stacked).sum(0) + 1) * world
            ok = bool(np.all(np.abs(got.astype(np.float64) - expected) <= tolerance))
        if not ok:
            failures.append(f"rank {rank} case {case} array {i} {got.dtype}[{got.size}] {op}: wrong values")
        digests = comm.allgather(hashlib.sha256(got.tobytes()).hexdigest())
        if len(set(digests)) != 1:
            failures.append(f"rank {rank} case {case} array {i}: bits differ across ranks")

report_and_exit()
