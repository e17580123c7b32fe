"""Runs on every rank: the engine's trust cases (issue 22), one section per run (argv[1]):

  shards   fused_reduce_scatter / fused_allgather and their async forms above DDLFAST_SMALL_BYTES: several arrays
           of one dtype, mixed dtypes, uneven counts= (empty blocks too), out=, fp16/bf16 on the wire
  many     20,000 tiny arrays through fused_reduce_scatter and fused_allgather (validation is n log n)
  pieces   broadcast(_async), broadcast_object, allgather_object, a codec's allgather and the agreement's
           description exchange with control.MAX_MESSAGE_BYTES lowered, so each runs in many pieces
  zeros    average of signed zeros on every path (small and ring; allreduce, fused, reduce_scatter, async;
           float32/float64/float16/bfloat16; fp16/bf16 on the wire)
  gpu      the same for GPU arrays on emulated device lanes (the GPU executor's small path and ring)
  faults   bad input on one rank after layouts were cached and after an earlier caught error; the allgather's
           wire-overflow message

The data are small integers times the world size, so every sum and every average is exact in every dtype and the
results are compared bit for bit with an independent NumPy reference (np.add folded over the ranks' inputs: IEEE
addition, -0 + -0 = -0; np.sum starts from +0 and would not be). Results that every rank holds must also have
identical bits on every rank. Prints "<n> cases, <m> failures" and exits non-zero on any failure.
"""

from __future__ import annotations

import functools
import hashlib
import pickle
import sys
from collections.abc import Callable
from pathlib import Path

import harness
import ml_dtypes
import numpy as np
from mpi4py import MPI

import ddlfast
import ddlfast.engine.control as control
from ddlfast.compression import TopKCodec

DTYPES = {
    "float32": np.float32, "float64": np.float64, "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16, "int32": np.int32, "int64": np.int64,
}
FLOATS = ("float32", "float64", "float16", "bfloat16")

comm = MPI.COMM_WORLD
RANK, WORLD = comm.Get_rank(), comm.Get_size()
failures: list[str] = []
cases = 0
# Elements per array for the ring (above the default DDLFAST_SMALL_BYTES of 8 KiB even for a 2-byte dtype)
# and for the small path.
BIG, SMALL = 6000 * WORLD, 4 * WORLD


def fail(name: str, problem: str) -> None:
    failures.append(f"rank {RANK} {name}: {problem}")


def contribution(rank: int, dtype_name: str, size: int, case: int) -> np.ndarray:
    """WORLD * k with small integers k, and signed zeros: element i % 8 == 0 is -0.0 on every rank, i % 8 == 1
    is -0.0 on even ranks and +0.0 on odd ones (floats)."""
    rng = np.random.default_rng([rank, case, size])
    values = (WORLD * rng.integers(-8, 9, size=size)).astype(np.float64)
    if dtype_name in FLOATS:
        values[0::8] = -0.0
        values[1::8] = -0.0 if rank % 2 == 0 else 0.0
    return values.astype(DTYPES[dtype_name])


def reference(inputs: list[np.ndarray], op: str, dtype_name: str) -> np.ndarray:
    """The reduction of the ranks' inputs, folded with np.add (exact for these data)."""
    if dtype_name.startswith("int"):
        total = functools.reduce(np.add, [x.astype(np.int64) for x in inputs])
        return (total // WORLD if op == "average" else total).astype(DTYPES[dtype_name])
    total = functools.reduce(np.add, [x.astype(np.float64) for x in inputs])
    return (total / WORLD if op == "average" else total).astype(DTYPES[dtype_name])


def bit_equal(name: str, got: np.ndarray, want: np.ndarray) -> None:
    global cases
    cases += 1
    got, want = np.ascontiguousarray(got).reshape(-1), np.ascontiguousarray(want).reshape(-1)
    if got.dtype != want.dtype or got.shape != want.shape:
        fail(name, f"got {got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}")
        return
    if not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
        width = got.dtype.itemsize
        bad = np.flatnonzero((got.view(np.uint8).reshape(-1, width) != want.view(np.uint8).reshape(-1, width))
                             .any(axis=1))[:4]
        fail(name, f"bits differ at {bad.tolist()}: got {got[bad].tolist()} expected {want[bad].tolist()}")


def same_on_every_rank(name: str, array: np.ndarray) -> None:
    digests = comm.allgather(hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest())
    if len(set(digests)) != 1:
        fail(name, f"bits differ across ranks: {digests}")


def uneven(total: int, case: int) -> list[int]:
    """A split of total into WORLD blocks, the same on every rank, one of them empty when WORLD > 2."""
    rng = np.random.default_rng([case, WORLD, total])
    cuts = np.sort(rng.integers(0, total + 1, size=WORLD - 1))
    counts = np.diff(np.concatenate(([0], cuts, [total]))).tolist()
    if WORLD > 2:
        counts[0] += counts[1]
        counts[1] = 0
    return counts


# -- shards ------------------------------------------------------------------------------------------------------


def reduce_scatter_call(label: str, specs: list[tuple[str, int, bool]], op: str, compression: str | None,
                        asynchronous: bool, with_out: bool, case: int) -> None:
    """specs: (dtype, elements, uneven counts?) per array."""
    name = f"{label} fused_reduce_scatter{'_async' if asynchronous else ''} {op} {compression} out={with_out} " \
           f"{[(d, n, u) for d, n, u in specs]}"
    arrays = [contribution(RANK, d, n, case + i) for i, (d, n, _) in enumerate(specs)]
    counts = [uneven(n, case + i) if u else [n // WORLD] * WORLD for i, (_, n, u) in enumerate(specs)]
    explicit = [c if u else None for c, (_, _, u) in zip(counts, specs, strict=True)]
    outs = [np.full(c[RANK], 7, DTYPES[d]) for c, (d, _, _) in zip(counts, specs, strict=True)] if with_out else None
    kwargs = {"op": op, "counts": explicit if any(u for _, _, u in specs) else None, "out": outs,
              "compression": compression}
    try:
        if asynchronous:
            results = ddlfast.fused_reduce_scatter_async(arrays, **kwargs).wait()
        else:
            results = ddlfast.fused_reduce_scatter(arrays, **kwargs)
    except ddlfast.DdlfastError as error:
        fail(name, f"raised {type(error).__name__}: {error}")
        return
    for i, ((d, n, _), result) in enumerate(zip(specs, results, strict=True)):
        full = reference([contribution(r, d, n, case + i) for r in range(WORLD)], op, d)
        lo = sum(counts[i][:RANK])
        bit_equal(f"{name} array {i}", result, full[lo:lo + counts[i][RANK]])
        if with_out and result is not outs[i]:
            fail(name, f"array {i}: out= not returned")


def allgather_call(label: str, specs: list[tuple[str, int]], compression: str | None, asynchronous: bool,
                   with_out: bool, case: int) -> None:
    name = f"{label} fused_allgather{'_async' if asynchronous else ''} {compression} out={with_out} {specs}"
    arrays = [contribution(RANK, d, n, case + i) for i, (d, n) in enumerate(specs)]
    outs = [np.empty(WORLD * n, DTYPES[d]) for d, n in specs] if with_out else None
    try:
        if asynchronous:
            results = ddlfast.fused_allgather_async(arrays, out=outs, compression=compression).wait()
        else:
            results = ddlfast.fused_allgather(arrays, out=outs, compression=compression)
    except ddlfast.DdlfastError as error:
        fail(name, f"raised {type(error).__name__}: {error}")
        return
    for i, ((d, n), result) in enumerate(zip(specs, results, strict=True)):
        want = np.concatenate([contribution(r, d, n, case + i) for r in range(WORLD)])
        bit_equal(f"{name} array {i}", result, want)
        same_on_every_rank(f"{name} array {i}", result)


def shards() -> None:
    case = 1000
    one_dtype = [("float32", BIG, False), ("float32", BIG // 2, False), ("float32", WORLD, False)]
    mixed = [("float32", BIG, True), ("float64", BIG // 2, False), ("float32", BIG + 3, True),
             ("int32", BIG, True), ("float16", BIG, False), ("bfloat16", BIG // 3 * 3, True), ("int64", BIG, False),
             ("float64", 2 * WORLD, False), ("float16", BIG, True)]
    small = [("float32", SMALL, False), ("float32", SMALL + 1, True), ("float64", SMALL, False)]
    # Integer average (quotients and remainders) and the half types' pre-scaling and overflow check, each with
    # several arrays of one dtype.
    exact = [("int32", BIG, True), ("int32", BIG // 2, False), ("int64", BIG, False), ("int64", WORLD, True),
             ("float16", BIG, True), ("float16", BIG, False), ("bfloat16", BIG, False), ("bfloat16", 2 * WORLD, True)]
    for specs in (one_dtype, mixed, small, exact, [("float32", BIG, True), ("float32", BIG, True)]):
        for op in ("sum", "average"):
            for asynchronous in (False, True):
                for with_out in (False, True):
                    case += 100
                    reduce_scatter_call("rs", specs, op, None, asynchronous, with_out, case)
    floats32 = [("float32", BIG, False), ("float32", BIG // 2, True), ("float32", WORLD, False)]
    for compression in ("fp16", "bf16"):
        for op in ("sum", "average"):
            for asynchronous in (False, True):
                case += 100
                reduce_scatter_call("rs wire", floats32, op, compression, asynchronous, False, case)
    gathered = [[("float32", BIG // WORLD), ("float32", BIG // WORLD // 2), ("float32", 1)],
                [("float32", BIG // WORLD), ("float64", 777), ("int32", BIG // WORLD), ("float16", 5000),
                 ("bfloat16", 1), ("int64", 3000), ("float32", 4097)],
                [("float32", 3), ("float64", 2)]]
    for specs in gathered:
        for asynchronous in (False, True):
            for with_out in (False, True):
                case += 100
                allgather_call("ag", specs, None, asynchronous, with_out, case)
    for compression in ("fp16", "bf16"):
        for asynchronous in (False, True):
            case += 100
            allgather_call("ag wire", gathered[0], compression, asynchronous, False, case)
    # uint8 and complex elements are opaque bytes to an allgather.
    global cases
    cases += 1
    raw = [np.arange(20000, dtype=np.uint8) + RANK, np.full(3000, RANK + 1j, np.complex64)]
    got = ddlfast.fused_allgather(raw)
    for i, result in enumerate(got):
        want = np.concatenate([(np.arange(20000, dtype=np.uint8) + r) if i == 0 else np.full(3000, r + 1j,
                                                                                             np.complex64)
                               for r in range(WORLD)])
        bit_equal(f"ag opaque array {i}", result, want)


# -- many --------------------------------------------------------------------------------------------------------


def many() -> None:
    n = 20_000
    arrays = [np.full(2 * WORLD, RANK + i % 7, np.float32) for i in range(n)]
    shards = ddlfast.fused_reduce_scatter(arrays, op="sum")
    want = np.float32(sum(r for r in range(WORLD)) + WORLD * 0)
    for i, shard in enumerate(shards):
        bit_equal(f"many rs array {i}", shard, np.full(2, want + WORLD * (i % 7), np.float32))
    full = ddlfast.fused_allgather(shards)
    for i, array in enumerate(full):
        bit_equal(f"many ag array {i}", array, np.full(2 * WORLD, want + WORLD * (i % 7), np.float32))
    # An output that overlaps the last of many inputs is still found (and named) by the sweep.
    arrays[-1] = np.zeros(4 * WORLD, np.float32)
    outs = [None] * (n - 1) + [arrays[-1][:4]]
    expect_everywhere("many overlap", lambda: ddlfast.fused_reduce_scatter(arrays, out=outs),
                      f"out {n - 1} on rank {RANK} overlaps array {n - 1}")


# -- pieces ------------------------------------------------------------------------------------------------------


def pieces() -> None:
    control.MAX_MESSAGE_BYTES = 1000  # every collective below runs in pieces of at most 1000 bytes
    for nbytes in (0, 1, 999, 1000, 1001, 4321, 200_000):
        for asynchronous in (False, True):
            for root in sorted({0, WORLD - 1}):
                name = f"broadcast {nbytes} B root={root} async={asynchronous}"
                source = np.random.default_rng([nbytes, root]).integers(0, 256, nbytes).astype(np.uint8)
                array = source.copy() if RANK == root else np.full(nbytes, 255 - RANK, np.uint8)
                if asynchronous:
                    ddlfast.broadcast_async(array, root=root).wait()
                else:
                    ddlfast.broadcast(array, root=root)
                bit_equal(name, array, source)
    shaped = np.arange(3 * 5000, dtype=np.float64).reshape(3, 5000) * (RANK == 0)
    ddlfast.broadcast(shaped, root=0)
    bit_equal("broadcast float64[3, 5000]", shaped, np.arange(3 * 5000, dtype=np.float64).reshape(3, 5000))
    big = {"weights": np.arange(30_000, dtype=np.float32), "name": "x" * 5000} if RANK == 0 else None
    got = ddlfast.broadcast_object(big, root=0)
    global cases
    cases += 1
    if pickle.dumps(got) != pickle.dumps({"weights": np.arange(30_000, dtype=np.float32), "name": "x" * 5000}):
        fail("broadcast_object in pieces", "differs from root's object")
    # Payloads of uneven lengths, one of them empty, one far past the piece size.
    mine = b"" if RANK == 1 else bytes(range(256)) * (RANK * 40 + 1)
    gathered = ddlfast.allgather_object(mine)
    cases += 1
    if gathered != [b"" if r == 1 else bytes(range(256)) * (r * 40 + 1) for r in range(WORLD)]:
        fail("allgather_object in pieces", "differs from the ranks' objects")
    # A codec's payload exchange (Control.allgather_array) in pieces: TopK's payload is ~2 * 4 * 0.5 * n bytes.
    # (No signed zeros here: TopK's residual and decompression start from +0, which is its sparse design.)
    def grad(rank: int) -> np.ndarray:
        return np.arange(1, 4001, dtype=np.float32) * (rank + 1)
    mine = grad(RANK)
    ddlfast.fused_allreduce([mine], compression=TopKCodec(1.0))
    bit_equal("TopKCodec(1.0) allgather in pieces", mine, reference([grad(r) for r in range(WORLD)], "sum", "float32"))
    # The agreement's description exchange (allgather_bytes) in pieces: a mismatch on one rank of a layout of
    # many arrays is still reported on every rank, and the context stays usable.
    arrays = [np.zeros(3, np.float32) for _ in range(500)]
    if RANK == WORLD - 1:
        arrays[321] = np.zeros(3, np.float64)
    expect_everywhere("mismatch in pieces", lambda: ddlfast.fused_allreduce(arrays), "array 321", consistent=True)
    ok = np.full(5000, RANK, np.int64)
    ddlfast.broadcast(ok, root=0)
    bit_equal("broadcast after the mismatch", ok, np.zeros(5000, np.int64))


# -- zeros -------------------------------------------------------------------------------------------------------


def zeros() -> None:
    case = 5000
    for dtype_name in FLOATS:
        for size in (SMALL, BIG):
            wires: tuple = (None, "fp16", "bf16") if dtype_name == "float32" else (None,)
            for compression in wires:
                case += 10
                path = "small" if size == SMALL else "ring"
                label = f"zeros {dtype_name} {path} {compression}"
                inputs = [contribution(r, dtype_name, size, case) for r in range(WORLD)]
                want = reference(inputs, "average", dtype_name)
                bit_equal(f"{label} reference signs", np.signbit(want[0::8]), np.ones(len(want[0::8]), bool))
                x = inputs[RANK].copy()
                ddlfast.allreduce(x, op="average", compression=compression)
                bit_equal(f"{label} allreduce", x, want)
                x = inputs[RANK].copy()
                ddlfast.allreduce_async(x, op="average", compression=compression).wait()
                bit_equal(f"{label} allreduce_async", x, want)
                pair = [inputs[RANK].copy(), inputs[RANK][:WORLD * 3].copy()]
                ddlfast.fused_allreduce(pair, op="average", compression=compression)
                bit_equal(f"{label} fused_allreduce", pair[0], want)
                bit_equal(f"{label} fused_allreduce short",
                          pair[1], reference([i[:WORLD * 3] for i in inputs], "average", dtype_name))
                pair = [inputs[RANK].copy(), inputs[RANK].copy()]
                ddlfast.fused_allreduce_async(pair, op="average", compression=compression).wait()
                bit_equal(f"{label} fused_allreduce_async", pair[1], want)
                block = size // WORLD
                mine = want[RANK * block:(RANK + 1) * block]
                bit_equal(f"{label} reduce_scatter",
                          ddlfast.reduce_scatter(inputs[RANK], op="average", compression=compression), mine)
                bit_equal(f"{label} reduce_scatter_async",
                          ddlfast.reduce_scatter_async(inputs[RANK], op="average", compression=compression).wait(),
                          mine)
                shards = ddlfast.fused_reduce_scatter([inputs[RANK], inputs[RANK]], op="average",
                                                      compression=compression)
                bit_equal(f"{label} fused_reduce_scatter", shards[1], mine)


def zeros_on_gpu_arrays() -> None:
    """The GPU executor's paths (its small path divides after MPI's sum too) on emulated device lanes
    (tests/cuda/emulated_gpu.py: host memory behind __cuda_array_interface__, the real GPU ring executor)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from tests.cuda import emulated_gpu

    emulated_gpu.install()
    case = 7000
    for dtype_name in ("float32", "float64"):
        for size in (SMALL, BIG):
            case += 10
            label = f"zeros gpu {dtype_name} {'small' if size == SMALL else 'ring'}"
            inputs = [contribution(r, dtype_name, size, case) for r in range(WORLD)]
            want = reference(inputs, "average", dtype_name)
            x = emulated_gpu.HostArray(inputs[RANK])
            ddlfast.allreduce(x, op="average")
            bit_equal(f"{label} allreduce", x.get(), want)
            pair = [emulated_gpu.HostArray(inputs[RANK]), emulated_gpu.HostArray(inputs[RANK][:WORLD * 3])]
            ddlfast.fused_allreduce_async(pair, op="average").wait()
            bit_equal(f"{label} fused_allreduce_async", pair[0].get(), want)
            bit_equal(f"{label} fused_allreduce_async short", pair[1].get(),
                      reference([i[:WORLD * 3] for i in inputs], "average", dtype_name))


# -- faults ------------------------------------------------------------------------------------------------------


def expect_everywhere(name: str, call: Callable[[], object], text: str, consistent: bool = False) -> None:
    """`call` must raise DdlfastError (not a broken context) on every rank, its message holding `text` (a rank
    refused by another quotes that rank's message)."""
    global cases
    cases += 1
    try:
        call()
    except ddlfast.DdlfastError as error:
        if consistent and not isinstance(error, ddlfast.DdlfastConsistentError):
            fail(name, f"raised {type(error).__name__}, not DdlfastConsistentError: {error}")
        if isinstance(error, ddlfast.DdlfastBrokenError):
            fail(name, f"broke the context: {error}")
        if text not in str(error):
            fail(name, f"message {str(error)!r} lacks {text!r}")
        return
    fail(name, "did not raise")


def faults() -> None:
    specs = [("float32", BIG, False), ("float32", BIG // 2, False), ("float64", BIG, False)]
    # Layouts cached by a first good call.
    reduce_scatter_call("faults warm-up", [(d, n, u) for d, n, u in specs], "average", None, False, False, 9000)
    arrays = [contribution(RANK, d, n, 9000 + i) for i, (d, n, _) in enumerate(specs)]
    # counts= that differ on one rank only.
    counts = [None, None, uneven(BIG, 1) if RANK == WORLD - 1 else None]
    expect_everywhere("counts on one rank", lambda: ddlfast.fused_reduce_scatter(arrays, counts=counts), "rank",
                      consistent=True)
    # An out= that overlaps an input on rank 0 only, after the earlier caught error.
    outs = [arrays[0][:BIG // WORLD] if RANK == 0 else None, None, None]
    expect_everywhere("overlapping out on one rank", lambda: ddlfast.fused_reduce_scatter(arrays, out=outs),
                      "out 0 on rank 0 overlaps array 0")
    # Then the cached layout runs again, right.
    reduce_scatter_call("faults after errors", [(d, n, u) for d, n, u in specs], "average", None, False, False, 9000)
    reduce_scatter_call("faults after errors async", [(d, n, u) for d, n, u in specs], "sum", None, True, True, 9000)
    # A float16 sum that overflows in one array of several (on one rank's block only): an error on every rank.
    halves16 = [np.full(BIG, 40000 if i == 1 else 1, np.float16) for i in range(3)]
    halves16[1][:-1] = 1  # only the last element, which lies in the last rank's block
    expect_everywhere("float16 sum overflow in one block", lambda: ddlfast.fused_reduce_scatter(halves16),
                      "float16 reduce-scatter sum overflowed", consistent=True)
    reduce_scatter_call("faults after the overflow", [(d, n, u) for d, n, u in specs], "sum", None, False, False,
                        9000)
    # An allgather past fp16's range on one rank: its own message (no partial sums, no op='average').
    def values_of(rank: int) -> np.ndarray:
        values = np.full(BIG // WORLD, 1.0, np.float32)
        if rank == WORLD - 1:
            values[5] = 1e5
        return values
    values = values_of(RANK)
    for attempt in range(2):  # the second after the first was caught
        expect_everywhere(f"allgather fp16 overflow {attempt}", lambda: ddlfast.allgather(values, compression="fp16"),
                          "out of the range of fp16 on the wire", consistent=True)
    try:
        ddlfast.allgather(values, compression="fp16")
    except ddlfast.DdlfastError as error:
        if "partial sums" in str(error) or "average" in str(error):
            fail("allgather fp16 overflow", f"message speaks of sums: {error}")
    expect_everywhere("allgather_async fp16 overflow",
                      lambda: ddlfast.allgather_async(values, compression="fp16").wait(),
                      "use compression='bf16' or compression='none'", consistent=True)
    got = ddlfast.allgather(values, compression="bf16")
    bit_equal("allgather bf16 after the overflow", got,
              np.concatenate([values_of(r) for r in range(WORLD)]).astype(ml_dtypes.bfloat16).astype(np.float32))
    allgather_call("faults ag after errors", [("float32", BIG // WORLD), ("float32", 5)], "fp16", True, False, 9500)


SECTIONS = {"shards": shards, "many": many, "pieces": pieces, "zeros": zeros, "gpu": zeros_on_gpu_arrays,
            "faults": faults}

if __name__ == "__main__":
    for section in sys.argv[1:] or list(SECTIONS):
        SECTIONS[section]()
    ddlfast.barrier()
    sys.exit(harness.report(f"{cases} cases, ", own=failures))
