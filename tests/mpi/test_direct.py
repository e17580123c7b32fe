"""The direct (all-to-all) reduce-scatter and DDLFAST_ALGORITHM on real ranks: allreduce and reduce_scatter with
DDLFAST_ALGORITHM=direct on every factorization of P into ring dims, all six dtypes and five ops, odd sizes, 0
and 1 elements, the fp16/bf16 wire, bit for bit against the direct step's own order where the dims are flat;
the other choices on the same cases where `sweep` is given; and the errors (tests/mpi/programs/direct_cases.py)."""

from __future__ import annotations

import pytest

from tests.mpi.launcher import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 8])
def test_direct_reduce_scatter(ranks: int) -> None:
    result = run_mpi(ranks, "direct_cases.py", timeout=600)
    assert " 0 failures" in result.stdout, result.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 3, 4])
def test_every_algorithm(ranks: int) -> None:
    """ring, auto, mpi (and rabenseifner where P is a power of two) on the same cases."""
    result = run_mpi(ranks, "direct_cases.py", "sweep", timeout=600)
    assert " 0 failures" in result.stdout, result.stdout
