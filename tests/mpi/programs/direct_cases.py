"""Runs on every rank: the direct (all-to-all) reduce-scatter (DDLFAST_ALGORITHM=direct) in allreduce and
reduce_scatter, on every factorization of the world size into ring dims: all six dtypes, sum/average/min/max/
product, odd sizes, 0 and 1 elements, tiny chunks with a small receive window, the fp16/bf16 wire; the other
large-message choices (ring, rabenseifner, mpi, auto) on the same cases; and the errors (a bad or impossible
DDLFAST_ALGORITHM, one rank choosing differently after the layout was cached, bad input on one rank).

Each rank regenerates every rank's input from seeds and checks its result against a NumPy reference computed
independently; on one flat dimension the reference is the direct step's own order (coordinate 0..P-1, float32
rounding after every addition; on the wire every contribution but the owner's own rounded once to fp16/bf16 and
the owner's block once more at the end), so the check is bit for bit. Every result must have identical bits on every
rank. Exits non-zero on any failure, printing the failing cases."""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable
from functools import reduce

import harness
import ml_dtypes
import numpy as np
from mpi4py import MPI
from shard_cases import DTYPES, factorizations  # a sibling program: its checks, for every dtype and ring shape

import ddlfast
from ddlfast import config
from ddlfast.api import _context_for

OPS = ("sum", "average", "min", "max", "product")
WIRE = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}
SIZES = (0, 1, 7, 333, 2 * 1024 + 3)
# Relative to the mean magnitude of the inputs (at least 1): a few roundings of the type (float16 and bfloat16
# average pre-scale every input, engine/exact_arithmetic.h).
AVERAGE_TOLERANCE = {"float32": 1e-6, "float64": 1e-14, "float16": 4e-3, "bfloat16": 3.2e-2}

comm = MPI.COMM_WORLD
RANK, WORLD = comm.Get_rank(), comm.Get_size()
failures: list[str] = []
cases = 0


def fail(name: str, problem: str) -> None:
    failures.append(f"rank {RANK} {name}: {problem}")


def exact_input(rank: int, dtype_name: str, n: int, case: int, op: str) -> np.ndarray:
    """Values whose reduction every dtype holds exactly in any order: small integers (products: +-1 and 2)."""
    rng = np.random.default_rng([rank, case, n])
    if op == "product":
        values = rng.choice([-1, 1, 1, 2], size=n)
    else:
        values = rng.integers(-8, 9, size=n)
    return values.astype(DTYPES[dtype_name])


def exact_reference(dtype_name: str, n: int, case: int, op: str) -> np.ndarray:
    inputs = np.stack([exact_input(r, dtype_name, n, case, op).astype(np.float64) for r in range(WORLD)])
    if op == "sum":
        total = inputs.sum(axis=0)
    elif op == "product":
        total = inputs.prod(axis=0)
    elif op == "min":
        total = inputs.min(axis=0)
    elif op == "max":
        total = inputs.max(axis=0)
    elif dtype_name.startswith("int"):  # the exact integer average: floor of the exact mean
        total = np.floor_divide(inputs.astype(np.int64).sum(axis=0), WORLD)
    else:
        total = inputs.sum(axis=0) / WORLD
    return total.astype(DTYPES[dtype_name])


def same_on_every_rank(name: str, array: np.ndarray) -> None:
    digest = hashlib.sha256(np.ascontiguousarray(array).view(np.uint8).tobytes()).hexdigest()
    if len(set(comm.allgather(digest))) != 1:
        fail(name, "results differ between ranks")


def bits_equal(name: str, got: np.ndarray, want: np.ndarray) -> None:
    if got.shape != want.shape or got.dtype != want.dtype:
        fail(name, f"got {got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}")
    elif not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
        differ = np.flatnonzero(np.any(got.reshape(got.size, -1).view(np.uint8)
                                       != want.reshape(want.size, -1).view(np.uint8), axis=1))[:5]
        fail(name, f"bits differ at {differ.tolist()}: got {got[differ].tolist()} expected {want[differ].tolist()}")


def blocks(n: int) -> list[tuple[int, int]]:
    """The near-equal split of n elements into WORLD blocks (algo/ring_schedule.h block_of): (start, count)."""
    base, extra = divmod(n, WORLD)
    out, start = [], 0
    for q in range(WORLD):
        count = base + (1 if q < extra else 0)
        out.append((start, count))
        start += count
    return out


def direct_order_sum(inputs: list[np.ndarray], owner: int, wire: object | None,
                     own_rounded: bool = False) -> np.ndarray:
    """The direct step's arithmetic on one flat dimension: float32 additions in coordinate order; on the wire,
    every contribution but the owner's own rounded once (the owner's own is not sent, so not rounded; the 2-rank
    ring alike), and the sum rounded once at the end. own_rounded=True: reproducible=True's canonical order, which
    rounds the owner's own too, so the owner does not matter. One rank: nothing moves, nothing is rounded."""
    if len(inputs) == 1:
        return inputs[0]
    terms = [x if wire is None or (q == owner and not own_rounded) else x.astype(wire).astype(np.float32)
             for q, x in enumerate(inputs)]
    total = reduce(lambda a, b: (a + b).astype(np.float32), terms)
    return total if wire is None else total.astype(wire).astype(np.float32)


def random_input(rank: int, n: int, case: int) -> np.ndarray:
    return (np.random.default_rng([rank, case, n, 7]).standard_normal(n) * 3).astype(np.float32)


# -- cases ----------------------------------------------------------------------------------------------------------


def exact_cases(dims: tuple[int, ...], algorithm: str) -> None:
    """Every dtype and op, allreduce and reduce_scatter: bit-exact against the reference, same bits everywhere."""
    global cases
    for dtype_name in DTYPES:
        for op in OPS:
            for n in SIZES:
                case = 10 * list(DTYPES).index(dtype_name) + OPS.index(op)  # the same on every rank
                where = f"{algorithm} dims={dims} {dtype_name} {op} n={n}"
                x = exact_input(RANK, dtype_name, n, case, op)
                want = exact_reference(dtype_name, n, case, op)
                cases += 1
                got = ddlfast.allreduce(x.copy(), op=op, dims=dims)
                check(f"allreduce {where}", got, want, dtype_name, op, n, case)
                same_on_every_rank(f"allreduce {where}", got)
                cases += 1
                full = np.concatenate([exact_input(RANK, dtype_name, n, case + q + 1, op) for q in range(WORLD)])
                shard = ddlfast.reduce_scatter(full, op=op, dims=dims)
                mine = exact_reference(dtype_name, n, case + RANK + 1, op)
                check(f"reduce_scatter {where}", shard, mine, dtype_name, op, n, case + RANK + 1)


def check(name: str, got: np.ndarray, want: np.ndarray, dtype_name: str, op: str, n: int, case: int) -> None:
    """Bit-exact, but a float average (the division rounds, also inside the engine's prescaling of half types):
    within a few roundings of the type, relative to the mean magnitude of the inputs."""
    if op == "average" and not dtype_name.startswith("int"):
        inputs = np.stack([exact_input(r, dtype_name, n, case, op).astype(np.float64) for r in range(WORLD)])
        magnitude = np.abs(inputs).sum(axis=0) / WORLD
        error = np.abs(got.astype(np.float64) - want.astype(np.float64))
        if got.shape != want.shape or np.any(error > AVERAGE_TOLERANCE[dtype_name] * np.maximum(magnitude, 1.0)):
            fail(name, f"off by up to {float(error.max()) if error.size else 0.0}")
    else:
        bits_equal(name, got, want)


def ordered_cases(dims: tuple[int, ...]) -> None:
    """float32 sums of random values: on one flat dimension the exact bits of the direct step's fixed order,
    also through the fp16/bf16 wire (one rounding per contribution but the owner's own, one at the end)."""
    global cases
    for n in SIZES[1:]:
        inputs = [random_input(r, n, 1) for r in range(WORLD)]
        for compression in ("none", "fp16", "bf16"):
            where = f"direct dims={dims} float32 sum n={n} compression={compression}"
            cases += 1
            got = ddlfast.allreduce(inputs[RANK].copy(), dims=dims, compression=compression)
            same_on_every_rank(where, got)
            wire = WIRE.get(compression)
            if len(dims) == 1:
                want = np.empty(n, np.float32)
                for owner, (start, count) in enumerate(blocks(n)):
                    want[start:start + count] = direct_order_sum([x[start:start + count] for x in inputs], owner, wire)
                bits_equal(where, got, want)
            else:  # one rounding per dimension and one at the end, of at most the sum of magnitudes
                magnitude = np.sum(np.abs(inputs), axis=0, dtype=np.float64)
                unit = {"fp16": 2.0**-11, "bf16": 2.0**-8}.get(compression, 2.0**-24 * WORLD)
                error = np.abs(got.astype(np.float64) - np.sum(inputs, axis=0, dtype=np.float64))
                if np.any(error > (len(dims) + 1) * unit * magnitude):
                    fail(where, f"off by up to {float(error.max())}")
        if len(dims) == 1:  # reduce_scatter: rank q's block is owned by coordinate q
            cases += 1
            full = [random_input(r, n * WORLD, 2) for r in range(WORLD)]
            shard = ddlfast.reduce_scatter(full[RANK], dims=dims)
            want = direct_order_sum([x[RANK * n:(RANK + 1) * n] for x in full], RANK, None)
            bits_equal(f"reduce_scatter direct dims={dims} ordered n={n}", shard, want)


def misaligned(values: np.ndarray) -> np.ndarray:
    """A writable copy of float32 `values` that starts one byte past an element boundary: the latency path
    refuses it, so this rank takes the general path while the others take the latency path."""
    raw = bytearray(values.nbytes + 1)
    array = np.ndarray(values.shape, np.float32, buffer=raw, offset=1)
    array[...] = values
    return array


def mixed_path_cases() -> None:
    """One rank on the general path, the others on the latency path: both run the direct step (flat dims: the
    bits of its fixed order)."""
    global cases
    n = 257 * WORLD + 2
    inputs = [random_input(r, n, 4) for r in range(WORLD)]
    cases += 1
    mine = misaligned(inputs[RANK]) if RANK == WORLD - 1 else inputs[RANK].copy()
    got = np.array(ddlfast.allreduce(mine, dims=(WORLD,)))
    want = np.empty(n, np.float32)
    for owner, (start, count) in enumerate(blocks(n)):
        want[start:start + count] = direct_order_sum([x[start:start + count] for x in inputs], owner, None)
    bits_equal("latency path and general path both direct", got, want)


def auto_compressed_cases() -> None:
    """Issue 27: under auto, a compressed dimension of more than 2 ranks takes the direct step (one rounding per
    contribution but the owner's own, and one at the end) unless the cost model predicts it more than 5 % slower;
    on one host it never is. 2 ranks: the ring, whose one step rounds the one contribution sent and the sum."""
    global cases
    os.environ["DDLFAST_ALGORITHM"] = "auto"
    n = 333 * WORLD + 1
    inputs = [random_input(r, n, 3) for r in range(WORLD)]
    for compression in ("fp16", "bf16"):
        cases += 1
        got = ddlfast.allreduce(inputs[RANK].copy(), dims=(WORLD,), compression=compression)
        want = np.empty(n, np.float32)
        for owner, (start, count) in enumerate(blocks(n)):
            want[start:start + count] = direct_order_sum([x[start:start + count] for x in inputs], owner,
                                                         WIRE[compression])
        bits_equal(f"auto picks direct on the {compression} wire", got, want)
    os.environ["DDLFAST_ALGORITHM"] = "direct"


def auto_half_data_cases() -> None:
    """Issue 27: fp16/bf16 *data* summed under auto is chosen for as a 16-bit wire is: the direct step, whose
    owner adds the contributions in float32 and rounds once (the ring would round at every hop, and its error
    grow with the ranks). The result is the float32 sum in coordinate order rounded once, bit for bit."""
    global cases
    os.environ["DDLFAST_ALGORITHM"] = "auto"
    chunk_bytes, os.environ["DDLFAST_CHUNK_BYTES"] = os.environ["DDLFAST_CHUNK_BYTES"], "16KiB"
    # Past the latency path's reach (4 MiB where ranks outnumber cores, in shared memory): the direct step's sizes.
    reach = _context_for(comm)._state.latency_reach(config.load_settings())
    n = max(reach, 1 << 20) // 2 + 1
    for dtype in (np.float16, ml_dtypes.bfloat16):
        inputs = [random_input(r, n, 4).astype(dtype) for r in range(WORLD)]
        for name, call in (("allreduce", lambda x: ddlfast.allreduce(x, dims=(WORLD,))),
                           ("fused_allreduce", lambda x: ddlfast.fused_allreduce([x], dims=(WORLD,))[0])):
            cases += 1
            got = call(inputs[RANK].copy())
            want = np.empty(n, dtype)
            for owner, (start, count) in enumerate(blocks(n)):
                exact = direct_order_sum([x[start:start + count].astype(np.float32) for x in inputs], owner, None)
                want[start:start + count] = exact.astype(dtype)
            bits_equal(f"auto sums {np.dtype(dtype).name} data in float32 ({name})", got, want)
    os.environ["DDLFAST_ALGORITHM"] = "direct"
    os.environ["DDLFAST_CHUNK_BYTES"] = chunk_bytes


def raises(name: str, call: Callable[[], object], *expected: str) -> None:
    """`call` must raise DdlfastError on this rank with every `expected` text in its message."""
    global cases
    cases += 1
    try:
        call()
    except ddlfast.DdlfastError as error:
        missing = [text for text in expected if text not in str(error)]
        if missing:
            fail(name, f"error lacks {missing}: {error}")
        return
    fail(name, "no DdlfastError")


def with_algorithm(value: str | None, call: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        os.environ["DDLFAST_ALGORITHM"] = value if value is not None else "direct"
        try:
            return call()
        finally:
            os.environ["DDLFAST_ALGORITHM"] = "direct"
    return run


def error_cases() -> None:
    n = 64 * WORLD
    good = np.ones(n, np.float32)
    raises("unknown DDLFAST_ALGORITHM", with_algorithm("fastest", lambda: ddlfast.allreduce(good.copy())),
           "DDLFAST_ALGORITHM", "auto", "latency", "mpi", "ring", "rabenseifner", "direct")
    if WORLD & (WORLD - 1):
        raises("rabenseifner on a P that is no power of two",
               with_algorithm("rabenseifner", lambda: ddlfast.allreduce(good.copy())), "DDLFAST_ALGORITHM",
               "power-of-two", "choices: auto, latency, mpi, ring, rabenseifner, direct")
    if WORLD > 1:
        raises("latency above DDLFAST_SMALL_BYTES",
               with_algorithm("latency", lambda: ddlfast.allreduce(np.ones(4096, np.float32))),
               "DDLFAST_ALGORITHM=latency", "DDLFAST_SMALL_BYTES", "choices")
        last = WORLD - 1
        for _ in range(2):  # the layout is cached (and the latency path planned) before the mismatch
            ddlfast.allreduce(good.copy())
        raises("one rank chooses ring after the layout was cached",
               with_algorithm("ring" if RANK == last else "direct", lambda: ddlfast.allreduce(good.copy())),
               "disagree")
        raises("one rank chooses ring in reduce_scatter",
               with_algorithm("ring" if RANK == last else "direct", lambda: ddlfast.reduce_scatter(good.copy())),
               "disagree")
        raises("bad input on one rank",
               lambda: ddlfast.allreduce(good.copy() if RANK != last else np.ones(n + 1, np.float32)), "disagree")
        raises("bad dtype on one rank",
               lambda: ddlfast.reduce_scatter(good if RANK != last else np.ones(n, np.uint8)), "uint8")
    # After every refusal the context still works, with the direct step.
    got = ddlfast.allreduce(np.full(n, RANK, np.float32))
    global cases
    cases += 1
    if not np.array_equal(got, np.full(n, WORLD * (WORLD - 1) / 2, np.float32)):
        fail("allreduce after the refusals", f"got {got[:4].tolist()}")


def main() -> int:
    config.MIN_CHUNK_BYTES = 16  # tiny chunks: many per block, so the receive window turns over
    os.environ["DDLFAST_SMALL_BYTES"] = "0"  # every size above it: the large-message algorithms run
    os.environ["DDLFAST_CHUNK_BYTES"] = "64"
    os.environ["DDLFAST_RECEIVES_IN_FLIGHT"] = "2"
    sweep = len(sys.argv) > 1 and sys.argv[1] == "sweep"
    for dims in factorizations(WORLD):
        os.environ["DDLFAST_ALGORITHM"] = "direct"
        exact_cases(dims, "direct")
        ordered_cases(dims)
    if sweep:
        for algorithm in ("ring", "auto", "mpi") + (("rabenseifner",) if not WORLD & (WORLD - 1) else ()):
            os.environ["DDLFAST_ALGORITHM"] = algorithm
            exact_cases((WORLD,), algorithm)
    auto_compressed_cases()
    auto_half_data_cases()
    mixed_path_cases()
    os.environ["DDLFAST_ALGORITHM"] = "direct"
    os.environ["DDLFAST_SMALL_BYTES"] = "1KiB"
    error_cases()
    return harness.report(f"{cases} cases, ", own=failures)


if __name__ == "__main__":
    sys.exit(main())
