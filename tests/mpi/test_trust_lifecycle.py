"""Lifecycle faults on one rank (tests/mpi/programs/trust_lifecycle.py): a second thread issuing on a context, a
fork() child, close() racing a submit, Ctrl-C while a rank waits on a peer and Ctrl-C that lands as the collective
completes. Every rank's outcome is asserted by the program; the job must end (no timing is asserted)."""

from __future__ import annotations

import pytest

from tests.mpi.launcher import run_mpi

ENV = {"DDLFAST_TIMEOUT_S": "60", "DDLFAST_ABORT_ON_STALL": "0"}


def outcomes(stdout: str, case: str, ranks: int) -> None:
    for r in range(ranks):
        assert f"rank {r}: ok {case}" in stdout, stdout


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("case", ["second-thread", "fork", "close-race"])
def test_thread_fork_and_close_faults(case: str, ranks: int) -> None:
    result = run_mpi(ranks, "trust_lifecycle.py", case, env=ENV, timeout=240)
    outcomes(result.stdout, case, ranks)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("path", ["fast", "general"])
def test_ctrl_c_in_a_wait_reaches_the_user_and_the_other_ranks(path: str, ranks: int) -> None:
    # DDLFAST_TIMEOUT_S=60: a rank that only failed at its stall limit would outlast the 3 s the peer sleeps by far,
    # and its message would not name the interrupted rank.
    result = run_mpi(ranks, "trust_lifecycle.py", "interrupt-in-wait", path, env=ENV, timeout=240)
    outcomes(result.stdout, "interrupt-in-wait", ranks)


@pytest.mark.mpi
@pytest.mark.parametrize("path", ["fast", "general"])
def test_ctrl_c_after_the_collective_completed_leaves_it_standing(path: str) -> None:
    # The victim's wait spins (it polls for signals only once it gives its core away), so a SIGINT sent during
    # it is seen only once the collective completed.
    result = run_mpi(2, "trust_lifecycle.py", "interrupt-after-completion", path,
                     env={**ENV, "DDLFAST_SPIN_US": "100000"}, timeout=240)
    outcomes(result.stdout, "interrupt-after-completion", 2)
