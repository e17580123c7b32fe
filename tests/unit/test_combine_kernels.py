"""min, max and product kernels against NumPy references, bit for bit, on every kernel path.

`_testing.combine_into(dst, src, n, dtype, op, path)` computes dst = op(dst, src) in place (op codes: 2 min,
3 max, 4 product). The rules (docs/numerics.md): floating min/max propagate nan as np.minimum/np.maximum
do, a nan result is the one canonical quiet nan (positive, zero payload) whichever nan came in, and
min(-0, +0) is -0, max is +0, whatever the order; halves' product is the fp32 product rounded once (NumPy's
float16 multiply); integer product wraps like NumPy.
"""

from __future__ import annotations

import numpy as np
import pytest

from ddlfast import _testing
from ddlfast.buffers.dtypes import DTYPE_CODES
from ddlfast.ops import OPS
from tests.unit.test_kernels import (
    BITS,
    DTYPES,
    FLOAT_DTYPES,
    PATHS,
    STORAGE,
    as_bits,
    bf16_to_f32,
    f32_to_bf16,
    random_values,
    special_pairs,
)

COMBINE_OPS = ("min", "max", "product")
CANONICAL_NAN = {"float32": 0x7FC00000, "float64": 0x7FF8000000000000, "float16": 0x7E00, "bfloat16": 0x7FC0}
SIGN = {"float32": 0x80000000, "float64": 0x8000000000000000, "float16": 0x8000, "bfloat16": 0x8000}


def as_values(dtype: str, stored: np.ndarray) -> np.ndarray:
    """Numeric values (bfloat16 through float32, exactly)."""
    return bf16_to_f32(stored) if dtype == "bfloat16" else stored


def reference(dtype: str, op: str, dst: np.ndarray, src: np.ndarray) -> np.ndarray:
    """op(dst, src) with NumPy, then the documented nan and signed-zero rules; returns bits."""
    a, b = as_values(dtype, dst), as_values(dtype, src)
    with np.errstate(all="ignore"):
        if op == "min":
            result = np.minimum(a, b)
        elif op == "max":
            result = np.maximum(a, b)
        elif dtype == "bfloat16":
            result = a * b  # exact in float32; rounded once below
        else:
            result = np.multiply(a, b)  # float16: NumPy rounds the float product once; integers wrap
    if dtype == "bfloat16":
        result = f32_to_bf16(result)
    bits = as_bits(dtype, result).copy()
    if dtype not in FLOAT_DTYPES:
        return bits
    a_bits, b_bits = as_bits(dtype, dst), as_bits(dtype, src)
    if op in ("min", "max"):
        # equal values (only +-0 have two spellings): min takes the sign if either has it, max only if both do
        equal = a == b
        tie = (a_bits | b_bits) if op == "min" else (a_bits & b_bits)
        bits = np.where(equal, tie, bits)
    nan = np.isnan(bf16_to_f32(bits) if dtype == "bfloat16" else bits.view(STORAGE[dtype]))
    return np.where(nan, BITS[dtype].type(CANONICAL_NAN[dtype]), bits).astype(BITS[dtype])


def combine(dtype: str, op: str, dst: np.ndarray, src: np.ndarray, path: str) -> np.ndarray:
    out = np.ascontiguousarray(dst).copy()
    src = np.ascontiguousarray(src)
    src_before = src.copy()
    _testing.combine_into(out.ctypes.data, src.ctypes.data, out.size, DTYPE_CODES[dtype], OPS[op], path)
    assert np.array_equal(as_bits(dtype, src), as_bits(dtype, src_before)), "the kernel modified src"
    return as_bits(dtype, out)


def assert_bits(dtype: str, got: np.ndarray, want: np.ndarray, context: str) -> None:
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{context}: {bad.size} element(s) differ, first at {bad[:6]}: got "
                           f"{[hex(v) for v in got[bad[:6]]]}, want {[hex(v) for v in want[bad[:6]]]}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op", COMBINE_OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_special_pairs(dtype: str, op: str, path: str) -> None:
    dst, src = special_pairs(dtype)
    assert_bits(dtype, combine(dtype, op, dst, src, path), reference(dtype, op, dst, src), f"{dtype} {op} {path}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op", COMBINE_OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 31, 33, 1000])
def test_random(dtype: str, op: str, path: str, n: int) -> None:
    rng = np.random.default_rng([n, DTYPE_CODES[dtype], OPS[op]])
    dst, src = random_values(dtype, n, rng), random_values(dtype, n, rng)
    assert_bits(dtype, combine(dtype, op, dst, src, path), reference(dtype, op, dst, src),
                f"{dtype} {op} {path} n={n}")


@pytest.mark.parametrize("op", COMBINE_OPS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_order_never_changes_bits(dtype: str, op: str) -> None:
    """op(a, b) == op(b, a) bit for bit, nan payloads and signed zeros included: MPI's own algorithms may
    combine in a different order on each rank, and every rank must still hold the same bits."""
    rng = np.random.default_rng(DTYPE_CODES[dtype])
    a, b = random_values(dtype, 4096, rng), random_values(dtype, 4096, rng)
    for path in PATHS:
        assert_bits(dtype, combine(dtype, op, a, b, path), combine(dtype, op, b, a, path), f"{dtype} {op} {path}")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_nan_payloads_become_canonical(dtype: str) -> None:
    exponent = {"float32": 0x7F800000, "float64": 0x7FF0000000000000, "float16": 0x7C00, "bfloat16": 0x7F80}[dtype]
    payloads = [exponent | 1, exponent | 3, SIGN[dtype] | exponent | 5, CANONICAL_NAN[dtype] | 7]
    nans = np.array(payloads, dtype=BITS[dtype]).view(STORAGE[dtype])
    ones = np.ones(len(payloads), dtype=np.float32)
    ones = f32_to_bf16(ones) if dtype == "bfloat16" else ones.astype(STORAGE[dtype])
    for op in COMBINE_OPS:
        for path in PATHS:
            for dst, src in ((nans, ones), (ones, nans), (nans, nans[::-1].copy())):
                got = combine(dtype, op, dst, src, path)
                assert (got == CANONICAL_NAN[dtype]).all(), f"{dtype} {op} {path}: {[hex(v) for v in got]}"


def test_paths_agree_on_large_random_input() -> None:
    for dtype in DTYPES:
        rng = np.random.default_rng(7)
        a, b = random_values(dtype, 5000, rng), random_values(dtype, 5000, rng)
        for op in COMBINE_OPS:
            results = [combine(dtype, op, a, b, path) for path in PATHS]
            for path, result in zip(PATHS[1:], results[1:], strict=True):
                assert_bits(dtype, result, results[0], f"{dtype} {op}: {path} vs {PATHS[0]}")


def test_combine_into_refuses_bad_codes() -> None:
    buffer = np.zeros(4, dtype=np.float32)
    with pytest.raises(Exception, match="op code"):
        _testing.combine_into(buffer.ctypes.data, buffer.ctypes.data, 4, 0, 1)
    with pytest.raises(Exception, match="dtype code"):
        _testing.combine_into(buffer.ctypes.data, buffer.ctypes.data, 4, 9, 2)
