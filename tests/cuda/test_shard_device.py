"""reduce_scatter and allgather of GPU arrays (through pinned host copies and the host engine): on emulated
device memory everywhere (the Context's GPU wiring), and for real on a GPU (skipped without one)."""

from __future__ import annotations

import pytest

from tests.cuda.support import needs_device, run_program


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 3])
def test_emulated_gpu_arrays_reduce_scatter_and_allgather(ranks: int) -> None:
    result = run_program(ranks, "shard_device_cases.py", "--emulated", timeout=300)
    assert "0 failures" in result.stdout, result.stdout


@needs_device
@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_gpu_arrays_reduce_scatter_and_allgather(ranks: int) -> None:
    result = run_program(ranks, "shard_device_cases.py", timeout=600)
    assert "0 failures" in result.stdout, result.stdout
