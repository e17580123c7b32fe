"""host_buffer: which arrays the core may reduce in place, and errors that name the array."""

from __future__ import annotations

import array
import sys

import numpy as np
import pytest

from ddlfast.buffers.dtypes import DTYPE_CODES, dtype_code
from ddlfast.buffers.host import host_buffer
from ddlfast.errors import DdlfastError

WHERE = "array 3 on rank 1"  # what callers pass; every error must repeat it
NUMPY_DTYPES = ["float32", "float64", "float16", "int32", "int64"]


@pytest.mark.parametrize("name", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (3, 5), (2, 0, 4), ()])
def test_accepts_supported_contiguous_writable_arrays(name: str, shape: tuple[int, ...]) -> None:
    data = np.zeros(shape, dtype=name)
    buffer = host_buffer(data, WHERE)
    assert buffer.array is data
    assert buffer.pointer == data.ctypes.data == data.__array_interface__["data"][0]
    assert buffer.count == data.size
    assert buffer.nbytes == data.nbytes == data.size * np.dtype(name).itemsize
    assert buffer.dtype_code == DTYPE_CODES[name]


def test_accepts_bfloat16_from_ml_dtypes() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    data = np.zeros(5, dtype=ml_dtypes.bfloat16)
    buffer = host_buffer(data, WHERE)
    assert (buffer.dtype_code, buffer.count, buffer.nbytes) == (DTYPE_CODES["bfloat16"], 5, 10)


def test_accepts_a_contiguous_view_and_points_at_the_view() -> None:
    base = np.arange(10, dtype=np.float64)
    view = base[3:7]
    buffer = host_buffer(view, WHERE)
    assert buffer.pointer == base.ctypes.data + 3 * 8
    assert buffer.count == 4
    row = np.zeros((4, 6), dtype=np.int32)[2]
    assert host_buffer(row, WHERE).pointer == row.ctypes.data


@pytest.mark.parametrize(
    "value",
    [[1.0, 2.0], (1, 2), 3.0, None, "abc", b"\x00" * 8, bytearray(8), memoryview(bytearray(8)),
     array.array("f", [1.0, 2.0]), np.float32(1.0)],
    ids=lambda v: type(v).__name__,
)
def test_rejects_non_numpy_objects(value: object) -> None:
    with pytest.raises(DdlfastError, match=WHERE) as error:
        host_buffer(value, WHERE)
    assert "NumPy" in str(error.value)
    assert type(value).__qualname__ in str(error.value)


def test_cuda_like_objects_get_a_hint() -> None:
    class FakeDeviceArray:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": 3}

    with pytest.raises(DdlfastError, match=WHERE) as error:
        host_buffer(FakeDeviceArray(), WHERE)
    assert "CUDA" in str(error.value)


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.zeros(10, np.float32)[::2],
        lambda: np.zeros(10, np.float32)[::-1],
        lambda: np.zeros((3, 4), np.float32).T,
        lambda: np.zeros((3, 4), np.float32, order="F"),
        lambda: np.zeros((3, 4), np.int64)[:, 1:3],
    ],
    ids=["step2", "reversed", "transposed", "fortran", "column-slice"],
)
def test_rejects_non_contiguous(make) -> None:
    with pytest.raises(DdlfastError, match=WHERE) as error:
        host_buffer(make(), WHERE)
    assert "contiguous" in str(error.value)


@pytest.mark.parametrize(
    "make",
    [
        lambda: _read_only(np.zeros(4, np.float32)),
        lambda: np.frombuffer(b"\x00" * 16, dtype=np.float32),
        lambda: _read_only(np.zeros(8, np.int64))[2:6],
    ],
    ids=["setflags", "frombuffer-bytes", "view-of-read-only"],
)
def test_rejects_read_only(make) -> None:
    with pytest.raises(DdlfastError, match=WHERE) as error:
        host_buffer(make(), WHERE)
    assert "read-only" in str(error.value)


def _read_only(data: np.ndarray) -> np.ndarray:
    data.setflags(write=False)
    return data


@pytest.mark.parametrize(
    "dtype",
    ["complex64", "complex128", "object", "bool", "int8", "uint8", "int16", "uint16", "uint32", "uint64",
     "longdouble", "datetime64[s]", "timedelta64[ns]", "U3", "S4", "V8", [("a", "<f4"), ("b", "<f4")]],
    ids=str,
)
def test_rejects_unsupported_dtypes(dtype: object) -> None:
    if dtype == "longdouble" and np.dtype(np.longdouble) == np.dtype(np.float64):
        pytest.skip("long double is float64 on this platform")
    data = np.zeros(4, dtype=dtype)
    with pytest.raises(DdlfastError, match=WHERE) as error:
        host_buffer(data, WHERE)
    message = str(error.value)
    assert "float32" in message, "the message should list what is supported"


@pytest.mark.parametrize("name", ["float32", "float64", "float16", "int32", "int64"])
def test_rejects_non_native_byte_order_and_still_accepts_native(name: str) -> None:
    foreign = np.dtype(name).newbyteorder("S")
    assert not foreign.isnative
    for _ in range(2):  # the dtype-code cache must keep the two byte orders apart, in either order
        with pytest.raises(DdlfastError, match=WHERE) as error:
            host_buffer(np.zeros(3, dtype=foreign), WHERE)
        assert host_buffer(np.zeros(3, dtype=name), WHERE).dtype_code == DTYPE_CODES[name]
    order = "big-endian" if foreign.byteorder == ">" else "little-endian"
    message = str(error.value)
    assert f"{foreign.str} ({order} {name}) is not supported" in message, message
    assert f".astype({np.dtype(name).str!r})" in message and "cannot be reduced" not in message, message


def test_big_endian_float32_message() -> None:
    if sys.byteorder != "little":
        pytest.skip("on a big-endian host >f4 is native")
    with pytest.raises(DdlfastError) as error:
        host_buffer(np.zeros(3, dtype=">f4"), WHERE)
    assert ">f4 (big-endian float32) is not supported" in str(error.value)
    assert ".astype('<f4')" in str(error.value)


def test_big_endian_bfloat16_message() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    foreign = np.dtype(ml_dtypes.bfloat16).newbyteorder("S")
    with pytest.raises(DdlfastError, match=r"bfloat16\) is not supported.*astype\(ml_dtypes\.bfloat16\)"):
        host_buffer(np.zeros(3, dtype=foreign), WHERE)


@pytest.mark.parametrize("mask", [False, [False, True, False], True], ids=["nomask", "some", "all"])
def test_rejects_masked_arrays(mask: object) -> None:
    data = np.ma.masked_array(np.arange(3, dtype=np.float32), mask=mask)
    with pytest.raises(DdlfastError, match=WHERE) as error:
        host_buffer(data, WHERE)
    assert "masked array" in str(error.value) and "array.data" in str(error.value)
    assert host_buffer(data.data, WHERE).count == 3  # the suggested fix works, in place


def test_dtype_code_names_the_array() -> None:
    with pytest.raises(DdlfastError, match="gradient 'w'"):
        dtype_code(np.dtype(np.complex64), "gradient 'w'")
    assert dtype_code(np.dtype("<i8" if sys.byteorder == "little" else ">i8"), "x") == DTYPE_CODES["int64"]


def test_array_with_two_problems_is_refused_by_name() -> None:
    data = _read_only(np.zeros(10, np.float32))[::2]
    with pytest.raises(DdlfastError, match=WHERE) as error:
        host_buffer(data, WHERE)
    assert "contiguous" in str(error.value) or "read-only" in str(error.value)
