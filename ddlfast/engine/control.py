"""Collectives on a context's control communicator, every one of them stall-limited.

Each is the non-blocking MPI call (`Iallgather`, `Ibcast`, `Iallreduce`, ...)
completed through the compiled core's one poll loop (`Engine.wait_requests`,
`MpiTransport::wait_request`): the same stall limit (DDLFAST_TIMEOUT_S), stall
census and broken-context refusal as the ring itself, for the host and the GPU
paths alike. Data a caller owns is never handed to MPI directly: a collective
abandoned after a stall can complete later, so it writes into a copy that is
then kept alive for good (`_ABANDONED`).
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
from mpi4py import MPI

# Buffers of collectives abandoned after a stall: MPI may still write into them, so they are never freed.
_ABANDONED: list[Any] = []


class Control:
    """Stall-limited collectives over `comm`, waited for by `core` (a ddlfast._core.Engine)."""

    def __init__(self, comm: MPI.Intracomm, core: Any) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._core = core

    def complete(self, request: MPI.Request, buffers: tuple, what: str,
                 waiting: tuple[int, int, int] | None = None) -> None:
        """waiting=(kind, peer, tag) marks a point-to-point wait for the stall census (Engine.wait_requests)."""
        try:
            self._core.wait_requests([request], what, waiting)
        except BaseException:
            _ABANDONED.append((request, buffers))
            raise

    def allgather_bytes(self, payload: bytes, what: str) -> list[bytes]:
        """Every rank's bytes (any length), in rank order."""
        mine = np.array([len(payload)], dtype=np.int64)
        lengths = np.zeros(self.size, dtype=np.int64)
        self.complete(self.comm.Iallgather(mine, lengths), (mine, lengths), what)
        displacements = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
        gathered = np.empty(int(lengths.sum()), dtype=np.uint8)
        send = np.frombuffer(payload, dtype=np.uint8).copy()
        request = self.comm.Iallgatherv(send, [gathered, (lengths.tolist(), displacements.tolist()), MPI.BYTE])
        self.complete(request, (send, gathered), what)
        return [gathered[d:d + n].tobytes() for d, n in zip(displacements.tolist(), lengths.tolist(), strict=True)]

    def allgather_objects(self, value: object, what: str) -> list:
        """Every rank's picklable value, in rank order."""
        return [pickle.loads(b) for b in self.allgather_bytes(pickle.dumps(value), what)]

    def bcast_into(self, target: np.ndarray, root: int, what: str) -> None:
        """Overwrite `target` (C-contiguous, writable) with root's bytes.

        Root sends straight from `target` (MPI only reads it; abandoned after a stall, the array is kept alive in
        _ABANDONED). The others receive into a staging buffer, so a broadcast abandoned after a stall can never
        write into the caller's array later; one copy, not two."""
        if self.rank == root:
            self.complete(self.comm.Ibcast([target.reshape(-1).view(np.uint8), MPI.BYTE], root=root), (target,),
                           what)
            return
        staging = np.empty(target.nbytes, dtype=np.uint8)
        self.complete(self.comm.Ibcast([staging, MPI.BYTE], root=root), (staging,), what)
        target.reshape(-1).view(np.uint8)[...] = staging

    def allreduce_sum(self, values: np.ndarray, what: str) -> np.ndarray:
        """The elementwise sum over ranks of `values` (a new array)."""
        send = np.ascontiguousarray(values).copy()
        result = np.empty_like(send)
        self.complete(self.comm.Iallreduce(send, result, op=MPI.SUM), (send, result), what)
        return result

    def allgather_array(self, array: np.ndarray, what: str) -> np.ndarray:
        """Every rank's array (same shape and dtype everywhere), stacked in rank order."""
        send = np.ascontiguousarray(array).copy()
        result = np.empty((self.size, *send.shape), dtype=send.dtype)
        flat = result.reshape(-1).view(np.uint8)
        self.complete(self.comm.Iallgather([send.reshape(-1).view(np.uint8), MPI.BYTE], [flat, MPI.BYTE]),
                       (send, result), what)
        return result

    def barrier(self, what: str) -> None:
        self.complete(self.comm.Ibarrier(), (), what)
