"""The kernels behind exact integer average and the half types' range check, against NumPy/Python ints,
on every kernel path (src/kernels/cpu/exact_generic.h; the method is in src/engine/exact_arithmetic.h).

- split: values = trunc(v / p) in place, remainders = v - trunc(v / p) * p (C's / and %);
- join: values += floor(remainders / p), wrapping like the integer sum;
- any_nonfinite: whether a float16/bfloat16 buffer holds inf or nan.

Together: splitting every rank's input, summing the quotients and the remainders (wrapping), then joining
gives NumPy's `sum(int(x) for x in inputs) // p`, the integer average, at the type's edges too.
"""

from __future__ import annotations

import numpy as np
import pytest

import ddlfast
from ddlfast import _core, _testing
from ddlfast.buffers.dtypes import DTYPE_CODES

PATHS = _core.kernel_paths()
INTS = {"int32": np.dtype(np.int32), "int64": np.dtype(np.int64)}
HALVES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(np.uint16)}  # bf16 as its bit patterns
EXPONENT = {"float16": 0x7C00, "bfloat16": 0x7F80}
OFFSETS = ((0, 0), (1, 0), (0, 3), (2, 1), (3, 3))
GUARD = 0x5A
# World sizes: small ones, the double route's edge (2**21) and int32's limit (46340) for int32 remainders.
DIVISORS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 255, 1000, 46340, 2**21 - 1, 2**21, 2**31 - 1)


def wrap(values: list[int], dtype: np.dtype) -> np.ndarray:
    bits = 8 * dtype.itemsize
    return np.array([((v + (1 << (bits - 1))) % (1 << bits)) - (1 << (bits - 1)) for v in values], dtype=dtype)


def trunc_div(v: int, p: int) -> int:
    return -(-v // p) if v < 0 else v // p


def edge_and_random(dtype: np.dtype, n: int, rng: np.random.Generator) -> np.ndarray:
    info = np.iinfo(dtype)
    values = rng.integers(info.min, info.max, size=n, dtype=dtype, endpoint=True)
    pick = rng.random(n)
    values[pick < 0.3] = rng.integers(-50, 50, size=int((pick < 0.3).sum()))
    edges = np.array([info.min, info.max, info.min + 1, info.max - 1, 0, -1, 1], dtype=dtype)
    values[pick > 0.85] = rng.choice(edges, size=int((pick > 0.85).sum()))
    return values


def guarded(values: np.ndarray, offset: int) -> tuple[np.ndarray, np.ndarray]:
    buffer = np.full((values.size + offset + 4) * values.itemsize, GUARD, np.uint8).view(values.dtype)
    view = buffer[offset:offset + values.size]
    view[...] = values
    return buffer, view


def check_guards(buffer: np.ndarray, offset: int, n: int, what: str) -> None:
    raw = buffer.view(np.uint8)
    size = buffer.itemsize
    outside = np.r_[0:offset * size, (offset + n) * size:raw.size]
    assert np.all(raw[outside] == GUARD), f"{what}: wrote outside the view"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", INTS)
def test_split_matches_c_division_all_lengths_and_offsets(name: str, path: str) -> None:
    dtype = INTS[name]
    rng = np.random.default_rng([DTYPE_CODES[name], PATHS.index(path)])
    for divisor in DIVISORS:
        for n in range(68):
            for value_offset, remainder_offset in OFFSETS:
                values = edge_and_random(dtype, n, rng)
                value_buffer, value_view = guarded(values, value_offset)
                remainder_buffer, remainder_view = guarded(np.zeros(n, dtype), remainder_offset)
                _testing.split_exact(value_view.ctypes.data, remainder_view.ctypes.data, n, DTYPE_CODES[name], divisor,
                                  path)
                want_q = [trunc_div(int(v), divisor) for v in values]
                want_r = [int(v) - q * divisor for v, q in zip(values, want_q, strict=True)]
                what = f"{name} path={path} divisor={divisor} n={n} offsets=({value_offset},{remainder_offset})"
                assert value_view.tolist() == want_q, what
                assert remainder_view.tolist() == want_r, what
                check_guards(value_buffer, value_offset, n, what)
                check_guards(remainder_buffer, remainder_offset, n, what)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", INTS)
def test_join_adds_floor_of_remainder_all_lengths_and_offsets(name: str, path: str) -> None:
    dtype = INTS[name]
    rng = np.random.default_rng([10 + DTYPE_CODES[name], PATHS.index(path)])
    for divisor in DIVISORS:
        for n in range(68):
            for value_offset, remainder_offset in OFFSETS:
                values, remainders = edge_and_random(dtype, n, rng), edge_and_random(dtype, n, rng)
                value_buffer, value_view = guarded(values, value_offset)
                remainder_buffer, remainder_view = guarded(remainders, remainder_offset)
                _testing.join_exact(value_view.ctypes.data, remainder_view.ctypes.data, n, DTYPE_CODES[name], divisor,
                                 path)
                want = wrap([int(v) + int(r) // divisor for v, r in zip(values, remainders, strict=True)], dtype)
                what = f"{name} path={path} divisor={divisor} n={n} offsets=({value_offset},{remainder_offset})"
                assert value_view.tolist() == want.tolist(), what
                assert remainder_view.tolist() == remainders.tolist(), f"{what}: remainders changed"
                check_guards(value_buffer, value_offset, n, what)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", INTS)
def test_split_sum_join_is_numpy_floor_average(name: str, path: str) -> None:
    """The whole method on p emulated ranks (sums wrap like the ring's): NumPy's sum(as Python ints) // p."""
    dtype = INTS[name]
    info = np.iinfo(dtype)
    rng = np.random.default_rng([20 + DTYPE_CODES[name], PATHS.index(path)])
    for world in (2, 3, 4, 5, 7, 8, 9, 16, 33, 1000):
        count = 67
        inputs = [edge_and_random(dtype, count, rng) for _ in range(world)]
        inputs[0][:4] = [info.min, info.max, info.min, -1]  # every rank at the same edge, and mixed edges
        for rank in range(1, world):
            inputs[rank][:4] = [info.min, info.max, info.max, -1]
        quotient_sum, remainder_sum = np.zeros(count, dtype), np.zeros(count, dtype)
        for values in inputs:
            values = values.copy()
            remainders = np.zeros(count, dtype)
            _testing.split_exact(values.ctypes.data, remainders.ctypes.data, count, DTYPE_CODES[name], world, path)
            with np.errstate(over="ignore"):
                quotient_sum += values
                remainder_sum += remainders
        _testing.join_exact(quotient_sum.ctypes.data, remainder_sum.ctypes.data, count, DTYPE_CODES[name], world, path)
        want = np.sum(np.stack(inputs).astype(object), axis=0) // world
        assert quotient_sum.tolist() == want.tolist(), f"{name} path={path} world={world}"
        assert quotient_sum.min() >= min(v.min() for v in inputs) and quotient_sum.max() <= max(v.max() for v in inputs)


def test_split_and_join_hand_checked() -> None:
    i64 = np.iinfo(np.int64)
    values = np.array([-7, 7, -1, i64.min, i64.max], np.int64)
    remainders = np.zeros(5, np.int64)
    _testing.split_exact(values.ctypes.data, remainders.ctypes.data, 5, DTYPE_CODES["int64"], 2)
    assert values.tolist() == [-3, 3, 0, i64.min // 2, i64.max // 2]
    assert remainders.tolist() == [-1, 1, -1, 0, 1]
    # int32 2**30 on two ranks: the average is 2**30 (the plain sum would wrap to -2**31 first).
    q, r = np.array([2**30, 2**30], np.int32), np.zeros(2, np.int32)
    _testing.split_exact(q.ctypes.data, r.ctypes.data, 2, DTYPE_CODES["int32"], 2)
    total_q, total_r = np.array([q.sum()], np.int32), np.array([r.sum()], np.int32)
    _testing.join_exact(total_q.ctypes.data, total_r.ctypes.data, 1, DTYPE_CODES["int32"], 2)
    assert total_q.tolist() == [2**30]
    # floor, not truncation: -3 // 2 == -2.
    q, r = np.array([-1], np.int32), np.array([-1], np.int32)
    _testing.join_exact(q.ctypes.data, r.ctypes.data, 1, DTYPE_CODES["int32"], 2)
    assert q.tolist() == [-2]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", HALVES)
def test_any_nonfinite_all_lengths_offsets_and_positions(name: str, path: str) -> None:
    rng = np.random.default_rng([30 + DTYPE_CODES[name], PATHS.index(path)])
    exponent = EXPONENT[name]
    # A few long buffers too, so a hit beyond the scan's first block is found.
    for n in [*range(68), 4095, 4096, 4097, 10_000]:
        for offset in (0, 1, 3):
            bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
            finite = (bits & exponent) != exponent
            bits[~finite] ^= np.uint16(0x0400 if name == "float16" else 0x0080)  # clear one exponent bit
            cases = [bits.copy()]
            if n:
                for where in {0, n - 1, int(rng.integers(0, n))}:
                    for special in (exponent, exponent | 0x8000, exponent | 1, 0xFFFF):  # +-inf and nans
                        hit = bits.copy()
                        hit[where] = special
                        cases.append(hit)
            for case in cases:
                _, view = guarded(case.view(HALVES[name]), offset)
                want = bool(np.any((case & exponent) == exponent))
                got = _testing.any_nonfinite(view.ctypes.data, n, DTYPE_CODES[name], path)
                assert got is want, f"{name} path={path} n={n} offset={offset}"


def test_bad_codes_raise() -> None:
    a = np.zeros(4, np.int32)
    with pytest.raises(ddlfast.DdlfastError, match="integer dtype"):
        _testing.split_exact(a.ctypes.data, a.ctypes.data, 4, DTYPE_CODES["float32"], 2)
    with pytest.raises(ddlfast.DdlfastError, match="divisor"):
        _testing.join_exact(a.ctypes.data, a.ctypes.data, 4, DTYPE_CODES["int32"], 0)
    with pytest.raises(ddlfast.DdlfastError, match="float16/bfloat16"):
        _testing.any_nonfinite(a.ctypes.data, 4, DTYPE_CODES["int32"])
