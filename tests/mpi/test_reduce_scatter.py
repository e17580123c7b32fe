"""reduce_scatter and allgather (and their fused and async forms) on real ranks: every factorization of P into
ring dims for P = 1..8, one mpiexec per P (tests/mpi/programs/shard_cases.py has the cases)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.mpi.launcher import mpi_command, run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 6, 7, 8])
def test_reduce_scatter_and_allgather(ranks: int) -> None:
    result = run_mpi(ranks, "shard_cases.py", timeout=600)
    assert " 0 failures" in result.stdout, result.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("shared", ["1", "0"])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_fast_path_results_and_faults(ranks: int, shared: str) -> None:
    """reduce_scatter() and allgather() of one array on their fast path (tests/mpi/programs/shard_fast_cases.py):
    every op and dtype carried in the agreement's messages and past the reach, against NumPy; ranks on the general
    path beside ranks on the fast path; faults on one rank after the plan was cached. shared: the agreement in
    shared memory (this host's default) or the butterfly's messages."""
    result = run_mpi(ranks, "shard_fast_cases.py", timeout=900, env={"DDLFAST_SHARED_MEMORY": shared})
    assert result.stdout.count(" 0 failures") == ranks, result.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("collective", ["reduce_scatter", "allgather", "broadcast"])
def test_bench_checks_each_collective_against_mpi(collective: str) -> None:
    """`python -m ddlfast.bench --collective X --check`: ddlfast beside its MPI counterpart, results verified
    (3 ranks: a size that is no multiple of 3 is cut to p equal blocks)."""
    command = [*mpi_command(3), sys.executable, "-m", "ddlfast.bench", "--collective", collective, "--sizes",
               "4KiB,100KiB", "--iters", "2", "--warmup", "0", "--check", "--dtype", "int32"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ,
                                                                                      "DDLFAST_SMALL_BYTES": "8KiB"})
    assert result.returncode == 0, result.stdout + result.stderr
    mpi_name = {"reduce_scatter": "MPI_Reduce_scatter_block", "allgather": "MPI_Allgather", "broadcast": "MPI_Bcast"}
    assert f"# check: ddlfast matches {mpi_name[collective]} on every rank in all 2 rows (exactly)" in result.stdout
    assert result.stdout.count(" ok") == 2, result.stdout
    if collective != "broadcast":  # 4 KiB rides in the agreement's messages (shards.carried_options)
        row = next(line for line in result.stdout.splitlines() if line.split()[:1] == ["4092"])
        assert " latency |" in row, row


@pytest.mark.mpi
def test_torch_cpu_tensors() -> None:
    pytest.importorskip("torch")
    result = run_mpi(3, "shard_torch_cases.py", timeout=300)
    assert "0 failures" in result.stdout, result.stdout
