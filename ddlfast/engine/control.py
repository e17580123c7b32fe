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

import json
from typing import Any

import numpy as np
from mpi4py import MPI

# Buffers of collectives abandoned after a stall: MPI may still write into them, so they are never freed.
_ABANDONED: list[Any] = []


class InvalidValue:
    """What allgather_values returns for a peer whose bytes were not JSON."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __repr__(self) -> str:
        return f"<unreadable value from rank {self.rank}>"


def _plain(value: object) -> object:
    """JSON for what json does not take itself: NumPy scalars as numbers, anything else as its text."""
    if isinstance(value, np.integer | np.bool_):
        return value.item()
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    return str(value)


def encode_value(value: object) -> bytes:
    """A plain value as JSON bytes (what allgather_values sends)."""
    return json.dumps(value, default=_plain).encode()


def decode_value(payload: bytes, peer: int) -> object:
    """What allgather_values makes of `peer`'s bytes: JSON data, or an InvalidValue naming the peer."""
    try:
        return json.loads(payload)
    except ValueError:  # also UnicodeDecodeError
        return InvalidValue(peer)


class Control:
    """Stall-limited collectives over `comm`, waited for by `core` (a ddlfast._core.Engine)."""

    def __init__(self, comm: MPI.Intracomm, core: Any) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._core = core

    def complete(self, request: MPI.Request, buffers: tuple, what: str) -> None:
        try:
            self._core.wait_requests([request], what)
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

    def allgather_values(self, value: object, what: str) -> list:
        """Every rank's plain value (JSON: str, int, float, bool, None, lists, str-keyed dicts), in rank order.

        JSON, never pickle: what a peer sends is read as data and cannot run code here (docs/trust.md). Tuples
        come back as lists; a peer's bytes that are not JSON come back as an InvalidValue naming the rank."""
        payloads = self.allgather_bytes(encode_value(value), what)
        return [decode_value(payload, peer) for peer, payload in enumerate(payloads)]

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
