"""The wire encoders count finite values that round to inf, on every kernel path."""

from __future__ import annotations

import numpy as np
import pytest

from ddlfast import _core, _testing


@pytest.mark.parametrize("path", _core.kernel_paths())
@pytest.mark.parametrize("length", [5, 8, 13, 64])  # vector body and scalar tail
def test_encoders_count_overflow_but_not_inf_or_nan(path: str, length: int) -> None:
    values = np.zeros(length, np.float32)
    values[:5] = [70_000.0, -70_000.0, np.inf, np.nan, 65_519.0]  # 65519 rounds down to 65504
    out = np.zeros(length, np.uint16)
    assert _testing.encode_wire(out.ctypes.data, values.ctypes.data, length, 0, path) == 2
    big = np.full(length, 3.4e38, np.float32)  # rounds past bf16's largest finite value
    assert _testing.encode_wire(out.ctypes.data, big.ctypes.data, length, 1, path) == length
    assert _testing.encode_wire(out.ctypes.data, values.ctypes.data, length, 1, path) == 0
