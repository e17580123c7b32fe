"""Runs on every rank: the rounding emulation (bench/rounding_error.py) against real runs, bit for bit: float32 sums
on every ring shape of P, every choice of ring or direct reduce-scatter per dimension, uncompressed and on the
fp16/bf16 wire (the core called directly, identity rank order, as the emulation assumes), float16/bfloat16 sums
on the same shapes and choices (a direct reduce-scatter adds them in float32 and rounds once), and
reproducible=True through the API (the emulation's flat direct schedule). Exits non-zero on any failure."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

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
            check(f"n={n} reproducible=True {compression}", got, emulate(inputs, (WORLD,), (1,), wire)[RANK])
        for dtype in ("float16", "bfloat16"):
            halves = inputs.astype(DATA_TYPES[dtype])
            got = ddlfast.allreduce(halves[RANK].copy(), reproducible=True)
            check(f"n={n} reproducible=True {dtype}", got, emulate(halves, (WORLD,), (1,), None, dtype)[RANK])
    everyone = [f for per_rank in comm.allgather(failures) for f in per_rank]
    if RANK == 0:
        print(f"{cases} cases, {len(everyone)} failures")
        print("\n".join(everyone[:40]))
    sys.exit(1 if everyone else 0)


if __name__ == "__main__":
    main()
