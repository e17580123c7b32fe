"""A minimal GPU array for tests that must not depend on CuPy: device memory from ddlfast._testing_cuda, filled
from and read back into NumPy, exported through __cuda_array_interface__ (version 3)."""

from __future__ import annotations

import numpy as np

TYPESTRS = {np.dtype(np.float32): "<f4", np.dtype(np.float64): "<f8", np.dtype(np.float16): "<f2",
            np.dtype(np.int32): "<i4", np.dtype(np.int64): "<i8"}


class DeviceArray:
    def __init__(self, host: np.ndarray, device: int = 0, stream: int | None = 1, offset: int = 0) -> None:
        """A device copy of `host`, `offset` bytes into its allocation (to exercise unaligned starts)."""
        from ddlfast import _testing_cuda

        self.dtype, self.shape = host.dtype, host.shape
        self.nbytes = host.nbytes
        self.memory = _testing_cuda.DeviceMemory(host.nbytes + offset + 16, device)
        self.pointer = self.memory.pointer + offset
        self.stream = stream
        self.set(host)

    def set(self, host: np.ndarray) -> None:
        from ddlfast import _testing_cuda

        data = np.ascontiguousarray(host, dtype=self.dtype)
        _testing_cuda.copy(self.pointer, data.ctypes.data, self.nbytes)

    def get(self) -> np.ndarray:
        from ddlfast import _testing_cuda

        out = np.empty(self.shape, dtype=self.dtype)
        _testing_cuda.copy(out.ctypes.data, self.pointer, self.nbytes)
        return out

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": TYPESTRS[self.dtype], "data": (self.pointer, False),
                "strides": None, "version": 3, "stream": self.stream}
