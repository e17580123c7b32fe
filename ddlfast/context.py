"""The Python-side context: one per communicator, owning the compiled core
context (private duplicate communicator, engines), the persistent fused
buffers and the cache of agreed layouts. No hidden state beyond the default
context for COMM_WORLD, created on first use."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from ddlfast import _core
from ddlfast.bucketing import assign_buckets
from ddlfast.buffers import HostBuffer, host_buffer
from ddlfast.config import Settings, load_settings, parse_dims
from ddlfast.dtypes import DTYPE_CODES
from ddlfast.errors import DdlfastError

OPS = {"sum": 0, "average": 1}
# dtypes whose NumPy arrays export a typed buffer (the fast single-array path).
_FAST_DTYPES = {np.dtype(name): code for name, code in DTYPE_CODES.items() if name != "bfloat16"}


class Context:
    """Communication state for one MPI intracommunicator (default COMM_WORLD)."""

    def __init__(self, comm: MPI.Intracomm | None = None) -> None:
        comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(comm, MPI.Comm):
            raise DdlfastError(f"comm must be an mpi4py communicator, not {type(comm).__name__}")
        self._core = _core.CoreContext(comm)
        self._control = comm.Dup()  # small agreement messages, apart from the data path
        self._fused: dict[str, np.ndarray] = {}
        self._agreed: set[tuple] = set()
        self._dims_cache: dict[tuple, tuple[int, ...]] = {}
        self._lock = threading.Lock()
        self._closed = False

    @property
    def rank(self) -> int:
        return self._core.rank

    @property
    def size(self) -> int:
        return self._core.size

    def close(self) -> None:
        """Free the private communicators; the context cannot be used afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._core.close()
            if not MPI.Is_finalized():
                self._control.Free()
            self._fused.clear()

    # -- helpers -----------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise DdlfastError("this ddlfast context is closed")

    def _resolve_dims(self, dims: object, settings: Settings) -> tuple[int, ...]:
        try:
            return self._dims_cache[(dims, settings.ring_dims)]
        except (KeyError, TypeError):  # TypeError: unhashable dims such as a list
            pass
        resolved = self._resolve_dims_uncached(dims, settings)
        try:
            self._dims_cache[(dims, settings.ring_dims)] = resolved
        except TypeError:
            pass
        return resolved

    def _resolve_dims_uncached(self, dims: object, settings: Settings) -> tuple[int, ...]:
        chosen = settings.ring_dims if dims is None else parse_dims(dims)
        if chosen in ("flat", "auto"):  # auto == flat until topology detection lands
            return (self.size,)
        product = int(np.prod(chosen))
        if product != self.size:
            shape = "x".join(map(str, chosen))
            raise DdlfastError(f"ring dims {shape} multiply to {product} but the communicator has {self.size} ranks")
        return chosen

    def _fused_buffer(self, dtype: np.dtype, count: int) -> np.ndarray:
        current = self._fused.get(dtype.name)
        if current is None or current.size < count:
            current = np.empty(max(count, 1), dtype=dtype)
            self._fused[dtype.name] = current
        return current[:count]

    def _agree(self, buffers: Sequence[HostBuffer], op: str, dims: tuple[int, ...]) -> None:
        """Verify once per layout that every rank passed the same arrays, op and dims.

        A mismatch would otherwise hang the ring or corrupt results; this way
        every rank raises the same error naming who passed what.
        """
        layout = (op, dims, tuple((b.array.dtype, b.array.shape) for b in buffers))
        if layout in self._agreed:
            return
        digest = hashlib.blake2b(repr(layout).encode(), digest_size=16).digest()
        digests = self._control.allgather(digest)
        if all(d == digest for d in digests):
            if len(self._agreed) >= 4096:  # bounded: layouts that never repeat must not grow memory
                self._agreed.clear()
            self._agreed.add(layout)
            return
        descriptions = self._control.allgather(_describe_layout(buffers, op, dims))
        raise DdlfastError(_disagreement_message(descriptions))

    # -- collectives ---------------------------------------------------------------------------------------------

    def allreduce(self, array: np.ndarray, *, op: str = "sum", dims: object = None) -> np.ndarray:
        """One array: the latency-sensitive path, with the per-call Python work kept to a minimum."""
        code = _FAST_DTYPES.get(array.dtype) if type(array) is np.ndarray else None
        if code is None or op not in OPS or array.dtype.byteorder == ">":
            return self.fused_allreduce([array], op=op, dims=dims)[0]  # general path, full error messages
        self._check_open()
        settings = load_settings()
        ring_dims = self._resolve_dims(dims, settings)
        layout = (op, ring_dims, ((array.dtype, array.shape),))
        with self._lock:
            self._check_open()
            if layout not in self._agreed:
                self._agree([host_buffer(array, f"array 0 on rank {self.rank}")], op, ring_dims)
            self._core.set_timeout(settings.timeout_s)
            try:
                self._core.allreduce_array(array, array.size, code, OPS[op], ring_dims, settings.chunk_bytes,
                                           settings.receives_in_flight, settings.small_bytes)
            except BufferError:
                host_buffer(array, f"array 0 on rank {self.rank}")  # raises the precise DdlfastError
                raise
        return array

    def fused_allreduce(self, arrays: Sequence[np.ndarray], *, op: str = "sum", dims: object = None) -> list:
        self._check_open()
        if op not in OPS:
            raise DdlfastError(f"op={op!r} is not one of {', '.join(OPS)}")
        if isinstance(arrays, np.ndarray) or not isinstance(arrays, Sequence):
            raise DdlfastError("fused_allreduce takes a list of arrays; use ddlfast.allreduce for one array")
        if len(arrays) == 0:
            raise DdlfastError("fused_allreduce got an empty list of arrays")
        settings = load_settings()
        ring_dims = self._resolve_dims(dims, settings)
        buffers = [host_buffer(array, f"array {i} on rank {self.rank}") for i, array in enumerate(arrays)]
        with self._lock:
            self._check_open()
            self._core.set_timeout(settings.timeout_s)
            self._agree(buffers, op, ring_dims)
            if len(buffers) == 1:
                self._reduce_bucket(buffers, OPS[op], ring_dims, settings)
                return list(arrays)
            buckets = assign_buckets(
                [b.array.dtype for b in buffers], [b.nbytes for b in buffers],
                settings.bucket_bytes, settings.first_bucket_bytes,
            )
            for bucket in buckets:
                self._reduce_bucket([buffers[i] for i in bucket.indices], OPS[op], ring_dims, settings)
        return list(arrays)

    def _reduce_bucket(self, members: list[HostBuffer], op: int, dims: tuple[int, ...], settings: Settings) -> None:
        if len(members) == 1:  # one array: reduce it where it lies, no packing
            target = members[0]
            self._core.allreduce(target.pointer, target.count, target.dtype_code, op, dims,
                                 settings.chunk_bytes, settings.receives_in_flight, settings.small_bytes)
            return
        count = sum(b.count for b in members)
        fused = self._fused_buffer(members[0].array.dtype, count)
        pointer = fused.__array_interface__["data"][0]
        pointers = [b.pointer for b in members]
        sizes = [b.nbytes for b in members]
        _core.pack_arrays(pointer, pointers, sizes)
        self._core.allreduce(pointer, count, members[0].dtype_code, op, dims,
                             settings.chunk_bytes, settings.receives_in_flight, settings.small_bytes)
        _core.unpack_arrays(pointer, pointers, sizes)


def _describe_layout(buffers: Sequence[HostBuffer], op: str, dims: tuple[int, ...]) -> dict:
    return {"op": op, "dims": dims, "arrays": [(b.array.dtype.name, tuple(b.array.shape)) for b in buffers]}


def _disagreement_message(descriptions: list[dict]) -> str:
    """Name the first thing the ranks disagree on, and which ranks passed what."""

    def groups(key_of) -> str:
        seen: dict[str, list[int]] = {}
        for rank, description in enumerate(descriptions):
            seen.setdefault(key_of(description), []).append(rank)
        parts = [f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))} passed {k}" for k, r in seen.items()]
        return "; ".join(parts)

    for field in ("op", "dims"):
        if len({repr(d[field]) for d in descriptions}) > 1:
            return f"ranks disagree on {field}: " + groups(lambda d, f=field: repr(d[f]))
    counts = {len(d["arrays"]) for d in descriptions}
    if len(counts) > 1:
        return "ranks disagree on the number of arrays: " + groups(lambda d: f"{len(d['arrays'])} arrays")
    for index in range(len(descriptions[0]["arrays"])):
        specs = {d["arrays"][index] for d in descriptions}
        if len(specs) > 1:
            return f"ranks disagree on array {index}: " + groups(
                lambda d, i=index: "{}[{}]".format(d["arrays"][i][0], ",".join(map(str, d["arrays"][i][1])))
            )
    return "ranks disagree on the collective's arguments"
