"""Who the others waited for (ddlfast.stragglers(), the waits in the agreement's header), the flight recorder
(its files on a stall, a mismatch, SIGUSR1 and on request, written off the caller's thread, merged by `python -m
ddlfast.flight`) and the merged timeline (`python -m ddlfast.timeline`): tests/mpi/programs/observe_cases.py, at 2
to 4 ranks. Delays are several hundred milliseconds, so no result depends on the machine's speed."""

from __future__ import annotations

import pytest

from tests.mpi.launcher import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("mode, ranks", [("stragglers", 4), ("stragglers", 3), ("stall", 4), ("mismatch", 3),
                                         ("dump", 2), ("timeline", 4)])
def test_observe(mode: str, ranks: int, tmp_path) -> None:
    result = run_mpi(ranks, "observe_cases.py", mode, str(tmp_path / "shared"), timeout=300)
    assert result.stdout.count(" 0 failures") == ranks, result.stdout
