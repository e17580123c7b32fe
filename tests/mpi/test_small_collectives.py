"""barrier, broadcast of every fixed-size dtype, broadcast_async, broadcast_object and allgather_object, their
bad input on one rank or all (DdlfastError on every rank naming the problem), and every collective on the halves
of a split communicator (tests/mpi/programs/small_collectives_cases.py)."""

from __future__ import annotations

import pytest

from tests.mpi.launcher import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_small_collectives(ranks: int) -> None:
    result = run_mpi(ranks, "small_collectives_cases.py", timeout=600)
    assert result.stdout.count(" 0 failures") == ranks, result.stdout
