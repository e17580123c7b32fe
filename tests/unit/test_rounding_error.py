"""The rounding emulation (bench/rounding_error.py) without MPI: its flat direct schedule against an independent
computation of the canonical order (reproducible=True's) and of the default order (the owner's own contribution
unrounded), the per-element worst-case bound of that order, and the error table's numbers at small p as bounds
(fixed seeds: the same numbers every run). Its bits against real runs: tests/mpi/test_rounding_emulation.py."""

from __future__ import annotations

from functools import reduce

import ml_dtypes
import numpy as np
import pytest

from bench.rounding_error import emulate, gradients, one_rounding, relative_error

UNIT = {"fp16": 2.0**-11, "bf16": 2.0**-8}  # unit roundoff of round-to-nearest-even
SUBNORMAL_STEP = {"fp16": 2.0**-24, "bf16": 0.0}  # bf16 has float32's range: its subnormals are far below these
WIRE = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}


def canonical(inputs: np.ndarray, wire: str | None, owner: int | None = None) -> np.ndarray:
    """Rank order, float32 additions; on the wire each input rounded once (but `owner`'s) and the sum once."""
    terms = [x if wire is None or q == owner else x.astype(WIRE[wire]).astype(np.float32)
             for q, x in enumerate(inputs)]
    total = reduce(lambda a, b: (a + b).astype(np.float32), terms)
    return total if wire is None else total.astype(WIRE[wire]).astype(np.float32)


@pytest.mark.parametrize("ranks", [2, 3, 8, 13])
@pytest.mark.parametrize("wire", [None, "fp16", "bf16"])
def test_flat_direct_is_the_canonical_order(ranks: int, wire: str | None) -> None:
    inputs = gradients(ranks, 1001, seed=ranks)
    result = emulate(inputs, (ranks,), (1,), wire, reproducible=True)
    want = canonical(inputs, wire)
    for rank in range(ranks):
        assert np.array_equal(result[rank].view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("ranks", [2, 3, 8])
@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_flat_direct_adds_the_owners_own_contribution_unrounded(ranks: int, wire: str) -> None:
    """Outside reproducible=True the owner of each block (block q: rank q; the first count % p blocks one element
    longer, algo/ring_schedule.h) adds its own values as they are: one wire rounding fewer than the canonical
    order."""
    count = 1001
    inputs = gradients(ranks, count, seed=ranks)
    result = emulate(inputs, (ranks,), (1,), wire)
    bounds = np.cumsum([0] + [count // ranks + (q < count % ranks) for q in range(ranks)])
    want = np.concatenate([canonical(inputs[:, bounds[q]:bounds[q + 1]], wire, owner=q) for q in range(ranks)])
    for rank in range(ranks):
        assert np.array_equal(result[rank].view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("reproducible", [True, False])
@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_flat_direct_within_its_worst_case_bound(wire: str, reproducible: bool) -> None:
    """|result - sum| <= u sum|x| (inputs rounded) + (p-1) u32 sum|x~| (float32 additions) + u |s~| (one final
    rounding), plus the subnormal steps, element by element (the owner's own input unrounded only lowers it)."""
    ranks = 64
    inputs = gradients(ranks, 4096, seed=5)
    exact = inputs.sum(axis=0, dtype=np.float64)
    magnitude = np.abs(inputs).sum(axis=0, dtype=np.float64)
    u, u32, step = UNIT[wire], 2.0**-24, SUBNORMAL_STEP[wire]
    rounded_magnitude = magnitude * (1 + u) + ranks * step
    before_final = (u * magnitude + ranks * step) + (ranks - 1) * u32 * rounded_magnitude
    bound = before_final + u * (np.abs(exact) + before_final) + step
    error = np.abs(emulate(inputs, (ranks,), (1,), wire, reproducible=reproducible)[0].astype(np.float64) - exact)
    assert np.all(error <= bound * 1.0001)


@pytest.mark.parametrize("ranks", [8, 32])
def test_error_table_bounds(ranks: int) -> None:
    """The table's numbers at small p (bench/rounding_error.py, fp16): every direct variant within 2x one
    rounding of the exact sum, the ring beyond it and growing with p."""
    inputs = gradients(ranks, 16384)
    exact = inputs.sum(axis=0, dtype=np.float64)
    single = one_rounding(exact, "fp16")
    host = ranks // 2
    errors = {name: relative_error(emulate(inputs, dims, direct, "fp16")[0], exact) / single
              for name, dims, direct in [("ring flat", (ranks,), ()), ("direct flat", (ranks,), (1,)),
                                         ("direct 2 dims", (host, 2), (1, 1)),
                                         ("direct in dim 1", (host, 2), (1, 0))]}
    assert errors["direct flat"] <= 1.6, errors
    assert errors["direct 2 dims"] <= 2.0, errors
    assert errors["direct in dim 1"] <= 2.0, errors
    assert errors["ring flat"] >= {8: 2.0, 32: 3.0}[ranks], errors


def test_ring_error_grows_with_the_rank_count() -> None:
    """The ring rounds a partial sum at every hop: its error at 64 ranks is well above its error at 8."""
    ring = {}
    for ranks in (8, 64):
        inputs = gradients(ranks, 8192, seed=3)
        ring[ranks] = relative_error(emulate(inputs, (ranks,), (), "fp16")[0], inputs.sum(axis=0, dtype=np.float64))
    assert ring[64] >= 2 * ring[8], ring
