"""The GPU path on a GPU (skipped without a CUDA device): the GPU ring against the host engine bit for
bit, the GPU executor (engine/device.py, DeviceExecutor) end to end, CuPy streams ordered by fences alone,
and the kernels' bandwidth. Ranks share the GPU when there is only one (rank % device count)."""

from __future__ import annotations

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


def test_kernels_reach_80_percent_of_copy_bandwidth() -> None:
    from tests.cuda.programs.kernel_bandwidth import measure

    results = measure(0, 256)
    copy = results[("copy", "float32")]
    report = {f"{k} {d}": round(rate / copy, 3) for (k, d), rate in results.items()}
    print(report)
    slow = {name: ratio for name, ratio in report.items()
            if ratio < 0.8 and not name.startswith(("reduce int", "reduce float64"))}
    assert not slow, f"below 80% of device copy bandwidth at 256 MiB: {slow} (all: {report})"
    assert DEVICES >= 1


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_public_api_on_gpu_arrays(ranks: int) -> None:
    result = run_program(ranks, "api_cases.py", timeout=600)
    assert "0 failures" in result.stdout, result.stdout
