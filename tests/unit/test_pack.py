"""pack_arrays / unpack_arrays: back-to-back copies into and out of a fusion bucket."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddlfast import _core
from ddlfast.fusion.bucketing import assign_buckets

GUARD = 0xA5


def pointers(arrays: list[np.ndarray]) -> list[int]:
    return [a.ctypes.data for a in arrays]


def sizes(arrays: list[np.ndarray]) -> list[int]:
    return [a.nbytes for a in arrays]


def guarded_bucket(nbytes: int, offset: int = 0, tail: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """A byte buffer of guards with a `nbytes` window at `offset` (the bucket), and that window."""
    raw = np.full(offset + nbytes + tail, GUARD, dtype=np.uint8)
    return raw, raw[offset : offset + nbytes]


def assert_guards(raw: np.ndarray, offset: int, nbytes: int) -> None:
    outside = np.r_[0:offset, offset + nbytes : raw.size]
    assert (raw[outside] == GUARD).all(), "wrote outside the bucket"


def sample_arrays(rng: np.random.Generator) -> list[np.ndarray]:
    return [
        rng.standard_normal(5).astype(np.float32),
        np.empty(0, dtype=np.float64),
        rng.integers(-100, 100, size=(3, 4)).astype(np.int64),
        rng.standard_normal(1).astype(np.float16),
        rng.integers(0, 255, size=7, dtype=np.uint8),  # odd size: what follows is unaligned
        rng.standard_normal(9),
    ]


@pytest.mark.parametrize("offset", [0, 1, 3, 8])
def test_pack_writes_arrays_back_to_back(offset: int) -> None:
    arrays = sample_arrays(np.random.default_rng(offset))
    before = [a.copy() for a in arrays]
    total = sum(sizes(arrays))
    raw, bucket = guarded_bucket(total, offset)
    _core.pack_arrays(bucket.ctypes.data, pointers(arrays), sizes(arrays))
    assert bucket.tobytes() == b"".join(a.tobytes() for a in arrays)
    assert_guards(raw, offset, total)
    assert all(np.array_equal(a, b) for a, b in zip(arrays, before, strict=True)), "pack modified a source"


@pytest.mark.parametrize("offset", [0, 1, 5])
def test_unpack_restores_each_array(offset: int) -> None:
    rng = np.random.default_rng(10 + offset)
    template = sample_arrays(rng)
    content = b"".join(a.tobytes() for a in template)
    raw, bucket = guarded_bucket(len(content), offset)
    bucket[:] = np.frombuffer(content, dtype=np.uint8)
    bucket_before = bucket.copy()
    # Targets live inside larger guarded buffers, so an overlong copy is caught.
    holders = []
    targets = []
    for a in template:
        holder = np.full(a.nbytes + 8, GUARD, dtype=np.uint8)
        holders.append(holder)
        targets.append(holder[4 : 4 + a.nbytes].view(a.dtype).reshape(a.shape))
    _core.unpack_arrays(bucket.ctypes.data, pointers(targets), sizes(targets))
    for a, target, holder in zip(template, targets, holders, strict=True):
        assert target.tobytes() == a.tobytes() and target.shape == a.shape
        assert (holder[:4] == GUARD).all() and (holder[4 + a.nbytes :] == GUARD).all(), "wrote past a target"
    assert np.array_equal(bucket, bucket_before), "unpack modified the bucket"
    assert_guards(raw, offset, len(content))


def test_round_trip_through_assigned_buckets() -> None:
    """What fused_allreduce does around the reduction: bucket, pack, unpack, every array intact."""
    rng = np.random.default_rng(5)
    arrays = [(rng.standard_normal(int(n)) * 1000).astype(dtype)
              for n, dtype in zip(rng.integers(0, 50, size=30), ["float32", "float64", "int32"] * 10, strict=True)]
    originals = [a.copy() for a in arrays]
    buckets = assign_buckets([a.dtype for a in arrays], [a.nbytes for a in arrays], 256, 64)
    for bucket in buckets:
        members = [arrays[i] for i in bucket.indices]
        fused = np.empty(bucket.nbytes, dtype=np.uint8)
        _core.pack_arrays(fused.ctypes.data, pointers(members), sizes(members))
        assert fused.tobytes() == b"".join(m.tobytes() for m in members)
        for member in members:
            member[...] = 0
        _core.unpack_arrays(fused.ctypes.data, pointers(members), sizes(members))
    for a, original in zip(arrays, originals, strict=True):
        assert np.array_equal(a, original)


def test_empty_lists_touch_nothing() -> None:
    raw, bucket = guarded_bucket(0, 4)
    _core.pack_arrays(bucket.ctypes.data, [], [])
    _core.unpack_arrays(bucket.ctypes.data, [], [])
    assert_guards(raw, 4, 0)


def test_zero_byte_entries_are_never_dereferenced() -> None:
    """Empty arrays may come with a null pointer; pack/unpack must skip them, not memcpy from 0."""
    data = np.arange(4, dtype=np.int32)
    raw, bucket = guarded_bucket(data.nbytes)
    _core.pack_arrays(bucket.ctypes.data, [0, data.ctypes.data, 0], [0, data.nbytes, 0])
    assert bucket.tobytes() == data.tobytes()
    out = np.zeros(4, dtype=np.int32)
    _core.unpack_arrays(bucket.ctypes.data, [0, out.ctypes.data, 0], [0, out.nbytes, 0])
    assert np.array_equal(out, data)
    assert_guards(raw, 0, data.nbytes)


@given(lengths=st.lists(st.integers(0, 40), max_size=12), offset=st.integers(0, 7))
@settings(max_examples=50, deadline=None)
def test_pack_unpack_round_trip_property(lengths: list[int], offset: int) -> None:
    arrays = [np.arange(n, dtype=np.uint8) + 7 * i for i, n in enumerate(lengths)]
    total = sum(lengths)
    raw, bucket = guarded_bucket(total, offset)
    _core.pack_arrays(bucket.ctypes.data, pointers(arrays), sizes(arrays))
    assert bucket.tobytes() == b"".join(a.tobytes() for a in arrays)
    outputs = [np.zeros(n, dtype=np.uint8) for n in lengths]
    _core.unpack_arrays(bucket.ctypes.data, pointers(outputs), sizes(outputs))
    assert all(np.array_equal(a, b) for a, b in zip(arrays, outputs, strict=True))
    assert_guards(raw, offset, total)
