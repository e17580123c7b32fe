"""Buffer adapters: turn user arrays into (pointer, count, dtype) for the core,
refusing anything that could be read or written wrongly."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ddlfast.dtypes import dtype_code
from ddlfast.errors import DdlfastError


class HostBuffer(NamedTuple):  # a tuple: built on every call, so kept cheap
    array: np.ndarray  # kept so the memory stays alive while in use
    pointer: int
    count: int
    nbytes: int
    dtype_code: int
    aligned: bool  # starts at a multiple of its element size; if not, it is packed (the kernels load whole elements)


def host_buffer(array: object, where: str) -> HostBuffer:
    """Validate one array for an in-place reduction; `where` names it in errors."""
    if not isinstance(array, np.ndarray):
        kind = type(array).__module__ + "." + type(array).__qualname__
        hint = " (CuPy/CUDA arrays need a CUDA build)" if hasattr(array, "__cuda_array_interface__") else ""
        raise DdlfastError(f"{where} is a {kind}, not a NumPy array{hint}")
    if isinstance(array, np.ma.MaskedArray):
        raise DdlfastError(f"{where} is a masked array (numpy.ma.MaskedArray); ddlfast would reduce the masked "
                           "elements too and ignore the mask: pass np.ma.filled(array, 0) (a copy) or array.data "
                           "(the values, in place) and combine the masks yourself")
    code = dtype_code(array.dtype, where)
    flags = array.flags
    if not flags.c_contiguous:
        raise DdlfastError(f"{where} is not C-contiguous (strides {array.strides}); pass np.ascontiguousarray(...)")
    if not flags.writeable:
        raise DdlfastError(f"{where} is read-only; ddlfast reduces in place and needs a writable array")
    pointer = array.ctypes.data
    return HostBuffer(array, pointer, array.size, array.nbytes, code, pointer % array.itemsize == 0)


def check_no_overlap(extents: list[tuple[int, int]], rank: int) -> None:
    """(pointer, nbytes) per array of one call: two that share memory (the same array twice, or overlapping
    views) would be reduced twice, so they are an error naming both indices."""
    order = sorted((start, start + size, index) for index, (start, size) in enumerate(extents) if size > 0)
    reach, holder = -1, -1  # the furthest end so far, and whose
    for start, end, index in order:
        if start < reach:
            low, high = sorted((holder, index))
            raise DdlfastError(f"arrays {low} and {high} on rank {rank} overlap in memory (the same array, or "
                               "views of one array, passed twice); each would be reduced twice")
        if end > reach:
            reach, holder = end, index
