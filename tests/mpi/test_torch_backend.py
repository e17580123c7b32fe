"""The "ddlfast" torch.distributed backend under mpiexec with torch 2.13.0 (CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.mpi.launcher import PROGRAMS, launcher_kind, mpi_command, no_cleanup_flags, run_mpi

pytest.importorskip("torch")


ENV = {"DDLFAST_TIMEOUT_S": "60"}


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
def test_backend_min_max_product() -> None:
    result = run_mpi(3, "torch_backend_cases.py", "ops", timeout=300, env=ENV)
    assert "0 failures" in result.stdout, result.stdout


@pytest.mark.mpi
def test_backend_reduce_scatter() -> None:
    result = run_mpi(3, "torch_backend_cases.py", "shard", timeout=300, env=ENV)
    assert "0 failures" in result.stdout, result.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_backend_ddp_join_uneven_inputs(ranks: int) -> None:
    result = run_mpi(ranks, "torch_backend_ddp.py", "join", timeout=300, env=ENV)
    assert "0 failures" in result.stdout, result.stdout


@pytest.mark.mpi
def test_stall_in_ddp_backward_ends_the_job() -> None:
    """The stall reaches the user as torch's RuntimeError (through DDP's C++ reducer); uncaught, it still ends the
    job (MPI_Abort) instead of leaving ranks waiting. The launcher is told to keep the ranks alive when one exits,
    so only MPI_Abort can end the rank that sleeps for 60 s; the job must end long before that. (Whether MPI's
    abort line reaches the output is the launcher's luck, so the test does not read it.)"""
    flags = no_cleanup_flags()
    if flags is None:
        pytest.skip(f"launcher {launcher_kind()!r} has no flag that keeps ranks alive when one exits")
    command = [*mpi_command(3, *flags), sys.executable, str(PROGRAMS / "torch_backend_stall.py"), "3"]
    start = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "DDLFAST_TIMEOUT_S": "3", "PYTHONUNBUFFERED": "1"})
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert elapsed < 40, f"the job ran {elapsed:.0f} s: the sleeping rank was not aborted\n{output[-3000:]}"
    assert "FAIL" not in output, output[-3000:]


@pytest.mark.mpi
@pytest.mark.parametrize("operation", ["allreduce", "barrier"])
def test_group_timeout_is_its_stall_limit(operation: str) -> None:
    """new_group(timeout=2 s) stalls after 2 s although DDLFAST_TIMEOUT_S is 120, worded "Timed out"."""
    result = run_mpi(3, "torch_backend_timeout.py", operation, timeout=200,
                     env={"DDLFAST_TIMEOUT_S": "120", "DDLFAST_ABORT_ON_STALL": "0"})
    assert "rank 0: ok after" in result.stdout, result.stdout + result.stderr
