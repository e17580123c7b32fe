"""assign_buckets: dtype-keyed, reverse-order, size-capped fusion buckets (a pure function)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddlfast.fusion.bucketing import Bucket, assign_buckets


def check_invariants(dtypes, nbytes, bucket_bytes, first_bucket_bytes, buckets) -> None:
    first_cap = bucket_bytes if first_bucket_bytes is None else max(1, first_bucket_bytes)
    # Every array in exactly one bucket.
    placed = sorted(i for b in buckets for i in b.indices)
    assert placed == list(range(len(dtypes))), f"arrays placed {placed}"
    seen_dtypes: dict[object, list[Bucket]] = {}
    for b in buckets:
        assert b.indices, "empty bucket"
        assert all(dtypes[i] == b.dtype for i in b.indices), f"{b} mixes dtypes"
        assert b.nbytes == sum(nbytes[i] for i in b.indices), f"{b}: nbytes is not the sum of its arrays"
        assert list(b.indices) == sorted(b.indices, reverse=True), f"{b}: not in reverse (backward) order"
        seen_dtypes.setdefault(b.dtype, []).append(b)
    for dtype, same in seen_dtypes.items():
        # Per dtype, buckets come in the order backward produces them: all indices descending.
        flat = [i for b in same for i in b.indices]
        assert flat == sorted((i for i, d in enumerate(dtypes) if d == dtype), reverse=True), f"{dtype}: order"
        for k, b in enumerate(same):
            cap = first_cap if k == 0 else bucket_bytes
            assert b.nbytes <= cap or len(b.indices) == 1, f"{b} exceeds its cap {cap}"
            if k + 1 < len(same):
                # Greedy: a bucket is closed only because the next array would not fit.
                assert b.nbytes + nbytes[same[k + 1].indices[0]] > cap, f"{b} closed early (cap {cap})"


def per_dtype(buckets: list[Bucket]) -> dict[object, list[tuple[tuple[int, ...], int]]]:
    """(indices, nbytes) of each dtype's buckets in output order (the order across dtypes is not specified)."""
    result: dict[object, list[tuple[tuple[int, ...], int]]] = {}
    for b in buckets:
        result.setdefault(b.dtype, []).append((b.indices, b.nbytes))
    return result


def test_hand_worked_example() -> None:
    dtypes = ["f32", "f32", "f16", "f32", "f32", "f16"]
    nbytes = [4, 4, 10, 4, 4, 2]
    buckets = assign_buckets(dtypes, nbytes, bucket_bytes=8, first_bucket_bytes=4)
    # Reverse order: 5 (f16), 4, 3, 2 (f16), 1, 0. The first bucket of each dtype is capped at 4, later ones
    # at 8; index 2 (10 bytes) does not fit after index 5 in the first f16 bucket and is over any cap.
    assert per_dtype(buckets) == {
        "f32": [((4,), 4), ((3, 1), 8), ((0,), 4)],
        "f16": [((5,), 2), ((2,), 10)],
    }
    assert len(buckets) == 5
    assert all(isinstance(b, Bucket) for b in buckets)
    check_invariants(dtypes, nbytes, 8, 4, buckets)


def test_everything_fits_in_one_bucket() -> None:
    buckets = assign_buckets(["float32"] * 5, [100] * 5, bucket_bytes=1 << 20)
    assert buckets == [Bucket("float32", (4, 3, 2, 1, 0), 500)]


def test_first_bucket_is_smaller() -> None:
    buckets = assign_buckets(["float32"] * 6, [4] * 6, bucket_bytes=12, first_bucket_bytes=4)
    assert [b.indices for b in buckets] == [(5,), (4, 3, 2), (1, 0)]


def test_first_bucket_defaults_to_bucket_bytes() -> None:
    buckets = assign_buckets(["float32"] * 6, [4] * 6, bucket_bytes=8)
    assert [b.indices for b in buckets] == [(5, 4), (3, 2), (1, 0)]
    assert buckets == assign_buckets(["float32"] * 6, [4] * 6, bucket_bytes=8, first_bucket_bytes=8)


def test_first_bucket_bytes_zero_means_one_array() -> None:
    buckets = assign_buckets(["float32"] * 3, [4] * 3, bucket_bytes=100, first_bucket_bytes=0)
    assert [b.indices for b in buckets] == [(2,), (1, 0)]


def test_array_larger_than_the_cap_gets_its_own_bucket() -> None:
    buckets = assign_buckets(["float32"] * 4, [4, 1000, 4, 4], bucket_bytes=16)
    assert [(b.indices, b.nbytes) for b in buckets] == [((3, 2), 8), ((1,), 1000), ((0,), 4)]


def test_each_dtype_has_its_own_first_bucket_cap() -> None:
    dtypes = ["a", "b", "a", "b", "a"]
    buckets = assign_buckets(dtypes, [4, 4, 4, 4, 4], bucket_bytes=8, first_bucket_bytes=4)
    assert per_dtype(buckets) == {"a": [((4,), 4), ((2, 0), 8)], "b": [((3,), 4), ((1,), 4)]}


def test_zero_byte_arrays_are_kept() -> None:
    buckets = assign_buckets(["float32"] * 3, [0, 8, 0], bucket_bytes=8)
    check_invariants(["float32"] * 3, [0, 8, 0], 8, None, buckets)
    assert sum(b.nbytes for b in buckets) == 8


def test_numpy_dtypes_as_keys() -> None:
    dtypes = [np.dtype(np.float32), np.dtype(np.float64), np.dtype("float32")]
    buckets = assign_buckets(dtypes, [4, 8, 4], bucket_bytes=1024)
    assert per_dtype(buckets) == {np.dtype(np.float32): [((2, 0), 8)], np.dtype(np.float64): [((1,), 8)]}


def test_empty_input() -> None:
    assert assign_buckets([], [], bucket_bytes=8) == []


def test_is_pure() -> None:
    """Every rank must compute the same assignment from the same sizes."""
    dtypes, nbytes = ["f32", "f16"] * 50, list(range(100))
    assert assign_buckets(dtypes, nbytes, 64, 16) == assign_buckets(list(dtypes), list(nbytes), 64, 16)


def test_mismatched_lengths_raise_naming_both() -> None:
    with pytest.raises(ValueError, match="dtypes and nbytes"):
        assign_buckets(["float32", "float32"], [4], bucket_bytes=8)


@pytest.mark.parametrize("bad", [0, -1])
def test_bucket_bytes_must_be_positive(bad: int) -> None:
    with pytest.raises(ValueError, match="bucket_bytes"):
        assign_buckets(["float32"], [4], bucket_bytes=bad)


@given(
    arrays=st.lists(st.tuples(st.sampled_from(["f32", "f16", "i64"]), st.integers(0, 300)), max_size=60),
    bucket_bytes=st.integers(1, 500),
    first_bucket_bytes=st.one_of(st.none(), st.integers(0, 500)),
)
@settings(max_examples=150, deadline=None)
def test_invariants_hold_for_random_inputs(arrays, bucket_bytes, first_bucket_bytes) -> None:
    dtypes = [d for d, _ in arrays]
    nbytes = [n for _, n in arrays]
    buckets = assign_buckets(dtypes, nbytes, bucket_bytes, first_bucket_bytes)
    check_invariants(dtypes, nbytes, bucket_bytes, first_bucket_bytes, buckets)
