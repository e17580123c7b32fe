"""comm= on the module API for sub-communicators (split, dup, reordered, COMM_NULL), under mpiexec."""

from __future__ import annotations

import pytest

from tests.mpi.launcher import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 3, 4])
def test_module_api_on_sub_communicators(ranks: int, tmp_path) -> None:
    result = run_mpi(ranks, "comm_cases.py", env={"DDLFAST_CACHE_DIR": str(tmp_path)}, timeout=240)
    assert result.stdout.count(" 0 failures") == ranks, result.stdout
