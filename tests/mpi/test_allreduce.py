"""Multi-rank correctness: every world size 1..8 we can afford, every
factorisation of it into ring dims, all six dtypes, sum and average."""

from __future__ import annotations

import pytest

from tests.mpi.launcher import run_mpi

# world size -> every ordered factorisation into ring dims (plus unit dims).
FACTORISATIONS = {
    1: ["flat", "1"],
    2: ["flat", "1x2", "2x1"],
    3: ["flat"],
    4: ["flat", "2x2"],
    6: ["flat", "2x3", "3x2"],
    8: ["flat", "2x4", "4x2", "2x2x2", "1x8"],
}
CASES = [(p, dims) for p, all_dims in FACTORISATIONS.items() for dims in all_dims]


@pytest.mark.mpi
@pytest.mark.parametrize(("ranks", "dims"), CASES, ids=[f"p{p}-{d}" for p, d in CASES])
def test_allreduce_matches_numpy_reference(ranks: int, dims: str) -> None:
    # Smaller "large" count at 8 ranks: 8 processes share 2 cores here.
    large = 1_000_003 if ranks <= 4 else 262_147
    result = run_mpi(ranks, "allreduce_cases.py", "--dims", dims, "--large", str(large), timeout=600)
    assert "0 failures" in result.stdout, result.stdout
