"""The element types ddlfast reduces, and their codes in the C++ core."""

from __future__ import annotations

import numpy as np

from ddlfast.errors import DdlfastError

# Mirrors enum class DType in src/common/dtype.h.
DTYPE_CODES: dict[str, int] = {
    "float32": 0,
    "float64": 1,
    "float16": 2,
    "bfloat16": 3,
    "int32": 4,
    "int64": 5,
}
SUPPORTED = tuple(DTYPE_CODES)


_codes_by_dtype: dict[np.dtype, int] = {}


def dtype_code(dtype: np.dtype, where: str) -> int:
    """The core's code for a NumPy dtype (bfloat16 from ml_dtypes too)."""
    code = _codes_by_dtype.get(dtype)
    if code is not None:
        return code
    name = np.dtype(dtype).name
    code = DTYPE_CODES.get(name) if np.dtype(dtype).isnative else None
    if code is None:
        raise DdlfastError(f"{where} has dtype {name}, which ddlfast cannot reduce; supported: {', '.join(SUPPORTED)}")
    _codes_by_dtype[np.dtype(dtype)] = code
    return code
