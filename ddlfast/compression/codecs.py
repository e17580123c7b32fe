"""User codecs: the Codec protocol (compress / decompress, payloads allgathered by ddlfast), the
CollectiveHook form (a callable that runs the whole collective) with its HookContext, and TopKCodec, the
shipped example."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from ddlfast.errors import DdlfastError


@runtime_checkable
class Codec(Protocol):
    """compress(bucket, state) -> payload arrays (allgathered by ddlfast), decompress(payloads_by_rank, bucket,
    state) writes the result into the bucket. A codec may declare `dtypes` (e.g. ("float32",)): arrays of
    another dtype are then refused before anything moves, like any bad input, on every rank."""

    def compress(self, bucket: np.ndarray, state: dict) -> Sequence[np.ndarray]: ...

    def decompress(self, payloads: list[list[np.ndarray]], bucket: np.ndarray, state: dict) -> None: ...


class Collectives(Protocol):
    """What a HookContext runs its collectives on (the engine's stall-limited Control): compression sits below
    the engine and names only this."""

    rank: int
    size: int

    def allgather_array(self, array: np.ndarray, what: str) -> np.ndarray: ...

    def allreduce_sum(self, values: np.ndarray, what: str) -> np.ndarray: ...


class HookContext:
    """What a CollectiveHook may use: rank, size, the per-bucket state, allgather and allreduce (both
    stall-limited, like every ddlfast collective)."""

    def __init__(self, control: Collectives, state: dict) -> None:
        self.rank, self.size, self.state = control.rank, control.size, state
        self._control = control

    def allgather(self, array: np.ndarray) -> np.ndarray:
        """Every rank's `array` stacked along a new first axis (same shape and dtype on all ranks)."""
        return self._control.allgather_array(array, "a codec's allgather")

    def allreduce(self, array: np.ndarray) -> np.ndarray:
        """Sum in place with MPI's own allreduce (for small side data)."""
        array[...] = self._control.allreduce_sum(array, "a codec's allreduce")
        return array


class TopKCodec:
    """Top-k sparsification with error feedback: each rank sends its k largest
    (after adding last step's residual) as (index, value) pairs; what it did not
    send is kept as the residual for the next step."""

    dtypes = ("float32",)  # checked before the agreement (engine/requests.py): a float64 array is refused there

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
