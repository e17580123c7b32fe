"""The built-in wire codecs' settings (which ring dimensions send fp16/bf16) and error feedback (the wire
rounding's residual, kept per bucket and added back next step). The codecs themselves are compiled
(src/engine/host_steps.h)."""

from __future__ import annotations

import numpy as np

from ddlfast.buffers.dtypes import numpy_dtype
from ddlfast.errors import DdlfastError

WIRE_CODES = {"none": -1, "fp16": 0, "bf16": 1}


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
    return values.astype(numpy_dtype("bfloat16")).astype(np.float32)
