"""The element types ddlfast reduces, their codes in the C++ core and their sizes."""

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
# The one table of element sizes (bytes), by dtype name and by core code.
ELEMENT_SIZES: dict[str, int] = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8}
ELEMENT_SIZES_BY_CODE: tuple[int, ...] = tuple(ELEMENT_SIZES[name] for name in DTYPE_CODES)


_codes_by_dtype: dict[np.dtype, int] = {}


def dtype_code(dtype: np.dtype, where: str) -> int:
    """The core's code for a NumPy dtype (bfloat16 from ml_dtypes too)."""
    code = _codes_by_dtype.get(dtype)
    if code is not None:
        return code
    dtype = np.dtype(dtype)
    name = dtype.name
    code = DTYPE_CODES.get(name) if dtype.isnative else None
    if code is None:
        if name in DTYPE_CODES:  # a supported type in the other byte order
            order = "big-endian" if dtype.byteorder == ">" else "little-endian"
            native = dtype.newbyteorder("=")
            plain = native.kind != "V"  # ml_dtypes' bfloat16 spells as raw bytes ('<V2')
            spelled = dtype.str if plain else f"{dtype.byteorder}{name}"
            fix = repr(native.str) if plain else f"ml_dtypes.{name}"
            raise DdlfastError(f"{where}: {spelled} ({order} {name}) is not supported; use .astype({fix}) "
                               "(ddlfast reduces native byte order only)")
        raise DdlfastError(f"{where} has dtype {name}, which ddlfast cannot reduce; supported: {', '.join(SUPPORTED)}")
    _codes_by_dtype[np.dtype(dtype)] = code
    return code


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a supported dtype name (bfloat16 from ml_dtypes)."""
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise DdlfastError("bfloat16 arrays on the host need the ml_dtypes package") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)
