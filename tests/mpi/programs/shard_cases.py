"""Runs on every rank: reduce_scatter and allgather for every factorization of the world size into ring dims,
all six dtypes, sum and average, odd sizes, uneven counts= (zero-size blocks too), out=, the fused and async
forms, fp16/bf16 on the wire, the small-message path (MPI's own collectives) and the ring path with many chunks,
and bad input on one rank. Each rank regenerates every rank's input from seeds and checks its result against a
NumPy reference computed independently; allgather results must also have identical bits on every rank.
Exits non-zero on any failure, printing the failing cases."""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable

import harness
import ml_dtypes
import numpy as np
from mpi4py import MPI

import ddlfast
from ddlfast import config

DTYPES = {
    "float32": np.float32, "float64": np.float64, "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16, "int32": np.int32, "int64": np.int64,
}
# Relative to sum(|x_i|) (to the result for the wire): a rounding of the type per ring step at most.
RELATIVE_TOLERANCE = {"float32": 1e-6, "float64": 1e-14, "float16": 2e-3, "bfloat16": 1.6e-2}
WIRE = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}

comm = MPI.COMM_WORLD
RANK, WORLD = comm.Get_rank(), comm.Get_size()
failures: list[str] = []
cases = 0


def factorizations(p: int) -> list[tuple[int, ...]]:
    """Every ordered factorization of p into factors >= 2 (p = 1: the one-rank ring)."""
    if p == 1:
        return [(1,)]
    found = []
    for d in range(2, p + 1):
        if p % d == 0:
            found += [(d, *rest) for rest in (factorizations(p // d) if p // d > 1 else [()])]
    return found


def contribution(rank: int, dtype_name: str, shape: tuple[int, ...], case: int, exact: bool) -> np.ndarray:
    """exact: small integers, whose sums every dtype holds exactly in any order (so results are bit-exact)."""
    rng = np.random.default_rng([rank, case])
    size = int(np.prod(shape, dtype=np.int64))
    if dtype_name.startswith("int"):
        values = rng.integers(-1000, 1000, size=size)
    elif exact:
        values = rng.integers(-8, 9, size=size).astype(np.float64)
    else:
        values = rng.standard_normal(size) * 4.0
    return values.astype(DTYPES[dtype_name]).reshape(shape)


def reduced(dtype_name: str, shape: tuple[int, ...], case: int, op: str, exact: bool) -> tuple[np.ndarray, np.ndarray]:
    """The whole reduced array (flat) and sum(|x|) per element, in int64 or float64."""
    inputs = [contribution(r, dtype_name, shape, case, exact).reshape(-1) for r in range(WORLD)]
    if dtype_name.startswith("int"):
        total = np.sum([x.astype(np.int64) for x in inputs], axis=0)
        return (total // WORLD if op == "average" else total), np.zeros(total.shape)
    stacked = np.stack([x.astype(np.float64) for x in inputs])
    total, magnitude = stacked.sum(axis=0), np.abs(stacked).sum(axis=0)
    return (total / WORLD, magnitude / WORLD) if op == "average" else (total, magnitude)


def compare(name: str, got: np.ndarray, expected: np.ndarray, magnitude: np.ndarray, dtype_name: str,
            exact: bool, tolerance: float | None = None) -> None:
    if got.shape != expected.shape:
        fail(name, f"shape {got.shape}, expected {expected.shape}")
        return
    if dtype_name.startswith("int") or exact:
        want = expected.astype(got.dtype)
        if not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
            bad = np.flatnonzero(got.astype(np.float64) != want.astype(np.float64))[:5]
            fail(name, f"not bit-exact at {bad.tolist()}: got {got[bad].tolist()} expected {want[bad].tolist()}")
        return
    relative = RELATIVE_TOLERANCE[dtype_name] if tolerance is None else tolerance
    limit = relative * (magnitude + 1e-30) * max(1, WORLD - 1)
    error = np.abs(got.astype(np.float64) - expected)
    if np.any(error > limit):
        worst = int(np.argmax(error - limit))
        fail(name, f"error {error.flat[worst]:.3g} > {limit.flat[worst]:.3g} at {worst}")


def fail(name: str, problem: str) -> None:
    failures.append(f"rank {RANK} {name}: {problem}")


def same_on_every_rank(name: str, array: np.ndarray) -> None:
    digests = comm.allgather(hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest())
    if len(set(digests)) != 1:
        fail(name, f"bits differ across ranks: {digests}")


def bounds(counts: list[int]) -> tuple[int, int]:
    return sum(counts[:RANK]), sum(counts[:RANK + 1])


# -- reduce-scatter ----------------------------------------------------------------------------------------------


def reduce_scatter_case(dims: object, dtype_name: str, op: str, shape: tuple[int, ...], counts: list[int] | None,
                        with_out: bool, compression: str | None = None) -> None:
    global cases
    cases += 1
    exact = op == "sum" and compression is None
    name = f"reduce_scatter dims={dims} {dtype_name}{list(shape)} {op} counts={counts} out={with_out} {compression}"
    array = contribution(RANK, dtype_name, shape, cases, exact)
    pristine = array.copy()
    total, magnitude = reduced(dtype_name, shape, cases, op, exact)
    per_rank = [total.size // WORLD] * WORLD if counts is None else counts
    lo, hi = bounds(per_rank)
    out = np.full(per_rank[RANK], 99, DTYPES[dtype_name]) if with_out else None
    result = ddlfast.reduce_scatter(array, op=op, dims=dims, counts=counts, out=out, compression=compression)
    if with_out and result is not out:
        fail(name, "did not return out=")
    if counts is None and shape and shape[0] % WORLD == 0 and not with_out:
        if result.shape != (shape[0] // WORLD, *shape[1:]):
            fail(name, f"result shape {result.shape}")
    if not np.array_equal(array.view(np.uint8), pristine.view(np.uint8)):
        fail(name, "the input changed")
    codec = compression or ""
    tolerance = 3e-2 if "bf16" in codec else 4e-3 if "fp16" in codec else None
    compare(name, result.reshape(-1), total[lo:hi], magnitude[lo:hi], dtype_name, exact, tolerance)


def uneven_counts(case: int, total: int) -> list[int]:
    """A random split of total into WORLD blocks, some of them empty."""
    rng = np.random.default_rng([case, WORLD])
    cuts = np.sort(rng.integers(0, total + 1, size=WORLD - 1))
    counts = np.diff(np.concatenate(([0], cuts, [total]))).tolist()
    if WORLD > 2:
        counts[1] += counts[2]
        counts[2] = 0  # always one empty block
    return counts


# -- allgather ----------------------------------------------------------------------------------------------------


def allgather_case(dims: object, dtype: object, shape: tuple[int, ...], with_out: bool,
                   compression: str | None = None) -> None:
    global cases
    cases += 1
    name = f"allgather dims={dims} {np.dtype(dtype)}{list(shape)} out={with_out} {compression}"
    inputs = [_any_dtype(r, dtype, shape, cases) for r in range(WORLD)]
    expected = np.concatenate([x if shape else x.reshape(1) for x in inputs])
    if not shape:
        expected = expected.reshape(WORLD)
    small = config.parse_size(os.environ.get("DDLFAST_SMALL_BYTES", "8KiB"), "DDLFAST_SMALL_BYTES")
    if compression is not None and expected.nbytes > small and WORLD > 1:
        # The wire rounds each value once, and the owner keeps the rounded bits (small buffers, and one rank,
        # send nothing compressed).
        wire = next(n for n in compression.split(",") if n != "none")
        expected = expected.astype(WIRE[wire]).astype(np.float32)
    out = np.zeros(expected.shape, expected.dtype) if with_out else None
    result = ddlfast.allgather(inputs[RANK], dims=dims, out=out, compression=compression)
    if with_out and result is not out:
        fail(name, "did not return out=")
    if result.shape != expected.shape or result.dtype != expected.dtype:
        fail(name, f"result {result.dtype}{result.shape}, expected {expected.dtype}{expected.shape}")
    elif not np.array_equal(result.view(np.uint8), expected.view(np.uint8)):
        fail(name, "not the ranks' arrays in rank order")
    same_on_every_rank(name, result)


def _any_dtype(rank: int, dtype: object, shape: tuple[int, ...], case: int) -> np.ndarray:
    rng = np.random.default_rng([rank, case, 7])
    dtype = np.dtype(dtype)
    raw = rng.integers(0, 256, size=int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, dtype=np.uint8)
    if dtype.kind in "fc" or dtype.name == "bfloat16":  # no nan bit patterns: values compare, not just bits
        return (rng.standard_normal(int(np.prod(shape, dtype=np.int64))) * 100).astype(dtype).reshape(shape)
    if dtype.kind == "b":
        return (raw % 2).astype(bool).reshape(shape)
    return raw.view(dtype).reshape(shape)


# -- fused and asynchronous -----------------------------------------------------------------------------------------


def fused_cases(dims: object) -> None:
    global cases
    cases += 1
    name = f"fused dims={dims}"
    specs = [("float32", (WORLD * 3, 2), None), ("int64", (WORLD * 5,), None), ("float32", (11,), "uneven"),
             ("bfloat16", (WORLD,), None)]
    arrays, expected, counts = [], [], []
    for i, (dtype_name, shape, kind) in enumerate(specs):
        arrays.append(contribution(RANK, dtype_name, shape, cases * 10 + i, True))
        total, _ = reduced(dtype_name, shape, cases * 10 + i, "sum", True)
        per = uneven_counts(cases + i, total.size) if kind else None
        counts.append(per)
        lo, hi = bounds(per if per else [total.size // WORLD] * WORLD)
        expected.append(total[lo:hi])
    for handle_form in (False, True):
        if handle_form:
            results = ddlfast.fused_reduce_scatter_async(arrays, dims=dims, counts=counts).wait()
        else:
            results = ddlfast.fused_reduce_scatter(arrays, dims=dims, counts=counts)
        for i, (r, e) in enumerate(zip(results, expected, strict=True)):
            compare(f"{name} reduce_scatter async={handle_form} array {i}", r.reshape(-1), e, e, specs[i][0], True)
    gathered_inputs = [np.full((2, 3), RANK, np.int32), np.array(RANK * 0.5), np.arange(5, dtype=np.uint8) + RANK]
    outs = [None, np.zeros(WORLD), None]
    for handle_form in (False, True):
        if handle_form:
            results = ddlfast.fused_allgather_async(gathered_inputs, dims=dims, out=outs).wait()
        else:
            results = ddlfast.fused_allgather(gathered_inputs, dims=dims, out=outs)
        want = [np.repeat(np.arange(WORLD, dtype=np.int32), 6).reshape(WORLD * 2, 3), np.arange(WORLD) * 0.5,
                np.concatenate([np.arange(5, dtype=np.uint8) + r for r in range(WORLD)])]
        if results[1] is not outs[1]:
            fail(name, "fused_allgather did not return out=")
        for i, (r, w) in enumerate(zip(results, want, strict=True)):
            if r.shape != w.shape or not np.array_equal(r, w):
                fail(f"{name} allgather async={handle_form} array {i}", f"got {r.tolist()}")
    # One handle of each kind outstanding at once; they complete in submission order.
    a = contribution(RANK, "float64", (WORLD * 4,), cases, True)
    total, _ = reduced("float64", (WORLD * 4,), cases, "sum", True)
    first = ddlfast.reduce_scatter_async(a, dims=dims)
    second = ddlfast.allgather_async(np.array([RANK], np.int64), dims=dims)
    compare(f"{name} reduce_scatter_async", first.wait(), total[RANK * 4:RANK * 4 + 4], total, "float64", True)
    if not np.array_equal(second.wait(), np.arange(WORLD)):
        fail(f"{name} allgather_async", f"got {second.wait()}")


def rank_order_case(dims: object) -> None:
    """Rank r gets block r whatever rank plays which torus position: the topology renumbers ranks when a
    launcher placed them off hosts (EngineState.rank_order), simulated here by reversing the order."""
    context = ddlfast.default_context()
    saved = context._state.rank_order
    context._state.rank_order = tuple(reversed(range(WORLD)))
    try:
        reduce_scatter_case(dims, "int64", "sum", (WORLD * 3,), None, False)
        reduce_scatter_case(dims, "int32", "average", (13,), uneven_counts(cases, 13), False)
        allgather_case(dims, np.int16, (3,), False)
    finally:
        context._state.rank_order = saved


# -- bad input on one rank ----------------------------------------------------------------------------------------


def raises(name: str, call: Callable[[], object], *needles: str) -> None:
    global cases
    cases += 1
    try:
        call()
    except ddlfast.DdlfastError as error:
        text = str(error)
        missing = [n for n in needles if n not in text]
        if missing:
            fail(name, f"message lacks {missing}: {text}")
    else:
        fail(name, "no DdlfastError")
    # The context is still usable: a good collective right after.
    check = ddlfast.allgather(np.array([RANK]))
    if not np.array_equal(check, np.arange(WORLD)):
        fail(name, f"the collective after the error gave {check}")


def bad_input_cases() -> None:
    n = 2 * WORLD
    good = np.ones(n, np.float32)
    last = WORLD - 1
    if WORLD == 1:
        return
    raises("length not a multiple", lambda: ddlfast.reduce_scatter(np.ones(n + 1, np.float32)),
           "not a multiple", f"rank {RANK}")
    raises("counts not summing on one rank",
           lambda: ddlfast.reduce_scatter(good, counts=[n + 1] + [0] * (WORLD - 1) if RANK == last else [2] * WORLD),
           "counts=", "sums to", f"rank {last}")
    raises("counts differ across ranks",
           lambda: ddlfast.reduce_scatter(good, counts=[n] + [0] * (WORLD - 1) if RANK == last else [2] * WORLD),
           "disagree on counts")
    raises("shape mismatch", lambda: ddlfast.reduce_scatter(good if RANK != last else np.ones(2 * n, np.float32)),
           "disagree on array 0", f"rank {last} passed float32[{2 * n}]")
    raises("op mismatch", lambda: ddlfast.reduce_scatter(good, op="average" if RANK == last else "sum"),
           "disagree on op")
    raises("wrong out= size",
           lambda: ddlfast.reduce_scatter(good, out=np.zeros(3 if RANK == last else 2, np.float32)),
           "out 0", "3 elements", f"rank {last}")
    raises("allgather shape mismatch", lambda: ddlfast.allgather(np.ones(3 if RANK == last else 2)),
           "disagree on array 0")
    raises("allgather wrong out= size",
           lambda: ddlfast.allgather(np.ones(2), out=np.zeros(2 * WORLD + (RANK == last))), "out 0")
    raises("allgather compression of int", lambda: ddlfast.allgather(np.ones(2, np.int32), compression="fp16"),
           "float32 arrays only")
    raises("reduce_scatter of a non-reducible dtype", lambda: ddlfast.reduce_scatter(np.ones(n, np.uint8)),
           "uint8")
    raises("out= overlapping the input on one rank",
           lambda: ddlfast.reduce_scatter(good, out=good[:2] if RANK == last else None), "overlaps")


def half_range_cases() -> None:
    """float16/bfloat16 keep allreduce's arithmetic: a sum that overflows is an error on every rank (although
    only one rank's block holds it), inf that came in stays inf, and average saturates instead of overflowing."""
    global cases
    n = 4 * WORLD
    for small_bytes in ("0", "1MiB"):
        os.environ["DDLFAST_SMALL_BYTES"] = small_bytes
        for dtype_name, big in (("float16", 40000.0), ("bfloat16", 2.0e38)):
            dtype = DTYPES[dtype_name]
            where = f"{dtype_name} small={small_bytes}"
            if WORLD > 1:
                overflowing = np.ones(n, dtype)
                overflowing[-1] = big  # in the last rank's block only
                raises(f"{where} sum overflow", lambda a=overflowing: ddlfast.reduce_scatter(a), "overflowed")
            cases += 1
            carried = np.ones(n, dtype)
            if RANK == 0:
                carried[0] = np.inf
            got = ddlfast.reduce_scatter(carried).astype(np.float64)
            want = np.full(4, float(WORLD))
            if RANK == 0:
                want[0] = np.inf
            if not np.array_equal(got, want):
                fail(f"{where} inf input", f"got {got.tolist()}")
            cases += 1
            largest = float(ml_dtypes.finfo(dtype).max)
            got = ddlfast.reduce_scatter(np.full(n, largest, dtype), op="average").astype(np.float64)
            if not (np.all(np.isfinite(got)) and np.all(np.abs(got - largest) <= largest * 1e-2)):
                fail(f"{where} average of the largest value", f"got {got.tolist()}")


# -- driver -------------------------------------------------------------------------------------------------------


def main() -> int:
    config.MIN_CHUNK_BYTES = 16  # tiny chunks: many per ring step, so the pipeline runs with small arrays
    all_dims = factorizations(WORLD)
    for dims in all_dims:
        for small_bytes, chunk in (("0", "64"), ("1MiB", "1MiB")):  # the ring path with tiny chunks; MPI's own
            os.environ["DDLFAST_SMALL_BYTES"] = small_bytes
            os.environ["DDLFAST_CHUNK_BYTES"] = chunk
            for dtype_name in DTYPES:
                for op in ("sum", "average"):
                    reduce_scatter_case(dims, dtype_name, op, (WORLD * 3, 2), None, False)
                    reduce_scatter_case(dims, dtype_name, op, (WORLD * 7 + WORLD,), None, True)
                    reduce_scatter_case(dims, dtype_name, op, (37,), uneven_counts(cases, 37), op == "sum")
                allgather_case(dims, DTYPES[dtype_name], (5, 3), dtype_name == "int32")
            for dtype in (np.uint8, np.complex128, np.bool_, np.dtype([("a", "<i4"), ("b", "<f8")])):
                allgather_case(dims, dtype, (7,), False)
            allgather_case(dims, np.float32, (), False)  # 0-d: shape (P,)
            allgather_case(dims, np.float64, (0, 4), True)
            reduce_scatter_case(dims, "float32", "sum", (0,), None, False)
            reduce_scatter_case(dims, "float64", "average", (WORLD,), None, False)  # one element each
            for codec in ("fp16", "bf16"):
                for op in ("sum", "average"):
                    reduce_scatter_case(dims, "float32", op, (WORLD * 50 + WORLD,), None, False, codec)
                    reduce_scatter_case(dims, "float32", op, (61,), uneven_counts(cases, 61), True, codec)
                allgather_case(dims, np.float32, (23,), False, codec)
            if len(dims) == 2:
                reduce_scatter_case(dims, "float32", "sum", (WORLD * 20,), None, False, "none,fp16")
                allgather_case(dims, np.float32, (9,), True, "fp16,none")
        fused_cases(dims)
        rank_order_case(dims)
    half_range_cases()
    os.environ["DDLFAST_SMALL_BYTES"] = "0"
    bad_input_cases()
    dims_text = ", ".join("x".join(map(str, d)) for d in all_dims)
    return harness.report(f"{cases} cases on {WORLD} ranks (dims {dims_text}), ", own=failures, limit=50)


if __name__ == "__main__":
    sys.exit(main())
