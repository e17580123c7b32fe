"""fused_allreduce: buckets, packing of small arrays, in-place segments for large ones."""

from __future__ import annotations

import pytest

from tests.mpi.launcher import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_fused_allreduce_mixed_lists(ranks: int) -> None:
    result = run_mpi(ranks, "fused_cases.py", timeout=300)
    assert "0 failures" in result.stdout, result.stdout
