"""The "ddlfast" torch.distributed backend under mpiexec with torch 2.13.0 (CPU)."""

from __future__ import annotations

import pytest

from tests.mpi.launcher import run_mpi

pytest.importorskip("torch")

import ddlfast  # noqa: E402
from ddlfast.context import OPS  # noqa: E402

ENV = {"DDLFAST_TIMEOUT_S": "60"}
needs_min_max_product = pytest.mark.skipif(
    not {"min", "max", "product"} <= set(OPS), reason="needs ops min/max/product in ddlfast (branch ops)")


# torch_backend_cases.py: every collective against NumPy (bit-identical on every rank), new_group with a subset,
#   point-to-point, mixed ddlfast/MPI operations in torch's order, bad input on one rank raising on every rank.
# torch_backend_ddp.py: DDP unchanged against single-process training and against DDP on gloo (no_sync,
#   find_unused_parameters, static_graph), broadcast_buffers, SyncBatchNorm's statistics, a failure in backward.
@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("program", ["torch_backend_cases.py", "torch_backend_ddp.py"])
def test_backend_program(program: str, ranks: int) -> None:
    result = run_mpi(ranks, program, timeout=300, env=ENV)
    assert "0 failures" in result.stdout, result.stdout


@pytest.mark.mpi
@needs_min_max_product
def test_backend_min_max_product() -> None:
    result = run_mpi(3, "torch_backend_cases.py", "ops", timeout=300, env=ENV)
    assert "0 failures" in result.stdout, result.stdout


@pytest.mark.mpi
@pytest.mark.skipif(not hasattr(ddlfast, "reduce_scatter"), reason="needs ddlfast.reduce_scatter (branch shard)")
def test_backend_reduce_scatter() -> None:
    result = run_mpi(3, "torch_backend_cases.py", "shard", timeout=300, env=ENV)
    assert "0 failures" in result.stdout, result.stdout


@pytest.mark.mpi
@needs_min_max_product  # DDP's join() agrees on ranks with a MAX allreduce
@pytest.mark.parametrize("ranks", [2, 3])
def test_backend_ddp_join_uneven_inputs(ranks: int) -> None:
    result = run_mpi(ranks, "torch_backend_ddp.py", "join", timeout=300, env=ENV)
    assert "0 failures" in result.stdout, result.stdout


@pytest.mark.mpi
def test_stall_in_ddp_backward_ends_the_job() -> None:
    """The stall reaches the user as torch's RuntimeError (through DDP's C++ reducer); uncaught, it still ends the
    job (MPI_Abort) instead of leaving ranks waiting."""
    result = run_mpi(3, "torch_backend_stall.py", "3", timeout=120, check=False, env={"DDLFAST_TIMEOUT_S": "3"})
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    # The launcher may drop the ranks' last lines when it kills the job; MPI's own abort line always comes.
    assert "MPI_Abort" in output, output[-3000:]
    assert "FAIL" not in output, output[-3000:]
