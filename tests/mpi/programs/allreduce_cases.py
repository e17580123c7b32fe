"""Runs on every rank: allreduce many (dims, dtype, count, op) cases and check
each against a NumPy reference computed independently on every rank (each
rank regenerates all ranks' inputs from their seeds), plus identical bits on
all ranks. Exits non-zero on any failure, printing the failing cases."""

from __future__ import annotations

import argparse
import hashlib
import sys

import harness
import ml_dtypes
import numpy as np
from mpi4py import MPI

import ddlfast

DTYPES = {
    "float32": np.float32, "float64": np.float64, "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16, "int32": np.int32, "int64": np.int64,
}
# Relative to sum(|x_i|): one rounding of the wire type per ring step at most.
RELATIVE_TOLERANCE = {"float32": 1e-6, "float64": 1e-14, "float16": 1e-3, "bfloat16": 8e-3}


def contribution(rank: int, dtype_name: str, count: int, case: int) -> np.ndarray:
    rng = np.random.default_rng([rank, count, case])
    if dtype_name.startswith("int"):
        values = rng.integers(-1000, 1000, size=count)
    else:
        values = rng.standard_normal(count) * 4.0
    return values.astype(DTYPES[dtype_name])


def reference(world: int, dtype_name: str, count: int, case: int, op: str) -> tuple[np.ndarray, np.ndarray]:
    inputs = [contribution(r, dtype_name, count, case) for r in range(world)]
    if dtype_name.startswith("int"):
        total = np.sum(np.stack(inputs).astype(np.int64), axis=0) if count else np.zeros(0, np.int64)
        if op == "average":
            total = total // world  # floor of the exact sum (no int64 overflow at these input sizes)
        return total, np.zeros(count)
    stacked = np.stack(inputs).astype(np.float64) if count else np.zeros((world, 0))
    total = stacked.sum(axis=0)
    magnitude = np.abs(stacked).sum(axis=0)
    if op == "average":
        total, magnitude = total / world, magnitude / world
    return total, magnitude


def check_case(comm, dims, dtype_name: str, count: int, op: str, case: int) -> str | None:
    rank, world = comm.Get_rank(), comm.Get_size()
    array = contribution(rank, dtype_name, count, case)
    returned = ddlfast.allreduce(array, op=op, dims=dims, comm=comm)
    if returned is not array:
        return "allreduce did not return the array it reduced in place"
    digest = hashlib.sha256(array.tobytes()).hexdigest()
    digests = comm.allgather(digest)
    if len(set(digests)) != 1:
        return f"results differ in bits across ranks: {digests}"
    expected, magnitude = reference(world, dtype_name, count, case, op)
    got = array.astype(np.float64) if not dtype_name.startswith("int") else array.astype(np.int64)
    if dtype_name.startswith("int"):
        if not np.array_equal(got, expected):
            bad = np.flatnonzero(got != expected)[:5]
            return f"int mismatch at {bad.tolist()}: got {got[bad].tolist()} expected {expected[bad].tolist()}"
        return None
    tolerance = RELATIVE_TOLERANCE[dtype_name] * (magnitude + 1e-30) * max(1, world - 1)
    error = np.abs(got - expected)
    if np.any(error > tolerance):
        worst = int(np.argmax(error - tolerance))
        return (f"float error {error[worst]:.3g} > {tolerance[worst]:.3g} at {worst} "
                f"(got {got[worst]}, expected {expected[worst]})")
    return None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", required=True, help="semicolon-separated list, e.g. 'flat;2x4;2x2x2'")
    parser.add_argument("--large", type=int, default=1_000_003)
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    world = comm.Get_size()
    counts = [0, 1, max(world - 1, 0), world + 1, 97, args.large]
    failures = []
    cases = 0
    for dims in args.dims.split(";"):
        for dtype_name in args.dtypes.split(","):
            for count in dict.fromkeys(counts):
                for op in ("sum", "average"):
                    cases += 1
                    problem = check_case(comm, dims, dtype_name, count, op, cases)
                    if problem:
                        failures.append(f"rank {comm.Get_rank()} dims={dims} {dtype_name}[{count}] {op}: {problem}")
    return harness.report(f"{cases} cases on {world} ranks, ", own=failures, limit=50)


if __name__ == "__main__":
    sys.exit(main())
