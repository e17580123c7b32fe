"""ddlfast.torch under mpiexec with torch 2.13.0 (CPU)."""

from __future__ import annotations

import pytest

from tests.mpi.launcher import run_mpi

pytest.importorskip("torch")


# torch_cases.py: hooks average gradients, unused parameters, broadcast_parameters, training in sync.
# torch_recipes.py: accumulation, clipping/AMP, sparse gradients, LR schedulers, buffers, unused parameters.
# ddp_hooks.py: DDP on gloo with ddlfast's hooks gives DDP's own parameters (bit-identical at 2 ranks) with
#   no_sync, find_unused_parameters and static_graph; fp16 no worse than torch's fp16_compress_hook; errors.
@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("program", ["torch_cases.py", "torch_recipes.py", "ddp_hooks.py"])
def test_torch_program(program: str, ranks: int) -> None:
    result = run_mpi(ranks, program, timeout=300, env={"DDLFAST_TIMEOUT_S": "60"})
    assert "0 failures" in result.stdout, result.stdout


def test_init_process_group_without_mpiexec_says_how_to_launch() -> None:
    """torchrun-style environment, no MPI launcher: a clear error, not a hang."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, WORLD_SIZE="2", RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")
    result = subprocess.run([sys.executable, "-c", "import ddlfast.torch as dt; dt.init_process_group()"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0
    assert "mpiexec" in result.stderr and "DdlfastError" in result.stderr, result.stderr
