"""reduce_scatter and allgather (and their fused and async forms) on real ranks: every factorization of P into
ring dims for P = 1..8, one mpiexec per P (tests/mpi/programs/shard_cases.py has the cases)."""

from __future__ import annotations

import pytest

from tests.mpi.launcher import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 6, 7, 8])
def test_reduce_scatter_and_allgather(ranks: int) -> None:
    result = run_mpi(ranks, "shard_cases.py", timeout=600)
    assert " 0 failures" in result.stdout, result.stdout
