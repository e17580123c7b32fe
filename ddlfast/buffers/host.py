"""Buffer adapters: turn user arrays into (pointer, count, dtype) for the core,
refusing anything that could be read or written wrongly."""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import numpy as np

from ddlfast.buffers.dtypes import dtype_code, numpy_dtype
from ddlfast.errors import DdlfastError


class HostBuffer(NamedTuple):  # a tuple: built on every call, so kept cheap
    array: np.ndarray  # kept so the memory stays alive while in use
    pointer: int
    count: int
    nbytes: int
    dtype_code: int
    aligned: bool  # starts at a multiple of its element size; if not, it is packed (the kernels load whole elements)


def host_buffer(array: object, where: str) -> HostBuffer:
    """Validate one array (NumPy, or a torch CPU tensor through its view) for an in-place reduction; `where` names
    it in errors."""
    if type(array) is not np.ndarray:  # the common case costs one compare (fused calls of 100k arrays)
        array = host_view(array, where)
    if not isinstance(array, np.ndarray):
        kind = type(array).__module__ + "." + type(array).__qualname__
        hint = " (CuPy/CUDA arrays need a CUDA build)" if hasattr(array, "__cuda_array_interface__") else ""
        raise DdlfastError(f"{where} is a {kind}, not a NumPy array or torch CPU tensor{hint}")
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


def torch_tensor_module(obj: object) -> Any:
    """torch, when `obj` is a torch tensor (torch is never imported here: a tensor means it already is)."""
    torch = sys.modules.get("torch")
    return torch if torch is not None and isinstance(obj, torch.Tensor) else None


def numpy_view(tensor: Any) -> np.ndarray:
    """A NumPy array sharing a CPU torch tensor's memory (bfloat16 through ml_dtypes). A tensor that requires
    grad is read detached, as gloo reads it: the view shares its storage, so in-place results land in it."""
    torch = torch_tensor_module(tensor)
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    return tensor.numpy()


def host_view(obj: object, where: str = "the tensor") -> object:
    """The one intake of host arrays: torch CPU tensors through their NumPy view (shared memory, read detached
    when they require grad); everything else as it is, for the caller's checks."""
    if torch_tensor_module(obj) is not None and obj.device.type == "cpu":  # type: ignore[attr-defined]
        try:
            return numpy_view(obj)
        except (TypeError, RuntimeError) as error:  # a dtype NumPy has no twin for (complex32, quantized, ...)
            raise DdlfastError(f"{where} is a torch tensor of {obj.dtype} with no NumPy view ({error})") from None
    return obj


def broadcast_target(array: object, where: str) -> np.ndarray:
    """A host array broadcast() can overwrite: any fixed-size dtype (the copy is of bytes), C-contiguous,
    writable; a torch CPU tensor through its view."""
    array = host_view(array, where)
    if not isinstance(array, np.ndarray) or isinstance(array, np.ma.MaskedArray):
        kind = type(array).__module__ + "." + type(array).__qualname__
        raise DdlfastError(f"{where}: the array is a {kind}, not a NumPy array or torch CPU tensor (or a GPU array "
                           "in a CUDA build)")
    if array.dtype.hasobject:
        raise DdlfastError(f"{where}: dtype {array.dtype} holds Python objects, which cannot be broadcast as bytes; "
                           "use ddlfast.broadcast_object")
    if not array.flags.c_contiguous:
        raise DdlfastError(f"{where}: the array is not C-contiguous (strides {array.strides}); pass "
                           "np.ascontiguousarray(...)")
    if not array.flags.writeable:
        raise DdlfastError(f"{where}: the array is read-only; broadcast overwrites it in place")
    return array
