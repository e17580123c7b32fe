"""The GPU path on a GPU (skipped without a CUDA device): the GPU ring against the host engine bit for
bit, the GPU executor (engine/device.py, DeviceExecutor) end to end, CuPy streams ordered by fences alone,
and the kernels' bandwidth. Ranks share the GPU when there is only one (rank % device count)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.support import DEVICES, has_cupy, needs_device, run_program

pytestmark = needs_device


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_gpu_ring_matches_the_host_engine(ranks: int) -> None:
    result = run_program(ranks, "device_ring_cases.py", timeout=600)
    assert " 0 failures" in result.stdout, result.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_fused_allreduce_of_gpu_arrays(ranks: int) -> None:
    result = run_program(ranks, "fused_device_cases.py", timeout=600)
    assert "0 failures" in result.stdout, result.stdout


@pytest.mark.mpi
@pytest.mark.skipif(not has_cupy(), reason="CuPy is not installed")
@pytest.mark.parametrize("ranks", [2])
def test_cupy_streams_are_ordered_by_fences(ranks: int) -> None:
    result = run_program(ranks, "cupy_cases.py", timeout=600)
    assert "0 failures" in result.stdout, result.stdout


def test_every_kernel_is_timed_against_the_copy() -> None:
    """The measurement itself (a timing target is not a test: scripts/gpu_check.sh's bandwidth step reports the 80%
    target; under pytest -n 8 on an H100 the same kernels read 78-92% of copy, alone 84-94%)."""
    from tests.cuda.programs.kernel_bandwidth import KERNELS, measure

    results = measure(0, 16, repeats=3)
    assert set(results) == set(KERNELS)
    assert all(np.isfinite(rate) and rate > 0 for rate in results.values()), results
    assert DEVICES >= 1


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("ring_min_bytes", ["0", "4MiB"])  # the GPU ring at every size; the default's host copies
def test_public_api_on_gpu_arrays(ranks: int, ring_min_bytes: str) -> None:
    result = run_program(ranks, "api_cases.py", timeout=600, env={"DDLFAST_GPU_RING_MIN_BYTES": ring_min_bytes})
    assert "0 failures" in result.stdout, result.stdout
