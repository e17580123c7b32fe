"""Elastic training: lose a rank, keep training (docs/elastic.md).

Under MPI's fault tolerance (Open MPI 5, `mpirun --with-ft ulfm`), a collective that loses ranks raises
`ddlfast.RanksLostError` on every survivor, and the context goes on with the survivors (ddlfast/ulfm.py). This
module is the training loop's side, shaped like Horovod Elastic:

    state = ddlfast.elastic.NumpyState(params=params, step=0)

    @ddlfast.elastic.run
    def train(state):
        while state.step < steps:
            ...; ddlfast.allreduce(grad); ...
            state.step += 1
            if state.step % 5 == 0:
                state.commit()

    train(state)

`run` syncs the state from rank 0 first; on RanksLostError it restores the last commit, syncs it from the
lowest surviving rank that has the newest commit, calls the membership callbacks, and calls the function again.
What the interrupted steps did since the last commit is lost (and redone by the survivors).
"""

from __future__ import annotations

import collections
import copy
import functools
import hashlib
import struct
import sys
import types
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from ddlfast import api, ulfm
from ddlfast.errors import DdlfastError, RanksLostError, ranks_text

MembershipCallback = Callable[[RanksLostError], None]


def comm() -> MPI.Intracomm:
    """The communicator of the default context: COMM_WORLD until ranks are lost, the survivors' afterwards."""
    return api.default_context().comm


class State:
    """What the training loop must get back after a loss: subclasses say how to snapshot, restore, fingerprint
    and broadcast it. `commit()` snapshots in memory (after a barrier, so no rank commits a step another rank
    never finished), `restore()` goes back to the last snapshot, `sync()` broadcasts it from the lowest rank that
    has the newest commit, after checking that the ranks' snapshots of the same commit are identical."""

    def __init__(self) -> None:
        ulfm.require("ddlfast.elastic")
        self.commits = 0  # how many commits this state has had (agreed by sync())
        self._callbacks: list[MembershipCallback] = []
        self._snapshot: Any = None

    # -- what a subclass provides ---------------------------------------------------------------------------------

    def save(self) -> Any:
        """A copy of the live state, kept in memory (never a view of it)."""
        raise NotImplementedError

    def load(self, snapshot: Any) -> None:
        """Make the live state equal to `snapshot` (which stays unchanged)."""
        raise NotImplementedError

    def fingerprint(self, snapshot: Any) -> str:
        """A digest of `snapshot`, equal on two ranks exactly when their snapshots are."""
        raise NotImplementedError

    def broadcast(self, root: int) -> None:
        """Copy the live state of rank `root` into every rank's live state (collective)."""
        raise NotImplementedError

    # -- the API ----------------------------------------------------------------------------------------------------

    def register_reset_callbacks(self, callbacks: list[MembershipCallback]) -> None:
        """Horovod's name for on_membership_change()."""
        for callback in callbacks:
            self.on_membership_change(callback)

    def on_membership_change(self, callback: MembershipCallback) -> None:
        """Call `callback(error)` on every survivor after a loss, once the state is restored and synced (e.g. to
        rescale the learning rate by error.size / error.old_size, or to reshard the data by ddlfast.rank())."""
        self._callbacks.append(callback)

    def commit(self) -> None:
        """Snapshot the state in memory: a barrier first (a loss there raises RanksLostError before this rank
        snapshots), then the copy."""
        api.barrier()
        self._snapshot = self.save()
        self.commits += 1

    def restore(self) -> None:
        """Go back to the last commit (or to the state as synced at the start, before any commit)."""
        if self._snapshot is None:
            raise DdlfastError("restore() before any commit or sync: nothing to go back to")
        self.load(self._snapshot)

    def sync(self) -> None:
        """Broadcast the state from the lowest rank holding the newest commit (rank 0 before any commit), then
        snapshot it. Refuses, on every rank, snapshots of the same commit that differ between ranks (a
        rank-dependent commit) instead of broadcasting one of them, and a state that has no canonical fingerprint
        (fingerprint_of) on any rank."""
        mine: tuple[int, str, str | None]  # commits, fingerprint, why there is none
        try:
            mine = (self.commits, self.fingerprint(self._snapshot) if self.commits and self._snapshot is not None
                    else "", None)
        except DdlfastError as error:  # told to every rank, which all raise it: none is left waiting here
            mine = (self.commits, "", str(error))
        everyone = api.allgather_object(mine)
        refused = [(rank, problem) for rank, (_, _, problem) in enumerate(everyone) if problem]
        if refused:
            raise DdlfastError(f"{refused[0][1]} (on {ranks_text([rank for rank, _ in refused])})")
        newest = max(commits for commits, _, _ in everyone)
        holders = [rank for rank, (commits, _, _) in enumerate(everyone) if commits == newest]
        digests = {everyone[rank][1] for rank in holders}
        if newest and len(digests) > 1:
            raise DdlfastError(
                f"ddlfast.elastic: the ranks' snapshots of commit {newest} differ (ranks {holders} hold it, with "
                f"{len(digests)} different fingerprints): commit() must be called where every rank's state is the "
                "same (a rank-dependent state cannot be synced by a broadcast)")
        if newest and self._snapshot is not None and self.commits == newest:
            self.load(self._snapshot)  # the live state may have moved on since
        self.broadcast(holders[0])
        self._snapshot = self.save()
        self.commits = newest

    def _lost(self, error: RanksLostError) -> None:
        for callback in self._callbacks:
            callback(error)


def run(function: Callable[..., Any] | None = None, *, regrow: bool = False) -> Any:
    """Wrap a training function `function(state, *args, **kwargs)`: sync the state first; on RanksLostError,
    restore the last commit, sync, call the membership callbacks and call the function again. A loss during the
    restore or the sync itself starts that over.

    `@run(regrow=True)`: after a loss, the survivors also start as many new processes as were lost, running this
    program again (MPI_Comm_spawn), so the world is back at the size it had when the wrapper was first called;
    the state reaches them through the sync. A replacement starts the program from the top: until it calls the
    wrapped function, the program must run no ddlfast collective (ddlfast.rank()/size() are fine)."""
    if function is None:
        return functools.partial(run, regrow=regrow)

    @functools.wraps(function)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        ulfm.require("ddlfast.elastic.run")
        if regrow and _process_group() is not None:
            raise DdlfastError("ddlfast.elastic.run(regrow=True) cannot bring a torch.distributed process group "
                               "back to its size (the replacements have none): use regrow=False with torch.distributed")
        full_size = api.size()
        lost: RanksLostError | None = None
        while True:
            context = api.default_context()
            generation = context.generation
            try:
                if lost is not None:
                    state.restore()
                    if regrow and context.size < full_size:
                        context.grow(ulfm.spawn_replacements(context.comm, full_size - context.size))
                        generation = context.generation
                state.sync()
                if lost is not None:
                    _rebuild_process_group()
                    state._lost(lost)
                    lost = None
                return function(state, *args, **kwargs)
            except Exception as caught:
                error = _loss_behind(caught, generation)
                if error is None:
                    raise
                if lost is not None:  # a second loss before the first was handled: report both
                    error = RanksLostError(f"{error} (after an earlier loss of ranks {lost.lost})",
                                           lost.lost + error.lost, error.size, error.rank, lost.old_size)
                lost = error

    return wrapper


def _loss_behind(error: Exception, generation: int) -> RanksLostError | None:
    """The RanksLostError that `error` is, or stands for: torch raises a collective's failure inside backward()
    (DDP's gradient allreduce on the ddlfast backend) as its own RuntimeError, so any exception raised after
    the default context lost ranks since `generation` is taken for that loss. None: not a loss."""
    if isinstance(error, RanksLostError):
        return error
    context = api.default_context()
    return context.last_loss if context.generation != generation else None


def _process_group() -> Any:
    """ddlfast's torch.distributed backend module where torch.distributed is initialized, else None."""
    backend = sys.modules.get("ddlfast.integrations.torch_backend")
    return backend if backend is not None and backend.dist.is_initialized() else None


def _rebuild_process_group() -> None:
    """torch.distributed's default "ddlfast" process group, where there is one, made anew on the survivors."""
    backend = _process_group()
    if backend is not None:
        backend.rebuild_process_group()


class NumpyState(State):
    """NumPy arrays (updated in place by the training loop) and plain scalars, as attributes:
    `NumpyState(params=w, step=0)` then `state.params`, `state.step`."""

    def __init__(self, **values: Any) -> None:
        super().__init__()
        self._arrays = [name for name, value in values.items() if isinstance(value, np.ndarray)]
        self._scalars = [name for name in values if name not in self._arrays]
        for name, value in values.items():
            setattr(self, name, value)

    def save(self) -> Any:
        return ({name: getattr(self, name).copy() for name in self._arrays},
                {name: copy.deepcopy(getattr(self, name)) for name in self._scalars})

    def load(self, snapshot: Any) -> None:
        arrays, scalars = snapshot
        for name, saved in arrays.items():
            np.copyto(getattr(self, name), saved)  # in place: the training loop keeps its references
        for name, saved in scalars.items():
            setattr(self, name, copy.deepcopy(saved))

    def fingerprint(self, snapshot: Any) -> str:
        arrays, scalars = snapshot
        return fingerprint_of({**arrays, **scalars})

    def broadcast(self, root: int) -> None:
        for name in self._arrays:
            api.broadcast(getattr(self, name), root=root)
        scalars: dict[str, Any] = api.broadcast_object(  # type: ignore[assignment]
            {name: getattr(self, name) for name in self._scalars}, root=root)
        for name, value in scalars.items():
            setattr(self, name, value)


class TorchState(State):
    """A torch model and optimizer (CPU tensors) and plain scalars: `TorchState(model=m, optimizer=o, epoch=0)`."""

    def __init__(self, model: Any, optimizer: Any = None, **scalars: Any) -> None:
        super().__init__()
        self.model, self.optimizer = model, optimizer
        self._scalars = list(scalars)
        for name, value in scalars.items():
            setattr(self, name, value)

    def save(self) -> Any:
        # Into the last snapshot's tensors where they fit: a new 100 MB tensor costs torch its page faults on
        # every commit (0.89 s for a 25 M-parameter model and its momentum; copying into the old ones: docs).
        previous_model, previous_optimizer, _ = self._snapshot if self._snapshot is not None else (None, None, None)
        try:
            model = _copied(self.model.state_dict(), previous_model)
            optimizer = (_copied(self.optimizer.state_dict(), previous_optimizer) if self.optimizer is not None
                         else None)
            scalars = {name: copy.deepcopy(getattr(self, name)) for name in self._scalars}
        except BaseException:
            self._snapshot = None  # partly overwritten: restore() must refuse rather than restore a mixture
            raise
        return model, optimizer, scalars

    def load(self, snapshot: Any) -> None:
        model, optimizer, scalars = snapshot
        self.model.load_state_dict(model)
        if optimizer is not None:
            self.optimizer.load_state_dict(copy.deepcopy(optimizer))
        for name, saved in scalars.items():
            setattr(self, name, copy.deepcopy(saved))

    def fingerprint(self, snapshot: Any) -> str:
        model, optimizer, scalars = snapshot
        return fingerprint_of({"model": model, "optimizer": optimizer, **scalars})

    def broadcast(self, root: int) -> None:
        for tensor in self.model.state_dict().values():
            api.broadcast(tensor.detach().numpy(), root=root)  # the state dict's tensors share the parameters
        optimizer = self.optimizer.state_dict() if self.optimizer is not None else None
        scalars = {name: getattr(self, name) for name in self._scalars}
        optimizer, scalars = api.broadcast_object((optimizer, scalars), root=root)  # type: ignore[misc]
        if self.optimizer is not None:
            self.optimizer.load_state_dict(optimizer)
        for name, value in scalars.items():
            setattr(self, name, value)


def _copied(value: Any, previous: Any) -> Any:
    """A deep copy of `value` (a state dict: dicts, lists, tensors, plain values) that reuses the tensors of
    `previous`, an earlier copy, where shape, dtype and device match (copied into in place)."""
    import torch  # only TorchState gets here

    if isinstance(value, torch.Tensor):
        if (isinstance(previous, torch.Tensor) and previous.shape == value.shape and previous.dtype == value.dtype
                and previous.device == value.device and previous.data_ptr() != value.data_ptr()):
            return previous.copy_(value.detach())
        return value.detach().clone()
    if isinstance(value, dict):
        earlier = previous if isinstance(previous, dict) else {}
        copied = copy.copy(value)  # its own kind of dict (OrderedDict, a defaultdict's factory), then each entry
        for key, item in value.items():
            copied[key] = _copied(item, earlier.get(key))
        return copied
    if type(value) in (list, tuple):
        fits = type(previous) is type(value) and len(previous) == len(value)
        return type(value)(_copied(item, previous[index] if fits else None) for index, item in enumerate(value))
    return copy.deepcopy(value)


# -- fingerprints ------------------------------------------------------------------------------------------------
# sync() compares the ranks' snapshots by a digest of each, so the digest must depend on the state alone, never
# on the process: repr() does not qualify (a set's order follows the per-process string hash seed, a default repr
# holds an address, a tensor's repr rounds and elides). Each value is encoded as a type tag, then a length or count
# where its size varies, then its content: an encoding no other value shares, and the same in every process.
# What has no such encoding (a function, a lock, a file, an object that is nothing but its address) is refused.

_LENGTH = struct.Struct("<Q")
_FLOAT = struct.Struct("<d")
_COMPLEX = struct.Struct("<dd")
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType)
_BUILTINS = (list, tuple, dict, set, frozenset, int, float, complex, str, bytes)


class _Unencodable(Exception):
    """A value with no canonical encoding; `path` grows by a step per container it is found in."""

    def __init__(self, reason: str, kind: type) -> None:
        super().__init__(reason)
        self.reason, self.kind, self.path = reason, kind, ""

    def inside(self, step: str) -> _Unencodable:
        self.path = step + self.path
        return self


def fingerprint_of(values: dict[str, Any], where: str = "state") -> str:
    """SHA-256 of the canonical encoding of `values` (name -> value), the same in every process for equal state:
    dicts (whatever their insertion order) and sets by their sorted entries, floats by their bits, objects by
    their class and what pickle stores of them (docs/elastic.md lists the kinds). Raises DdlfastError naming
    where in `where`.<name> a value that has no canonical encoding is, and its type."""
    digest = hashlib.sha256()
    try:
        _Encoder(digest.update).mapping(values, attributes=True)
    except _Unencodable as unencodable:
        raise DdlfastError(
            f"ddlfast.elastic cannot fingerprint {where}{unencodable.path} ({_name_of(unencodable.kind)}): "
            f"{unencodable.reason}; a state holds plain data, NumPy arrays, torch tensors and objects made of "
            "those (docs/elastic.md)") from None
    except RecursionError:
        raise DdlfastError(f"ddlfast.elastic cannot fingerprint {where}: it is nested too deeply") from None
    return digest.hexdigest()


class _Encoder:
    """Writes the canonical encoding of values through `write`: a digest's update, or a list's append where the
    bytes are needed to sort a dict's or a set's entries."""

    def __init__(self, write: Callable[[Any], object], inside: set[int] | None = None) -> None:
        self.write = write
        self.inside = set() if inside is None else inside  # containers being encoded: one holding itself is refused

    def value(self, value: Any) -> None:
        write = self.write
        kind = type(value)
        if value is None:
            write(b"N")
        elif kind is bool:
            write(b"T" if value else b"F")
        elif kind is int:
            self.sized(b"i", value.to_bytes(value.bit_length() // 8 + 1, "little", signed=True))
        elif kind is float:
            write(b"f" + _FLOAT.pack(value))  # its bits: -0.0 and each NaN as they are
        elif kind is complex:
            write(b"c" + _COMPLEX.pack(value.real, value.imag))
        elif kind is str:
            self.sized(b"s", value.encode("utf-8", "surrogatepass"))
        elif kind is bytes or kind is bytearray:
            self.sized(b"b" if kind is bytes else b"a", value)
        elif isinstance(value, np.ndarray | np.generic | np.dtype):
            self.numpy(value)
        elif _is_torch(value):
            self.torch(value)
        else:
            self.container(value)

    def sized(self, tag: bytes, data: Any) -> None:
        self.write(tag + _LENGTH.pack(len(data)))
        self.write(data)

    def encoded(self, value: Any) -> bytes:
        parts: list[Any] = []
        _Encoder(parts.append, self.inside).value(value)
        return b"".join(parts)

    def container(self, value: Any) -> None:
        if id(value) in self.inside:
            raise _Unencodable("it holds itself", type(value))
        self.inside.add(id(value))
        try:
            kind = type(value)
            if kind in _BUILTINS:
                self.builtin(value, kind)
            elif isinstance(value, _BUILTINS):
                # A subclass (a namedtuple, an OrderedDict, an IntEnum ...): its class, then its base's content.
                self.sized(b"S", _name_of(kind).encode())
                base = next(base for base in kind.__mro__ if base in _BUILTINS)
                self.builtin(value, base, ordered=isinstance(value, collections.OrderedDict))
                self.mapping(getattr(value, "__dict__", {}), attributes=True)
            elif isinstance(value, type):
                self.sized(b"g", _name_of(value).encode())
            elif isinstance(value, _FUNCTIONS):
                raise _Unencodable("a function or a module has no content to compare", kind)
            else:
                self.reduced(value)
        finally:
            self.inside.discard(id(value))

    def builtin(self, value: Any, kind: Any, ordered: bool = False) -> None:
        """`value` as one of _BUILTINS, `kind` (its type, or its base where it is a subclass)."""
        if kind in (int, float, complex, str, bytes):
            self.value(kind.__getnewargs__(value)[0])  # the plain value (a subclass's __str__ may say otherwise)
        elif kind is list or kind is tuple:
            self.write((b"l" if kind is list else b"t") + _LENGTH.pack(len(value)))
            for index, item in enumerate(value):
                try:
                    self.value(item)
                except _Unencodable as unencodable:
                    raise unencodable.inside(f"[{index}]") from None
        elif kind is dict:
            self.mapping(value, ordered=ordered)
        else:  # a set: its elements sorted by their encodings (it iterates in the order of the string hash seed)
            self.write((b"e" if kind is set else b"z") + _LENGTH.pack(len(value)))
            try:
                encoded = sorted(self.encoded(item) for item in value)
            except _Unencodable as unencodable:
                raise unencodable.inside(" (an element)") from None
            for element in encoded:
                self.write(element)

    def mapping(self, value: dict, attributes: bool = False, ordered: bool = False) -> None:
        """A dict's entries, sorted by their keys' encodings (dicts equal whatever their insertion order encode
        alike), or in their order where that is part of equality (an OrderedDict). `attributes`: its keys are
        names (an object's attributes), shown as `.name` in a refusal."""
        self.write(b"d" + _LENGTH.pack(len(value)))
        try:
            entries = [(self.encoded(key), key, item) for key, item in value.items()]
        except _Unencodable as unencodable:
            raise unencodable.inside(" (a key)") from None
        if not ordered:
            entries.sort(key=lambda entry: entry[0])
        for encoded, key, item in entries:
            self.write(encoded)
            try:
                self.value(item)
            except _Unencodable as unencodable:
                named = attributes and type(key) is str and key.isidentifier()
                raise unencodable.inside(f".{key}" if named else f"[{key!r}]") from None

    def numpy(self, value: np.ndarray | np.generic | np.dtype) -> None:
        if isinstance(value, np.dtype):
            self.sized(b"y", repr(value.descr if value.fields else value.str).encode())
            return
        array = np.asarray(value)
        self.sized(b"A" if isinstance(value, np.ndarray) else b"x", array.dtype.str.encode())
        self.write(_LENGTH.pack(array.ndim) + b"".join(_LENGTH.pack(n) for n in array.shape))
        if array.dtype.hasobject:  # its bytes are pointers: the elements themselves, in C order
            for index, item in enumerate(array.ravel()):
                try:
                    self.value(item)
                except _Unencodable as unencodable:
                    raise unencodable.inside(f" (element {index})") from None
        else:
            self.sized(b"", np.ascontiguousarray(array).reshape(-1).view(np.uint8))

    def torch(self, value: Any) -> None:
        import torch  # imported already: _is_torch found one of its types

        if isinstance(value, torch.dtype | torch.device):
            self.sized(b"D", f"{_name_of(type(value))}:{value}".encode())
            return
        try:
            tensor = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
            data = tensor.reshape(-1).view(torch.uint8).numpy()
        except Exception as error:  # noqa: BLE001 (a sparse, quantized ... tensor: refused, saying why)
            raise _Unencodable(f"its bytes cannot be read ({error})", type(value)) from None
        self.sized(b"P", str(tensor.dtype).encode())
        self.write(_LENGTH.pack(tensor.dim()) + b"".join(_LENGTH.pack(n) for n in tensor.shape))
        self.sized(b"", data)

    def reduced(self, value: Any) -> None:
        """Any other object by what pickle stores of it (sync() broadcasts the state pickled anyway): the callable
        that rebuilds it, its arguments, and its state (a dataclass's or plain object's attributes, its slots, or
        what its __getstate__ returns)."""
        try:
            reduction = value.__reduce_ex__(4)
        except Exception as error:  # noqa: BLE001 (what cannot be pickled has no content to compare)
            raise _Unencodable(f"it cannot be pickled ({type(error).__name__}: {error})", type(value)) from None
        if isinstance(reduction, str):  # a global, pickled by its name
            self.sized(b"g", f"{getattr(value, '__module__', None)}.{reduction}".encode())
            return
        rebuild, arguments, state, items, entries = (*reduction, None, None, None)[:5]
        if (state is None and items is None and entries is None and tuple(arguments) in ((), (type(value),))
                and type(value).__eq__ is object.__eq__):
            raise _Unencodable("it has no state: only its address tells it apart", type(value))
        self.sized(b"o", _name_of(rebuild).encode())
        try:
            self.value(tuple(arguments))
        except _Unencodable as unencodable:
            raise unencodable.inside(" (its constructor's arguments)") from None
        if isinstance(state, dict):
            self.mapping(state, attributes=True)
        else:
            self.value(state)
        self.value(list(items) if items is not None else None)
        self.value(list(entries) if entries is not None else None)


def _name_of(thing: Any) -> str:
    """A class's or a function's name with its module: the same in every process."""
    name = getattr(thing, "__qualname__", None) or getattr(thing, "__name__", None) or repr(thing)
    return f"{getattr(thing, '__module__', None) or '?'}.{name}"


def _is_torch(value: Any) -> bool:
    torch = sys.modules.get("torch")  # where torch was never imported, no value is a tensor
    return torch is not None and isinstance(value, torch.Tensor | torch.dtype | torch.device)
