"""The CUDA kernels on a GPU against the CPU kernels, bit for bit (skipped without a CUDA device).

Covers every dtype and divisor, lengths around the vector width, aligned and misaligned starts (same and
different misalignment of dst and src), special values, every fp16/bf16 value, the wire casts, the fused
pack kernel over more than one launch's worth of copies, and the refusal of misaligned pointers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ddlfast import _core, _testing
from ddlfast.buffers.dtypes import DTYPE_CODES
from ddlfast.errors import DdlfastError
from tests.cuda.support import needs_device
from tests.cuda.test_host_twins import BITS, DTYPES, WIRES, assert_bits_equal, random_bits, special_values

pytestmark = needs_device


def on_device(bits: np.ndarray, offset_elements: int = 0):
    """Device memory holding `bits`, starting `offset_elements` elements into a fresh allocation."""
    from ddlfast import _testing_cuda

    itemsize = bits.dtype.itemsize
    memory = _testing_cuda.DeviceMemory(bits.nbytes + (offset_elements + 4) * itemsize)
    pointer = memory.pointer + offset_elements * itemsize
    _testing_cuda.copy(pointer, bits.ctypes.data, bits.nbytes)
    return memory, pointer


def read_back(pointer: int, like: np.ndarray) -> np.ndarray:
    from ddlfast import _testing_cuda

    out = np.empty_like(like)
    _testing_cuda.copy(out.ctypes.data, pointer, out.nbytes)
    return out


def gpu_reduce(dtype: str, dst: np.ndarray, src: np.ndarray, divisor: int, dst_offset: int = 0,
               src_offset: int = 0) -> np.ndarray:
    from ddlfast import _testing_cuda

    keep_dst, dst_pointer = on_device(dst, dst_offset)
    keep_src, src_pointer = on_device(src, src_offset)
    # On the legacy stream, then a blocking copy.
    _testing_cuda.reduce(dst_pointer, src_pointer, dst.size, DTYPE_CODES[dtype], divisor)
    return read_back(dst_pointer, dst)


def cpu_reduce(dtype: str, dst: np.ndarray, src: np.ndarray, divisor: int) -> np.ndarray:
    out = dst.copy()
    _core.reduce_into(out.ctypes.data, src.ctypes.data, out.size, DTYPE_CODES[dtype], divisor)
    return out


@pytest.mark.parametrize("divisor", [1, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_lengths_and_misalignments(dtype: str, divisor: int) -> None:
    rng = np.random.default_rng([DTYPE_CODES[dtype], divisor])
    for n in list(range(0, 68)) + [1000, (1 << 20) + 3]:
        for dst_offset, src_offset in ((0, 0), (1, 1), (3, 3), (1, 0), (0, 3), (2, 1)):
            dst, src = random_bits(dtype, n, rng), random_bits(dtype, n, rng)
            got = gpu_reduce(dtype, dst, src, divisor, dst_offset, src_offset)
            assert_bits_equal(dtype, got, cpu_reduce(dtype, dst, src, divisor), dst, src,
                              f"{dtype} n={n} divisor={divisor} offsets=({dst_offset},{src_offset})")


@pytest.mark.parametrize("divisor", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_special_value_pairs(dtype: str, divisor: int) -> None:
    values = special_values(dtype)
    pairs = np.array(list(itertools.product(values, values)), dtype=values.dtype)
    dst, src = np.ascontiguousarray(pairs[:, 0]), np.ascontiguousarray(pairs[:, 1])
    assert_bits_equal(dtype, gpu_reduce(dtype, dst, src, divisor), cpu_reduce(dtype, dst, src, divisor), dst, src,
                      f"{dtype} divisor={divisor}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_reduce_every_value(dtype: str) -> None:
    every = np.arange(1 << 16, dtype=np.uint16)
    for partner, divisor in itertools.product(special_values(dtype).tolist() + [0x3555, 0xC123], (1, 3)):
        src = np.full(every.size, partner, dtype=np.uint16)
        assert_bits_equal(dtype, gpu_reduce(dtype, every, src, divisor), cpu_reduce(dtype, every, src, divisor),
                          every, src, f"{dtype} + {partner:#06x} divisor={divisor}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_wire_casts(dtype: str) -> None:
    from ddlfast import _testing_cuda

    wire = WIRES[dtype]
    rng = np.random.default_rng(11 + wire)
    floats = np.concatenate([special_values("float32"), random_bits("float32", 300_001, rng)])
    keep_f, f_pointer = on_device(floats)
    keep_h, h_pointer = on_device(np.zeros(floats.size, np.uint16), 1)
    _testing_cuda.encode(h_pointer, f_pointer, floats.size, wire)
    want = np.zeros(floats.size, np.uint16)
    _testing.encode_wire(want.ctypes.data, floats.ctypes.data, floats.size, wire, "scalar")
    got = read_back(h_pointer, want)
    assert (got == want).all(), f"encode {dtype}: {np.flatnonzero(got != want)[:8]}"

    every = np.arange(1 << 16, dtype=np.uint16)
    keep_w, w_pointer = on_device(every)
    keep_d, d_pointer = on_device(np.zeros(every.size, np.uint32))
    _testing_cuda.decode(d_pointer, w_pointer, every.size, wire)
    want_f = np.zeros(every.size, np.uint32)
    _testing.decode_wire(want_f.ctypes.data, every.ctypes.data, every.size, wire, "scalar")
    assert (read_back(d_pointer, want_f) == want_f).all(), f"decode {dtype}"

    for divisor in (1, 3):
        base = floats[: every.size].copy()
        keep_a, a_pointer = on_device(base)
        _testing_cuda.accumulate(a_pointer, w_pointer, every.size, wire, divisor)
        want_a = base.copy()
        _testing.accumulate_wire(want_a.ctypes.data, every.ctypes.data, every.size, wire, divisor, "scalar")
        assert_bits_equal("float32", read_back(a_pointer, base), want_a, base, want_f,
                          f"accumulate {dtype} divisor={divisor}")


def test_fused_copy_of_many_arrays() -> None:
    from ddlfast import _testing_cuda

    rng = np.random.default_rng(5)
    sizes = [int(s) for s in rng.choice([0, 1, 3, 16, 100, 4096, 70_001, 300_000], size=300)]  # > one launch
    source = rng.integers(0, 256, size=sum(sizes) + 300 * 32, dtype=np.uint8)
    keep_s, s_pointer = on_device(source)
    keep_d, d_pointer = on_device(np.zeros(source.size, np.uint8))
    dsts, srcs, expected = [], [], np.zeros(source.size, np.uint8)
    src_cursor, dst_cursor = 0, 0
    for size in sizes:
        src_cursor += int(rng.integers(0, 16))  # every relative alignment
        dst_cursor += int(rng.integers(0, 16))
        srcs.append(s_pointer + src_cursor)
        dsts.append(d_pointer + dst_cursor)
        expected[dst_cursor:dst_cursor + size] = source[src_cursor:src_cursor + size]
        src_cursor += size
        dst_cursor += size
    _testing_cuda.copy_batch(dsts, srcs, sizes)
    got = read_back(d_pointer, expected)
    assert (got == expected).all(), np.flatnonzero(got != expected)[:8]


def test_misaligned_pointers_are_refused() -> None:
    from ddlfast import _testing_cuda

    memory = _testing_cuda.DeviceMemory(64)
    with pytest.raises(DdlfastError, match="aligned"):
        _testing_cuda.reduce(memory.pointer + 2, memory.pointer, 4, DTYPE_CODES["float32"])


def test_bits_helpers_cover_every_dtype() -> None:
    assert set(BITS) == set(DTYPES)
