"""Integer average within the inputs' range, half-precision average pre-scaled, half-precision sum overflow
an error: on the ring and on the small-message path, at several world sizes
(tests/mpi/programs/exact_arithmetic_cases.py)."""

from __future__ import annotations

import pytest

from tests.mpi.launcher import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_edges_of_each_type_on_both_paths(ranks: int) -> None:
    result = run_mpi(ranks, "exact_arithmetic_cases.py", timeout=600)
    assert " 0 failures" in result.stdout, result.stdout
