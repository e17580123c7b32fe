"""ddlfast.buffers.device's adapters and checks, without a GPU: what a GPU array says about itself, how arrays of a
call are validated together, bucket layout and settings. A fake `_cuda` module stands in for the device
queries where a test needs devices."""

from __future__ import annotations

import numpy as np
import pytest

from ddlfast import config
from ddlfast.buffers import device as device_arrays
from ddlfast.engine import device as gpu_executor
from ddlfast.errors import DdlfastError
from ddlfast.fusion.pack_policy import DEVICE_ALIGN_BYTES, aligned_offsets

WHERE = "array 2 on rank 1"


class FakeCudaArray:
    """The smallest CuPy look-alike: only __cuda_array_interface__ (version 3 unless told)."""

    def __init__(self, shape=(2, 3), typestr="<f4", pointer=0x7F0000001000, strides=None, readonly=False,
                 version=3, stream=1, mask=None, extra=None) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (pointer, readonly),
                                         "strides": strides, "version": version, "stream": stream}
        if mask is not None:
            self.__cuda_array_interface__["mask"] = mask
        if extra:
            self.__cuda_array_interface__.update(extra)


class RaisingInterface:
    """Like a CPU torch tensor: the property exists but refuses."""

    @property
    def __cuda_array_interface__(self) -> dict:
        raise RuntimeError("not on a CUDA device")


class FakeDLPack:
    """A DLPack exporter that claims a CUDA device but hands out a host array's capsule (parsing only)."""

    def __init__(self, array: np.ndarray, device: tuple[int, int] = (2, 0)) -> None:
        self.array, self.device = array, device
        self.streams: list[object] = []

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device

    def __dlpack__(self, stream=None):
        self.streams.append(stream)
        return self.array.__dlpack__()


class FakeModule:
    """Stands in for ddlfast._cuda: pointers map to devices by their high bits."""

    def __init__(self, devices: int = 2, stream_devices: dict | None = None, kind: str = "device") -> None:
        self.devices, self.stream_devices, self.kind = devices, stream_devices or {}, kind
        self.located: list[int] = []

    def device_count(self) -> int:
        return self.devices

    def no_device_reason(self) -> str:
        return "" if self.devices else "CUDA error in cudaGetDeviceCount: cudaErrorNoDevice"

    def locate_pointer(self, pointer: int) -> tuple[str, int]:
        self.located.append(pointer)
        return self.kind, pointer >> 40

    def device_of_stream(self, stream: int) -> int:
        return self.stream_devices.get(stream, -1)


def on_device(device: int, offset: int = 0x1000, **kwargs) -> FakeCudaArray:
    return FakeCudaArray(pointer=(device << 40) + offset, **kwargs)


# ---------------------------------------------------------------- recognising GPU arrays


def test_is_device_array() -> None:
    assert device_arrays.is_device_array(FakeCudaArray())
    assert not device_arrays.is_device_array(np.zeros(3))
    assert not device_arrays.is_device_array(RaisingInterface())
    assert not device_arrays.is_device_array([1, 2])
    assert device_arrays.is_device_array(FakeDLPack(np.zeros(3, np.float32)))
    assert not device_arrays.is_device_array(FakeDLPack(np.zeros(3, np.float32), device=(1, 0)))  # kDLCPU
    assert device_arrays.any_device_array([np.zeros(2), FakeCudaArray()])
    assert not device_arrays.any_device_array([np.zeros(2)])
    assert not device_arrays.any_device_array("not arrays")


# ---------------------------------------------------------------- __cuda_array_interface__


@pytest.mark.parametrize(("typestr", "name"), [("<f4", "float32"), ("<f8", "float64"), ("<f2", "float16"),
                                               ("<i4", "int32"), ("<i8", "int64"), ("=f4", "float32")])
def test_interface_dtypes(typestr: str, name: str) -> None:
    described = device_arrays.describe_interface(FakeCudaArray(typestr=typestr), WHERE)
    assert described.dtype_name == name
    assert described.shape == (2, 3)
    assert described.pointer == 0x7F0000001000
    assert described.stream == 1


@pytest.mark.parametrize("typestr", ["<u1", "<i2", "<c8", ">f4", "|b1"])
def test_interface_unsupported_dtype_names_the_array_and_the_supported_ones(typestr: str) -> None:
    with pytest.raises(DdlfastError, match=rf"{WHERE} has typestr .*supported: float32, float64"):
        device_arrays.describe_interface(FakeCudaArray(typestr=typestr), WHERE)


def test_interface_bfloat16_hint() -> None:
    with pytest.raises(DdlfastError, match="DLPack"):
        device_arrays.describe_interface(FakeCudaArray(typestr="<V2"), WHERE)


def test_interface_read_only_masked_and_malformed() -> None:
    with pytest.raises(DdlfastError, match=f"{WHERE} is read-only"):
        device_arrays.describe_interface(FakeCudaArray(readonly=True), WHERE)
    with pytest.raises(DdlfastError, match="masked"):
        device_arrays.describe_interface(FakeCudaArray(mask=object()), WHERE)
    broken = FakeCudaArray()
    del broken.__cuda_array_interface__["data"]
    with pytest.raises(DdlfastError, match="malformed"):
        device_arrays.describe_interface(broken, WHERE)


def test_interface_strides() -> None:
    assert device_arrays.describe_interface(FakeCudaArray(strides=(12, 4)), WHERE).shape == (2, 3)
    # Extent-1 dimensions may carry any stride; empty arrays are contiguous.
    device_arrays.describe_interface(FakeCudaArray(shape=(1, 3), strides=(999, 4)), WHERE)
    device_arrays.describe_interface(FakeCudaArray(shape=(0, 3), strides=(4, 8)), WHERE)
    with pytest.raises(DdlfastError, match=rf"{WHERE} is not C-contiguous .*strides \(4, 8\)"):
        device_arrays.describe_interface(FakeCudaArray(strides=(4, 8)), WHERE)
    with pytest.raises(DdlfastError, match="not C-contiguous"):
        device_arrays.describe_interface(FakeCudaArray(shape=(6,), strides=(8,)), WHERE)


def test_interface_streams_by_version() -> None:
    assert device_arrays.describe_interface(FakeCudaArray(stream=0x55AA), WHERE).stream == 0x55AA
    assert device_arrays.describe_interface(FakeCudaArray(stream=None), WHERE).stream is None
    # no stream before version 3
    assert device_arrays.describe_interface(FakeCudaArray(version=2, stream=7), WHERE).stream is None
    with pytest.raises(DdlfastError, match="stream 0"):
        device_arrays.describe_interface(FakeCudaArray(stream=0), WHERE)


def test_interface_scalar_and_empty() -> None:
    assert device_arrays.describe_interface(FakeCudaArray(shape=()), WHERE).shape == ()
    assert device_arrays.describe_interface(FakeCudaArray(shape=(0,), pointer=0), WHERE).pointer == 0


# ---------------------------------------------------------------- DLPack


def test_dlpack_view() -> None:
    host = np.arange(6, dtype=np.float32).reshape(2, 3)
    exporter = FakeDLPack(host)
    described = device_arrays.describe_dlpack(exporter, WHERE, stream=None)
    assert (described.pointer, described.shape, described.dtype_name) == (host.ctypes.data, (2, 3), "float32")
    assert described.stream == 1 and exporter.streams == [1]  # legacy default stream, as DLPack says
    assert described.keepalive is not None  # the capsule stays alive with the buffer
    assert device_arrays.describe_dlpack(FakeDLPack(host), WHERE, stream=0x1234).stream == 0x1234


def test_dlpack_refusals() -> None:
    with pytest.raises(DdlfastError, match="not C-contiguous"):
        device_arrays.describe_dlpack(FakeDLPack(np.zeros((3, 4), np.float32).T), WHERE, None)
    with pytest.raises(DdlfastError, match="DLPack dtype .* cannot reduce"):
        device_arrays.describe_dlpack(FakeDLPack(np.zeros(4, np.int8)), WHERE, None)
    with pytest.raises(DdlfastError, match="not a CUDA DLPack array"):
        device_arrays.describe_dlpack(FakeDLPack(np.zeros(4, np.float32), device=(1, 0)), WHERE, None)


# ---------------------------------------------------------------- streams, layout, settings


def test_stream_handles() -> None:
    class CupyStream:
        ptr = 0xABC

    class TorchStream:
        cuda_stream = 0xDEF

    assert device_arrays.stream_handle(None) is None
    assert device_arrays.stream_handle(0x10) == 0x10
    assert device_arrays.stream_handle(CupyStream()) == 0xABC
    assert device_arrays.stream_handle(TorchStream()) == 0xDEF
    for bad in (-1, True, "stream", 1.5):
        with pytest.raises(DdlfastError, match="not a CUDA stream"):
            device_arrays.stream_handle(bad)


def test_bucket_layout_aligns_every_array() -> None:
    assert aligned_offsets([5, 16, 0, 17], DEVICE_ALIGN_BYTES) == ([0, 16, 32, 32], 64)
    assert aligned_offsets([], DEVICE_ALIGN_BYTES) == ([], 0)
    offsets, total = aligned_offsets([3, 3, 3], 8)
    assert offsets == [0, 8, 16] and total == 24


def test_cuda_aware_setting() -> None:
    assert config.cuda_aware_mpi({}) == "auto"
    assert config.cuda_aware_mpi({"DDLFAST_CUDA_AWARE_MPI": " ON "}) == "on"
    assert config.cuda_aware_mpi({"DDLFAST_CUDA_AWARE_MPI": ""}) == "auto"
    with pytest.raises(DdlfastError, match="DDLFAST_CUDA_AWARE_MPI"):
        config.cuda_aware_mpi({"DDLFAST_CUDA_AWARE_MPI": "yes"})
    assert gpu_executor.use_direct_transfers("on", False) and gpu_executor.use_direct_transfers("auto", True)
    assert not gpu_executor.use_direct_transfers("auto", False) and not gpu_executor.use_direct_transfers("off", True)


def test_layout_marks_gpu_arrays() -> None:
    from ddlfast.engine.device import layout_arrays

    buffer = device_arrays.DeviceBuffer(None, 1, 6, 24, 0, "float32", (2, 3), 0, None)
    assert layout_arrays([buffer]) == (("cuda float32", (2, 3)),)


# ---------------------------------------------------------------- a call's arrays together (fake devices)


def test_buffers_on_one_device(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeModule()
    monkeypatch.setattr(device_arrays, "_cuda", fake)
    buffers = device_arrays.device_buffers([on_device(1), on_device(1, 0x2000, shape=(5,), typestr="<i8")], rank=1)
    assert [b.device for b in buffers] == [1, 1]
    assert [(b.count, b.nbytes, b.dtype_code) for b in buffers] == [(6, 24, 0), (5, 40, 5)]
    assert buffers[0].stream == 1  # exported by the array


def test_arrays_on_different_devices_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_arrays, "_cuda", FakeModule())
    with pytest.raises(DdlfastError, match=r"arrays 0 and 2 on rank 3 are on different GPUs \(cuda:0 and cuda:1\)"):
        device_arrays.device_buffers([on_device(0), on_device(0, 0x2000), on_device(1)], rank=3)


def test_host_and_gpu_arrays_mixed_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_arrays, "_cuda", FakeModule())
    with pytest.raises(DdlfastError, match="array 1 on rank 0 is a numpy.ndarray .*all on the GPU or all in host"):
        device_arrays.device_buffers([on_device(0), np.zeros(3)], rank=0)


def test_a_stream_of_another_device_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_arrays, "_cuda", FakeModule(stream_devices={0x5000: 1}))
    with pytest.raises(DdlfastError, match=r"stream 0x5000 on rank 2 belongs to cuda:1 but the arrays are on cuda:0"):
        device_arrays.device_buffers([on_device(0)], rank=2, stream=0x5000)
    # The default streams follow the current device: accepted, and they override the exported stream.
    assert device_arrays.device_buffers([on_device(0)], rank=2, stream=2)[0].stream == 2


def test_memory_that_is_not_device_memory_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_arrays, "_cuda", FakeModule(kind="host (pinned)"))
    with pytest.raises(DdlfastError, match="host \\(pinned\\) memory"):
        device_arrays.device_buffers([on_device(0)], rank=0)


def test_empty_arrays_need_no_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeModule()
    monkeypatch.setattr(device_arrays, "_cuda", fake)
    buffers = device_arrays.device_buffers([FakeCudaArray(shape=(0,), pointer=0), on_device(1)], rank=0)
    assert buffers[0].device is None and buffers[1].device == 1
    assert fake.located == [(1 << 40) + 0x1000]


def test_misaligned_pointer_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_arrays, "_cuda", FakeModule())
    with pytest.raises(DdlfastError, match="not aligned"):
        device_arrays.device_buffers([on_device(0, 0x1002)], rank=0)


# ---------------------------------------------------------------- builds without CUDA, machines without GPUs


def test_gpu_arrays_without_a_cuda_build_get_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_arrays, "_cuda", None)
    assert not device_arrays.built_with_cuda() and device_arrays.device_count() == 0
    with pytest.raises(DdlfastError, match=rf"{WHERE} is a .*FakeCudaArray on a CUDA device, but this ddlfast build "
                                           r"has no CUDA support .*DDLFAST_CUDA=on.*cupy.asnumpy"):
        device_arrays.device_buffer(FakeCudaArray(), WHERE)
    with pytest.raises(DdlfastError, match="no CUDA support"):
        gpu_executor.DeviceExecutor(core=None)


def test_gpu_arrays_without_a_device_get_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_arrays, "_cuda", FakeModule(devices=0))
    with pytest.raises(DdlfastError, match=rf"{WHERE} is a .* but this process sees no usable CUDA device: "
                                           "CUDA error in cudaGetDeviceCount"):
        device_arrays.device_buffer(FakeCudaArray(), WHERE)
