"""Runs on every rank: every op (sum, average, min, max, product) x every dtype x every path, against NumPy
references computed here from every rank's inputs (each rank regenerates them all from seeds), and the
result's bits compared across ranks.

Paths: the ring (DDLFAST_SMALL_BYTES=0), the latency path (DDLFAST_SMALL_BYTES=1GiB: the allreduce inside the
agreement's butterfly) and MPI's allreduce with ddlfast's kernels as user ops (DDLFAST_ALGORITHM=mpi); calls:
allreduce,
fused_allreduce of three arrays, and explicit dims "2x2" at 4 ranks. min/max inputs hold nan (several
payloads, both signs), +-inf and +-0; the result must follow docs/numerics.md: nan propagates as the one
canonical quiet nan, min(-0, +0) = -0, max = +0. Products use values whose products are exact in every
type, so the reference does not depend on the order of reduction. Then the compressed wire (min/max exact
in the wire type, product refused), half-precision product overflow, and bad input: an unknown op on one
rank, ops that differ across ranks; every rank must raise DdlfastError naming the problem.

Prints "N cases on P ranks, F failures"; exits non-zero on any failure.
"""

from __future__ import annotations

import hashlib
import os
import sys

import ml_dtypes
import numpy as np
from harness import report_results
from mpi4py import MPI

import ddlfast

PATHS = {"ring": {"DDLFAST_SMALL_BYTES": "0", "DDLFAST_ALGORITHM": "auto"},
         "latency": {"DDLFAST_SMALL_BYTES": "1GiB", "DDLFAST_ALGORITHM": "auto"},
         "mpi": {"DDLFAST_SMALL_BYTES": "1GiB", "DDLFAST_ALGORITHM": "mpi"}}
OPS = ("sum", "average", "min", "max", "product")
DTYPES = {
    "float32": np.dtype(np.float32), "float64": np.dtype(np.float64), "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16), "int32": np.dtype(np.int32), "int64": np.dtype(np.int64),
}
FLOATS = ("float32", "float64", "float16", "bfloat16")
UNSIGNED = {2: np.uint16, 4: np.uint32, 8: np.uint64}
CANONICAL_NAN = {"float32": 0x7FC00000, "float64": 0x7FF8000000000000, "float16": 0x7E00, "bfloat16": 0x7FC0}
# Factors whose products over 4 ranks are exact in every float type (at most 7 significant bits), in any order.
EXACT_FACTORS = np.array([1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 1.5, -1.5, 0.75, 0.25, 0.0, -0.0])
# Over more ranks a product of 1.5s rounds in bfloat16 at some orders (1.5^6 needs 10 bits) and not at others, and
# the reduction orders differ by path (a butterfly's tree, shared memory's rank order): powers of two only.
EXACT_FACTORS_MANY_RANKS = np.array([1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 0.25, 0.0, -0.0])


def bits_of(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).view(UNSIGNED[array.dtype.itemsize])


def inputs_for(name: str, op: str, world: int, count: int, case: int) -> list[np.ndarray]:
    """Every rank's input, the same on every rank that computes it."""
    dtype = DTYPES[name]
    inputs = []
    for r in range(world):
        rng = np.random.default_rng([case, r, count])
        if name in ("int32", "int64"):
            info = np.iinfo(dtype)
            if op in ("min", "max", "product"):
                values = rng.integers(info.min, info.max, size=count, dtype=dtype, endpoint=True)
                small = rng.random(count) < 0.5
                values[small] = rng.integers(-9, 9, size=int(small.sum()))
            else:
                values = rng.integers(-1000, 1000, size=count).astype(dtype)
            inputs.append(values)
            continue
        if op == "product":
            values = rng.choice(EXACT_FACTORS if world <= 4 else EXACT_FACTORS_MANY_RANKS, size=count)
            special = rng.random(count) < 0.05
            values[special] = rng.choice([np.inf, -np.inf, np.nan], size=int(special.sum()))
        elif op in ("min", "max"):
            values = rng.standard_normal(count) * 100.0
            values[rng.random(count) < 0.2] = rng.choice([0.0, -0.0, 1.0, -1.0])  # ties and signed zeros
            values[rng.random(count) < 0.05] = rng.choice([np.inf, -np.inf])
        else:
            values = rng.integers(-8, 8, size=count).astype(np.float64)  # exact sums in every type
        array = values.astype(dtype)
        if op in ("min", "max"):  # nans of several payloads and both signs
            nan_at = np.flatnonzero(rng.random(count) < 0.04)
            payloads = rng.integers(1, 4, size=nan_at.size)
            bits = bits_of(array)
            unsigned = bits.dtype.type
            sign_bit = unsigned(1) << unsigned(8 * dtype.itemsize - 1)
            signs = np.where(rng.random(nan_at.size) < 0.5, unsigned(0), sign_bit)
            bits[nan_at] = unsigned(CANONICAL_NAN[name]) | payloads.astype(bits.dtype) | signs.astype(bits.dtype)
        inputs.append(array)
    return inputs


def zero_sign_fix(values: np.ndarray, stacked: np.ndarray, op: str) -> np.ndarray:
    """docs/numerics.md: min of zeros is -0 when any input there is -0; max is +0 when any input is +0."""
    zero = values == 0
    negative_zero = (stacked == 0) & np.signbit(stacked)
    positive_zero = (stacked == 0) & ~np.signbit(stacked)
    if op == "min":
        wants_negative = negative_zero.any(axis=0)
    else:
        wants_negative = ~positive_zero.any(axis=0)
    result = values.copy()
    result[zero] = np.where(wants_negative[zero], -0.0, 0.0)
    return result


def reference(name: str, op: str, inputs: list[np.ndarray]) -> np.ndarray:
    """The expected result in the array's dtype, computed with NumPy only."""
    dtype = DTYPES[name]
    world = len(inputs)
    if name in ("int32", "int64"):
        stacked = np.stack(inputs)
        if op == "sum":
            return stacked.sum(axis=0, dtype=dtype)
        if op == "average":
            return np.array([sum(int(x) for x in column) // world for column in stacked.T], dtype=dtype)
        if op == "product":
            return np.multiply.reduce(stacked, axis=0, dtype=dtype)  # wraps, like the engine
        return (np.minimum if op == "min" else np.maximum).reduce(stacked, axis=0)
    stacked = np.stack([x.astype(np.float64) for x in inputs])  # every input is exact in float64
    with np.errstate(all="ignore"):
        if op == "sum":
            values = stacked.sum(axis=0)
        elif op == "average":
            values = stacked.sum(axis=0) / world
        elif op == "product":
            values = np.multiply.reduce(stacked, axis=0)  # exact: the factors have few significant bits
        else:
            values = zero_sign_fix((np.minimum if op == "min" else np.maximum).reduce(stacked, axis=0), stacked, op)
        return values.astype(dtype)


def check_result(name: str, op: str, got: np.ndarray, want: np.ndarray, identity: bool = False) -> str | None:
    """identity: one rank reduces nothing, so its input comes back bit for bit (nan payloads too)."""
    if op == "average" and name in FLOATS:
        # float averages scale by 1/p (rounded) or pre-scale halves: within a few roundings of the exact value
        tolerance = {"float32": 1e-6, "float64": 1e-14, "float16": 1e-2, "bfloat16": 5e-2}[name]
        g, w = got.astype(np.float64), want.astype(np.float64)
        bad = np.flatnonzero(np.abs(g - w) > tolerance * np.maximum(1.0, np.abs(w)))
        if bad.size:
            return f"{bad.size} elements off, first at {bad[0]}: got {g[bad[0]]} want {w[bad[0]]}"
        return None
    want_bits = bits_of(want).copy()
    if name in FLOATS and not identity:
        want_bits[np.isnan(want.astype(np.float64))] = CANONICAL_NAN[name]
    got_bits = bits_of(got)
    bad = np.flatnonzero(got_bits != want_bits)
    if bad.size:
        i = bad[0]
        return (f"{bad.size} elements differ, first at {i}: got {got[i]!r} (bits {int(got_bits[i]):#x}), want "
                f"{want[i]!r} (bits {int(want_bits[i]):#x})")
    return None


def same_on_every_rank(comm: MPI.Intracomm, array: np.ndarray) -> bool:
    return len(set(comm.allgather(hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()))) == 1


def run_op(name: str, op: str, count: int, api: str, case: int, comm: MPI.Intracomm) -> str | None:
    rank, world = comm.Get_rank(), comm.Get_size()
    inputs = inputs_for(name, op, world, count, case)
    array = inputs[rank].copy()
    if api == "fused":  # three arrays: one packed pair and one array reduced where it lies
        cut = [0, min(3, count), count // 2 if count > 6 else count, count]
        parts = [array[cut[i]:cut[i + 1]].copy() for i in range(3)]
        parts = [p for p in parts if p.size] or [array]
        ddlfast.fused_allreduce(parts, op=op, comm=comm)
        array = np.concatenate(parts)
    elif api == "dims":
        ddlfast.allreduce(array, op=op, dims="2x2", comm=comm)
    else:
        ddlfast.allreduce(array, op=op, comm=comm)
    if not same_on_every_rank(comm, array):
        return "results differ in bits across ranks"
    if world == 1:
        return check_result(name, op, array, inputs[0], identity=True)
    return check_result(name, op, array, reference(name, op, inputs))


def expect_error(comm: MPI.Intracomm, call, *needles: str) -> str | None:
    """Every rank must raise DdlfastError mentioning every needle."""
    try:
        call()
        message = None
    except ddlfast.DdlfastError as error:
        message = str(error)
    messages = comm.allgather(message)
    for r, text in enumerate(messages):
        if text is None:
            return f"rank {r} raised nothing"
        missing = [needle for needle in needles if needle not in text]
        if missing:
            return f"rank {r}'s error lacks {missing}: {text}"
    return None


def compressed_cases(comm: MPI.Intracomm, case: int) -> list[tuple[str, str | None]]:
    """min/max on the fp16/bf16 wire: the wire rounding of the exact result, identical on every rank; product
    refused on every rank; min with error feedback refused."""
    rank, world = comm.Get_rank(), comm.Get_size()
    results = []
    os.environ.update(PATHS["ring"])
    for wire, wire_dtype in (("fp16", np.float16), ("bf16", ml_dtypes.bfloat16)):
        for op in ("min", "max"):
            for count in (1, 5, 1001):
                case += 1
                inputs = inputs_for("float32", op, world, count, case)
                array = inputs[rank].copy()
                ddlfast.allreduce(array, op=op, compression=wire)
                # one rank reduces nothing, so nothing is rounded to the wire
                rounded = reference("float32", op, inputs).astype(wire_dtype).astype(np.float32)
                want = inputs[0] if world == 1 else rounded
                failure = None if same_on_every_rank(comm, array) else "results differ in bits across ranks"
                results.append((f"{op} float32[{count}] compression={wire}",
                                failure or check_result("float32", op, array, want, identity=world == 1)))
        results.append((f"product compression={wire} refused", expect_error(
            comm, lambda w=wire: ddlfast.allreduce(np.ones(100, np.float32), op="product", compression=w),
            "product", "compressed wire")))
    results.append(("min with error_feedback refused", expect_error(
        comm, lambda: ddlfast.fused_allreduce([np.ones(10, np.float32), np.ones(3, np.float32)], op="min",
                                              compression="fp16", error_feedback=True), "error_feedback")))
    return results


def bad_input_cases(comm: MPI.Intracomm) -> list[tuple[str, str | None]]:
    rank = comm.Get_rank()
    results = []
    for api in ("allreduce", "fused"):
        def unknown_on_one_rank(api: str = api) -> None:
            op = "mean" if rank == comm.Get_size() - 1 else "sum"
            array = np.ones(10, np.float32)
            if api == "fused":
                ddlfast.fused_allreduce([array, np.ones(3, np.float32)], op=op)
            else:
                ddlfast.allreduce(array, op=op)
        results.append((f"unknown op on one rank ({api})",
                        expect_error(comm, unknown_on_one_rank, "'mean'", "sum, average, min, max, product")))
    if comm.Get_size() > 1:
        results.append(("ops differ across ranks", expect_error(
            comm, lambda: ddlfast.allreduce(np.ones(10, np.float32), op="min" if rank == 0 else "max"),
            "disagree")))
    results.append(("unhashable op", expect_error(
        comm, lambda: ddlfast.allreduce(np.ones(4, np.int32), op=["min"]), "not one of")))
    after = np.full(6, rank + 1, np.int64)
    ddlfast.allreduce(after, op="max")  # the context still works
    want = np.full(6, comm.Get_size(), np.int64)
    results.append(("context works after refusals", None if np.array_equal(after, want) else f"got {after}"))
    return results


def overflow_cases(comm: MPI.Intracomm) -> list[tuple[str, str | None]]:
    """A half-precision product of finite inputs that overflows is an error on every rank (as a sum's is);
    an inf that came in is IEEE's."""
    world = comm.Get_size()
    results = []
    if world < 2:
        return results
    for path, variables in PATHS.items():
        os.environ.update(variables)
        for name, big in (("float16", 300.0), ("bfloat16", 1e30)):
            array = np.full(9, big, dtype=DTYPES[name])
            results.append((f"{name} product overflow ({path})", expect_error(
                comm, lambda a=array: ddlfast.allreduce(a, op="product"), "product overflowed")))
            array = np.full(9, 2.0, dtype=DTYPES[name])
            array[0] = np.inf
            ddlfast.allreduce(array, op="product")
            want = np.full(9, 2.0**world)
            want[0] = np.inf
            ok = np.array_equal(array.astype(np.float64), want)
            results.append((f"{name} product with inf input ({path})", None if ok else f"got {array}"))
    return results


def main() -> int:
    comm = MPI.COMM_WORLD
    world = comm.Get_size()
    apis = ["allreduce", "fused"] + (["dims"] if world == 4 else [])
    results: list[tuple[str, str | None]] = []
    case = 0
    for path, variables in PATHS.items():
        os.environ.update(variables)
        for name in DTYPES:
            for op in OPS:
                for count in (1, 7, 301):
                    for api in apis:
                        case += 1
                        label = f"{op} {name}[{count}] {api} {path}"
                        try:
                            failure = run_op(name, op, count, api, case, comm)
                        except ddlfast.DdlfastError as error:
                            failure = f"raised {error}"
                        results.append((label, failure))
    results += compressed_cases(comm, case)
    results += overflow_cases(comm)
    os.environ.update(PATHS["ring"])
    results += bad_input_cases(comm)
    return report_results(comm, results)


if __name__ == "__main__":
    sys.exit(main())
