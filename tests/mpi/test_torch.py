"""ddlfast.torch under mpiexec with torch 2.13.0 (CPU)."""

from __future__ import annotations

import pytest

from tests.mpi.launcher import run_mpi

pytest.importorskip("torch")


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_torch_hooks_average_gradients(ranks: int) -> None:
    result = run_mpi(ranks, "torch_cases.py", timeout=300)
    assert "0 failures" in result.stdout, result.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_torch_recipes(ranks: int) -> None:
    """Accumulation, clipping/AMP, sparse gradients, LR schedulers, buffers, unused parameters."""
    result = run_mpi(ranks, "torch_recipes.py", timeout=300)
    assert "0 failures" in result.stdout, result.stdout
