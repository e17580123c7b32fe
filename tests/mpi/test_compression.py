"""Wire compression, error feedback and codec hooks on real ranks."""

from __future__ import annotations

import pytest

from tests.mpi.launcher import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_compression_accuracy_and_training(ranks: int) -> None:
    result = run_mpi(ranks, "compression_cases.py", timeout=300)
    assert "0 failures" in result.stdout, result.stdout
