"""The GPU ring executor on emulated device lanes (no GPU needed): bit-identical to the host engine.

The emulation defers every copy and kernel and runs them in random interleavings of the two lanes, with
stalls, so a missing event or stream wait in the executor shows up as wrong bits here. Each removed
ordering point of the executor was checked to make one of these runs fail. The executor and the emulated lanes
build without nvcc (ddlfast._testing), so these run on every machine.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from ddlfast import _core, _testing
from ddlfast.buffers.dtypes import DTYPE_CODES
from ddlfast.engine.device import takes_gpu_ring
from ddlfast.errors import DdlfastError
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
    # Every size on the GPU ring (the default sends calls below 4 MiB through host copies: test below).
    result = run_program(ranks, "api_cases.py", "--emulated", timeout=300, env={"DDLFAST_GPU_RING_MIN_BYTES": "0"})
    assert "0 failures" in result.stdout, result.stdout


@pytest.mark.parametrize("dtype", ["int32", "int64", "float16", "bfloat16"])
def test_gpu_ring_refuses_the_averages_only_the_host_engine_does_exactly(dtype: str) -> None:
    """The library sends these to the host engine (engine/device.py, _HOST_ARITHMETIC); the ring itself must refuse
    them rather than divide in its last step and give other bits (seen on an H100)."""
    core = _core.Core(MPI.COMM_SELF, 30.0)
    data = np.zeros(100, dtype=np.uint16 if dtype == "bfloat16" else dtype)
    options = _core.CallOptions((1,), 1 << 20, 2, 0, ())
    try:
        with pytest.raises(DdlfastError, match=f"average' of {dtype} is not implemented in the GPU ring"):
            _testing.emulated_allreduce(core, [data.ctypes.data], [data.size], DTYPE_CODES[dtype], 1, options)
        _testing.emulated_allreduce(core, [data.ctypes.data], [data.size], DTYPE_CODES[dtype], 0, options)  # sum runs
    finally:
        core.close()


@pytest.mark.mpi
def test_emulated_gpu_arrays_below_the_ring_minimum_take_host_copies() -> None:
    result = run_program(2, "api_cases.py", "--emulated", timeout=300)
    assert "0 failures" in result.stdout, result.stdout


@pytest.mark.parametrize(("total", "direct", "minimum", "ring"), [
    (4 << 20, False, 4 << 20, True), ((4 << 20) - 1, False, 4 << 20, False), (0, False, 0, True),
    (1, True, 4 << 20, True)])
def test_small_staged_calls_take_host_copies(total: int, direct: bool, minimum: int, ring: bool) -> None:
    assert takes_gpu_ring(total, direct, minimum) is ring
