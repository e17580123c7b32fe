"""ddlfast.alltoall, allgatherv and join(): results against NumPy references, bad input on one rank raising on
every rank (tests/mpi/programs/exchange_cases.py)."""

from __future__ import annotations

import pytest

from tests.mpi.launcher import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 3, 4])
def test_exchange(ranks: int) -> None:
    result = run_mpi(ranks, "exchange_cases.py", timeout=300)
    assert result.stdout.count(" 0 failures") == ranks, result.stdout
