"""Cross-rank agreement on every collective's arguments.

Every collective a context runs — allreduce, fused allreduce, broadcast, the
context's own creation — first passes one agreement: the ranks compare a
64-bit fingerprint of (the call's sequence number on this context, its
layout). The layout is everything that decides which element meets which and
how big each message is: the kind of collective, arrays' dtypes and shapes in
order, op, ring dims, compression, broadcast root, and the engine settings that
size messages (chunk, small-message, bucket sizes). The comparison runs in the
compiled core (`MpiTransport::agree`, src/transport/agreement_exchange.cc): a
butterfly of point-to-point messages each headed by its sender's fingerprint
and mismatch flag, which connects every pair of ranks, so all ranks learn at
once whether every fingerprint was equal, before any ring message is posted: a
mismatch leaves nothing in flight and the context stays usable. Only on a
mismatch do the ranks exchange full descriptions (stall-limited), so every rank
raises the same DdlfastError naming who passed what. A rank whose input is bad
joins the agreement with its error instead of a layout, so the others learn of
it at once, not at a timeout.

The latency path costs no message for its check: an allreduce of at most
DDLFAST_SMALL_BYTES rides in the agreement's own messages (each rank combines
its partner's data only while no mismatch was seen, and the result lands only
when all agreed), and a single uncompressed bucket passes its fingerprint into
its one core call (`state.agreed_in_core`). Why not the ring's first message:
a mismatch found there leaves ring messages of the wrong size in flight (a
broken context on every rank). The layout digest is cached per layout; the
per-call cost is a dict lookup and, for ring-sized buffers, one butterfly of
48-byte messages.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ddlfast import _core, config
from ddlfast.errors import DdlfastConsistentError, DdlfastError, ranks_text

MAX_CACHED_DIGESTS = 4096
# name= of every collective: a str or an int (e.g. the training step), or None.
Name = str | int | None


def arrays_of(buffers: Sequence[Any]) -> tuple:
    """((dtype, shape), ...) of host buffers, the arrays part of a layout."""
    return tuple((b.array.dtype, b.array.shape) for b in buffers)


def allreduce_layout(op: str, dims: tuple[int, ...], arrays: tuple, codec: object, error_feedback: bool,
                     settings: Any) -> tuple:
    """Everything the ranks must agree on for an allreduce (host or GPU arrays)."""
    return ("allreduce", op, dims, arrays, codec, error_feedback,
            (settings.chunk_bytes, settings.small_bytes, settings.bucket_bytes, settings.first_bucket_bytes,
             settings.algorithm), settings.reproducible)


def creation_layout(settings: Any) -> tuple:
    """What every rank must share when a context is created: the engine settings and what drives the topology."""
    named = {
        "DDLFAST_BUCKET_BYTES": settings.bucket_bytes, "DDLFAST_FIRST_BUCKET_BYTES": settings.first_bucket_bytes,
        "DDLFAST_CHUNK_BYTES": settings.chunk_bytes, "DDLFAST_SMALL_BYTES": settings.small_bytes,
        "DDLFAST_RING_DIMS": settings.ring_dims, "DDLFAST_COMPRESSION": settings.compression,
        "DDLFAST_PROBE": config.probe_mode(), "DDLFAST_HOSTS_PER_GROUP": config.hosts_per_group(),
        "DDLFAST_CUDA_AWARE_MPI": config.cuda_aware_mpi(), "DDLFAST_GPU_RING_MIN_BYTES": config.gpu_ring_min_bytes(),
        "DDLFAST_HALVING_BYTES": config.halving_bytes(),
    }
    return ("context", tuple(named.items()))


class Agreement:
    """The per-call check of one context: `check(layout)` before every collective (see the module doc)."""

    def __init__(self, core: Any, control: Any, flight: Any = None, warn_stragglers: bool = False) -> None:
        self._core = core  # ddlfast._core.Core: agree() is the butterfly of headers, and counts them
        self._control = control  # ddlfast.engine.control.Control: descriptions on a mismatch
        self.flight = flight  # ddlfast.engine.flight.FlightRecorder, or None (DDLFAST_FLIGHT_RECORDS=0)
        self.warn_stragglers = warn_stragglers  # DDLFAST_STRAGGLER_WARN_S, on rank 0
        self._digests: dict[tuple, int] = {}  # the core counts collectives: its sequence is in every fingerprint
        self._layouts: dict[int, tuple] = {}  # digest -> layout, and fingerprint -> (layout, name) of named calls
        self._named: dict[int, tuple] = {}
        # The caller's name for the collective being agreed (name=, e.g. a training step), set by the Context
        # around one call; None for unnamed calls. It enters the fingerprint, so a rank that skipped a step of a
        # loop of same-layout calls is caught at its next named call.
        self.name: str | int | None = None

    def digest(self, layout: tuple) -> int:
        try:
            return self._digests[layout]
        except KeyError:
            pass
        digest = int.from_bytes(hashlib.blake2b(repr(layout).encode(), digest_size=8).digest(), "little")
        if len(self._digests) >= MAX_CACHED_DIGESTS:  # layouts that never repeat must not grow memory
            self._digests.clear()
            self._layouts.clear()
        self._digests[layout] = digest
        self._layouts[digest] = layout
        return digest

    def layout_of(self, fingerprint: int) -> tuple:
        """(layout, name) behind a fingerprint this rank agreed on ((None, None) once forgotten): the flight
        recorder's lookup, made only when it writes its file."""
        named = self._named.get(fingerprint)
        if named is not None:
            return named
        return self._layouts.get(fingerprint), None

    def known_layouts(self) -> Callable[[int], tuple]:
        """layout_of as of now, over copies of the caches: the flight recorder's writer thread looks fingerprints
        up while this rank goes on agreeing (which may clear the caches)."""
        named, layouts = dict(self._named), dict(self._layouts)
        return lambda fingerprint: named.get(fingerprint) or (layouts.get(fingerprint), None)

    def fingerprint(self, layout: tuple, digest: int | None = None, name: Name = None) -> int:
        """The 64 bits the ranks compare for a call: the layout's digest, mixed with the call's name."""
        if digest is None:
            digest = self.digest(layout)
        if name is None:
            return digest
        fingerprint = digest ^ name_digest(name)
        if self.flight is not None:
            if len(self._named) >= MAX_CACHED_DIGESTS:
                self._named.clear()
            self._named[fingerprint] = (layout, name)
        return fingerprint

    def check(self, layout: tuple, digest: int | None = None) -> None:
        """Collective: returns when every rank passed the same layout in the same collective; otherwise every
        rank raises the same DdlfastError naming who passed what."""
        flight = self.flight
        while True:
            if flight is None:
                agreed = self._core.agree(self.fingerprint(layout, digest, self.name))
            else:
                self._core.set_flight_site(flight.site())
                try:
                    agreed = self._core.agree(self.fingerprint(layout, digest, self.name))
                except BaseException as error:
                    flight.failed(error)
                    raise
            if self.warn_stragglers and self._core.straggler_warning_pending:
                warn_straggler(self._core)
            if agreed:
                return
            self.disagreed(layout, self.name)  # returned: ranks that joined take part now, so agree again

    def disagreed(self, layout: tuple, name: Name = None) -> None:
        """After an agreement that failed on every rank (here, or inside a core call that runs it itself, as
        the latency path does): exchange descriptions, raise the same error everywhere. The descriptions
        travel as JSON and are validated (`readable`): a peer's bytes are never unpickled here.

        Returns instead, on every rank alike, when the only difference is ranks inside ddlfast.join() and the
        collective is one they can take part in with zeros (join_problem): they then run it, and the caller
        runs its agreement (with its collective) again."""
        descriptions = self.exchange(layout, name)
        if any(d["kind"] == "join" for d in descriptions):
            problem = join_problem(descriptions)
            if problem is None:
                return
            error = DdlfastConsistentError(problem)
        else:
            error = DdlfastConsistentError(disagreement_message(descriptions))
        error.rank, error.size = self._core.rank, self._core.size  # the same on every rank: printed once
        if self.flight is not None:
            self.flight.failed(error, descriptions)
        raise error

    def exchange(self, layout: tuple, name: Name) -> list[dict]:
        """Every rank's description of the collective it is at, in rank order (after a failed agreement)."""
        mine = describe(layout, self._core.sequence, name)
        received = self._control.allgather_values(mine, "the description of every rank's collective")
        return [readable(d, r) for r, d in enumerate(received)]

    def refuse(self, error: DdlfastError) -> DdlfastError:
        """This rank cannot take part (its input is bad): take part in the agreement with the error, so every
        rank raises at once. Returns the error to raise on this rank."""
        try:
            self.check(("error", str(error)))
        except DdlfastError as disagreement:
            return disagreement
        return error  # every rank failed the same way: each raises its own error


class StragglerWarning(UserWarning):
    """DDLFAST_STRAGGLER_WARN_S: a rank held the others longer than that within the last 100 collectives."""


def warn_straggler(core: Any) -> None:
    """Rank 0's one warning per straggling rank (the core decides, ArrivalLog::take_warning)."""
    taken = core.take_straggler_warning()
    if taken is not None:
        rank, held = taken
        warnings.warn(f"ddlfast: rank {rank} held the other ranks {held:.3f} s within the last 100 collectives "
                      f"(DDLFAST_STRAGGLER_WARN_S); ddlfast.stragglers() has the details", StragglerWarning,
                      stacklevel=2)


def _dtype_name(dtype: object) -> str:
    """A NumPy dtype's name; GPU layouts carry their own text ("cuda float32")."""
    if isinstance(dtype, str) and dtype.startswith("cuda "):
        return dtype
    try:
        dtype = np.dtype(dtype)
        if dtype.names:  # a structured dtype names its fields (ddlfast.torch.broadcast_parameters: each tensor)
            return "{" + ", ".join(dtype.names) + "}"
        return dtype.name
    except TypeError:  # a name NumPy does not know (a torch dtype's, "bfloat16" without ml_dtypes)
        return str(dtype)


def _size_settings(sizes: tuple) -> dict:
    """The engine settings of an allreduce-like layout, by variable name."""
    names = ("DDLFAST_CHUNK_BYTES", "DDLFAST_SMALL_BYTES", "DDLFAST_BUCKET_BYTES", "DDLFAST_FIRST_BUCKET_BYTES",
             "DDLFAST_ALGORITHM")
    return dict(zip(names, sizes, strict=True))


_MASK64 = (1 << 64) - 1


def name_digest(name: str | int) -> int:
    """64 bits of a collective's name, the same on every rank (Python's own str hash differs per process). An int
    (a step count, the common case) is mixed arithmetically (_core.mix_name), a str through blake2b, kept: the
    names of a model's buckets come back every step."""
    if type(name) is str:
        digest = _STR_DIGESTS.get(name)
        if digest is None:
            if len(_STR_DIGESTS) >= MAX_CACHED_DIGESTS:
                _STR_DIGESTS.clear()
            digest = _STR_DIGESTS[name] = _blake2b_digest(name)
        return digest
    if type(name) is not int and not isinstance(name, str):
        name = int(name)  # a NumPy integer: the same digest as the Python int of that value
    if type(name) is int and 0 <= name <= _MASK64:
        return _core.mix_name(name)
    return _blake2b_digest(name)


_STR_DIGESTS: dict[str, int] = {}


def _blake2b_digest(name: str | int) -> int:
    return int.from_bytes(hashlib.blake2b(repr(name).encode(), digest_size=8, person=b"ddlfast-name").digest(),
                          "little")


def check_name(name: object, rank: int) -> None:
    """name= on a collective: None, a str or an int (e.g. a training step)."""
    if name is not None and (isinstance(name, bool) or not isinstance(name, str | int | np.integer)):
        raise DdlfastError(f"name={name!r} on rank {rank} must be a str or an int (e.g. the training step), "
                           f"not {type(name).__name__}")


def describe(layout: tuple, sequence: int, name: str | int | None = None) -> dict:
    """A layout as plain data (JSON) for the mismatch message."""
    kind, *fields = layout
    description: dict[str, Any] = {"sequence": sequence, "kind": kind}
    if name is not None:
        description["name"] = name if isinstance(name, str) else int(name)
    if kind == "allreduce":
        op, dims, arrays, codec, error_feedback, sizes, reproducible = fields
        description.update(op=op, dims=dims, arrays=[(_dtype_name(d), tuple(s)) for d, s in arrays],
                           compression=codec, error_feedback=error_feedback, settings=_size_settings(sizes),
                           reproducible=reproducible)
    elif kind in ("reduce_scatter", "allgather"):
        op, dims, arrays, counts, codec, sizes, reproducible = fields
        description.update(op=op, dims=dims, arrays=[(_dtype_name(d), tuple(s)) for d, s in arrays], counts=counts,
                           compression=codec, settings=_size_settings(sizes), reproducible=reproducible)
    elif kind == "broadcast":
        root, arrays = fields
        description.update(root=root, arrays=[(_dtype_name(d), tuple(s)) for d, s in arrays])
    elif kind == "error":
        description["error"] = fields[0]
    elif kind == "codec":
        name, payloads = fields
        description.update(codec=name, arrays=[(_dtype_name(d), tuple(s)) for d, s in payloads])
    elif kind == "context":
        description["settings"] = dict(fields[0])
    else:
        description["details"] = fields
    return description


# What a rank inside ddlfast.join() agrees on, round after round, until every rank has joined.
JOIN_LAYOUT = ("join",)


def join_problem(descriptions: list[dict]) -> str | None:
    """Some ranks are inside ddlfast.join(): None when the others' collective is one the joined ranks take part in
    with zeros (an allreduce of host arrays, sum or average, as in Horovod and DDP's Join), else the error every
    rank that is not inside join() raises."""
    joined = [r for r, d in enumerate(descriptions) if d["kind"] == "join"]
    others = [d for d in descriptions if d["kind"] != "join"]
    who = ranks_text(joined)
    if len({repr({k: v for k, v in d.items() if k != "sequence"}) for d in others}) > 1:
        return f"{disagreement_message(others)} (and {who} called join())"
    call = others[0]
    if call["kind"] == "error":
        return f"{disagreement_message(others)} (and {who} called join())"
    if call["kind"] != "allreduce":
        return (f"{call['kind']} cannot run while {who} called join(): a rank that joined takes part only in "
                "allreduce (sum or average), with zeros")
    if call["op"] not in ("sum", "average") or call.get("error_feedback"):
        return (f"allreduce with op={call['op']}{' and error feedback' if call.get('error_feedback') else ''} "
                f"cannot run while {who} called join(): a joined rank's zeros stand in only for sum and average")
    if any(dtype.startswith("cuda ") for dtype, _ in call["arrays"]):
        return f"an allreduce of GPU arrays cannot run while {who} called join() (host arrays only)"
    return None


def _tuples(value: object) -> object:
    """JSON's lists back into tuples (hashable, as describe() made them)."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "sequence": int, "kind": str, "name": (str, int), "op": str, "error": str, "root": int,
    "arrays": tuple, "counts": (tuple, type(None)), "settings": dict, "error_feedback": bool, "dims": tuple,
    "reproducible": bool,
}


def readable(received: object, rank: int) -> dict:
    """A peer's description, checked to be of describe()'s form (fields of the right types, arrays as
    (dtype text, shape)); anything else becomes an "invalid" description naming the rank."""
    value = _tuples(received)
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        fields_ok = all(isinstance(value[k], t) for k, t in _FIELD_TYPES.items() if k in value)
        arrays_ok = all(isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str) and isinstance(a[1], tuple)
                        and all(isinstance(n, int) for n in a[1]) for a in value.get("arrays", ()))
        if fields_ok and arrays_ok and "kind" in value and "sequence" in value:
            return value
    return {"kind": "invalid", "sequence": -1,
            "error": f"rank {rank} sent a description of its collective that is not ddlfast's ({received!r:.80})"}


def _by_rank(descriptions: list[dict], key_of: Callable[[dict], str]) -> str:
    seen: dict[str, list[int]] = {}
    for rank, description in enumerate(descriptions):
        seen.setdefault(key_of(description), []).append(rank)
    return "; ".join(f"{ranks_text(r)} passed {k}" for k, r in seen.items())


def _differs(descriptions: list[dict], field: str) -> bool:
    return len({repr(d.get(field)) for d in descriptions}) > 1


def _array_text(array: tuple) -> str:
    return "{}[{}]".format(array[0], ",".join(map(str, array[1])))


def disagreement_message(descriptions: list[dict]) -> str:
    """Name the first thing the ranks disagree on, and which ranks passed what."""
    invalid = [d["error"] for d in descriptions if d["kind"] == "invalid"]
    if invalid:
        return "; ".join(invalid)
    failed = [(rank, d["error"]) for rank, d in enumerate(descriptions) if d["kind"] == "error"]
    if failed:
        sequence = descriptions[failed[0][0]]["sequence"]
        creating = any(d["kind"] == "context" for d in descriptions)  # the others were creating their context
        what = "the ddlfast context could not be created" if creating else f"collective #{sequence} could not run"
        return f"{what}: " + "; ".join(f"rank {r}: {text}" for r, text in failed)
    if _differs(descriptions, "name"):
        return ("ranks passed different names for this collective (a rank skipped or added a call, or passed other "
                "arguments that the name carries): " +
                _by_rank(descriptions, lambda d: f"name={d.get('name')!r}"))
    if _differs(descriptions, "kind"):
        return "ranks called different collectives: " + _by_rank(descriptions, lambda d: d["kind"])
    if _differs(descriptions, "sequence"):
        return ("ranks are at different collectives on this context (a rank skipped or added a call): " +
                "; ".join(f"rank {r} is at collective #{d['sequence']}" for r, d in enumerate(descriptions)))
    for field in ("root", "op", "dims", "compression", "error_feedback", "codec", "counts", "reproducible"):
        if _differs(descriptions, field):
            return f"ranks disagree on {field}: " + _by_rank(descriptions, lambda d, f=field: repr(d.get(f)))
    if _differs(descriptions, "settings"):
        first = descriptions[0]["settings"]
        name = next(n for n in first if len({repr(d["settings"].get(n)) for d in descriptions}) > 1)
        return (f"ranks disagree on {name} (the ranks' settings must match): " +
                _by_rank(descriptions, lambda d: f"{name}={d['settings'][name]!r}"))
    if _differs(descriptions, "details"):
        return (f"ranks disagree on the arguments of {descriptions[0]['kind']}: " +
                _by_rank(descriptions, lambda d: repr(d["details"])))
    if len({len(d.get("arrays", ())) for d in descriptions}) > 1:
        return "ranks disagree on the number of arrays: " + _by_rank(
            descriptions, lambda d: f"{len(d['arrays'])} arrays")
    for index in range(len(descriptions[0].get("arrays", ()))):
        if len({d["arrays"][index] for d in descriptions}) > 1:
            return f"ranks disagree on array {index}: " + _by_rank(
                descriptions, lambda d, i=index: _array_text(d["arrays"][i]))
    return "ranks disagree on the collective's arguments"
