"""Runs on every rank: the numbers at the edges of each type (src/engine/exact_arithmetic.h), on the ring
(DDLFAST_SMALL_BYTES=0) and on the small-message path (DDLFAST_SMALL_BYTES=1GiB):

- int32/int64 average at the range edges equals NumPy's `sum(as Python ints) // p`, identical bits on every rank;
- float16/bfloat16 average of values near the largest finite value is finite and within rounding of the float64
  reference / p, and the two paths agree within that rounding;
- a float16/bfloat16 sum that overflows raises DdlfastError on every rank (also when another element's input is
  inf), and the context keeps working after it;
- inf/nan in an input gives inf/nan (IEEE), no error.

Prints "N cases on P ranks, F failures"; exits non-zero on any failure.
"""

from __future__ import annotations

import hashlib
import os
import sys

import harness
import ml_dtypes
import numpy as np
from mpi4py import MPI

import ddlfast

PATHS = {"ring": "0", "small": "1GiB"}
HALVES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
LARGEST = {name: float(ml_dtypes.finfo(dtype).max) for name, dtype in HALVES.items()}


def int_inputs(name: str, world: int, count: int, case: int) -> list[np.ndarray]:
    """Every rank's input: the type's edges (the same edge on every rank, and mixed) and random values."""
    dtype = np.dtype(name)
    info = np.iinfo(dtype)
    edges = [info.min, info.max, info.min + 1, info.max - 1, 0, -1, 1, 2**30, -(2**30), info.max // 2 + 1]
    inputs = []
    for rank in range(world):
        rng = np.random.default_rng([case, rank, count])
        values = rng.integers(info.min, info.max, size=count, dtype=dtype, endpoint=True)
        small = rng.random(count) < 0.3
        values[small] = rng.integers(-5 * world, 5 * world, size=int(small.sum()))
        head = min(count, 2 * len(edges))
        values[:head] = (edges + edges[rank % len(edges):] + edges[:rank % len(edges)])[:head]
        inputs.append(values)
    return inputs


def half_inputs(name: str, world: int, count: int, case: int, near_max: bool) -> list[np.ndarray]:
    largest = LARGEST[name]
    inputs = []
    for rank in range(world):
        rng = np.random.default_rng([case, rank, count])
        if near_max:
            values = rng.uniform(0.9, 1.0, count) * largest * rng.choice([-1.0, 1.0], count)
            values[:4] = [largest, -largest, largest, largest if rank % 2 else -largest]
        else:
            values = rng.standard_normal(count) * 3.0
        inputs.append(values.astype(HALVES[name]))
    return inputs


def same_on_every_rank(comm: MPI.Intracomm, array: np.ndarray) -> bool:
    digests = comm.allgather(hashlib.sha256(array.tobytes()).hexdigest())
    return len(set(digests)) == 1


def check_int_average(comm: MPI.Intracomm, name: str, count: int, api: str, case: int) -> str | None:
    rank, world = comm.Get_rank(), comm.Get_size()
    inputs = int_inputs(name, world, count, case)
    array = inputs[rank].copy()
    if api == "fused":  # several segments: one large array where it lies, two small ones packed
        cut = [0, 3, count // 2, count]
        parts = [array[cut[i]:cut[i + 1]].copy() for i in range(3)]
        ddlfast.fused_allreduce(parts, op="average")
        array = np.concatenate(parts)
    else:
        ddlfast.allreduce(array, op="average")
    if not same_on_every_rank(comm, array):
        return "results differ in bits across ranks"
    want = np.sum(np.stack(inputs).astype(object), axis=0) // world if count else np.zeros(0, object)
    got = array.astype(object)
    bad = np.flatnonzero(got != want)
    if bad.size:
        first = bad[:4]
        return f"{bad.size} wrong, first at {first.tolist()}: got {got[first].tolist()} want {want[first].tolist()}"
    return None


def check_half_average(comm: MPI.Intracomm, name: str, count: int, near_max: bool, case: int) -> tuple:
    rank, world = comm.Get_rank(), comm.Get_size()
    inputs = half_inputs(name, world, count, case, near_max)
    array = inputs[rank].copy()
    ddlfast.allreduce(array, op="average")
    if not same_on_every_rank(comm, array):
        return "results differ in bits across ranks", array
    got = array.astype(np.float64)
    if not np.all(np.isfinite(got)):
        return f"non-finite average at {np.flatnonzero(~np.isfinite(got))[:4].tolist()}", array
    stacked = np.stack(inputs).astype(np.float64)
    want, magnitude = stacked.mean(axis=0), np.abs(stacked).mean(axis=0)
    # One rounding per scaled input, one per add: 2p roundings of at most |x|/p each, plus the subnormal step.
    tolerance = 2 * world * UNIT_ROUNDOFF[name] * magnitude + 2.0**-24
    error = np.abs(got - want)
    if np.any(error > tolerance):
        worst = int(np.argmax(error - tolerance))
        return (f"error {error[worst]:.4g} > {tolerance[worst]:.4g} at {worst} "
                f"(got {got[worst]}, want {want[worst]})"), array
    return None, array


def expect_overflow(comm: MPI.Intracomm, name: str, count: int, with_inf_elsewhere: bool, case: int) -> str | None:
    rank, world = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng([case, rank])
    array = (rng.standard_normal(count) * 3.0).astype(HALVES[name])
    at = count // 2
    array[at] = 0.75 * LARGEST[name]  # every rank: the sum of two is already past the largest finite value
    if with_inf_elsewhere and rank == world - 1:
        array[0] = np.inf
    raised = ""
    try:
        ddlfast.allreduce(array, op="sum")
    except ddlfast.DdlfastError as error:
        raised = str(error)
    outcomes = comm.allgather(raised)
    wrong = [r for r, text in enumerate(outcomes) if f"{name} sum overflowed: 1 of {count} elements" not in text]
    if wrong:
        return f"ranks {wrong} did not raise the overflow error: {outcomes}"
    after = np.full(5, rank, HALVES[name])  # the context still works
    ddlfast.allreduce(after, op="sum")
    if not np.all(after.astype(np.float64) == world * (world - 1) / 2):
        return f"the call after the error gave {after}"
    return None


def check_nonfinite_inputs(comm: MPI.Intracomm, name: str, op: str, case: int) -> str | None:
    """inf, -inf and nan in inputs go through as IEEE says (no error), beside large finite values."""
    rank, world = comm.Get_rank(), comm.Get_size()
    count = 40
    array = np.full(count, 1.0, HALVES[name])
    array[10] = 0.75 * LARGEST[name]  # at the same element as an inf input: inf, not an overflow
    if rank == 0:
        array[3], array[10], array[20] = np.inf, np.inf, np.inf
    if rank == world - 1:
        array[5], array[20] = np.nan, -np.inf
    if world == 1 or rank == 1:
        array[7] = -np.inf
    try:
        ddlfast.allreduce(array, op=op)
    except ddlfast.DdlfastError as error:
        return f"raised {error}"
    if not same_on_every_rank(comm, array):
        return "results differ in NaN-ness or bits across ranks"
    got = array.astype(np.float64)
    if not (got[3] == np.inf and np.isnan(got[5]) and got[7] == -np.inf and got[10] == np.inf):
        return f"got {got[[3, 5, 7, 10]].tolist()} at 3, 5, 7, 10; want inf, nan, -inf, inf"
    if world > 1 and not np.isnan(got[20]):
        return f"inf + -inf gave {got[20]}, not nan"
    rest = np.delete(got, [3, 5, 7, 10, 20])
    want = world if op == "sum" else 1.0  # average: p scaled terms, each rounded
    if not np.allclose(rest, want, rtol=2 * world * UNIT_ROUNDOFF[name], atol=0):
        return f"finite elements {rest[:5]} != {want}"
    return None


def main() -> int:
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    failures: list[str] = []
    cases = 0

    def record(what: str, problem: str | None) -> None:
        nonlocal cases
        cases += 1
        if problem:
            failures.append(f"rank {rank} {what}: {problem}")

    for path, small_bytes in PATHS.items():
        os.environ["DDLFAST_SMALL_BYTES"] = small_bytes
        for name in ("int32", "int64"):
            for count in (1, 7, 20, 1001, 100_003):
                record(f"{path} {name}[{count}] average",
                       check_int_average(comm, name, count, "allreduce", cases))
            record(f"{path} {name} fused average", check_int_average(comm, name, 150_001, "fused", cases))
        for name in HALVES:
            for near_max in (True, False):
                for count in (5, 1000, 50_001):
                    problem, result = check_half_average(comm, name, count, near_max, cases)
                    record(f"{path} {name}[{count}] average near_max={near_max}", problem)
            for with_inf in (False, True):
                for count in (9, 30_001):
                    record(f"{path} {name}[{count}] sum overflow (inf elsewhere: {with_inf})",
                           expect_overflow(comm, name, count, with_inf, cases))
            for op in ("sum", "average"):
                record(f"{path} {name} {op} of inf/nan inputs", check_nonfinite_inputs(comm, name, op, cases))

    # The two paths agree with each other within the half type's rounding.
    for name in HALVES:
        results = {}
        for path, small_bytes in PATHS.items():
            os.environ["DDLFAST_SMALL_BYTES"] = small_bytes
            _, results[path] = check_half_average(comm, name, 999, True, 12345)
        a, b = results["ring"].astype(np.float64), results["small"].astype(np.float64)
        tolerance = 2 * world * UNIT_ROUNDOFF[name] * LARGEST[name]
        record(f"{name} ring vs small path", None if np.all(np.abs(a - b) <= tolerance) else
               f"differ by {np.max(np.abs(a - b)):.4g} > {tolerance:.4g}")

    return harness.report(f"{cases} cases on {world} ranks, ", own=failures)


if __name__ == "__main__":
    sys.exit(main())
