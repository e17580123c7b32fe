"""Which arrays of a bucket are packed, and where: one policy for the host and the GPU executor.

Small arrays are packed into the bucket's fused buffer (their per-message cost would dominate); large ones are
reduced where they lie, as further segments of one logical buffer. The choice depends on sizes alone, which
every rank agreed on, so every rank lays a bucket out alike (docs/architecture.md: the layout is a pure function of the
agreed arguments).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from ddlfast.fusion.bucketing import assign_buckets

# Arrays below this are packed into the fused buffer; larger ones are reduced in place.
PACK_BELOW_BYTES = 256 << 10
# On the GPU packed arrays start at multiples of this in the bucket, so pack, unpack and reduce use 16-byte
# vectors (the host packs them back to back: its kernels load unaligned).
DEVICE_ALIGN_BYTES = 16


def bucket_indices(dtypes: Sequence[Hashable], nbytes: Sequence[int], bucket_bytes: int,
                   first_bucket_bytes: int) -> list[tuple[int, ...]]:
    """A call's arrays as buckets (positions in the call's list); one array is its own bucket."""
    if len(dtypes) == 1:
        return [(0,)]
    return [bucket.indices for bucket in assign_buckets(dtypes, nbytes, bucket_bytes, first_bucket_bytes)]


def packed_positions(nbytes: Sequence[int]) -> list[int]:
    """Positions (in the bucket) of the arrays to pack: those below PACK_BELOW_BYTES, unless only one is
    (packing a lone array would only add two copies)."""
    small = [i for i, size in enumerate(nbytes) if size < PACK_BELOW_BYTES]
    return small if len(small) > 1 else []


def aligned_offsets(nbytes: Sequence[int], align: int) -> tuple[list[int], int]:
    """Byte offsets of packed arrays (each a multiple of `align`) and the bucket's size; the gaps are zero and
    stay zero, and like the rest of the layout they depend on sizes only."""
    offsets, cursor = [], 0
    for size in nbytes:
        offsets.append(cursor)
        cursor += (size + align - 1) // align * align
    return offsets, cursor
