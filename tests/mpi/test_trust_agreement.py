"""The agreement's own faults (tests/mpi/programs/trust_agreement.py): a skipped named step, an exception of any
type while one rank validates its arguments. Each injected on one rank, after the layout was cached and after an
earlier error; every rank's outcome is asserted by the program."""

from __future__ import annotations

import pytest

from tests.mpi.launcher import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("case", ["named-skip", "validation-exception", "validation-interrupt",
                                  "torch-skipped-batch"])
def test_agreement_fault_reaches_every_rank(case: str, ranks: int) -> None:
    # A generous stall limit: a fault that took the slow route ends as DdlfastTimeoutError, which the program refuses.
    result = run_mpi(ranks, "trust_agreement.py", case, env={"DDLFAST_TIMEOUT_S": "60", "DDLFAST_ABORT_ON_STALL": "0"},
                     timeout=240)
    for r in range(ranks):
        assert f"rank {r}: ok {case}" in result.stdout, result.stdout
