"""Bucket assignment: a pure function from array sizes to fusion buckets.

Like PyTorch DDP's compute_bucket_assignment_by_size: arrays are keyed by
dtype, taken in reverse order (the order backward produces gradients), and
packed into buckets capped at `bucket_bytes`, except the first bucket, capped
at `first_bucket_bytes` so communication can start early.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Bucket:
    dtype: Hashable  # a dtype name or np.dtype: only compared for equality
    indices: tuple[int, ...]  # positions in the caller's list
    nbytes: int


def assign_buckets(
    dtypes: Sequence[Hashable], nbytes: Sequence[int], bucket_bytes: int, first_bucket_bytes: int | None = None
) -> list[Bucket]:
    if len(dtypes) != len(nbytes):
        raise ValueError("dtypes and nbytes differ in length")
    if bucket_bytes < 1:
        raise ValueError("bucket_bytes must be >= 1")
    first_cap = bucket_bytes if first_bucket_bytes is None else max(1, first_bucket_bytes)
    open_buckets: dict[Hashable, tuple[list[int], int]] = {}
    caps: dict[Hashable, int] = {}
    buckets: list[Bucket] = []
    for index in reversed(range(len(dtypes))):
        dtype, size = dtypes[index], nbytes[index]
        indices, total = open_buckets.get(dtype, ([], 0))
        cap = caps.setdefault(dtype, first_cap)
        if indices and total + size > cap:
            buckets.append(Bucket(dtype, tuple(indices), total))
            caps[dtype] = bucket_bytes
            indices, total = [], 0
        indices.append(index)
        open_buckets[dtype] = (indices, total + size)
    for dtype, (indices, total) in open_buckets.items():
        if indices:
            buckets.append(Bucket(dtype, tuple(indices), total))
    return buckets
