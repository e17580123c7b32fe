"""The fault-injection suite (tests/mpi/programs/faults.py): one fault per case, on one rank or all, and every
rank's outcome asserted by the program itself (right numbers, or the right DdlfastError naming the fault)."""

from __future__ import annotations

import pytest

from tests.mpi.launcher import run_mpi

CASES = ["mismatch-after-cache", "skipped-call", "alignment", "aliasing", "bad-input-one-rank", "broadcast-roots",
         "env-differs-at-creation", "env-differs-later", "error-then-calls", "bad-environment",
         "emulated-hosts-differ", "halving-differs-at-creation"]


def outcomes(stdout: str, case: str, ranks: int) -> None:
    for r in range(ranks):
        assert f"rank {r}: ok {case}" in stdout, stdout


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("case", CASES)
def test_fault_reaches_every_rank(case: str, ranks: int) -> None:
    # A generous stall limit: a fault that took the slow route would still end, with the wrong error type.
    result = run_mpi(ranks, "faults.py", case, env={"DDLFAST_TIMEOUT_S": "60", "DDLFAST_ABORT_ON_STALL": "0"},
                     timeout=240)
    outcomes(result.stdout, case, ranks)


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["stall-then-calls", "close-with-work-in-flight"])
def test_a_missing_rank(case: str) -> None:
    env = {"DDLFAST_TIMEOUT_S": "3", "DDLFAST_ABORT_ON_STALL": "0"}
    result = run_mpi(3, "faults.py", case, env=env, timeout=120)
    outcomes(result.stdout, case, 3)


@pytest.mark.mpi
@pytest.mark.parametrize("level", ["serialized", "single"])
def test_async_calls_below_thread_multiple_say_how_to_fix_it(level: str) -> None:
    result = run_mpi(2, "faults.py", "thread-level", env={"MPI4PY_RC_THREAD_LEVEL": level}, timeout=120)
    outcomes(result.stdout, "thread-level", 2)


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["mismatch-after-cache", "skipped-call", "stall-then-calls",
                                  "close-with-work-in-flight"])
def test_faults_on_the_canonical_chain(case: str) -> None:
    """The mismatch and missing-rank cases with DDLFAST_REPRODUCIBLE=1 on 2 emulated hosts of 2 ranks, where
    every allreduce runs the canonical chain (src/engine/chain_phase.h)."""
    env = {"DDLFAST_REPRODUCIBLE": "1", "DDLFAST_EMULATED_HOSTS": "2", "DDLFAST_ABORT_ON_STALL": "0",
           "DDLFAST_TIMEOUT_S": "3" if case in ("stall-then-calls", "close-with-work-in-flight") else "60"}
    result = run_mpi(4, "faults.py", case, env=env, timeout=120)
    outcomes(result.stdout, case, 4)
