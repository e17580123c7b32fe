"""Property-based tests (hypothesis) of the CPU reduce and wire kernels: any bit patterns, lengths,
element offsets, divisors and kernel paths, against the independent NumPy references of test_kernels."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ddlfast import _testing
from tests.unit.test_kernels import BITS, DTYPES, PATHS, STORAGE, assert_same, reduce_guarded, reference


@st.composite
def reduce_cases(draw: st.DrawFn) -> tuple:
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(0, 300))
    width = BITS[dtype]
    patterns = st.integers(0, (1 << (8 * width.itemsize)) - 1)
    dst = np.array(draw(st.lists(patterns, min_size=n, max_size=n)), dtype=width).view(STORAGE[dtype])
    src = np.array(draw(st.lists(patterns, min_size=n, max_size=n)), dtype=width).view(STORAGE[dtype])
    return (dtype, dst, src, draw(st.sampled_from([1, 2, 3, 4, 5, 8, 1000])), draw(st.sampled_from(PATHS)),
            draw(st.integers(0, 3)), draw(st.integers(0, 3)))


@given(reduce_cases())
@settings(max_examples=400, deadline=None)
def test_reduce_matches_numpy_for_any_bits(case: tuple) -> None:
    """Every bit pattern (NaNs, infinities, subnormals, integer wrap-around): NaN-ness and all other bits
    as NumPy computes them; nothing outside the destination written, the source untouched."""
    dtype, dst, src, divisor, path, dst_offset, src_offset = case
    got = reduce_guarded(dtype, dst, src, divisor, path, dst_offset, src_offset)
    assert_same(dtype, got, reference(dtype, dst, src, divisor), f"{dtype} {path} divisor={divisor} n={dst.size}")


@given(st.lists(st.floats(-60000, 60000, width=32), max_size=200), st.sampled_from(["fp16", "bf16"]))
@settings(max_examples=200, deadline=None)
def test_wire_round_trip_is_the_nearest_half_value(values: list[float], wire: str) -> None:
    """encode then decode gives what a float32 -> fp16/bf16 cast gives (round to nearest even)."""
    import ml_dtypes

    data = np.array(values, dtype=np.float32)
    code = 0 if wire == "fp16" else 1
    encoded = np.empty(data.size, dtype=np.uint16)
    _testing.encode_wire(encoded.ctypes.data, data.ctypes.data, data.size, code)
    decoded = np.empty(data.size, dtype=np.float32)
    _testing.decode_wire(decoded.ctypes.data, encoded.ctypes.data, data.size, code)
    half = np.float16 if wire == "fp16" else ml_dtypes.bfloat16
    np.testing.assert_array_equal(decoded, data.astype(half).astype(np.float32))
