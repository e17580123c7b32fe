"""The CUDA kernels' element functions, run on the host (`_testing_cuda.host_*`), against the CPU kernels, bit for bit.

Runs without a GPU: it checks the arithmetic the kernels share with their host twins (the NaN rules, the
rounding of fp16/bf16, integer wrap-around and division, the scale) over special values and random bit
patterns. On the device the same functions run with IEEE round-to-nearest intrinsics (no FMA
contraction); tests/cuda/test_kernels_device.py repeats these checks on a GPU.
"""

from __future__ import annotations

import itertools
import platform

import numpy as np
import pytest

from ddlfast import _core, _testing
from ddlfast.buffers.dtypes import DTYPE_CODES
from tests.cuda.support import BUILT, needs_build

pytestmark = needs_build
if BUILT:
    from ddlfast import _testing_cuda

DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
STORAGE = {"float32": np.float32, "float64": np.float64, "float16": np.float16, "bfloat16": np.uint16,
           "int32": np.int32, "int64": np.int64}
BITS = {"float32": np.uint32, "float64": np.uint64, "float16": np.uint16, "bfloat16": np.uint16,
        "int32": np.uint32, "int64": np.uint64}
WIRES = {"float16": 0, "bfloat16": 1}


def is_nan(dtype: str, bits: np.ndarray) -> np.ndarray:
    masks = {"float32": (0x7FFFFFFF, 0x7F800000), "float64": (0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000),
             "float16": (0x7FFF, 0x7C00), "bfloat16": (0x7FFF, 0x7F80)}
    if dtype not in masks:
        return np.zeros(bits.shape, dtype=bool)
    mask, inf = masks[dtype]
    return (bits & BITS[dtype](mask)) > BITS[dtype](inf)


def special_values(dtype: str) -> np.ndarray:
    """Edge values as bit patterns: zeros, subnormals, extremes, infinities, quiet and signalling NaNs."""
    if dtype == "int32":
        return np.array([0, 1, -1, 7, -7, 2**31 - 1, -(2**31), 12345, -12345], dtype=np.int32).view(np.uint32)
    if dtype == "int64":
        return np.array([0, 1, -1, 7, -7, 2**63 - 1, -(2**63), 10**12, -(10**12)], dtype=np.int64).view(np.uint64)
    patterns = {
        "float32": [0, 0x80000000, 1, 0x80000001, 0x007FFFFF, 0x00800000, 0x3F800000, 0xBF800000, 0x7F7FFFFF,
                    0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x7FA00123, 0x33000001],
        "float64": [0, 1 << 63, 1, 0x000FFFFFFFFFFFFF, 0x3FF0000000000000, 0xBFF0000000000000, 0x7FEFFFFFFFFFFFFF,
                    0x7FF0000000000000, 0xFFF0000000000000, 0x7FF8000000000000, 0x7FF0000000000001,
                    0xFFF4000000000123],
        "float16": [0, 0x8000, 1, 0x8001, 0x3FF, 0x400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00,
                    0x7C01, 0xFDFF, 0x7E01],
        "bfloat16": [0, 0x8000, 1, 0x8001, 0x7F, 0x80, 0x3F80, 0xBF80, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0,
                     0x7F81, 0xFFA0, 0x3F81],
    }[dtype]
    return np.array(patterns, dtype=BITS[dtype])


def random_bits(dtype: str, n: int, rng: np.random.Generator) -> np.ndarray:
    bits = BITS[dtype]
    return rng.integers(0, np.iinfo(bits).max, size=n, dtype=bits, endpoint=True)


def assert_bits_equal(dtype: str, got: np.ndarray, want: np.ndarray, dst: np.ndarray, src: np.ndarray,
                      context: str) -> None:
    """Exact bits, except where both operands are NaN (a CPU may return either payload)."""
    either = is_nan(dtype, dst) & is_nan(dtype, src)
    bad = np.flatnonzero((got != want) & ~either)
    assert bad.size == 0, (f"{context}: {bad.size} differ, first at {bad[:6]}: dst {[hex(v) for v in dst[bad[:6]]]} "
                           f"src {[hex(v) for v in src[bad[:6]]]} got {[hex(v) for v in got[bad[:6]]]} "
                           f"want {[hex(v) for v in want[bad[:6]]]}")
    assert (is_nan(dtype, got) == is_nan(dtype, want)).all(), f"{context}: NaN-ness differs"


def cpu_reduce(dtype: str, dst: np.ndarray, src: np.ndarray, divisor: int, path: str | None) -> np.ndarray:
    out = dst.copy()
    _core.reduce_into(out.ctypes.data, src.ctypes.data, out.size, DTYPE_CODES[dtype], divisor, path)
    return out


def twin_reduce(dtype: str, dst: np.ndarray, src: np.ndarray, divisor: int) -> np.ndarray:
    out = dst.copy()
    _testing_cuda.host_reduce(out.ctypes.data, src.ctypes.data, out.size, DTYPE_CODES[dtype], divisor)
    return out


@pytest.mark.parametrize("divisor", [1, 2, 3, 4, 7, 1000])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_matches_every_cpu_path_on_special_value_pairs(dtype: str, divisor: int) -> None:
    values = special_values(dtype)
    pairs = np.array(list(itertools.product(values, values)), dtype=values.dtype)
    dst, src = np.ascontiguousarray(pairs[:, 0]), np.ascontiguousarray(pairs[:, 1])
    got = twin_reduce(dtype, dst, src, divisor)
    for path in _core.kernel_paths():
        want = cpu_reduce(dtype, dst, src, divisor, path)
        assert_bits_equal(dtype, got, want, dst, src, f"{dtype} divisor={divisor} vs CPU path {path}")


@pytest.mark.parametrize("divisor", [1, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_matches_the_cpu_on_random_bit_patterns(dtype: str, divisor: int) -> None:
    rng = np.random.default_rng([DTYPE_CODES[dtype], divisor])
    dst, src = random_bits(dtype, 200_000, rng), random_bits(dtype, 200_000, rng)
    got = twin_reduce(dtype, dst, src, divisor)
    for path in _core.kernel_paths():
        assert_bits_equal(dtype, got, cpu_reduce(dtype, dst, src, divisor, path), dst, src,
                          f"{dtype} divisor={divisor} vs CPU path {path}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_reduce_every_value_against_a_spread_of_partners(dtype: str) -> None:
    every = np.arange(1 << 16, dtype=np.uint16)
    partners = special_values(dtype).tolist() + [0x3555, 0xC123, 0x0201, 0x7BFE]
    for partner, divisor in itertools.product(partners, (1, 3)):
        src = np.full(every.size, partner, dtype=np.uint16)
        got = twin_reduce(dtype, every, src, divisor)
        assert_bits_equal(dtype, got, cpu_reduce(dtype, every, src, divisor, "scalar"), every, src,
                          f"{dtype} + {partner:#06x} divisor={divisor}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_encode_decode_accumulate_match_the_cpu_codecs(dtype: str) -> None:
    wire = WIRES[dtype]
    rng = np.random.default_rng(7 + wire)
    floats = np.concatenate([special_values("float32"), random_bits("float32", 100_000, rng),
                             (rng.standard_normal(100_000) * np.exp2(rng.integers(-30, 20, 100_000)))
                             .astype(np.float32).view(np.uint32)])
    got, want = np.zeros(floats.size, np.uint16), np.zeros(floats.size, np.uint16)
    _testing_cuda.host_encode(got.ctypes.data, floats.ctypes.data, floats.size, wire)
    _testing.encode_wire(want.ctypes.data, floats.ctypes.data, floats.size, wire, "scalar")
    assert (got == want).all(), f"encode {dtype}: {np.flatnonzero(got != want)[:8]}"

    every = np.arange(1 << 16, dtype=np.uint16)
    got_f, want_f = np.zeros(every.size, np.uint32), np.zeros(every.size, np.uint32)
    _testing_cuda.host_decode(got_f.ctypes.data, every.ctypes.data, every.size, wire)
    _testing.decode_wire(want_f.ctypes.data, every.ctypes.data, every.size, wire, "scalar")
    assert (got_f == want_f).all(), f"decode {dtype}: {np.flatnonzero(got_f != want_f)[:8]}"

    for divisor in (1, 3, 4):
        base = floats[: every.size].copy()
        got_a, want_a = base.copy(), base.copy()
        _testing_cuda.host_accumulate(got_a.ctypes.data, every.ctypes.data, every.size, wire, divisor)
        _testing.accumulate_wire(want_a.ctypes.data, every.ctypes.data, every.size, wire, divisor, "scalar")
        src_as_f32 = want_f  # the decoded wire values, for the both-NaN rule
        assert_bits_equal("float32", got_a, want_a, base, src_as_f32, f"accumulate {dtype} divisor={divisor}")


def test_nan_rule_is_this_cpus() -> None:
    nan32, nan64 = _testing_cuda.nan_rule()
    inf32 = np.array([np.inf], np.float32)
    inf64 = np.array([np.inf], np.float64)
    with np.errstate(invalid="ignore"):
        assert int((inf32 - inf32).view(np.uint32)[0]) == nan32
        assert int((inf64 - inf64).view(np.uint64)[0]) == nan64
    if platform.machine() in ("x86_64", "AMD64"):
        assert (nan32, nan64) == (0xFFC00000, 0xFFF8000000000000)  # x86's "real indefinite"


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_invalid_operations_give_the_given_default_nan(dtype: str) -> None:
    """The kernels replace the GPU's canonical NaN by the host's; with another rule the result follows it.

    (On x86 the host twin's own arithmetic already gives 0xFFC00000: a different rule proves the
    replacement runs, as it must on the device.)"""
    inf = {"float32": 0x7F800000, "float64": 0x7FF0000000000000, "float16": 0x7C00, "bfloat16": 0x7F80}[dtype]
    sign = {"float32": 1 << 31, "float64": 1 << 63, "float16": 0x8000, "bfloat16": 0x8000}[dtype]
    dst = np.array([inf, inf], dtype=BITS[dtype])
    src = np.array([inf | sign, inf | sign], dtype=BITS[dtype])
    out = dst.copy()
    _testing_cuda.host_reduce(out.ctypes.data, src.ctypes.data, out.size, DTYPE_CODES[dtype], 1,
                      (0x7FC00000, 0x7FF8000000000000))
    want = {"float32": 0x7FC00000, "float64": 0x7FF8000000000000, "float16": 0x7E00, "bfloat16": 0x7FC0}[dtype]
    assert [hex(v) for v in out] == [hex(want)] * 2


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(Exception, match="divisor"):
        _testing_cuda.host_reduce(0, 0, 0, 0, 0)
    with pytest.raises(Exception, match="dtype"):
        _testing_cuda.host_reduce(0, 0, 0, 9, 1)
    with pytest.raises(Exception, match="wire"):
        _testing_cuda.host_encode(0, 0, 0, 5)
