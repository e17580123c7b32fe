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

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from ddlfast.errors import DdlfastError

if TYPE_CHECKING:
    from ddlfast.agreement import Agreement
    from ddlfast.control import Control

WIRE_CODES = {"none": -1, "fp16": 0, "bf16": 1}
_WIRE_DTYPES = {"fp16": np.float16}


def wire_by_dim(names: tuple[str, ...], dims: tuple[int, ...], hosts_tier: int | None = None) -> tuple[int, ...]:
    """Per-dimension wire codes; one name applies to every dimension.

    'auto' compresses only the dimensions past the first when ranks span
    several hosts (hosts_tier: index of the first inter-host dimension); on
    one host shared memory is faster than any conversion, so it is 'none'.
    """
    if names == ("auto",):
        if hosts_tier is None:
            return ()
        return tuple(-1 if i < hosts_tier else WIRE_CODES["fp16"] for i in range(len(dims)))
    if len(names) == 1:
        codes = tuple(WIRE_CODES[names[0]] for _ in dims)
    elif len(names) == len(dims):
        codes = tuple(WIRE_CODES[n] for n in names)
    else:
        raise DdlfastError(f"compression names {len(names)} dimensions ({','.join(names)}) but the ring dims "
                           f"{'x'.join(map(str, dims))} have {len(dims)}")
    return codes if any(code >= 0 for code in codes) else ()


@runtime_checkable
class Codec(Protocol):
    def compress(self, bucket: np.ndarray, state: dict) -> Sequence[np.ndarray]: ...

    def decompress(self, payloads: list[list[np.ndarray]], bucket: np.ndarray, state: dict) -> None: ...


class HookContext:
    """What a CollectiveHook may use: rank, size, the per-bucket state, allgather and allreduce (both
    stall-limited, like every ddlfast collective)."""

    def __init__(self, control: Control, state: dict) -> None:
        self.rank, self.size, self.state = control.rank, control.size, state
        self._control = control

    def allgather(self, array: np.ndarray) -> np.ndarray:
        """Every rank's `array` stacked along a new first axis (same shape and dtype on all ranks)."""
        return self._control.allgather_array(array, "a codec's allgather")

    def allreduce(self, array: np.ndarray) -> np.ndarray:
        """Sum in place with MPI's own allreduce (for small side data)."""
        array[...] = self._control.allreduce_sum(array, "a codec's allreduce")
        return array


def run_codec(codec: Any, bucket: np.ndarray, state: dict, control: Control, agreement: Agreement,
              op: str) -> None:
    """One bucket through a user Codec or CollectiveHook; validates what the codec returns."""
    hook_context = HookContext(control, state)
    if not isinstance(codec, Codec):
        codec(bucket, hook_context)
    else:
        payloads = codec.compress(bucket, state)
        if isinstance(payloads, np.ndarray) or not isinstance(payloads, Sequence):
            raise DdlfastError(f"{type(codec).__name__}.compress must return a list of arrays")
        for i, payload in enumerate(payloads):
            if not isinstance(payload, np.ndarray):
                raise DdlfastError(f"{type(codec).__name__}.compress returned a {type(payload).__name__} "
                                   f"as payload {i}, not a NumPy array")
        layout = ("codec", type(codec).__name__, tuple((p.dtype, p.shape) for p in payloads))
        agreement.check(layout)  # mismatched payload sizes across ranks: an error, not garbage
        gathered = [hook_context.allgather(p) for p in payloads]
        by_rank = [[g[r] for g in gathered] for r in range(control.size)]
        shape_before = bucket.shape
        codec.decompress(by_rank, bucket, state)
        if bucket.shape != shape_before:
            raise DdlfastError(f"{type(codec).__name__}.decompress changed the bucket's shape")
    if op == "average":
        bucket /= control.size


class ErrorFeedback:
    """Residuals of the wire quantization, one per bucket, added back next step."""

    def __init__(self) -> None:
        self._residuals: dict[tuple, np.ndarray] = {}

    def apply(self, key: tuple, bucket: np.ndarray, wire: str) -> None:
        """bucket <- round(bucket + residual); residual <- what that rounding lost."""
        residual = self._residuals.get(key)
        if residual is None or residual.shape != bucket.shape:
            residual = np.zeros_like(bucket)
            self._residuals[key] = residual
        bucket += residual
        rounded = _round_through(bucket, wire)
        np.subtract(bucket, rounded, out=residual)
        bucket[...] = rounded


def _round_through(values: np.ndarray, wire: str) -> np.ndarray:
    if wire == "fp16":
        with np.errstate(over="ignore"):
            return values.astype(np.float16).astype(np.float32)
    import ml_dtypes

    return values.astype(ml_dtypes.bfloat16).astype(np.float32)


class TopKCodec:
    """Top-k sparsification with error feedback: each rank sends its k largest
    (after adding last step's residual) as (index, value) pairs; what it did not
    send is kept as the residual for the next step."""

    def __init__(self, ratio: float = 0.01) -> None:
        if not 0 < ratio <= 1:
            raise DdlfastError(f"TopKCodec ratio must be in (0, 1], got {ratio}")
        self.ratio = ratio

    def compress(self, bucket: np.ndarray, state: dict) -> list[np.ndarray]:
        flat = bucket.reshape(-1)
        if flat.dtype != np.float32:
            raise DdlfastError(f"TopKCodec takes float32 buckets, got {flat.dtype}")
        residual = state.get("residual")
        if residual is None or residual.shape != flat.shape:
            residual = state["residual"] = np.zeros_like(flat)
        corrected = flat + residual
        k = max(1, int(self.ratio * flat.size))
        indices = np.argpartition(np.abs(corrected), flat.size - k)[flat.size - k:].astype(np.int64)
        values = corrected[indices]
        residual[...] = corrected
        residual[indices] = 0
        return [indices, values.astype(np.float32)]

    def decompress(self, payloads: list[list[np.ndarray]], bucket: np.ndarray, state: dict) -> None:
        flat = bucket.reshape(-1)
        flat[...] = 0
        for indices, values in payloads:
            np.add.at(flat, indices, values)
