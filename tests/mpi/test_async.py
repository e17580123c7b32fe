"""Asynchronous handles, FusedBuffer, broadcast and the timeline on real ranks."""

from __future__ import annotations

import pytest

from tests.mpi.launcher import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 3, 4])
def test_async_handles_order_and_results(ranks: int) -> None:
    result = run_mpi(ranks, "async_cases.py", timeout=180)
    assert "0 failures" in result.stdout, result.stdout


@pytest.mark.mpi
def test_timeline_is_a_chrome_trace(tmp_path) -> None:
    base = tmp_path / "trace"
    result = run_mpi(2, "async_cases.py", env={"DDLFAST_TIMELINE": str(base)}, timeout=180)
    assert "0 failures" in result.stdout, result.stdout
    assert (tmp_path / "trace.rank0.json").exists() and (tmp_path / "trace.rank1.json").exists()
