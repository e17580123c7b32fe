"""Issue 22 ("Trust") for the torch integrations: each fault injected on one rank, also after layouts were cached
and after an earlier caught error, ends in a DdlfastError on every rank that names what and where, or in the right
numbers (tests/mpi/programs/trust_torch_cases.py)."""

from __future__ import annotations

import pytest

from tests.mpi.launcher import run_mpi

pytest.importorskip("torch")


# "inputs": sparse gradients whose table size differs per rank (and a gathered row index out of range), a torch
#   backend broadcast whose dtypes or dtype order differ per rank, a parameter unfrozen or added after
#   distribute() (on one rank, then on every rank, then rebuild()), tensors that require grad, point-to-point tags
#   above MPI_TAG_UB, a dropped recv Work, unwaited sends.
@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_bad_input_on_one_rank(ranks: int) -> None:
    result = run_mpi(ranks, "trust_torch_cases.py", "inputs", timeout=300, env={"DDLFAST_TIMEOUT_S": "60"})
    assert "0 failures" in result.stdout, result.stdout


# "deadlock": every rank receives from the next, nobody sends: every rank raises DdlfastTimeoutError naming the
#   point-to-point receives (not "only slower than DDLFAST_TIMEOUT_S"); destroy_process_group() after it is quiet.
@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_point_to_point_deadlock(ranks: int) -> None:
    result = run_mpi(ranks, "trust_torch_cases.py", "deadlock", timeout=120, env={"DDLFAST_TIMEOUT_S": "2"})
    assert "0 failures" in result.stdout, result.stdout
