"""A stand-in for ddlfast._cuda on machines without a GPU, for running the GPU executor end to end:
"device" arrays are host memory exported through __cuda_array_interface__, copies are memmoves, fences
do nothing, and the collective itself runs the real GPU ring executor on emulated lanes
(_testing.emulated_allreduce). What it cannot check: anything CUDA does (kernels, streams, events)."""

from __future__ import annotations

import ctypes
import itertools

import numpy as np

from ddlfast.buffers import device as device_arrays
from tests.cuda.device_array import TYPESTRS


class HostArray:
    """DeviceArray's interface over host memory."""

    def __init__(self, host: np.ndarray, device: int = 0, stream: int | None = 1, offset: int = 0) -> None:
        self.dtype, self.shape, self.nbytes = host.dtype, host.shape, host.nbytes
        self.memory = np.zeros(host.nbytes + offset + 64, dtype=np.uint8)
        self.pointer = self.memory.ctypes.data + (-self.memory.ctypes.data) % 16 + offset
        self.stream = stream
        self.set(host)

    def set(self, host: np.ndarray) -> None:
        data = np.ascontiguousarray(host, dtype=self.dtype)
        ctypes.memmove(self.pointer, data.ctypes.data, self.nbytes)

    def get(self) -> np.ndarray:
        out = np.empty(self.shape, dtype=self.dtype)
        ctypes.memmove(out.ctypes.data, self.pointer, self.nbytes)
        return out

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": TYPESTRS[self.dtype], "data": (self.pointer, False),
                "strides": None, "version": 3, "stream": self.stream}


class _Fence:
    def make_wait(self, stream: int) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _StreamFence:
    @staticmethod
    def record(device: int, stream: int) -> _Fence:
        return _Fence()


class _PinnedMemory(bytearray):
    @property
    def nbytes(self) -> int:
        return len(self)


class _DeviceCore:
    def __init__(self, core) -> None:
        from ddlfast import _testing

        self._real = _testing
        self.core = core
        self.buckets: dict[int, np.ndarray] = {}
        self.record_events = False
        self.seeds = itertools.count(core.rank * 1000)

    def set_timeout(self, seconds: float) -> None:
        self.core.set_timeout(seconds)

    def wait_for(self, device: int, fence: object) -> None:
        pass

    def bucket(self, device: int, dtype: int, nbytes: int) -> int:
        current = self.buckets.get(dtype)
        if current is None or current.nbytes < nbytes + 64:
            current = self.buckets[dtype] = np.zeros(nbytes + 64, dtype=np.uint8)
        return current.ctypes.data + (-current.ctypes.data) % 16

    def copy_batch(self, device: int, dsts: list, srcs: list, sizes: list) -> None:
        for dst, src, size in zip(dsts, srcs, sizes, strict=True):
            ctypes.memmove(dst, src, size)

    def copy(self, device: int, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    def allreduce_segments(self, device, pointers, counts, dtype, op, options, direct=False) -> None:
        self._real.emulated_allreduce(self.core, list(pointers), list(counts), dtype, op, options, direct,
                                      next(self.seeds))

    def record(self, device: int) -> _Fence:
        return _Fence()

    def synchronize(self, device: int) -> None:
        pass

    def stream(self, device: int) -> int:
        return 0

    def take_events(self) -> list:
        return []

    def close(self) -> None:
        pass


class _Module:
    StreamFence = _StreamFence
    PinnedMemory = _PinnedMemory
    DeviceCore = _DeviceCore

    def device_count(self) -> int:
        return 1

    def no_device_reason(self) -> str:
        return ""

    def locate_pointer(self, pointer: int) -> tuple[str, int]:
        return "device", 0

    def device_of_stream(self, stream: int) -> int:
        return -1

    def mpi_cuda_support(self) -> tuple[bool, str]:
        return False, "emulated"


def install() -> None:
    """Make the GPU adapters and executor use the stand-in (any build: the emulated executor is in ddlfast._testing)."""
    device_arrays._cuda = _Module()  # the adapters and the GPU executor both ask it (cuda_module())
