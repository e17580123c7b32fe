"""FusedBuffer: arrays that are views into one flat buffer, so they need no packing at all (what DDP calls
gradient_as_bucket_view)."""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

import numpy as np

from ddlfast.api import default_context
from ddlfast.context import Context
from ddlfast.engine.worker import Handle


class FusedBuffer:
    """Zero-copy fusion: `views[i]` has `shapes[i]` and lives inside `flat`.

    Write gradients into the views, then allreduce() reduces `flat` in one
    collective with no packing or unpacking.
    """

    def __init__(self, shapes: Sequence[Sequence[int]], dtype: object = np.float32,
                 context: Context | None = None) -> None:
        self.shapes = [tuple(int(d) for d in shape) for shape in shapes]
        self.flat = np.zeros(sum(prod(shape) for shape in self.shapes), dtype=dtype)
        self.views: list[np.ndarray] = []
        offset = 0
        for shape in self.shapes:
            count = prod(shape)
            self.views.append(self.flat[offset:offset + count].reshape(shape))
            offset += count
        self._context = context or default_context()

    def allreduce(self, *, op: str = "sum", dims: object = None) -> list[np.ndarray]:
        self._context.allreduce(self.flat, op=op, dims=dims)
        return self.views

    def allreduce_async(self, *, op: str = "sum", dims: object = None) -> Handle:
        """The handle's wait() returns the views."""
        return self._context.fused_allreduce_async([self.flat], op=op, dims=dims, result=self.views)
