"""Collectives on a context's control communicator, every one of them stall-limited.

Each is the non-blocking MPI call (`Iallgather`, `Ibcast`, `Iallreduce`, ...)
completed through the compiled core's one poll loop (`Engine.wait_requests`,
`MpiTransport::wait_request`): the same stall limit (DDLFAST_TIMEOUT_S), stall
census and broken-context refusal as the ring itself, for the host and the GPU
paths alike. Data a caller owns is never handed to MPI directly: a collective
abandoned after a stall can complete later, so it writes into a copy that is
then kept alive for good (`_ABANDONED`).

No MPI call here moves more than MAX_MESSAGE_BYTES in one count or displacement: MPI-3's counts and
displacements are C ints, and Open MPI 5 refuses a broadcast of 2 GiB or more with MPI_ERR_ARG (which would
break the context). Larger collectives run in pieces, all posted at once (MPI orders the collectives of one
communicator) and completed through one wait, as the ring cuts its messages into chunks.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from mpi4py import MPI

# Buffers of collectives abandoned after a stall: MPI may still write into them, so they are never freed.
_ABANDONED: list[Any] = []

# The most bytes one MPI call here sends or receives in one count (a power of two well inside a C int). Read at
# each call, so tests lower it to run the pieced paths on small buffers (tests/mpi/programs/trust_engine_cases.py).
MAX_MESSAGE_BYTES = 1 << 30
# A broadcast's staging buffer up to this size is kept for the next one: a new one of 16 MiB cost its page faults on
# every call (at P=2 the broadcast took 2.6x MPI_Bcast's time). Larger ones (a model's start-up broadcast) are not
# kept.
KEPT_STAGING_BYTES = 64 << 20


def _pieces(nbytes: int, piece: int) -> list[tuple[int, int]]:
    """(start, stop) of consecutive pieces of at most `piece` bytes covering nbytes (one empty piece for 0)."""
    return [(start, min(start + piece, nbytes)) for start in range(0, max(nbytes, 1), piece)]


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
    """Stall-limited collectives over `comm`, waited for by `core` (a ddlfast._core.Core)."""

    def __init__(self, comm: MPI.Intracomm, core: Any) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._core = core
        self._staging = np.empty(0, np.uint8)  # bcast_into's, kept up to KEPT_STAGING_BYTES

    def complete(self, request: MPI.Request | list[MPI.Request], buffers: tuple, what: str,
                 waiting: tuple[int, int, int] | None = None) -> None:
        """waiting=(kind, peer, tag) marks a point-to-point wait for the stall census (Engine.wait_requests)."""
        requests = request if isinstance(request, list) else [request]
        try:
            self._core.wait_requests(requests, what, waiting)
        except BaseException:
            _ABANDONED.append((requests, buffers))
            raise

    def allgather_bytes(self, payload: bytes, what: str) -> list[bytes]:
        """Every rank's bytes (any length), in rank order."""
        mine = np.array([len(payload)], dtype=np.int64)
        lengths = np.zeros(self.size, dtype=np.int64)
        self.complete(self.comm.Iallgather(mine, lengths), (mine, lengths), what)
        send = np.frombuffer(payload, dtype=np.uint8).copy()
        gathered = np.empty(int(lengths.sum()), dtype=np.uint8)
        self.allgatherv_into(send, lengths, gathered, what)
        starts = np.concatenate(([0], np.cumsum(lengths))).tolist()
        return [gathered[starts[r]:starts[r + 1]].tobytes() for r in range(self.size)]

    def allgatherv_into(self, send: np.ndarray, lengths: np.ndarray, target: np.ndarray, what: str) -> None:
        """MPI_Allgatherv of bytes: rank r's `send` (uint8, lengths[r] bytes; every rank passes the same lengths)
        into `target` (uint8, sum(lengths) bytes, a buffer of ddlfast's own: MPI may write it directly, and
        complete() keeps it alive if the collective is abandoned after a stall) in rank order."""
        lengths = np.asarray(lengths, dtype=np.int64)
        # Round k carries bytes [k*share, (k+1)*share) of every rank's payload, so no count and no displacement
        # of a round passes MAX_MESSAGE_BYTES; one round when everything fits.
        share = max(1, MAX_MESSAGE_BYTES // self.size)
        rounds = max(1, -(-int(lengths.max(initial=0)) // share)) if lengths.sum() > MAX_MESSAGE_BYTES else 1
        if rounds == 1:
            share = max(int(lengths.max(initial=0)), 1)
        requests, received = [], []
        for k in range(rounds):
            counts = np.clip(lengths - k * share, 0, share)
            displacements = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
            gathered = target if rounds == 1 else np.empty(int(counts.sum()), dtype=np.uint8)
            piece = send[k * share:k * share + int(counts[self.rank])]
            requests.append(self.comm.Iallgatherv(piece, [gathered, (counts.tolist(), displacements.tolist()),
                                                          MPI.BYTE]))
            received.append((gathered, counts.tolist(), displacements.tolist()))
        self.complete(requests, (send, received), what)
        if rounds == 1:
            return  # one round wrote `target` in rank order itself
        starts = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        for k, (gathered, c, d) in enumerate(received):
            for r in range(self.size):
                if c[r]:
                    target[starts[r] + k * share:starts[r] + k * share + c[r]] = gathered[d[r]:d[r] + c[r]]

    def alltoallv_into(self, send: np.ndarray, send_counts: np.ndarray, target: np.ndarray,
                       receive_counts: np.ndarray, pair_bytes: np.ndarray, what: str) -> None:
        """MPI_Alltoallv of bytes: `send` holds this rank's blocks for ranks 0..P-1 back to back (send_counts
        bytes each), `target` (a buffer of ddlfast's own: MPI may write it directly) receives the blocks from ranks
        0..P-1 back to back (receive_counts bytes each).
        `pair_bytes[s, d]` (the same matrix on every rank) sizes every block, so all ranks cut the exchange into
        the same rounds of at most MAX_MESSAGE_BYTES per count and displacement."""
        share = max(1, MAX_MESSAGE_BYTES // self.size)
        largest = int(pair_bytes.max(initial=0))
        heaviest = int(max(pair_bytes.sum(axis=1).max(initial=0), pair_bytes.sum(axis=0).max(initial=0)))
        rounds = max(1, -(-largest // share)) if heaviest > MAX_MESSAGE_BYTES else 1
        if rounds == 1:
            share = max(largest, 1)
        send_starts = np.concatenate(([0], np.cumsum(send_counts)[:-1])).astype(np.int64)
        receive_starts = np.concatenate(([0], np.cumsum(receive_counts)[:-1])).astype(np.int64)
        requests, pieces = [], []
        for k in range(rounds):
            out_counts = np.clip(np.asarray(send_counts, np.int64) - k * share, 0, share)
            in_counts = np.clip(np.asarray(receive_counts, np.int64) - k * share, 0, share)
            if rounds == 1:
                outgoing = send
            else:
                outgoing = np.concatenate([send[send_starts[d] + k * share:send_starts[d] + k * share + out_counts[d]]
                                           for d in range(self.size)])
            # One round: straight into `target` (the caller's staging buffer, never a user's array: kept alive by
            # complete() if the exchange is abandoned); several: a piece buffer per round.
            incoming = target if rounds == 1 else np.empty(int(in_counts.sum()), dtype=np.uint8)
            out_offsets = np.concatenate(([0], np.cumsum(out_counts)[:-1])).astype(np.int64)
            in_offsets = np.concatenate(([0], np.cumsum(in_counts)[:-1])).astype(np.int64)
            requests.append(self.comm.Ialltoallv([outgoing, (out_counts.tolist(), out_offsets.tolist()), MPI.BYTE],
                                                 [incoming, (in_counts.tolist(), in_offsets.tolist()), MPI.BYTE]))
            pieces.append((outgoing, incoming, in_counts, in_offsets))
        self.complete(requests, (send, pieces), what)
        if rounds == 1:
            return
        for k, (_, incoming, in_counts, in_offsets) in enumerate(pieces):
            for s in range(self.size):
                n = int(in_counts[s])
                if n:
                    start = receive_starts[s] + k * share
                    target[start:start + n] = incoming[in_offsets[s]:in_offsets[s] + n]

    def allgather_values(self, value: object, what: str) -> list:
        """Every rank's plain value (JSON: str, int, float, bool, None, lists, str-keyed dicts), in rank order.

        JSON, never pickle: what a peer sends is read as data and cannot run code here (docs/trust.md). Tuples
        come back as lists; a peer's bytes that are not JSON come back as an InvalidValue naming the rank."""
        payloads = self.allgather_bytes(encode_value(value), what)
        return [decode_value(payload, peer) for peer, payload in enumerate(payloads)]

    def bcast_into(self, target: np.ndarray, root: int, what: str) -> None:
        """Overwrite `target` (C-contiguous, writable) with root's bytes, in pieces of MAX_MESSAGE_BYTES.

        Root sends straight from `target` (MPI only reads it; abandoned after a stall, the array is kept alive in
        _ABANDONED). The others receive into a staging buffer, so a broadcast abandoned after a stall can never
        write into the caller's array later; one copy, not two."""
        flat = target.reshape(-1).view(np.uint8)
        buffer = flat if self.rank == root else self._staging_of(target.nbytes)
        requests = [self.comm.Ibcast([buffer[start:stop], MPI.BYTE], root=root)
                    for start, stop in _pieces(buffer.nbytes, MAX_MESSAGE_BYTES)]
        self.complete(requests, (target if self.rank == root else buffer,), what)
        if self.rank != root:
            flat[...] = buffer

    def _staging_of(self, nbytes: int) -> np.ndarray:
        """A staging buffer of nbytes. The kept one is reused only while this context works: a broadcast abandoned
        after a stall (complete() keeps its buffer alive for MPI) broke the context, so no later call writes it."""
        if nbytes > KEPT_STAGING_BYTES:
            return np.empty(nbytes, np.uint8)
        if self._staging.nbytes < nbytes:
            self._staging = np.empty(nbytes, np.uint8)
        return self._staging[:nbytes]

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
        share = max(1, MAX_MESSAGE_BYTES // self.size)
        if send.nbytes <= share:
            flat = result.reshape(-1).view(np.uint8)
            self.complete(self.comm.Iallgather([send.reshape(-1).view(np.uint8), MPI.BYTE], [flat, MPI.BYTE]),
                           (send, result), what)
            return result
        # In pieces: round k gathers bytes [start, stop) of every rank's array.
        mine = send.reshape(-1).view(np.uint8)
        by_rank = result.reshape(self.size, -1).view(np.uint8)
        rounds = [(start, stop, np.empty((self.size, stop - start), dtype=np.uint8))
                  for start, stop in _pieces(send.nbytes, share)]
        requests = [self.comm.Iallgather([mine[start:stop], MPI.BYTE], [pieces, MPI.BYTE])
                    for start, stop, pieces in rounds]
        self.complete(requests, (send, rounds), what)
        for start, stop, pieces in rounds:
            by_rank[:, start:stop] = pieces
        return result

    def barrier(self, what: str) -> None:
        self.complete(self.comm.Ibarrier(), (), what)
