"""Every reduction op (sum, average, min, max, product) x every dtype x the ring, the small-message path,
fused calls and explicit dims, against NumPy references and bit-identical on every rank; the compressed wire's
min/max and refused product; half-precision product overflow; bad ops on one rank
(tests/mpi/programs/ops_cases.py)."""

from __future__ import annotations

import pytest

from tests.mpi.launcher import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_every_op_every_dtype_every_path(ranks: int) -> None:
    result = run_mpi(ranks, "ops_cases.py", timeout=600)
    assert "rank 0: " in result.stdout and " 0 failures" in result.stdout, result.stdout
    assert result.stdout.count(" 0 failures") == ranks, result.stdout
