"""Runs on every rank: the rounding emulation (bench/rounding_error.py) against real runs, bit for bit: float32 sums
on every ring shape of P, every choice of ring or direct reduce-scatter per dimension, uncompressed and on the
fp16/bf16 wire (the core called directly, identity rank order, as the emulation assumes), float16/bfloat16 sums
on the same shapes and choices (a direct reduce-scatter adds them in float32 and rounds once), and
reproducible=True through the API (the emulation's flat direct schedule, whose owner rounds its own contribution
too).

Then the fp16 DDP hook's arithmetic (ddlfast.torch.fp16_hook: fused_allreduce_async, op="average", fp16 on the
wire) against torch's fp16_compress_hook, emulated here in NumPy: on fixed gradients, at sizes below and above
DDLFAST_SMALL_BYTES and past the latency path's reach, by the API's own choice and by the core's flat ring and
flat direct reduce-scatter, ddlfast's error must be below torch's, and its bits the same on every rank. At P=2
the direct reduce-scatter with the owner's own contribution rounded (as reproducible=True does) has exactly
torch's bits, so its error is not below. Exits non-zero on any failure."""

from __future__ import annotations

import itertools
import sys
from functools import reduce
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI
from shard_cases import factorizations  # a sibling program: every ring shape of P

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: bench/

import ddlfast  # noqa: E402
from bench.rounding_error import DATA_TYPES, emulate, gradients  # noqa: E402
from ddlfast import _core, config  # noqa: E402
from ddlfast.buffers.dtypes import DTYPE_CODES  # noqa: E402
from ddlfast.compression.wire import WIRE_CODES  # noqa: E402
from ddlfast.ops import OPS  # noqa: E402

comm = MPI.COMM_WORLD
RANK, WORLD = comm.Get_rank(), comm.Get_size()
config.MIN_CHUNK_BYTES = 64
failures: list[str] = []
cases = 0


def check(name: str, got: np.ndarray, want: np.ndarray) -> None:
    global cases
    cases += 1
    bits = np.dtype(f"uint{8 * got.itemsize}")
    if got.dtype != want.dtype or not np.array_equal(got.view(bits), want.view(bits)):
        wrong = np.flatnonzero(got.view(bits) != want.astype(got.dtype).view(bits))
        failures.append(f"rank {RANK} {name}: {wrong.size} elements differ, first at {wrong[:4].tolist()}: got "
                        f"{got[wrong[:4]].tolist()} emulated {want[wrong[:4]].tolist()}")


def torch_fp16_hook(inputs: np.ndarray) -> np.ndarray:
    """torch's fp16_compress_hook on inputs [P, n], as gloo sums fp16: each input divided by P in float32 and
    rounded to fp16 (torch's hook casts first and divides in fp16, which rounds a subnormal quotient twice: this
    is at least as accurate), summed in fp16 in rank order (every partial sum rounded), back to float32."""
    quotients = (inputs / np.float32(len(inputs))).astype(np.float16)
    return reduce(lambda a, b: (a + b).astype(np.float16), quotients).astype(np.float32)


def check_below_torch(name: str, got: np.ndarray, inputs: np.ndarray) -> None:
    """ddlfast's averaged `got` on every rank: the same bits everywhere, and nearer the exact average than torch's
    fp16 hook, norm-wise."""
    global cases
    cases += 1
    if not all(np.array_equal(got.view(np.uint32), other.view(np.uint32)) for other in comm.allgather(got)):
        failures.append(f"rank {RANK} {name}: the ranks hold different bits")
    exact = inputs.astype(np.float64).mean(axis=0)
    error = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    torch_error = np.linalg.norm(torch_fp16_hook(inputs) - exact) / np.linalg.norm(exact)
    if RANK == 0 and not error < torch_error:
        failures.append(f"{name}: relative error {error:.4g}, not below torch's fp16_compress_hook's {torch_error:.4g}")


def check_fp16_hook_against_torch(core: Any) -> None:
    """The DDP hook's arithmetic against torch's hook: 1000 elements (4 KB, below DDLFAST_SMALL_BYTES: float32
    exactly), 2049 (just above), 16384 (64 KiB, the latency path's reach where ranks outnumber cores: a
    compressed call never rides there), 300000 (past a 1 MiB chunk). Gradients without outliers, so the norm
    sums many elements' errors and not a few elements' luck."""
    small_bytes = config.DEFAULT_SMALL_BYTES
    for n in (1000, 2049, 16384, 300000):
        inputs = gradients(WORLD, n, seed=7 * n, outliers=0.0)
        got = inputs[RANK].copy()
        ddlfast.fused_allreduce_async([got], op="average", compression="fp16").wait()
        check_below_torch(f"fp16 hook's call n={n}", got, inputs)
        for direct in ((), (1,)):  # the flat ring and the flat direct reduce-scatter, whatever auto picks
            options = _core.CallOptions((WORLD,), 1 << 20, 2, small_bytes, (), (WIRE_CODES["fp16"],), direct)
            got = inputs[RANK].copy()
            core.allreduce(got.ctypes.data, n, 0, OPS["average"], options)
            core.take_overflows()
            check_below_torch(f"fp16 average n={n} direct={direct}", got, inputs)


def main() -> None:
    core = ddlfast.Context(comm)._state.core  # the engine itself, with the schedule the emulation runs
    for n in (7, 3001):
        inputs = gradients(WORLD, n, seed=n)
        for dims in factorizations(WORLD):
            for direct in itertools.product((0, 1), repeat=len(dims)):
                for wire in (None, "fp16", "bf16"):
                    codes = () if wire is None else (WIRE_CODES[wire],) * len(dims)
                    options = _core.CallOptions(dims, 256, 2, 0, (), codes, direct)
                    x = inputs[RANK].copy()
                    core.allreduce(x.ctypes.data, n, 0, OPS["sum"], options)
                    core.take_overflows()
                    want = emulate(inputs, dims, direct, wire)[RANK]
                    check(f"n={n} dims={dims} direct={direct} wire={wire}", x, want)
                for dtype in ("float16", "bfloat16"):
                    options = _core.CallOptions(dims, 256, 2, 0, (), (), direct)
                    halves = inputs.astype(DATA_TYPES[dtype])
                    x = halves[RANK].copy()
                    core.allreduce(x.ctypes.data, n, DTYPE_CODES[dtype], OPS["sum"], options)
                    want = emulate(halves, dims, direct, None, dtype)[RANK]
                    check(f"n={n} dims={dims} direct={direct} {dtype}", x, want)
        for compression in ("none", "fp16", "bf16"):
            got = ddlfast.allreduce(inputs[RANK].copy(), compression=compression, reproducible=True)
            wire = None if compression == "none" else compression
            want = emulate(inputs, (WORLD,), (1,), wire, reproducible=True)[RANK]
            check(f"n={n} reproducible=True {compression}", got, want)
        for dtype in ("float16", "bfloat16"):
            halves = inputs.astype(DATA_TYPES[dtype])
            got = ddlfast.allreduce(halves[RANK].copy(), reproducible=True)
            want = emulate(halves, (WORLD,), (1,), None, dtype, reproducible=True)[RANK]
            check(f"n={n} reproducible=True {dtype}", got, want)
    check_fp16_hook_against_torch(core)
    everyone = [f for per_rank in comm.allgather(failures) for f in per_rank]
    if RANK == 0:
        print(f"{cases} cases, {len(everyone)} failures")
        print("\n".join(everyone[:40]))
    sys.exit(1 if everyone else 0)


if __name__ == "__main__":
    main()
