"""Bad input across real ranks: clear DdlfastError everywhere, no hang, nothing lost."""

from __future__ import annotations

import pytest

from tests.mpi.launcher import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_bad_input_raises_on_every_rank(ranks: int) -> None:
    result = run_mpi(ranks, "bad_input.py", timeout=120)
    assert "0 failures" in result.stdout, result.stdout
    assert "rank 1 passed float32[1007]" in result.stdout


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("variable", "value", "needle"),
    [
        ("DDLFAST_CHUNK_BYTES", "lots", "DDLFAST_CHUNK_BYTES='lots'"),
        ("DDLFAST_BUCKET_BYTES", "-5", "DDLFAST_BUCKET_BYTES"),
        ("DDLFAST_RING_DIMS", "3x3", "multiply to 9"),
        ("DDLFAST_TIMEOUT_S", "soon", "DDLFAST_TIMEOUT_S"),
        ("DDLFAST_COMPRESSION", "zip", "DDLFAST_COMPRESSION"),
    ],
)
def test_bad_environment_is_a_clear_error(variable: str, value: str, needle: str) -> None:
    result = run_mpi(2, "one_allreduce.py", env={variable: value}, check=False, timeout=120)
    assert result.returncode != 0
    assert "DdlfastError" in result.stderr and needle in result.stderr, result.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_bad_setting_on_one_rank_fails_every_rank(ranks: int) -> None:
    """A DDLFAST_* value that fails validation on rank 1 alone: every rank raises at creation (or at the next
    collective, when set later), naming the variable and the rank; a new Context then works. Before, the others
    waited out the stall limit, and the next Context on the communicator hung in its creation."""
    result = run_mpi(ranks, "bad_setting_one_rank.py", env={"DDLFAST_TIMEOUT_S": "10", "DDLFAST_ABORT_ON_STALL": "0"},
                     timeout=240)
    assert "bad setting on one rank: 0 failures" in result.stdout, result.stdout + result.stderr[-3000:]
