"""The CPU reduce kernels against independent NumPy references, on every kernel path.

`_core.reduce_into(dst, src, n, dtype, divisor, path)` computes dst = (dst + src) / divisor in place:
floats multiply by 1/divisor computed in the element type, fp16/bf16 add in fp32 and round once to
nearest-even, integers wrap around and divide truncating toward zero. Every path (AVX2+F16C, scalar)
must give the same bits.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import ddlfast
from ddlfast import _core
from ddlfast.buffers.dtypes import DTYPE_CODES

PATHS = _core.kernel_paths()
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")
# How each dtype is stored in NumPy (bfloat16 has no NumPy dtype: its bit patterns as uint16).
STORAGE = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
}
# Unsigned integer views of the same width, for bitwise comparison.
BITS = {name: np.dtype(f"u{STORAGE[name].itemsize}") for name in DTYPES}
QUIET_BIT = {"float16": 0x0200, "bfloat16": 0x0040}
GUARD = 0x5A  # byte pattern of the guard elements around every view
PAD = 4  # guard elements after the largest offset


# ---------------------------------------------------------------- references


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round to nearest even; NaNs stay NaN and become quiet (payload's top bits kept)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet = (bits >> 16) | QUIET_BIT["bfloat16"]
    return np.where(is_nan, quiet, rounded).astype(np.uint16)


def reference(dtype: str, dst: np.ndarray, src: np.ndarray, divisor: int) -> np.ndarray:
    """(dst + src) / divisor computed with NumPy, independently of the core."""
    with np.errstate(all="ignore"):
        return _reference(dtype, dst, src, divisor)


def _reference(dtype: str, dst: np.ndarray, src: np.ndarray, divisor: int) -> np.ndarray:
    if dtype in ("float32", "float64"):
        t = STORAGE[dtype].type
        total = dst + src
        return total if divisor == 1 else total * (t(1) / t(divisor))
    if dtype in ("float16", "bfloat16"):
        to_f32 = (lambda a: a.astype(np.float32)) if dtype == "float16" else bf16_to_f32
        total = to_f32(dst) + to_f32(src)
        if divisor != 1:
            total = total * (np.float32(1) / np.float32(divisor))
        return total.astype(np.float16) if dtype == "float16" else f32_to_bf16(total)
    total = dst + src  # NumPy arrays wrap around like the kernel
    if divisor == 1:
        return total
    quotient = total // divisor  # floor; C truncates toward zero
    quotient[(total % divisor != 0) & (total < 0)] += 1
    return quotient


def as_bits(dtype: str, values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=STORAGE[dtype]).view(BITS[dtype])


def is_nan_bits(dtype: str, bits: np.ndarray) -> np.ndarray:
    if dtype not in FLOAT_DTYPES:
        return np.zeros(bits.shape, dtype=bool)
    if dtype == "bfloat16":
        return (bits & 0x7FFF) > 0x7F80
    return np.isnan(bits.view(STORAGE[dtype]))


def assert_same(dtype: str, got: np.ndarray, want: np.ndarray, context: str, exact_nan: bool = False) -> None:
    """Bitwise equality; NaNs only need to be NaN (and quiet for fp16/bf16) unless exact_nan."""
    got_bits, want_bits = as_bits(dtype, got), as_bits(dtype, want)
    if not exact_nan:
        got_nan, want_nan = is_nan_bits(dtype, got_bits), is_nan_bits(dtype, want_bits)
        bad = np.flatnonzero(got_nan != want_nan)
        assert bad.size == 0, f"{context}: NaN-ness differs at {bad[:8]}: got {got[bad[:8]]}, want {want[bad[:8]]}"
        if dtype in QUIET_BIT:
            loud = np.flatnonzero(got_nan & ((got_bits & QUIET_BIT[dtype]) == 0))
            assert loud.size == 0, f"{context}: signalling NaN written at {loud[:8]}"
        got_bits = np.where(got_nan, 0, got_bits)
        want_bits = np.where(want_nan, 0, want_bits)
    bad = np.flatnonzero(got_bits != want_bits)
    assert bad.size == 0, (
        f"{context}: {bad.size} element(s) differ, first at {bad[:8]}: "
        f"got bits {[hex(v) for v in as_bits(dtype, got)[bad[:8]]]}, "
        f"want {[hex(v) for v in as_bits(dtype, want)[bad[:8]]]}"
    )


# ---------------------------------------------------------------- helpers


def random_values(dtype: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Values that exercise rounding, wrap-around and (for the half types) every bit pattern."""
    if dtype in ("int32", "int64"):
        info = np.iinfo(STORAGE[dtype])
        values = rng.integers(info.min, info.max, size=n, dtype=STORAGE[dtype], endpoint=True)
        small = rng.random(n) < 0.5  # also small values, so the quotients are not all huge
        values[small] = rng.integers(-50, 50, size=int(small.sum()))
        return values
    if dtype in ("float16", "bfloat16"):
        return rng.integers(0, 1 << 16, size=n, dtype=np.uint16).view(STORAGE[dtype])  # all patterns, NaN included
    t = STORAGE[dtype]
    values = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, size=n))).astype(t)
    raw = rng.random(n) < 0.25  # a quarter raw bit patterns: subnormals, inf, nan, huge
    values[raw] = rng.integers(0, np.iinfo(BITS[dtype]).max, size=int(raw.sum()), dtype=BITS[dtype]).view(t)
    return values


def run_kernel(dtype: str, dst: np.ndarray, src: np.ndarray, divisor: int, path: str | None) -> None:
    assert dst.dtype == STORAGE[dtype] and src.dtype == STORAGE[dtype] and dst.size == src.size
    _core.reduce_into(dst.ctypes.data, src.ctypes.data, dst.size, DTYPE_CODES[dtype], divisor, path)


def guarded(dtype: str, values: np.ndarray, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """A buffer of guard elements with `values` written at `offset`, and that view."""
    buffer = np.full((values.size + offset + PAD) * STORAGE[dtype].itemsize, GUARD, dtype=np.uint8)
    buffer = buffer.view(STORAGE[dtype])
    view = buffer[offset : offset + values.size]
    view[...] = values
    return buffer, view


def reduce_guarded(
    dtype: str, dst: np.ndarray, src: np.ndarray, divisor: int, path: str, dst_offset: int = 0, src_offset: int = 0
) -> np.ndarray:
    """Runs the kernel on views at the given element offsets; checks nothing outside them changed."""
    dst_buffer, dst_view = guarded(dtype, dst, dst_offset)
    src_buffer, src_view = guarded(dtype, src, src_offset)
    src_before = src_buffer.copy()
    run_kernel(dtype, dst_view, src_view, divisor, path)
    guard_bits = np.full(dst_buffer.nbytes, GUARD, dtype=np.uint8).view(BITS[dtype])
    n = dst.size
    outside = np.r_[0:dst_offset, dst_offset + n : dst_buffer.size]
    dst_buffer_bits = dst_buffer.view(BITS[dtype])
    assert np.array_equal(dst_buffer_bits[outside], guard_bits[outside]), (
        f"{dtype} path={path} n={n} offset={dst_offset}: wrote outside [offset, offset+n)"
    )
    assert np.array_equal(src_buffer.view(BITS[dtype]), src_before.view(BITS[dtype])), "the kernel modified src"
    return dst_view.copy()


def special_values(dtype: str) -> np.ndarray:
    """Edge values of each dtype: signed zeros, subnormals, extremes, infinities and one NaN."""
    if dtype == "float16":
        bits = [0x0000, 0x8000, 0x0001, 0x8001, 0x0002, 0x0003, 0x03FF, 0x0400, 0x3C00, 0xBC00, 0x3555, 0x4000,
                0x4200, 0x6800, 0x7BFE, 0x7BFF, 0xFBFF, 0x7800, 0x7C00, 0xFC00, 0x7E00]
        return np.array(bits, dtype=np.uint16).view(np.float16)
    if dtype == "bfloat16":
        bits = [0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x3F80, 0xBF80, 0x3F81, 0x3B80, 0x3C00, 0x3EAB,
                0x4040, 0x7F7F, 0xFF7F, 0x7F00, 0x7F80, 0xFF80, 0x7FC0]
        return np.array(bits, dtype=np.uint16)
    if dtype in ("int32", "int64"):
        info = np.iinfo(STORAGE[dtype])
        return np.array([0, 1, -1, 2, -2, 3, -3, 7, -7, info.max, info.min, info.max - 1, info.min + 1,
                         info.max // 2, info.min // 2], dtype=STORAGE[dtype])
    t = STORAGE[dtype].type
    info = np.finfo(t)
    tiny = info.smallest_subnormal
    return np.array([0.0, -0.0, tiny, -tiny, 2 * tiny, 3 * tiny, info.smallest_normal - tiny, info.smallest_normal,
                     1.0, -1.0, 1 / 3, 3.0, 2.0 ** (info.nmant + 1), 1e30, info.max, -info.max, info.max / 2,
                     np.inf, -np.inf, np.nan], dtype=t)


def special_pairs(dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Every pair of special values (both orders), as dst and src arrays."""
    values = special_values(dtype)
    index = np.array(list(itertools.product(range(values.size), repeat=2)))
    return values[index[:, 0]].copy(), values[index[:, 1]].copy()


# ---------------------------------------------------------------- tests


def test_kernel_paths_and_selection() -> None:
    assert "scalar" in PATHS
    assert len(PATHS) == len(set(PATHS))
    assert _core.selected_kernel_path() == PATHS[0], "the default should be the best available path"


@pytest.mark.parametrize("divisor", [1, 3, 4])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_numpy_reference_all_lengths_and_offsets(dtype: str, path: str, divisor: int) -> None:
    rng = np.random.default_rng([DTYPE_CODES[dtype], divisor, PATHS.index(path)])
    for n in range(68):
        for dst_offset, src_offset in ((0, 0), (1, 0), (0, 3), (2, 1), (3, 3), (1, 2)):
            dst, src = random_values(dtype, n, rng), random_values(dtype, n, rng)
            got = reduce_guarded(dtype, dst, src, divisor, path, dst_offset, src_offset)
            assert_same(dtype, got, reference(dtype, dst, src, divisor),
                        f"{dtype} path={path} divisor={divisor} n={n} offsets=({dst_offset},{src_offset})")


@pytest.mark.parametrize("divisor", [1, 2, 3, 4, 7, 1000])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values_exact_bits(dtype: str, path: str, divisor: int) -> None:
    """All pairs of edge values: exact bits against the reference, NaN bits included."""
    dst, src = special_pairs(dtype)
    got = reduce_guarded(dtype, dst, src, divisor, path, dst_offset=1, src_offset=2)
    assert_same(dtype, got, reference(dtype, dst, src, divisor), f"{dtype} path={path} divisor={divisor}",
                exact_nan=True)


@pytest.mark.skipif(len(PATHS) < 2, reason="only one kernel path on this CPU/build")
@pytest.mark.parametrize("divisor", [1, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_paths_give_identical_bits(dtype: str, divisor: int) -> None:
    rng = np.random.default_rng(99 + DTYPE_CODES[dtype])
    special_dst, special_src = special_pairs(dtype)
    cases = [(special_dst, special_src)]
    for n in (1, 7, 8, 9, 15, 16, 17, 31, 33, 64, 67, 1000):
        dst, src = random_values(dtype, n, rng), random_values(dtype, n, rng)
        if dtype == "float16":  # NaN payloads are a known divergence; see test_fp16_nan_payload_...
            dst[np.isnan(dst)] = np.float16(np.nan)
            src[np.isnan(src)] = np.float16(np.nan)
        cases.append((dst, src))
    for dst, src in cases:
        results = [reduce_guarded(dtype, dst, src, divisor, path) for path in PATHS]
        for path, got in zip(PATHS[1:], results[1:], strict=True):
            # Operands that are both NaN may legitimately give either payload; compare NaN-ness there.
            both_nan = is_nan_bits(dtype, as_bits(dtype, dst)) & is_nan_bits(dtype, as_bits(dtype, src))
            keep = ~both_nan
            assert_same(dtype, got[keep], results[0][keep], f"{dtype} divisor={divisor} n={dst.size} "
                        f"{path} vs {PATHS[0]}", exact_nan=True)
            assert_same(dtype, got, results[0], f"{dtype} divisor={divisor} n={dst.size} {path} vs {PATHS[0]}")


def test_fp16_nan_payload_is_the_same_on_every_path_and_position() -> None:
    patterns = np.array([0x7E01, 0x7C01, 0xFFFF, 0x7DFF], dtype=np.uint16)
    seen = {}
    for path in PATHS:
        for pattern in patterns:
            dst = np.full(9, pattern, dtype=np.uint16).view(np.float16)  # 8 in the vector body, 1 in the tail
            got = reduce_guarded("float16", dst, np.zeros(9, np.float16), 1, path)
            for bits in as_bits("float16", got):
                assert (bits & 0x7E00) == 0x7E00, f"{path}: {hex(pattern)} became {hex(bits)}, not a quiet NaN"
                seen.setdefault(int(pattern), set()).add(int(bits))
    assert all(len(results) == 1 for results in seen.values()), {hex(k): sorted(map(hex, v)) for k, v in seen.items()}


@pytest.mark.parametrize("path", PATHS)
def test_hand_checked_examples(path: str) -> None:
    """A few results worked out by hand, so the references above are not the only judge."""

    def one(dtype: str, a, b, divisor: int = 1):
        dst = np.array(a, dtype=STORAGE[dtype])
        run_kernel(dtype, dst, np.array(b, dtype=STORAGE[dtype]), divisor, path)
        return dst

    i32 = np.iinfo(np.int32)
    assert one("int32", [i32.max, i32.min, 5], [1, -1, -5]).tolist() == [i32.min, i32.max, 0]  # wrap-around
    assert one("int32", [-7, 7, -1, -6, 6], [0, 0, 0, 0, 0], 2).tolist() == [-3, 3, 0, -3, 3]  # toward zero
    assert one("int64", [-9, 9, -10], [0, 0, -1], 4).tolist() == [-2, 2, -2]
    i64 = np.iinfo(np.int64)
    assert one("int64", [i64.max], [1], 1).tolist() == [i64.min]
    assert one("int64", [i64.min], [0], 3).tolist() == [-(2**63 // 3)]
    # float32: (1+2)/3 and (2+4)/3 round back to 1 and 2; subnormals are not flushed: 2 units / 4 ties to 0,
    # 6 units / 4 = 1.5 units ties to 2.
    unit = np.finfo(np.float32).smallest_subnormal
    assert one("float32", [1.0, 2.0], [2.0, 4.0], 3).tolist() == [1.0, 2.0]
    assert (one("float32", [unit, 3 * unit, unit], [unit, 3 * unit, 0], 4) / unit).tolist() == [0.0, 2.0, 0.0]
    assert (one("float32", [unit, 3 * unit], [unit, 0], 1) / unit).tolist() == [2.0, 3.0]
    assert one("float64", [0.5, -0.0], [0.25, -0.0], 1).tolist() == [0.75, -0.0]
    assert np.signbit(one("float64", [-0.0], [-0.0], 4)[0])
    # fp16: 65504 is the largest finite value; 65520 is halfway to 65536 and rounds (to even) to inf.
    h = one("float16", [65504, 65504, 65504, -65504, 65504], [8, 16, 65504, -16, 65504], 1).view(np.uint16)
    assert [hex(v) for v in h] == ["0x7bff", "0x7c00", "0x7c00", "0xfc00", "0x7c00"]
    # ... and averaging after the overflowing fp32 sum stays finite, since the sum is exact in fp32.
    assert one("float16", [65504], [65504], 2).view(np.uint16)[0] == 0x7BFF
    # fp16 subnormals (unit 2^-24): 1+1 = 2 units; 1/2 unit ties to even (0); 3/2 units ties to 2.
    units = one("float16", np.array([1, 1, 3, 1], np.uint16).view(np.float16),
                np.array([1, 0, 0, 0], np.uint16).view(np.float16), 2).view(np.uint16)
    assert units.tolist() == [1, 0, 2, 0]
    units = one("float16", np.array([1, 3], np.uint16).view(np.float16), np.zeros(2, np.float16)).view(np.uint16)
    assert units.tolist() == [1, 3]
    # bf16 (7 mantissa bits): 1 + 2^-8 ties to 1.0 (even); (1 + 2^-7) + 2^-8 ties up to 1 + 2^-6.
    b = one("bfloat16", np.array([0x3F80, 0x3F81, 0x7F7F, 0xFF7F], np.uint16),
            np.array([0x3B80, 0x3B80, 0x7F7F, 0xFF7F], np.uint16))
    assert [hex(v) for v in b] == ["0x3f80", "0x3f82", "0x7f80", "0xff80"]
    # bf16: 1 + 1 + 1 = 3 exactly, /3 = 1.0 after rounding; NaN stays a quiet NaN.
    b = one("bfloat16", np.array([0x3F80, 0x4000, 0x7F81], np.uint16), np.array([0x4000, 0x3F80, 0x3F80], np.uint16), 3)
    assert b[0] == 0x3F80 and b[1] == 0x3F80 and (b[2] & 0x7FC0) == 0x7FC0


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_averaging_many_ranks_worth_of_divisors(dtype: str, path: str) -> None:
    """Divisors other than the grid above (large and odd), on a length that has body and tail."""
    rng = np.random.default_rng(7)
    for divisor in (2, 5, 6, 8, 255, 256, 1 << 20, 2**31 - 1):
        dst, src = random_values(dtype, 37, rng), random_values(dtype, 37, rng)
        got = reduce_guarded(dtype, dst, src, divisor, path, 3, 1)
        assert_same(dtype, got, reference(dtype, dst, src, divisor), f"{dtype} path={path} divisor={divisor}")


@pytest.mark.parametrize("path", PATHS)
def test_bf16_sweep_of_rounding_boundaries(path: str) -> None:
    """Every bf16 pattern plus a neighbour that lands on, below and above the rounding ties."""
    dst = np.arange(1 << 16, dtype=np.uint16)
    for delta in (0x0001, 0x0080, 0x3B80):
        src = np.full(dst.size, delta, dtype=np.uint16)
        for divisor in (1, 3):
            got = reduce_guarded("bfloat16", dst, src, divisor, path)
            assert_same("bfloat16", got, reference("bfloat16", dst, src, divisor), f"bf16 path={path} src={delta}")


@pytest.mark.parametrize("path", PATHS)
def test_fp16_sweep_of_all_patterns(path: str) -> None:
    dst = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    for delta in (0x0001, 0x3C00, 0x7BFF, 0x1400):
        src = np.full(dst.size, delta, dtype=np.uint16).view(np.float16)
        for divisor in (1, 3):
            got = reduce_guarded("float16", dst, src, divisor, path)
            assert_same("float16", got, reference("float16", dst, src, divisor), f"fp16 path={path} src={delta}")


def test_fp16_reference_is_float32_then_round() -> None:
    """NumPy's float32 -> float16 cast is round-to-nearest-even with correct subnormals and overflow."""
    halfway_up = np.array([65520.0, 65519.996, 2.0**-25, 2.0**-25 * 3, 1 + 2.0**-11, 1 + 3 * 2.0**-11], np.float32)
    with np.errstate(over="ignore"):
        rounded = halfway_up.astype(np.float16)
    assert as_bits("float16", rounded).tolist() == [0x7C00, 0x7BFF, 0x0000, 0x0002, 0x3C00,
                                                                         0x3C02]


def test_bf16_reference_agrees_with_ml_dtypes() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(3)
    values = rng.integers(0, 1 << 32, size=200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    values = values[~np.isnan(values)]
    ours = f32_to_bf16(values)
    theirs = values.astype(ml_dtypes.bfloat16)
    assert np.array_equal(ours, theirs.view(np.uint16))
    assert np.array_equal(bf16_to_f32(ours), theirs.astype(np.float32))


def test_unknown_path_and_dtype_code_raise() -> None:
    a, b = np.zeros(4, np.float32), np.ones(4, np.float32)
    with pytest.raises(ddlfast.DdlfastError, match="no-such-path"):
        _core.reduce_into(a.ctypes.data, b.ctypes.data, 4, 0, 1, "no-such-path")
    for code in (-1, 6, 100):
        with pytest.raises(ddlfast.DdlfastError, match=f"dtype code {code}"):
            _core.reduce_into(a.ctypes.data, b.ctypes.data, 4, code)
    assert not a.any(), "a failed call must not touch the data"
