"""Compression: built-in fp16/bf16 wire codecs (compiled; fp32 accumulation),
error feedback, and the hook API for user codecs.

Built-in: `compression="fp16"` (or "bf16", or "none,fp16" per ring dimension)
sends float32 buckets as half precision; every receiver accumulates in
float32 and the allgather carries the wire type, so the error is one rounding
per ring hop, far below reducing in half precision (what Horovod's and DDP's
fp16 hooks do). `op="average"` pre-scales, so fp16 partial sums cannot
overflow where the inputs did not; with `op="sum"` a partial sum beyond
+-65504 raises DdlfastError (on every rank whose input was finite) instead of
silently returning inf. Use bf16 (float32's range) when sums are that large.

User codecs plug in per bucket (`compression=MyCodec()`):

- `Codec`: compress(bucket, state) -> payload arrays (same shapes and dtypes
  on every rank); decompress(payloads_by_rank, bucket, state) writes the sum
  into bucket. ddlfast allgathers the payloads. `state` is a dict kept per
  bucket across steps (for error feedback).
- `CollectiveHook`: a callable (bucket, hook_context) that performs the whole
  collective itself, like a DDP communication hook.

TopKCodec is the shipped example: top-k sparsification with error feedback.
"""

from ddlfast.compression.codecs import Codec, HookContext, TopKCodec
from ddlfast.compression.wire import WIRE_CODES, ErrorFeedback, wire_by_dim

__all__ = ["Codec", "ErrorFeedback", "HookContext", "TopKCodec", "WIRE_CODES", "wire_by_dim"]
