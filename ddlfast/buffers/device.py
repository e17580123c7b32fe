"""GPU arrays: adapters for `__cuda_array_interface__` and DLPack arrays (CuPy,
PyTorch CUDA tensors, Numba, JAX, ...) and the checks that refuse what cannot
be reduced in place. The GPU executor (ddlfast/engine/device.py) runs what
these adapters describe.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ddlfast import _core
from ddlfast.buffers.dtypes import DTYPE_CODES, ELEMENT_SIZES
from ddlfast.errors import DdlfastError

try:
    from ddlfast import _cuda
except ImportError:  # built without CUDA
    _cuda = None
if _cuda is not None and not _core.build_facts()["cuda"]:
    _cuda = None  # a stale module left by an earlier CUDA build: this build has no CUDA


# __cuda_array_interface__ typestrs (little-endian hosts only, as CUDA is).
_TYPESTRS = {"<f4": "float32", "<f8": "float64", "<f2": "float16", "<i4": "int32", "<i8": "int64"}
# DLPack: device types and (type code, bits) of the supported dtypes.
_DLPACK_CUDA, _DLPACK_CUDA_MANAGED = 2, 13
_DLPACK_DTYPES = {(2, 32): "float32", (2, 64): "float64", (2, 16): "float16", (4, 16): "bfloat16",
                  (0, 32): "int32", (0, 64): "int64"}


def built_with_cuda() -> bool:
    """Whether this build carries the GPU path (the same answer as ddlfast.has_cuda())."""
    return _cuda is not None


def device_count() -> int:
    """CUDA devices this process can use; 0 without a CUDA build, a driver or a device."""
    return _cuda.device_count() if _cuda is not None else 0


def _kind(obj: object) -> str:
    return type(obj).__module__ + "." + type(obj).__qualname__


def _interface(obj: object) -> dict | None:
    try:
        interface = obj.__cuda_array_interface__  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - e.g. a CPU torch tensor raises; then it is not a GPU array
        return None
    return interface if isinstance(interface, dict) else None


def _dlpack_device(obj: object) -> tuple[int, int] | None:
    method = getattr(obj, "__dlpack_device__", None)
    if method is None:
        return None
    try:
        kind, index = method()
    except Exception:  # noqa: BLE001
        return None
    return int(kind), int(index)


def is_device_array(obj: object) -> bool:
    """Whether `obj` is a GPU array: it exports __cuda_array_interface__ or a CUDA DLPack device."""
    if isinstance(obj, np.ndarray):
        return False
    if _interface(obj) is not None:
        return True
    device = _dlpack_device(obj)
    return device is not None and device[0] in (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED)


def any_device_array(arrays: object) -> bool:
    if is_device_array(arrays):
        return True
    return isinstance(arrays, Sequence) and not isinstance(arrays, (str, bytes)) and any(
        is_device_array(a) for a in arrays)


class DeviceBuffer(NamedTuple):
    """A validated GPU array: where it is, what it holds, and what keeps it alive."""

    array: Any  # the caller's object
    pointer: int
    count: int
    nbytes: int
    dtype_code: int
    dtype_name: str
    shape: tuple[int, ...]
    device: int | None  # None for an empty array (no memory to locate)
    stream: int | None  # the stream the array's producer works on (None: nothing to wait for)
    keepalive: Any = None  # e.g. the DLPack capsule, alive while the buffer is in use


class _Described(NamedTuple):
    """What an array says about itself, before any CUDA call (pure: testable without a GPU)."""

    pointer: int
    shape: tuple[int, ...]
    dtype_name: str
    stream: int | None
    device: int | None  # known from DLPack; None from the CUDA array interface
    keepalive: Any


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def _check_contiguous(shape: tuple[int, ...], strides: Sequence[int] | None, itemsize: int, where: str) -> None:
    if strides is None or 0 in shape:
        return
    expected = _c_strides(shape, itemsize)
    # Strides of extent-1 dimensions never matter.
    if any(s != e for s, e, n in zip(strides, expected, shape, strict=True) if n != 1):
        raise DdlfastError(f"{where} is not C-contiguous (shape {shape}, byte strides {tuple(strides)}); "
                           "pass a contiguous copy (e.g. cupy.ascontiguousarray(...) or tensor.contiguous())")


def describe_interface(obj: object, where: str) -> _Described:
    """Read and check __cuda_array_interface__ (versions 0-3) without touching the GPU."""
    interface = _interface(obj)
    if interface is None:
        raise DdlfastError(f"{where} ({_kind(obj)}) has no usable __cuda_array_interface__")
    try:
        shape = tuple(int(n) for n in interface["shape"])
        typestr = str(interface["typestr"])
        pointer, readonly = interface["data"]
    except (KeyError, TypeError, ValueError) as error:
        raise DdlfastError(f"{where} ({_kind(obj)}) has a malformed __cuda_array_interface__: {error!r}") from None
    if interface.get("mask") is not None:
        raise DdlfastError(f"{where} is a masked array; ddlfast reduces plain arrays only")
    if readonly:
        raise DdlfastError(f"{where} is read-only; ddlfast reduces in place and needs a writable array")
    name = _TYPESTRS.get(typestr.replace("=", "<"))
    if name is None:
        hint = " (bfloat16 arrays: pass them through DLPack, e.g. a torch tensor)" if typestr.endswith("V2") else ""
        raise DdlfastError(f"{where} has typestr {typestr!r}, which ddlfast cannot reduce; supported: "
                           f"{', '.join(DTYPE_CODES)}{hint}")
    _check_contiguous(shape, interface.get("strides"), ELEMENT_SIZES[name], where)
    stream = interface.get("stream") if int(interface.get("version", 0)) >= 3 else None
    if stream == 0:
        raise DdlfastError(f"{where} exports stream 0, which the CUDA array interface forbids (1 means the legacy "
                           "default stream)")
    return _Described(int(pointer or 0), shape, name, None if stream is None else int(stream), None, None)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):  # dlpack.h, the legacy (unversioned) layout
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


def describe_dlpack(obj: object, where: str, stream: int | None) -> _Described:
    """Take a DLPack view of a CUDA array (legacy "dltensor" capsule, kept alive, never consumed).

    `stream` is the stream ddlfast will order against: the producer makes it wait for its own work.
    """
    device = _dlpack_device(obj)
    if device is None or device[0] not in (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED):
        raise DdlfastError(f"{where} ({_kind(obj)}) is not a CUDA DLPack array")
    try:
        capsule = obj.__dlpack__(stream=1 if stream is None else stream)  # type: ignore[attr-defined]
    except Exception as error:  # noqa: BLE001 - the producer's own refusal, passed on
        raise DdlfastError(f"{where} ({_kind(obj)}) refused to export DLPack: {error}") from None
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    try:
        address = get_pointer(capsule, b"dltensor")
    except ValueError:
        raise DdlfastError(f"{where} ({_kind(obj)}) exported a DLPack capsule that is not a 'dltensor'") from None
    tensor = _DLTensor.from_address(address)
    shape = tuple(int(tensor.shape[i]) for i in range(tensor.ndim))
    name = _DLPACK_DTYPES.get((tensor.dtype.code, tensor.dtype.bits)) if tensor.dtype.lanes == 1 else None
    if name is None:
        raise DdlfastError(f"{where} has DLPack dtype (code {tensor.dtype.code}, {tensor.dtype.bits} bits, "
                           f"{tensor.dtype.lanes} lanes), which ddlfast cannot reduce; supported: "
                           f"{', '.join(DTYPE_CODES)}")
    itemsize = ELEMENT_SIZES[name]
    strides = None
    if tensor.strides:  # DLPack strides count elements
        strides = [int(tensor.strides[i]) * itemsize for i in range(tensor.ndim)]
    _check_contiguous(shape, strides, itemsize, where)
    pointer = (tensor.data or 0) + int(tensor.byte_offset)
    return _Described(pointer, shape, name, 1 if stream is None else stream, int(tensor.device.device_id), capsule)


def stream_handle(stream: object) -> int | None:
    """A stream given as an int, a CuPy stream (.ptr), a torch stream (.cuda_stream) or None."""
    if stream is None:
        return None
    for attribute in ("ptr", "cuda_stream", "handle"):
        value = getattr(stream, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    if isinstance(stream, int) and not isinstance(stream, bool) and stream >= 0:
        return stream
    raise DdlfastError(f"stream={stream!r} is not a CUDA stream: pass an int handle, a cupy.cuda.Stream or a "
                       "torch.cuda.Stream")


def _require_cuda(obj: object, where: str) -> Any:
    if _cuda is None:
        raise DdlfastError(f"{where} is a {_kind(obj)} on a CUDA device, but this ddlfast build has no CUDA support "
                           "(no nvcc when it was built). Rebuild with the CUDA toolkit installed (DDLFAST_CUDA=on), "
                           "or pass a host copy (e.g. cupy.asnumpy(array) or tensor.cpu().numpy())")
    if _cuda.device_count() == 0:
        raise DdlfastError(f"{where} is a {_kind(obj)} on a CUDA device, but this process sees no usable CUDA "
                           f"device: {_cuda.no_device_reason()}")
    return _cuda


def device_buffer(array: object, where: str, stream: int | None = None) -> DeviceBuffer:
    """Validate one GPU array for an in-place reduction; `where` names it in errors.

    stream: the caller's stream (an int handle) overriding the one the array exports.
    """
    if not is_device_array(array):
        raise DdlfastError(f"{where} is a {_kind(array)}, not a CUDA array")
    cuda = _require_cuda(array, where)
    if _interface(array) is not None:
        described = describe_interface(array, where)
    else:
        described = describe_dlpack(array, where, stream)
    count = int(np.prod(described.shape, dtype=np.int64)) if described.shape else 1
    nbytes = count * ELEMENT_SIZES[described.dtype_name]
    device = described.device
    if nbytes > 0:
        kind, located = cuda.locate_pointer(described.pointer)
        if kind not in ("device", "managed"):
            raise DdlfastError(f"{where} says it is a CUDA array, but its memory is {kind} memory; pass it as a "
                               "NumPy array instead")
        if device is not None and located != device:
            raise DdlfastError(f"{where} says it is on cuda:{device} but its memory is on cuda:{located}")
        device = located
        if described.pointer % ELEMENT_SIZES[described.dtype_name]:
            raise DdlfastError(f"{where} starts at an address not aligned to its element size")
    return DeviceBuffer(array, described.pointer, count, nbytes, DTYPE_CODES[described.dtype_name],
                        described.dtype_name, described.shape, device,
                        stream if stream is not None else described.stream, described.keepalive)


def device_buffers(arrays: Sequence[object], rank: int, stream: object = None) -> list[DeviceBuffer]:
    """Validate a call's arrays: all on the GPU, all on one device."""
    handle = stream_handle(stream)
    buffers = []
    first_device: tuple[int, int] | None = None  # (index, device)
    for i, array in enumerate(arrays):
        where = f"array {i} on rank {rank}"
        if not is_device_array(array):
            if first_device is not None or i > 0:
                raise DdlfastError(f"{where} is a {_kind(array)} (host memory) but array 0 is a CUDA array; one "
                                   "collective takes arrays of one device: all on the GPU or all in host memory")
            raise DdlfastError(f"{where} is a {_kind(array)}, not a CUDA array")
        buffer = device_buffer(array, where, handle)
        if buffer.device is not None:
            if first_device is None:
                first_device = (i, buffer.device)
            elif buffer.device != first_device[1]:
                raise DdlfastError(f"arrays {first_device[0]} and {i} on rank {rank} are on different GPUs "
                                   f"(cuda:{first_device[1]} and cuda:{buffer.device}); one collective reduces "
                                   "arrays of one device")
        buffers.append(buffer)
    if handle is not None and first_device is not None:
        owner = _cuda.device_of_stream(handle)
        if owner >= 0 and owner != first_device[1]:
            raise DdlfastError(f"stream {handle:#x} on rank {rank} belongs to cuda:{owner} but the arrays are on "
                               f"cuda:{first_device[1]}; pass a stream of the arrays' device")
    return buffers


def cuda_module() -> Any:
    """The compiled GPU side (ddlfast._cuda), or None in a build without CUDA."""
    return _cuda
