"""Cross-rank agreement on a collective's arguments.

Before a new layout (arrays' dtypes and shapes, op, dims) runs, the ranks
exchange a 16-byte digest of it; on a mismatch they exchange full
descriptions so every rank raises the same error naming who passed what.
Agreed layouts are cached, so steady-state steps pay one set lookup.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np
from mpi4py import MPI

from ddlfast.buffers import HostBuffer
from ddlfast.errors import DdlfastError

MAX_CACHED_LAYOUTS = 4096


def layout_of(buffers: Sequence[HostBuffer], op: str, dims: tuple[int, ...]) -> tuple:
    return (op, dims, tuple((b.array.dtype, b.array.shape) for b in buffers))


class Agreement:
    def __init__(self, control: MPI.Intracomm) -> None:
        self._control = control
        self._agreed: set[tuple] = set()

    def known(self, layout: tuple) -> bool:
        return layout in self._agreed

    def check(self, layout: tuple) -> None:
        """Collective over the control communicator unless `layout` is cached."""
        if layout in self._agreed:
            return
        digest = hashlib.blake2b(repr(layout).encode(), digest_size=16).digest()
        digests = self._control.allgather(digest)
        if all(d == digest for d in digests):
            if len(self._agreed) >= MAX_CACHED_LAYOUTS:  # layouts that never repeat must not grow memory
                self._agreed.clear()
            self._agreed.add(layout)
            return
        descriptions = self._control.allgather(describe(layout))
        raise DdlfastError(disagreement_message(descriptions))


def describe(layout: tuple) -> dict:
    """layout: (op, dims, ((dtype, shape), ...), *extras) -> plain data for the message."""
    op, dims, arrays, *extras = layout
    return {"op": op, "dims": dims, "arrays": [(np.dtype(dtype).name, tuple(shape)) for dtype, shape in arrays],
            "compression": extras[0] if extras else None, "error_feedback": extras[1] if len(extras) > 1 else None}


def _by_rank(descriptions: list[dict], key_of: Callable[[dict], str]) -> str:
    seen: dict[str, list[int]] = {}
    for rank, description in enumerate(descriptions):
        seen.setdefault(key_of(description), []).append(rank)
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))} passed {k}" for k, r in seen.items())


def disagreement_message(descriptions: list[dict]) -> str:
    """Name the first thing the ranks disagree on, and which ranks passed what."""
    for field in ("op", "dims", "compression", "error_feedback"):
        if len({repr(d[field]) for d in descriptions}) > 1:
            return f"ranks disagree on {field}: " + _by_rank(descriptions, lambda d, f=field: repr(d[f]))
    if len({len(d["arrays"]) for d in descriptions}) > 1:
        return "ranks disagree on the number of arrays: " + _by_rank(
            descriptions, lambda d: f"{len(d['arrays'])} arrays")
    for index in range(len(descriptions[0]["arrays"])):
        if len({d["arrays"][index] for d in descriptions}) > 1:
            return f"ranks disagree on array {index}: " + _by_rank(
                descriptions,
                lambda d, i=index: "{}[{}]".format(d["arrays"][i][0], ",".join(map(str, d["arrays"][i][1]))),
            )
    return "ranks disagree on the collective's arguments"
