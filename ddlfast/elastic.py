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

import copy
import functools
import hashlib
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from ddlfast import api, ulfm
from ddlfast.errors import DdlfastError, RanksLostError

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
        rank-dependent commit) instead of broadcasting one of them."""
        mine = (self.commits, self.fingerprint(self._snapshot) if self.commits and self._snapshot is not None
                else "")
        everyone = api.allgather_object(mine)
        newest = max(commits for commits, _ in everyone)
        holders = [rank for rank, (commits, _) in enumerate(everyone) if commits == newest]
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


def _digest(arrays: list[np.ndarray], scalars: dict[str, Any]) -> str:
    digest = hashlib.sha256(repr(sorted(scalars.items())).encode())
    for array in arrays:
        digest.update(f"{array.dtype}{array.shape}".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


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
        return _digest([arrays[name] for name in self._arrays], scalars)

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
        arrays = [tensor.cpu().numpy() for tensor in model.values()]
        return _digest(arrays, {**scalars, "optimizer": repr(optimizer)})

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
