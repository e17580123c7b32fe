"""The compiled GPU module as loaded here: it imports wherever CUDA was built, reports devices (or why
there are none) without failing, and every CUDA failure reaches Python as a DdlfastError that says what
to do. On a machine with no GPU these are the GPU path's checks that run."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import ddlfast
from ddlfast.buffers import device as device_arrays
from ddlfast.engine import device as gpu_executor
from ddlfast.errors import DdlfastError
from tests.cuda.support import BUILT, DEVICES, needs_build

no_device = pytest.mark.skipif(DEVICES > 0, reason="a CUDA device is present")


class FakeCupyArray:
    """What a CuPy array shows ddlfast: __cuda_array_interface__ and nothing else."""

    def __init__(self) -> None:
        self.__cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0x7F0000000000, False),
                                         "strides": None, "version": 3, "stream": 1}


def test_has_cuda_and_the_module_agree() -> None:
    assert ddlfast.has_cuda() == device_arrays.built_with_cuda()


@needs_build
def test_the_module_imports_and_reports_its_build() -> None:
    from ddlfast import _cuda

    assert _cuda.runtime_version().startswith("CUDA ")
    supported, how = _cuda.mpi_cuda_support()
    assert isinstance(supported, bool) and how
    assert _cuda.device_count() == device_arrays.device_count() >= 0


@needs_build
@no_device
def test_no_device_is_reported_not_raised() -> None:
    from ddlfast import _cuda

    assert _cuda.device_count() == 0
    assert "CUDA error in cudaGetDeviceCount" in _cuda.no_device_reason()


@needs_build
@no_device
def test_cuda_failures_are_ddlfast_errors_with_a_hint() -> None:
    from ddlfast import _cuda, _testing_cuda

    for attempt in (lambda: _testing_cuda.DeviceMemory(16), lambda: _cuda.PinnedMemory(16),
                    lambda: _cuda.StreamFence.record(0, 0), lambda: _cuda.locate_pointer(0x1000)):
        with pytest.raises(DdlfastError, match=r"CUDA error in \w+.*: cudaError\w+ \(.*\)(; .+)?"):
            attempt()


@needs_build
@no_device
def test_a_gpu_context_without_a_device_fails_cleanly_at_first_use() -> None:
    from ddlfast import _core, _cuda

    context = _cuda.DeviceCore(_core.Core(MPI.COMM_SELF))  # creating it touches no device
    with pytest.raises(DdlfastError, match="CUDA error"):
        context.allreduce_segments(0, [0x1000], [4], 0, 0, _core.CallOptions((1,), 1 << 20, 4, 0))
    with pytest.raises(DdlfastError, match="CUDA error"):
        context.bucket(0, 0, 64)
    context.close()
    with pytest.raises(DdlfastError, match="closed"):
        context.stream(0)


@needs_build
@no_device
def test_a_cupy_like_array_is_refused_clearly_without_a_device() -> None:
    with pytest.raises(DdlfastError, match=r"array 0 on rank 0 is a .*FakeCupyArray on a CUDA device, but this "
                                           r"process sees no usable CUDA device: CUDA error"):
        device_arrays.device_buffers([FakeCupyArray()], rank=0)


def test_a_cupy_like_array_is_never_taken_for_a_host_array() -> None:
    from ddlfast.buffers.host import host_buffer

    with pytest.raises(DdlfastError, match="not a NumPy array"):
        host_buffer(FakeCupyArray(), "array 0 on rank 0")
    assert device_arrays.is_device_array(FakeCupyArray()) and not device_arrays.is_device_array(np.zeros(4))


@needs_build
def test_pinned_memory_is_a_buffer_when_a_device_exists() -> None:
    if DEVICES == 0:
        pytest.skip("pinned memory needs a CUDA driver")
    from ddlfast import _cuda

    pinned = _cuda.PinnedMemory(64)
    view = np.frombuffer(pinned, dtype=np.float32)
    view[:] = 3.0
    assert view.size == 16 and pinned.pointer == view.ctypes.data


def test_cuda_path_on_empty_arrays_does_nothing() -> None:
    if not BUILT:
        pytest.skip("built without CUDA")
    from ddlfast import _core

    path = gpu_executor.DeviceExecutor(_core.Core(MPI.COMM_SELF))
    submission = gpu_executor.Submission([], None, [], [])
    path.run(submission, "sum", (1,), settings=None)  # no device touched, no settings read
    path.close()
