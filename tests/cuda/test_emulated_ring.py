"""The GPU ring executor on emulated device lanes (no GPU needed): bit-identical to the host engine.

The emulation defers every copy and kernel and runs them in random interleavings of the two lanes, with
stalls, so a missing event or stream wait in the executor shows up as wrong bits here. Each removed
ordering point of the executor was checked to make one of these runs fail. The executor and the emulated lanes
build without nvcc (ddlfast._testing), so these run on every machine.
"""

from __future__ import annotations

import pytest

from tests.cuda.support import run_program


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_emulated_gpu_ring_matches_the_host_engine(ranks: int) -> None:
    result = run_program(ranks, "emulated_ring_cases.py", timeout=300)
    assert " 0 failures" in result.stdout, result.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_emulated_cuda_path_end_to_end(ranks: int) -> None:
    """ddlfast.engine.device.DeviceExecutor on emulated device memory: buckets, the fused pack, the host path."""
    result = run_program(ranks, "fused_device_cases.py", "--emulated", timeout=300)
    assert "0 failures" in result.stdout, result.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_emulated_gpu_arrays_through_the_public_api(ranks: int) -> None:
    """fused_allreduce / allreduce / _async / broadcast on GPU arrays dispatch to the GPU path, and bad
    GPU input is refused on every rank."""
    result = run_program(ranks, "api_cases.py", "--emulated", timeout=300)
    assert "0 failures" in result.stdout, result.stdout
