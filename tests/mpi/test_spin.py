"""DDLFAST_SPIN_US: the poll loop's spin before it yields reaches the core, and allreduce stays correct with no
spin at all and with a long one (checked against NumPy, identical bits on every rank)."""

from __future__ import annotations

import os

import pytest

from tests.mpi.launcher import run_mpi

# 2 ranks on this 2-core machine spin by default (200 us), 4 do not: both automatic choices are checked too.
CASES = [(2, "0"), (2, "1000"), (2, None), (4, "0"), (4, "1000"), (4, None)]


@pytest.mark.mpi
@pytest.mark.parametrize(("ranks", "spin_us"), CASES, ids=[f"p{p}-spin{s}" for p, s in CASES])
def test_allreduce_matches_numpy_with_each_spin(monkeypatch: pytest.MonkeyPatch, ranks: int,
                                                spin_us: str | None) -> None:
    if spin_us is None:
        monkeypatch.delenv("DDLFAST_SPIN_US", raising=False)
    env = {} if spin_us is None else {"DDLFAST_SPIN_US": spin_us}
    dims = "flat;2x2" if ranks == 4 else "flat"
    result = run_mpi(ranks, "spin_cases.py", "--dims", dims, "--large", "100003",
                     "--dtypes", "float32,float64,bfloat16,int64", env=env, timeout=600)
    assert f"every rank spins {spin_us or ''}" in result.stdout and " 0 failures" in result.stdout, result.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_ranks_pinned_to_cores_of_their_own_spin(monkeypatch: pytest.MonkeyPatch, ranks: int) -> None:
    """Rank r pinned to core r mod 2 first (as --bind-to core): each has one core, and 2 ranks on 2 cores have a
    core each (they spin, and the plan is not the oversubscribed one), where 4 share them (no spin)."""
    if len(os.sched_getaffinity(0)) != 2:
        pytest.skip("written for 2 cores: pins rank r to core r mod 2")
    monkeypatch.delenv("DDLFAST_SPIN_US", raising=False)
    result = run_mpi(ranks, "spin_cases.py", "--pin", "--dims", "flat", "--large", "100003",
                     "--dtypes", "float32,int64", timeout=600)
    expected = "200 us; oversubscribed=False" if ranks == 2 else "0 us; oversubscribed=True"
    assert f"every rank spins {expected}" in result.stdout and " 0 failures" in result.stdout, result.stdout


@pytest.mark.mpi
def test_a_bad_spin_is_an_error_naming_the_variable_on_every_rank() -> None:
    result = run_mpi(2, "spin_cases.py", "--expect-error", env={"DDLFAST_SPIN_US": "-5"}, timeout=120)
    for rank in (0, 1):
        assert f"rank {rank} raised: DDLFAST_SPIN_US='-5' is not an integer" in result.stdout, result.stdout
