"""ddlfast the torch way across ranks (issue 25 item 3): plain dist.init_process_group("ddlfast") under mpiexec,
torch CPU tensors through every collective, op= from mpi4py and torch, local_rank()/local_size(), profiler
ranges (tests/mpi/programs/torch_way_cases.py)."""

from __future__ import annotations

import os

import pytest

from tests.mpi.launcher import run_mpi

pytest.importorskip("torch")


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_torch_way(ranks: int) -> None:
    rendezvous = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")
    env = {name: "" for name in rendezvous if name in os.environ}  # as mpiexec leaves them: unset (blank here)
    result = run_mpi(ranks, "torch_way_cases.py", timeout=300, env={"DDLFAST_TIMEOUT_S": "60", **env})
    assert "0 failures" in result.stdout, result.stdout
