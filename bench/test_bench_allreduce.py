"""pytest-benchmark suites: ddlfast beside mpi4py's comm.Allreduce (MPI's own algorithm), under mpiexec.

    mpiexec -n 4 python -m pytest bench/ -p no:cacheprovider --benchmark-only

Every rank runs the same tests in the same order (see conftest.py: only rank 0 reports). Each round's setup resets
the buffers from a pristine copy and meets the other ranks at a Barrier; neither is timed. Results are checked
against exact sums at the end (inputs are small integers, so float sums are exact in any order).
DDLFAST_BENCH_LARGE=1 adds 64MiB.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from statistics import median

import numpy as np
import pytest
from mpi4py import MPI

import ddlfast

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()
WORLD = COMM.Get_size()

KIB, MIB = 1 << 10, 1 << 20
LARGE = os.environ.get("DDLFAST_BENCH_LARGE", "") not in ("", "0")
SIZES = [4 * KIB, 1 * MIB, 16 * MIB] + ([64 * MIB] if LARGE else [])
ROUNDS = {4 * KIB: 200, 1 * MIB: 50, 16 * MIB: 10, 64 * MIB: 5}
WARMUP_ROUNDS = 3
FUSED_ROUNDS = 30

# ~50 gradients of a small CNN: 24 3x3 convolutions and a linear layer, weight + bias each (50 arrays, 4.7 MiB).
_CHANNELS = (
    [(3, 16)] + [(16, 16)] * 4 + [(16, 32)] + [(32, 32)] * 5 + [(32, 64)] + [(64, 64)] * 5 + [(64, 128)]
    + [(128, 128)] * 6
)
FUSED_SHAPES: list[tuple[int, ...]] = []
for _c_in, _c_out in _CHANNELS:
    FUSED_SHAPES += [(_c_out, _c_in, 3, 3), (_c_out,)]
FUSED_SHAPES += [(10, 128), (10,)]


def _label(nbytes: int) -> str:
    return f"{nbytes // MIB}MiB" if nbytes >= MIB else f"{nbytes // KIB}KiB"


def _inputs(shape: tuple[int, ...], salt: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(this rank's input, the exact sum over ranks): small integers stored as float32."""
    base = (np.arange(int(np.prod(shape)), dtype=np.int64) + salt) % 13
    mine = (base + RANK).astype(np.float32).reshape(shape)
    total = (base * WORLD + WORLD * (WORLD - 1) // 2).astype(np.float32).reshape(shape)
    return mine, total


def _run(benchmark, call: Callable[[], object], reset: Callable[[], None], rounds: int, group: str) -> None:
    """benchmark.pedantic with an untimed reset + Barrier before each round; records the slowest rank's times."""
    benchmark.group = f"{group} (P={WORLD})"
    durations: list[float] = []

    def setup() -> None:
        reset()
        COMM.Barrier()

    def timed() -> None:
        start = MPI.Wtime()
        call()
        durations.append(MPI.Wtime() - start)

    benchmark.pedantic(timed, setup=setup, rounds=rounds, warmup_rounds=WARMUP_ROUNDS, iterations=1)
    slowest = np.array(durations[WARMUP_ROUNDS:], dtype=np.float64)
    COMM.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
    benchmark.extra_info["world"] = WORLD
    benchmark.extra_info["max_rank_median_us"] = float(median(slowest.tolist())) * 1e6


@pytest.mark.parametrize("nbytes", SIZES, ids=_label)
@pytest.mark.parametrize("impl", ["ddlfast-flat", "mpi4py-Allreduce"])
def test_allreduce(benchmark, impl: str, nbytes: int) -> None:
    pristine, expected = _inputs((nbytes // 4,))
    buf = np.empty_like(pristine)
    if impl == "ddlfast-flat":
        def call() -> object:
            return ddlfast.allreduce(buf, dims="flat")
    else:
        def call() -> object:
            return COMM.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    _run(benchmark, call, lambda: np.copyto(buf, pristine), ROUNDS[nbytes], f"allreduce {_label(nbytes)} float32")
    benchmark.extra_info["bytes"] = nbytes
    np.testing.assert_array_equal(buf, expected)


@pytest.mark.parametrize("impl", ["ddlfast-fused", "ddlfast-per-array", "mpi4py-Allreduce-per-array"])
def test_fused_gradients(benchmark, impl: str) -> None:
    pairs = [_inputs(shape, salt=i) for i, shape in enumerate(FUSED_SHAPES)]
    pristine = [mine for mine, _ in pairs]
    arrays = [np.empty_like(p) for p in pristine]
    if impl == "ddlfast-fused":
        def call() -> object:
            return ddlfast.fused_allreduce(arrays)
    elif impl == "ddlfast-per-array":
        def call() -> object:
            return [ddlfast.allreduce(a) for a in arrays]
    else:
        def call() -> object:
            return [COMM.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM) for a in arrays]

    def reset() -> None:
        for target, source in zip(arrays, pristine, strict=True):
            np.copyto(target, source)

    total = sum(a.nbytes for a in arrays)
    _run(benchmark, call, reset, FUSED_ROUNDS, f"{len(arrays)} gradients, {total / MIB:.1f} MiB float32")
    benchmark.extra_info["arrays"] = len(arrays)
    benchmark.extra_info["bytes"] = total
    for result, (_, expected) in zip(arrays, pairs, strict=True):
        np.testing.assert_array_equal(result, expected)
