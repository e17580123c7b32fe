"""The host executor's persistent fused buffers (one growable flat buffer per dtype) and the compiled
pack/unpack of a bucket's small arrays into them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ddlfast import _core
from ddlfast.buffers.host import HostBuffer


class FusedBufferPool:
    """One growable flat buffer per dtype, reused across steps."""

    def __init__(self) -> None:
        self._by_dtype: dict[np.dtype, np.ndarray] = {}

    def get(self, dtype: np.dtype, count: int) -> np.ndarray:
        current = self._by_dtype.get(dtype)
        if current is None or current.size < count:
            current = np.empty(max(count, 1), dtype=dtype)
            self._by_dtype[dtype] = current
        return current[:count]

    def clear(self) -> None:
        self._by_dtype.clear()


def pack(fused: np.ndarray, members: Sequence[HostBuffer]) -> None:
    _core.pack_arrays(fused.ctypes.data, [b.pointer for b in members], [b.nbytes for b in members])


def unpack(fused: np.ndarray, members: Sequence[HostBuffer]) -> None:
    _core.unpack_arrays(fused.ctypes.data, [b.pointer for b in members], [b.nbytes for b in members])
