"""Cross-rank agreement on a collective's arguments.

Before a new layout (arrays' dtypes and shapes, op, dims) runs, the ranks
exchange a 16-byte digest of it; on a mismatch they exchange full
descriptions so every rank raises the same error naming who passed what.
Agreed layouts are cached, so steady-state steps pay one set lookup.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence

import numpy as np
from mpi4py import MPI

from ddlfast.buffers import HostBuffer
from ddlfast.errors import DdlfastError, DdlfastTimeoutError

MAX_CACHED_LAYOUTS = 4096


def layout_of(buffers: Sequence[HostBuffer], op: str, dims: tuple[int, ...]) -> tuple:
    return (op, dims, tuple((b.array.dtype, b.array.shape) for b in buffers))


_DIGEST_TAG = 7101
_VERDICT_TAG = 7102
_OK, _MISSING = 0, 1


class Agreement:
    def __init__(self, control: MPI.Intracomm) -> None:
        self._control = control
        self._agreed: set[tuple] = set()
        self.timeout_s = 0.0  # 0: wait forever

    def known(self, layout: tuple) -> bool:
        return layout in self._agreed

    def check(self, layout: tuple) -> None:
        """Collective over the control communicator unless `layout` is cached."""
        if layout in self._agreed:
            return
        digest = hashlib.blake2b(repr(layout).encode(), digest_size=16).digest()
        digests = self._exchange(digest)
        if all(d == digest for d in digests):
            if len(self._agreed) >= MAX_CACHED_LAYOUTS:  # layouts that never repeat must not grow memory
                self._agreed.clear()
            self._agreed.add(layout)
            return
        descriptions = self._control.allgather(describe(layout))
        raise DdlfastError(disagreement_message(descriptions))


    def name_missing(self, stalled: Exception) -> Exception:
        """After a stalled collective: which ranks never joined? (a census through rank 0)."""
        try:
            self._exchange(b"ddlfast-census!!")
        except DdlfastTimeoutError as named:
            return named
        return DdlfastTimeoutError(f"{stalled}; every rank is alive, so the collective was only slower than "
                                   "DDLFAST_TIMEOUT_S allows")

    def _exchange(self, digest: bytes) -> list[bytes]:
        """Every rank's digest, through rank 0, with a stall limit.

        Point-to-point rather than an allgather so that rank 0 knows exactly
        which ranks never arrived and can tell the others: every waiting rank
        raises DdlfastTimeoutError naming them instead of hanging.
        """
        comm, size, rank = self._control, self._control.Get_size(), self._control.Get_rank()
        if size == 1:
            return [digest]
        verdict = np.zeros(2 + size + 2 * size, dtype=np.int64)  # status, count, missing ranks, digests
        if rank == 0:
            digests = np.zeros((size, 16), dtype=np.uint8)
            digests[0] = np.frombuffer(digest, dtype=np.uint8)
            receives = [comm.Irecv(digests[r], source=r, tag=_DIGEST_TAG) for r in range(1, size)]
            done = wait_all(receives, self.timeout_s)
            missing = [r for r, finished in zip(range(1, size), done, strict=True) if not finished]
            if missing:
                for request, finished in zip(receives, done, strict=True):
                    if not finished:
                        request.Cancel()
                verdict[0], verdict[1] = _MISSING, len(missing)
                verdict[2:2 + len(missing)] = missing
            else:
                verdict[2 + size:] = digests.view(np.int64).reshape(-1)
            arrived = [r for r in range(1, size) if r not in missing]
            sends = [comm.Isend(verdict, dest=r, tag=_VERDICT_TAG) for r in arrived]
            wait_all(sends, self.timeout_s)
        else:
            send = comm.Isend(np.frombuffer(digest, dtype=np.uint8).copy(), dest=0, tag=_DIGEST_TAG)
            receive = comm.Irecv(verdict, source=0, tag=_VERDICT_TAG)
            # Rank 0 may itself wait timeout_s for a missing rank before it answers.
            patience = 2 * self.timeout_s + 1 if self.timeout_s > 0 else 0
            if not all(wait_all([receive], patience)):
                receive.Cancel()
                raise DdlfastTimeoutError(
                    f"rank {rank} waited {patience:g} s for rank 0 to confirm the collective's arguments; "
                    "rank 0 never joined (DDLFAST_TIMEOUT_S). Abort the job: this communicator is out of step.")
            wait_all([send], self.timeout_s)
        if verdict[0] == _MISSING:
            missing = verdict[2:2 + verdict[1]].tolist()
            raise DdlfastTimeoutError(
                f"rank {rank}: ranks {','.join(map(str, missing))} did not join the collective within "
                f"{self.timeout_s:g} s (DDLFAST_TIMEOUT_S). Abort the job: this communicator is out of step.")
        table = verdict[2 + size:].view(np.uint8).reshape(size, 16)
        return [bytes(row) for row in table]


def wait_all(requests: list[MPI.Request], timeout_s: float) -> list[bool]:
    """Poll until all complete or timeout_s passes (0: forever); which ones completed."""
    done = [False] * len(requests)
    deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
    pause = 1e-5
    while True:
        for i, request in enumerate(requests):
            if not done[i]:
                done[i] = request.Test()
        if all(done) or (deadline is not None and time.monotonic() > deadline):
            return done
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


def _dtype_name(dtype: object) -> str:
    """A NumPy dtype's name; GPU layouts carry their own text ("cuda float32")."""
    if isinstance(dtype, str) and dtype.startswith("cuda "):
        return dtype
    return np.dtype(dtype).name


def describe(layout: tuple) -> dict:
    """layout: (op, dims, ((dtype, shape), ...), *extras) -> plain data for the message."""
    op, dims, arrays, *extras = layout
    return {"op": op, "dims": dims, "arrays": [(_dtype_name(dtype), tuple(shape)) for dtype, shape in arrays],
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
