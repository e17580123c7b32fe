"""All-to-all and allgather with per-rank first dimensions (allgatherv): the collectives whose block sizes differ
per rank, so no rank can know them from its own arguments (MPI_Alltoallv, MPI_Allgatherv; Horovod's alltoall
and allgather).

Like reduce_scatter and allgather (shards.py), a call is validated on the caller's thread (bad input raises where
it was passed, and joins the agreement as an error on every rank), then passes the per-call agreement on what
every rank must share: the kind, and per array its dtype and its shape after the first dimension. The block sizes
are then exchanged (one small allgather of every rank's counts, so every rank knows the whole matrix and cuts the
data into the same rounds), and the data moves in one stall-limited MPI_Ialltoallv / MPI_Iallgatherv of bytes per
round (Control.alltoallv_into / allgatherv_into). A fused call packs its arrays' blocks per peer, so it is one
exchange whatever the number of arrays.

Host arrays: NumPy and torch CPU tensors (through their NumPy view); any fixed-size dtype (the copy is of bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ddlfast.buffers.device import any_device_array
from ddlfast.buffers.host import host_view
from ddlfast.engine.shards import _like
from ddlfast.engine.state import EngineState
from ddlfast.errors import DdlfastConsistentError, DdlfastError

ALLTOALL = "alltoall"
ALLGATHERV = "allgatherv"


class ExchangeRequest(NamedTuple):
    """A validated alltoall or allgatherv, ready to run on any thread."""

    kind: str
    arrays: list[np.ndarray]  # C-contiguous host views of the inputs
    originals: list  # what the caller passed (results come back as the same kind of array)
    splits: list[tuple[int, ...]]  # alltoall: per array, rows to each rank; allgatherv: per array, (rows,)
    expected: list[tuple[int, ...] | None]  # alltoall: per array, the rows the caller expects from each rank
    outs: list[np.ndarray | None]  # host views of the caller's out= arrays
    out_originals: list  # the out= arrays as the caller passed them
    single: bool
    layout: tuple


def _rows(array: np.ndarray) -> int:
    return int(array.shape[0]) if array.ndim else 1


def _row_bytes(array: np.ndarray) -> int:
    return int(np.prod(array.shape[1:], dtype=np.int64)) * array.itemsize if array.ndim else array.itemsize


def _host_array(array: object, where: str) -> np.ndarray:
    if any_device_array([array]):
        raise DdlfastError(f"{where} is a GPU array: alltoall and allgatherv take host arrays (NumPy, torch CPU)")
    view = host_view(array, where)
    if not isinstance(view, np.ndarray) or isinstance(view, np.ma.MaskedArray):
        raise DdlfastError(f"{where} is a {type(array).__module__}.{type(array).__qualname__}, not a NumPy array "
                           "or torch CPU tensor")
    if view.dtype.hasobject or view.itemsize == 0:
        raise DdlfastError(f"{where} has dtype {view.dtype}; only fixed-size elements can be exchanged")
    if view.ndim == 0:
        raise DdlfastError(f"{where} is 0-dimensional; the exchange splits and concatenates along the first "
                           "dimension")
    return np.ascontiguousarray(view)


def _split_rows(splits: object, rows: int, world: int, where: str, what: str = "splits") -> tuple[int, ...]:
    """None: equal blocks; else one non-negative row count per rank, summing to the first dimension."""
    if splits is None:
        if rows % world:
            raise DdlfastError(f"{where} has {rows} rows, not a multiple of the {world} ranks; pass splits= for "
                               "uneven blocks")
        return (rows // world,) * world
    torch_values = getattr(splits, "tolist", None)
    values = torch_values() if callable(torch_values) and not isinstance(splits, list | tuple) else splits
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise DdlfastError(f"{what}={splits!r} for {where} is not a sequence of {world} integers")
    checked = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
            raise DdlfastError(f"{what}={list(values)!r} for {where} holds {value!r}, not a row count >= 0")
        checked.append(int(value))
    if len(checked) != world:
        raise DdlfastError(f"{what}={checked!r} for {where} gives {len(checked)} blocks for {world} ranks")
    if what == "splits" and sum(checked) != rows:
        raise DdlfastError(f"splits={checked!r} for {where} sum to {sum(checked)}, but the array has {rows} rows")
    return tuple(checked)


def _per_array(value: object, n: int, name: str, single: bool, rank: int) -> list:
    if value is None:
        return [None] * n
    if single:
        return [value]
    if not isinstance(value, list | tuple) or len(value) != n:
        raise DdlfastError(f"{name}= of a fused call on rank {rank} needs one entry per array ({n})")
    return list(value)


def prepare(state: EngineState, kind: str, arrays: object, splits: object, expected: object, out: object,
            single: bool) -> ExchangeRequest:
    """Validate a call on the caller's thread, so bad input raises where it was passed."""
    rank, world = state.rank, state.size
    name = kind if single else f"fused_{kind}"
    if single:
        arrays = [arrays]
    elif isinstance(arrays, np.ndarray) or not isinstance(arrays, Sequence) or not arrays:
        raise DdlfastError(f"{name} on rank {rank} takes a non-empty list of arrays")
    where = [f"array {i} of {name} on rank {rank}" for i in range(len(arrays))]
    views = [_host_array(a, w) for a, w in zip(arrays, where, strict=True)]
    if kind == ALLTOALL:
        chosen = [_split_rows(s, _rows(v), world, w)
                  for s, v, w in zip(_per_array(splits, len(views), "splits", single, rank), views, where,
                                     strict=True)]
        wanted = [None if e is None else _split_rows(e, 0, world, w, "receive_splits")
                  for e, w in zip(_per_array(expected, len(views), "receive_splits", single, rank), where,
                                  strict=True)]
    else:
        if splits is not None or expected is not None:
            raise DdlfastError(f"{name} on rank {rank} takes no splits: every rank gives all its rows")
        chosen, wanted = [(_rows(v),) for v in views], [None] * len(views)
    outs: list[np.ndarray | None] = []
    out_originals = _per_array(out, len(views), "out", single, rank)
    for i, o in enumerate(out_originals):
        if o is None:
            outs.append(None)
            continue
        target = host_view(o, f"out {i} of {name} on rank {rank}")
        if (not isinstance(target, np.ndarray) or target.dtype != views[i].dtype or not target.flags.c_contiguous
                or not target.flags.writeable):
            raise DdlfastError(f"out {i} of {name} on rank {rank} must be a C-contiguous writable array of "
                               f"{views[i].dtype}")
        expected_rows = wanted[i]
        if expected_rows is None:  # the result's size is known before the exchange only from the receivers' splits
            raise DdlfastError(f"out {i} of {name} on rank {rank} needs receive_splits= (the rows expected from "
                               "each rank), which size it")
        if target.nbytes != sum(expected_rows) * _row_bytes(views[i]):
            raise DdlfastError(f"out {i} of {name} on rank {rank} has {target.nbytes} bytes; receive_splits="
                               f"{list(expected_rows)} make {sum(expected_rows) * _row_bytes(views[i])}")
        outs.append(target)
    # What every rank must share: per array the dtype and the shape after the first dimension; and whether the
    # receivers name their block sizes (then a block whose sender and receiver disagree is an error everywhere).
    layout = (kind, tuple((v.dtype.str, v.shape[1:]) for v in views), tuple(w is not None for w in wanted))
    return ExchangeRequest(kind, views, list(arrays), chosen, wanted, outs, out_originals, single, layout)


def execute(state: EngineState, request: ExchangeRequest) -> Any:
    """The agreement, then the exchange; returns what the call returns."""
    return state.agreed(request.layout, lambda: _run(state, request))


def _run(state: EngineState, request: ExchangeRequest) -> Any:
    control, rank, world = state.control, state.rank, state.size
    kind, arrays = request.kind, request.arrays
    what = f"the block sizes of {kind}"
    # Every rank's rows: (ranks, arrays, destinations) for alltoall, (ranks, arrays, 1) for allgatherv.
    rows = control.allgather_array(np.array(request.splits, dtype=np.int64), what)
    row_bytes = np.array([_row_bytes(a) for a in arrays], dtype=np.int64)
    if kind == ALLTOALL:
        _check_expected(state, request, rows)
        received = rows[:, :, rank]  # (sources, arrays): the rows each source sends here
        pair_bytes = np.einsum("sad,a->sd", rows, row_bytes)  # bytes rank s sends rank d
        send = _pack_by_destination(arrays, request.splits, row_bytes, world)
        target = np.empty(int(pair_bytes[:, rank].sum()), dtype=np.uint8)
        control.alltoallv_into(send, pair_bytes[rank], target, pair_bytes[:, rank], pair_bytes, kind)
    else:
        received = rows[:, :, 0]
        lengths = received @ row_bytes
        send = np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays]) if len(arrays) > 1 else \
            arrays[0].reshape(-1).view(np.uint8)
        target = np.empty(int(lengths.sum()), dtype=np.uint8)
        control.allgatherv_into(send, lengths, target, kind)
    results = _unpack_by_source(request, target, received, row_bytes, state.rank)
    splits = [received[:, i].tolist() for i in range(len(arrays))]
    if kind == ALLGATHERV:
        return results[0] if request.single else results
    return (results[0], splits[0]) if request.single else (results, splits)


def _check_expected(state: EngineState, request: ExchangeRequest, rows: np.ndarray) -> None:
    """Receivers that named their block sizes: every rank checks its own, then all learn every mismatch."""
    if not any(w is not None for w in request.expected):
        return
    rank = state.rank
    wrong = [(s, i, int(rows[s, i, rank]), e[s]) for i, e in enumerate(request.expected) if e is not None
             for s in range(state.size) if rows[s, i, rank] != e[s]]
    everyone = [(r, *w) for r, found in enumerate(state.control.allgather_values(wrong, "the block checks of "
                                                                                  "alltoall")) for w in found]
    if everyone:
        pairs = "; ".join(f"rank {s} sends {n} rows of array {i} to rank {r}, which expects {e}"
                          for r, s, i, n, e in everyone[:6])
        raise DdlfastConsistentError(f"alltoall: block sizes disagree ({pairs})")


def _pack_by_destination(arrays: list[np.ndarray], splits: list[tuple[int, ...]], row_bytes: np.ndarray,
                         world: int) -> np.ndarray:
    """This rank's send buffer: for each destination, its block of every array, back to back."""
    if len(arrays) == 1:
        return arrays[0].reshape(-1).view(np.uint8)  # one array: its blocks already are in destination order
    flats = [a.reshape(-1).view(np.uint8) for a in arrays]
    starts = [np.concatenate(([0], np.cumsum(s))) * rb for s, rb in zip(splits, row_bytes, strict=True)]
    return np.concatenate([flats[i][starts[i][d]:starts[i][d + 1]] for d in range(world) for i in range(len(arrays))])


def _unpack_by_source(request: ExchangeRequest, target: np.ndarray, received: np.ndarray, row_bytes: np.ndarray,
                      rank: int) -> list:
    """The received bytes (per source, its block of every array) into one result per array."""
    results = []
    shares = received * row_bytes  # (sources, arrays) bytes
    offsets = np.concatenate(([0], np.cumsum(shares.reshape(-1))[:-1])).reshape(shares.shape)
    for i, array in enumerate(request.arrays):
        shape = (int(received[:, i].sum()), *array.shape[1:])
        out = request.outs[i]
        if out is not None:
            flat = out.reshape(-1).view(np.uint8)  # its size was checked against receive_splits in prepare()
        elif len(request.arrays) == 1:  # the received bytes are the result: no copy
            results.append(_like(target.view(array.dtype).reshape(shape), request.originals[i]))
            continue
        else:
            result = np.empty(shape, array.dtype)
            flat = result.reshape(-1).view(np.uint8)
        if len(request.arrays) == 1:
            flat[...] = target
        else:
            position = 0
            for s in range(received.shape[0]):
                n = int(shares[s, i])
                flat[position:position + n] = target[offsets[s, i]:offsets[s, i] + n]
                position += n
        results.append(request.out_originals[i] if out is not None else _like(result, request.originals[i]))
    return results
