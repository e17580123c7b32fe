"""PyTorch integration without DDP (CPU tensors, and CUDA tensors in a CUDA build): gradient bucketing with hooks,
so each bucket is allreduced while backward is still computing the next ones.

    import ddlfast.torch as dt
    reducer = dt.distribute(model)               # registers the hooks; buffers follow rank 0 each forward
    dt.broadcast_parameters(model)               # every rank starts equal
    optimizer = dt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), reducer)
    loss.backward(); optimizer.step()            # step() waits for the averaged gradients first

DDP users keep DDP and register `dt.allreduce_hook` instead (ddlfast/integrations/torch_ddp.py, docs/torch.md).

One step's life (every rank runs the same sequence, so every rank submits the same buckets in the same order):
- a backward pass is a *sync pass* when it is outside `no_sync()` and the `backward_passes_per_step`-th since the
  last step; other passes only accumulate into the bucket views (nothing goes on the wire);
- in a sync pass a bucket goes on the wire (in bucket order) once each of its parameters got its gradient; at the
  end of the pass (an autograd engine callback) the parameters that got none are marked ready, so an unused
  parameter holds the buckets after it back until the end of backward, never until step(); with
  `find_unused_parameters=True` the forward's graph is walked and they are marked ready before backward starts;
- `synchronize()` waits for the buckets (and reduces sparse gradients); a second call, or `step()` after it,
  does nothing more. A backward pass after a sync pass and before `synchronize()` raises `DdlfastError`.

Gradients live in per-bucket flat buffers (DDP's gradient_as_bucket_view). Parameters that received no gradient on
a rank contribute zeros (their .grad becomes the average of the others'). Accumulation is DDP's: after passes
g1..gN, every rank holds (1/P) * sum over ranks of (g1 + ... + gN); scale the loss by 1/N for a mean over passes.

CUDA parameters (all on one device): the buckets live on that device and go to the GPU path as tensors; each is
ordered after the stream backward ran on when its hook fired (torch's current stream), never by a device-wide
synchronize.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from ddlfast.api import default_context
from ddlfast.config import load_settings
from ddlfast.context import Context
from ddlfast.engine.worker import Handle
from ddlfast.errors import DdlfastConsistentError, DdlfastError
from ddlfast.fusion.bucketing import assign_buckets
from ddlfast.integrations.tensors import (
    SUPPORTED_DTYPES,
    broadcast_bytes,
    collective_view,
    for_backward,
    nbytes,
    numpy_view,
    stream_of,
)
from ddlfast.integrations.torch_backend import register as _register_backend
from ddlfast.integrations.torch_ddp import HookState, allreduce_hook, bf16_hook, fp16_hook, install_mpi_rendezvous
from ddlfast.integrations.torch_ddp import init_process_group as _init_from_mpi

# Importing ddlfast.torch makes "ddlfast" a torch.distributed backend and lets torch's env:// rendezvous take what
# the environment lacks from MPI, so `dist.init_process_group("ddlfast")` works under mpiexec as it is.
_register_backend()
install_mpi_rendezvous()

_SPARSE_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)

# Parameters and submodules registered on any module since import (torch's global registration hooks, installed
# by the first distribute()): a reducer walks its model's parameters only after this count changed.
_registrations = [0]


def _registrations_seen() -> int:
    if not _registrations[1:]:
        def count(*_: Any) -> None:
            _registrations[0] += 1

        torch.nn.modules.module.register_module_parameter_registration_hook(count)
        torch.nn.modules.module.register_module_module_registration_hook(count)
        _registrations.append(1)  # installed
    return _registrations[0]

# Phases of one step (see the module docstring).
_IDLE, _ACCUMULATING, _SUBMITTED = "idle", "accumulating", "submitted"


def _check_tensors(tensors: Iterable[torch.Tensor], what: str) -> list[torch.Tensor]:
    tensors = list(tensors)
    devices = sorted({str(t.device) for t in tensors})
    if len(devices) > 1:
        raise DdlfastError(f"{what} on {', '.join(devices)}: ddlfast takes tensors of one device per call")
    for t in tensors:
        if t.device.type not in ("cpu", "cuda"):
            raise DdlfastError(f"{what} on {t.device}: ddlfast takes CPU or CUDA tensors")
        if t.dtype not in SUPPORTED_DTYPES:
            raise DdlfastError(f"{what} of dtype {t.dtype} cannot be reduced (float32, float64, float16, bfloat16)")
    return tensors


def _output_tensors(output: Any) -> list[torch.Tensor]:
    leaves, _ = torch.utils._pytree.tree_flatten(output)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def _reachable_parameters(outputs: list[torch.Tensor]) -> set[int]:
    """ids of the leaf tensors whose gradients backward from `outputs` will accumulate (DDP's unused-parameter
    search: a walk of the autograd graph to its AccumulateGrad nodes)."""
    reached: set[int] = set()
    seen: set[Any] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return reached


class _GradBucket:
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        total = sum(p.numel() for p in params)
        self.flat = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        self.flat_view = collective_view(self.flat)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            self.views.append(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.handle: Handle | None = None
        self.touched: set[int] = set()  # positions that got a gradient since the last step
        self.ready: set[int] = set()  # positions done for this sync pass

    def mark_ready(self, position: int) -> None:
        """A position the sync pass will not (or no longer) write: zeros if it got no gradient this step."""
        if position not in self.touched:
            self.views[position].zero_()
        self.params[position].grad = self.views[position]
        self.ready.add(position)


class GradientReducer:
    """Owns the hooks and buckets of one model; see the module docstring.

    op: "average" (default) or "sum". backward_passes_per_step: accumulate this many backward passes locally
    before the gradients go on the wire (Horovod's option; `no_sync()` is DDP's). broadcast_buffers: copy rank
    0's buffers (BatchNorm statistics) to every rank before each training forward, as DDP does.
    find_unused_parameters: walk each forward's graph so parameters it does not reach stall no bucket.
    Embedding/EmbeddingBag modules with sparse=True get sparse gradients, allgathered (indices and values) and
    averaged at synchronize(); sparse_as_dense=True reduces them densely in the buckets instead.
    reproducible: True sums the gradients in one canonical order (ddlfast.fused_allreduce; None:
    DDLFAST_REPRODUCIBLE), so the bits do not depend on the ring dims, the buckets or the algorithm.
    """

    def __init__(self, model: torch.nn.Module, *, op: str = "average", dims: object = None,
                 bucket_bytes: int | None = None, first_bucket_bytes: int | None = None,
                 context: Context | None = None, backward_passes_per_step: int = 1,
                 broadcast_buffers: bool = True, find_unused_parameters: bool = False,
                 sparse_as_dense: bool = False, reproducible: bool | None = None) -> None:
        self.context = context or default_context()
        self._model = model
        self._options = {"op": op, "dims": dims, "bucket_bytes": bucket_bytes,
                         "first_bucket_bytes": first_bucket_bytes, "context": self.context,
                         "backward_passes_per_step": backward_passes_per_step,
                         "broadcast_buffers": broadcast_buffers, "find_unused_parameters": find_unused_parameters,
                         "sparse_as_dense": sparse_as_dense, "reproducible": reproducible}
        if op not in ("average", "sum"):
            raise DdlfastError(f"op must be 'average' or 'sum', not {op!r}")
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise DdlfastError(f"backward_passes_per_step must be an int >= 1, not {backward_passes_per_step!r}")
        self.op, self.dims, self.reproducible = op, dims, reproducible
        self.backward_passes_per_step = backward_passes_per_step
        self.find_unused_parameters = find_unused_parameters
        self.sparse_as_dense = sparse_as_dense
        self._names = {id(p): name for name, p in model.named_parameters()}
        params = [p for p in model.parameters() if p.requires_grad]
        self._planned = [id(p) for p in params]  # the trainable parameters the plan covers, in order
        # What the per-step check reads (_plan_change): the parameters frozen when planned, and how many
        # parameters and modules had been registered anywhere (a new one may be this model's).
        self._frozen = [p for p in model.parameters() if not p.requires_grad]
        self._registrations = _registrations_seen()
        self._stale: str | None = None  # this sync pass: why the plan no longer covers the model (see _plan_change)
        if not params:
            raise DdlfastError("the model has no parameters that require gradients")
        _check_tensors(params, "parameters")
        sparse_ids = set() if sparse_as_dense else {
            id(m.weight) for m in model.modules() if isinstance(m, _SPARSE_MODULES) and m.sparse}
        self.sparse_params = [p for p in params if id(p) in sparse_ids]
        dense = [p for p in params if id(p) not in sparse_ids]
        settings = load_settings()
        buckets = assign_buckets(
            [p.dtype for p in dense], [p.numel() * p.element_size() for p in dense],
            bucket_bytes or settings.bucket_bytes, first_bucket_bytes or settings.first_bucket_bytes,
        ) if dense else []
        self.buckets = [_GradBucket([dense[i] for i in b.indices]) for b in buckets]
        self._slot: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, position)
        for b, bucket in enumerate(self.buckets):
            for position, p in enumerate(bucket.params):
                self._slot[id(p)] = (b, position)
                p.grad = bucket.views[position]
        self._phase = _IDLE
        self._passes = 0  # backward passes since the last step
        # Each bucket's collective is named (step << 20 | bucket index): the step set_step() was given, else the
        # number of sync passes so far (docs/trust.md says what each catches).
        self._sync_passes = 0
        self._user_step: int | None = None
        self._in_pass = False
        self._sync_pass = False
        self._no_sync_depth = 0
        self._next_to_submit = 0
        self._unreached: set[int] | None = None  # find_unused_parameters: ids the last forwards did not reach
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
        self._hooks.append(model.register_forward_hook(self._after_forward))
        self._buffers = [b for b in model.buffers() if b.numel() > 0] if broadcast_buffers else []
        if self._buffers and self.context.size > 1:
            self._hooks.append(model.register_forward_pre_hook(self._broadcast_buffers))
        self.exposed_s = 0.0  # time synchronize() spent waiting: communication not hidden behind backward
        self.communication_s = 0.0  # time the communication thread spent on this model's buckets

    def _name(self, param: torch.Tensor) -> str:
        return self._names.get(id(param), f"parameter of shape {tuple(param.shape)}")

    def _plan_change(self, planned: Iterable[torch.Tensor] = ()) -> str | None:
        """Why the buckets no longer cover the model's trainable parameters (one unfrozen with requires_grad_(True)
        or added since distribute(), or one frozen since), or None. A parameter outside the plan is never
        averaged, so the ranks' models would drift apart silently; a frozen one would get averaged zeros.

        Cheap in a step where nothing changed: it reads requires_grad of the parameters frozen when planned and
        of `planned` (the planned ones that got no gradient this pass: only those can have been frozen since),
        about 0.3 us each, and walks the model only after a parameter or module was registered somewhere."""
        if (_registrations[0] == self._registrations and not any(p.requires_grad for p in self._frozen)
                and all(p.requires_grad for p in planned)):
            return None
        now = [(name, p) for name, p in self._model.named_parameters() if p.requires_grad]
        if [id(p) for _, p in now] == self._planned:
            if not any(p.requires_grad for p in self._frozen):
                self._registrations = _registrations[0]  # the registrations were another model's
            return None
        planned, current = set(self._planned), {id(p) for _, p in now}
        added = [name for name, p in now if id(p) not in planned]
        names = {id(p): name for name, p in self._model.named_parameters()}
        frozen = [names.get(pid, self._names.get(pid, "a removed parameter")) for pid in self._planned
                  if pid not in current]
        parts = []
        if added:
            parts.append(f"{', '.join(added[:4])}{' ...' if len(added) > 4 else ''} require"
                         f"{'s' if len(added) == 1 else ''} gradients but did not when distribute() was called "
                         "(unfrozen with requires_grad_(True), or added since): never averaged")
        if frozen:
            parts.append(f"{', '.join(frozen[:4])}{' ...' if len(frozen) > 4 else ''} no longer require"
                         f"{'s' if len(frozen) == 1 else ''} gradients")
        if not parts:
            parts.append("the trainable parameters are in another order than when distribute() was called")
        return (f"the model's trainable parameters on rank {self.context.rank} changed after distribute(): "
                f"{'; '.join(parts)}. Call reducer.rebuild() on every rank after changing which parameters train")

    def rebuild(self) -> None:
        """Plan the buckets again for the parameters that train now, on every rank, between steps (after
        requires_grad_() changed or parameters were added). The gradients start again from zero."""
        if self._in_pass:
            raise DdlfastError("rebuild() was called during backward")
        self.discard()
        self.remove()
        for bucket in self.buckets:
            for p in bucket.params:
                p.grad = None
        self.__init__(self._model, **self._options)  # type: ignore[misc]

    # -- forward -------------------------------------------------------------------------------------------------

    def _broadcast_buffers(self, module: torch.nn.Module, inputs: Any) -> None:
        if module.training and torch.is_grad_enabled():
            broadcast_parameters(self._buffers, root=0, context=self.context)

    def _after_forward(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or not (self._phase == _SUBMITTED or self.find_unused_parameters):
            return
        outputs = _output_tensors(output)
        if self._phase == _SUBMITTED:
            for t in outputs:  # fail before backward accumulates into buckets that are on the wire
                t.register_hook(self._second_backward)
        else:
            reached = _reachable_parameters(outputs)
            unreached = {pid for pid in self._slot if pid not in reached}
            self._unreached = unreached if self._unreached is None else self._unreached & unreached

    def _second_backward(self, grad: torch.Tensor) -> None:
        raise DdlfastError(
            "backward() ran again before optimizer.step() (or reducer.synchronize()) while this step's gradients "
            "are being averaged: for gradient accumulation wrap the earlier passes in reducer.no_sync() or pass "
            "distribute(model, backward_passes_per_step=N)")

    # -- backward ------------------------------------------------------------------------------------------------

    def _begin_pass(self) -> None:
        if self._phase == _SUBMITTED:
            self._second_backward(None)
        self._in_pass = True
        self._phase = _ACCUMULATING
        self._sync_pass = self._no_sync_depth == 0 and self._passes + 1 >= self.backward_passes_per_step
        torch.autograd.Variable._execution_engine.queue_callback(self._end_pass)
        if self._sync_pass:
            self._sync_passes += 1
            # Before any bucket goes out: a stale plan makes this rank refuse every bucket of the step instead,
            # so every rank's buckets fail alike (through the agreement) and synchronize() raises everywhere.
            self._stale = self._plan_change(self._params_of(self._unreached or ()))
            for bucket in self.buckets:
                bucket.ready.clear()
            for pid in self._unreached or ():
                b, position = self._slot[pid]
                self.buckets[b].mark_ready(position)
            self._submit_ready()

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._in_pass:
            self._begin_pass()
        slot = self._slot.get(id(param))
        if slot is None:  # a sparse parameter: reduced at synchronize()
            if param.grad is not None and not param.grad.is_sparse:
                raise DdlfastError(f"{self._name(param)} is an Embedding with sparse=True but got a dense gradient")
            return
        b, position = slot
        bucket = self.buckets[b]
        if bucket.handle is not None:
            raise DdlfastError(
                f"{self._name(param)} got its gradient after its bucket went on the wire: with "
                "find_unused_parameters=True every parameter that gets a gradient must be reached from the "
                "model's output (not used outside forward), and backward must not run twice per step")
        view = bucket.views[position]
        grad = param.grad
        if grad is not None and (grad.is_sparse or grad.data_ptr() != view.data_ptr()):
            if grad.is_sparse and not self.sparse_as_dense:
                raise DdlfastError(
                    f"{self._name(param)} got a sparse gradient: ddlfast reduces the sparse gradients of "
                    "Embedding/EmbeddingBag(sparse=True) modules; for others pass "
                    "distribute(model, sparse_as_dense=True) to reduce them as dense tensors")
            view.copy_(grad.to_dense() if grad.is_sparse else grad)  # zero_grad(set_to_none=True) or sparse
            param.grad = view
        bucket.touched.add(position)
        if self._sync_pass:
            bucket.ready.add(position)
            if len(bucket.ready) == len(bucket.params):
                self._submit_ready()

    def _end_pass(self) -> None:
        self._in_pass = False
        self._passes += 1
        self._unreached = None
        if self._sync_pass:
            self._flush()

    def _params_of(self, ids: Iterable[int]) -> list[torch.Tensor]:
        return [self.buckets[b].params[position] for b, position in (self._slot[pid] for pid in ids)]

    def _flush(self) -> None:
        """Mark every parameter ready and put every bucket on the wire (end of a sync pass, or synchronize())."""
        if self._stale is None:
            # A planned parameter that got no gradient may have been frozen since: checked before its bucket
            # (and every later one) goes out, so from that bucket on this rank refuses, and every rank fails alike.
            unready = [bucket.params[position] for bucket in self.buckets[self._next_to_submit:]
                       for position in range(len(bucket.params)) if position not in bucket.ready]
            self._stale = self._plan_change([*unready, *self.sparse_params])
        for bucket in self.buckets:
            for position in range(len(bucket.params)):
                if position not in bucket.ready:
                    bucket.mark_ready(position)
        self._submit_ready()
        self._phase = _SUBMITTED

    def _submit_ready(self) -> None:
        # Buckets go out strictly in index order on every rank, whatever order
        # their gradients arrived in, so all ranks submit the same sequence.
        while (self._next_to_submit < len(self.buckets)
               and len(self.buckets[self._next_to_submit].ready) == len(self.buckets[self._next_to_submit].params)):
            bucket = self.buckets[self._next_to_submit]
            with for_backward(self.context):  # a gradient hook, maybe on an autograd device thread
                if self._stale is not None:
                    bucket.handle = self._refused(self._stale)
                else:
                    bucket.handle = self.context.fused_allreduce_async(
                        [bucket.flat_view], op=self.op, dims=self.dims, stream=stream_of(bucket.flat),
                        reproducible=self.reproducible,
                        name=(self._sync_passes if self._user_step is None else self._user_step) << 20
                        | self._next_to_submit)
            self._next_to_submit += 1

    def set_step(self, step: int) -> None:
        """The training loop's own step (e.g. `for step, batch in enumerate(loader)`): this step's buckets are
        named by it, so a rank that skipped a batch is caught at its next bucket (every rank raises
        DdlfastConsistentError naming the ranks' steps) instead of averaging one step's gradients with another's.
        Without it the buckets are named by the number of sync passes, which a rank that skipped a whole step
        also counts alike."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise DdlfastError(f"set_step takes the step as an int >= 0, not {step!r}")
        self._user_step = step

    def _refused(self, error: str) -> Handle:
        """A bucket's place in the order of collectives, taken by this rank's refusal: the others' allreduce of
        the bucket meets it in the agreement, and every rank's handle fails with a DdlfastConsistentError that
        quotes `error` (nothing was sent; the context stays usable)."""
        def refuse() -> None:
            raise DdlfastConsistentError(error)

        return self.context.submit_agreed(("error", error), refuse, "a refused bucket")

    # -- the step ------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate locally (DDP's no_sync); the first one outside reduces."""
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    def synchronize(self) -> None:
        """Put what is not yet on the wire there, wait for every bucket, reduce sparse gradients.

        After it every .grad holds the average; calling it again (or step() after it) does nothing until the
        next backward. Before the backward_passes_per_step-th pass it reduces what was accumulated so far."""
        if self._in_pass:
            raise DdlfastError("synchronize() was called during backward")
        if self._phase == _IDLE:
            return
        if self._phase == _ACCUMULATING:  # no sync pass checked the plan: _flush checks it before buckets go out
            self._flush()
        start = time.perf_counter()
        try:
            failure: DdlfastError | None = None
            for bucket in self.buckets:  # every bucket, so none is left in flight behind a failed one
                if bucket.handle is not None:
                    try:
                        bucket.handle.wait()
                    except DdlfastError as error:
                        failure = failure or error
                    self.communication_s += bucket.handle.duration_s
            if failure is not None:
                raise failure
            if self.sparse_params:
                self._reduce_sparse()
        finally:
            self.exposed_s += time.perf_counter() - start
            self._reset()

    def discard(self) -> None:
        """Drop this step's reduction (zero_grad() calls it): wait for buckets on the wire, forget the rest.
        Also the way back after a backward that raised (its end-of-pass callback never ran)."""
        self._in_pass = False
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
        self._reset()

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.handle = None
            bucket.touched.clear()
            bucket.ready.clear()
        self._next_to_submit = 0
        self._passes = 0
        self._phase = _IDLE
        self._stale = None

    def _reduce_sparse(self) -> None:
        """Allgather every sparse gradient's indices and values (as sums into zeros: the public API has no
        allgather) and average them; every rank builds the same coalesced tensor."""
        rank, world = self.context.rank, self.context.size
        # Every rank's sparse parameters, full shapes and dtypes, must match (as the dense buckets' agreement
        # refuses dense ones that differ): a table of 10 rows on one rank and 4000 on another would otherwise
        # gather indices that are out of range on the smaller one. A stale plan (_plan_change) joins this
        # agreement too (with dense buckets it has already failed them).
        # So does each rank's own check of its gradients' row indices: torch's coalesce() itself corrupts memory
        # on a negative one, so a bad gradient is refused before it, on every rank alike.
        problem = self._stale or self._sparse_index_problem()
        shapes = "; ".join(f"{self._name(p)} {str(p.dtype).removeprefix('torch.')}[{','.join(map(str, p.shape))}]"
                           for p in self.sparse_params)

        def check() -> None:
            if problem is not None:
                raise DdlfastConsistentError(problem)

        layout = ("sparse gradients of Embedding(sparse=True)", shapes + (f"; {problem}" if problem else ""))
        self.context.submit_agreed(layout, check, "the sparse gradients' shapes").wait()
        grads = []
        for p in self.sparse_params:
            g = p.grad.coalesce() if p.grad is not None else None
            if g is not None and g.device.type != "cpu":
                raise DdlfastError(f"{self._name(p)}: sparse gradients are reduced on the CPU only")
            grads.append(g)
        counts = np.zeros((len(grads), world), np.int64)
        for i, g in enumerate(grads):
            counts[i, rank] = 0 if g is None else g.indices().shape[1]
        self.context.fused_allreduce([counts], op="sum")
        arrays, slots = [], []
        for p, g, row in zip(self.sparse_params, grads, counts, strict=True):
            total, offset = int(row.sum()), int(row[:rank].sum())
            if total == 0:
                continue
            dense_shape = tuple(p.shape[1:])
            indices = np.zeros((1, total), np.int64)
            values = torch.zeros((total, *dense_shape), dtype=p.dtype)
            if g is not None:
                indices[:, offset:offset + g.indices().shape[1]] = g.indices().numpy()
                values[offset:offset + g.values().shape[0]] = g.values()
            arrays += [indices, numpy_view(values)]
            slots.append((p, indices, values, row))
        if arrays:
            self.context.fused_allreduce(arrays, op="sum")
        for p, indices, _, row in slots:
            # Every rank holds the same gathered indices, so every rank reaches the same verdict.
            outside = np.flatnonzero((indices[0] < 0) | (indices[0] >= p.shape[0]))
            if outside.size:
                culprit = int(np.searchsorted(np.cumsum(row), outside[0], side="right"))
                raise DdlfastConsistentError(
                    f"{self._name(p)}: rank {culprit}'s sparse gradient has row index {int(indices[0, outside[0]])}, "
                    f"outside the table's {p.shape[0]} rows (shape {tuple(p.shape)})")
        for p, indices, values, _ in slots:
            if self.op == "average":
                values /= world
            p.grad = torch.sparse_coo_tensor(torch.from_numpy(indices), values, p.shape,
                                             check_invariants=False).coalesce()

    def _sparse_index_problem(self) -> str | None:
        """What is wrong with this rank's sparse gradients (a row index outside the table, more than one sparse
        dimension), or None; one min/max over each gradient's indices."""
        for p in self.sparse_params:
            g = p.grad
            if g is None or not g.is_sparse:
                continue
            if g.sparse_dim() != 1:
                return (f"{self._name(p)}: rank {self.context.rank}'s sparse gradient has {g.sparse_dim()} sparse "
                        "dimensions; an Embedding's has 1 (its rows)")
            rows = g._indices()
            if rows.numel():
                low, high = int(rows.min()), int(rows.max())
                if low < 0 or high >= p.shape[0]:
                    return (f"{self._name(p)}: rank {self.context.rank}'s sparse gradient has row index "
                            f"{low if low < 0 else high}, outside the table's {p.shape[0]} rows (shape "
                            f"{tuple(p.shape)})")
        return None

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def distribute(model: torch.nn.Module, **options: Any) -> GradientReducer:
    """Register gradient hooks on `model`; returns the reducer (options: see GradientReducer)."""
    return GradientReducer(model, **options)


class DistributedOptimizer(torch.optim.Optimizer):
    """The optimizer itself, made distributed: `DistributedOptimizer(torch.optim.SGD(...), reducer)` returns an
    instance of a subclass of both this class and SGD, sharing the optimizer's state and param_groups, so LR
    schedulers, GradScaler and state_dict() take it as the optimizer it is (Horovod's construction).

    step() synchronizes first (no-op if synchronize() already ran); with a closure (LBFGS), after each closure
    call, and the closure's loss is averaged over ranks so every rank takes the same decisions.
    skip_synchronize(): Horovod's pattern for clipping and AMP:
        optimizer.synchronize(); clip_grad_norm_(...)   # or scaler.unscale_(optimizer)
        with optimizer.skip_synchronize(): optimizer.step()
    zero_grad(set_to_none=True) (torch's default) drops a reduction in flight first; set_to_none=False keeps the
    bucket views as the gradients and saves one copy per parameter in the next backward.
    """

    _classes: dict[type, type] = {}

    def __new__(cls, optimizer: torch.optim.Optimizer, reducer: GradientReducer) -> DistributedOptimizer:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise DdlfastError(f"DistributedOptimizer wraps a torch.optim.Optimizer, not {type(optimizer).__name__}")
        base = type(optimizer)
        if isinstance(optimizer, DistributedOptimizer):
            raise DdlfastError("this optimizer is already a DistributedOptimizer")
        subclass = cls._classes.get(base)
        if subclass is None:
            subclass = type(f"Distributed{base.__name__}", (cls, base), {"__module__": __name__})
            cls._classes[base] = subclass
        return object.__new__(subclass)

    def __init__(self, optimizer: torch.optim.Optimizer, reducer: GradientReducer) -> None:  # noqa: D107
        self.__dict__.update(optimizer.__dict__)  # the same param_groups, state and hooks objects
        self.reducer = reducer
        self._skip_synchronize = False

    def synchronize(self) -> None:
        self.reducer.synchronize()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        self._skip_synchronize = True
        try:
            yield
        finally:
            self._skip_synchronize = False

    def step(self, closure: Any = None) -> Any:
        if not self._skip_synchronize:
            self.reducer.synchronize()
        if closure is None:
            return super().step()

        def synchronized_closure() -> Any:
            with torch.enable_grad():
                loss = closure()
            self.reducer.synchronize()
            return self._average_loss(loss)

        return super().step(synchronized_closure)

    def _average_loss(self, loss: Any) -> Any:
        """The closure's loss averaged over ranks: optimizers such as LBFGS decide on it (stop, line search), so
        every rank must see the same value or they would call the closure, and reduce, different numbers of
        times."""
        if loss is None:
            return None
        value = np.array([float(loss.detach() if isinstance(loss, torch.Tensor) else loss)], np.float64)
        self.reducer.context.allreduce(value, op="average")
        return torch.tensor(value[0], dtype=loss.dtype) if isinstance(loss, torch.Tensor) else float(value[0])

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.reducer.discard()
        super().zero_grad(set_to_none=set_to_none)


def broadcast_parameters(params: torch.nn.Module | dict | Iterable[torch.Tensor], root: int = 0,
                         context: Context | None = None) -> None:
    """Copy root's parameters (and buffers, for a module) to every rank, in place, in one broadcast."""
    context = context or default_context()
    if isinstance(params, torch.nn.Module):
        tensors = list(params.state_dict().values())
    elif isinstance(params, dict):
        tensors = list(params.values())
    else:
        tensors = list(params)
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type not in ("cpu", "cuda"):
            raise DdlfastError(f"broadcast_parameters takes CPU or CUDA tensors, got {type(tensor).__name__}")
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return
    # One byte buffer on the host for all (any dtype, bool buffers too): a broadcast per forward when BatchNorm
    # statistics follow rank 0, so one call, not one per tensor. Broadcast as one element of a structured dtype
    # whose fields name each tensor's dtype and shape: the agreement then compares them (not only the byte count),
    # so ranks whose models differ in dtypes or shapes with the same total bytes raise on every rank instead of
    # reinterpreting root's bytes.
    broadcast_bytes(tensors, lambda flat: context.broadcast(flat.view(_layout_dtype(tensors)), root))


_LAYOUT_DTYPES: dict[tuple, np.dtype] = {}


def _layout_dtype(tensors: list[torch.Tensor]) -> np.dtype:
    """A structured NumPy dtype of the tensors' bytes, one field per tensor named "<index>:<dtype>[<shape>]"
    (cached: broadcast_parameters runs before every training forward when buffers follow rank 0)."""
    key = tuple((t.dtype, t.shape) for t in tensors)
    dtype = _LAYOUT_DTYPES.get(key)
    if dtype is None:
        if len(_LAYOUT_DTYPES) >= 256:
            _LAYOUT_DTYPES.clear()
        names = [f"{i}:{str(d).removeprefix('torch.')}[{','.join(map(str, shape))}]"
                 for i, (d, shape) in enumerate(key)]
        formats = [f"V{nbytes(t)}" for t in tensors]
        dtype = _LAYOUT_DTYPES[key] = np.dtype({"names": names, "formats": formats})
    return dtype


def init_process_group(backend: str = "gloo", **kwargs: Any) -> None:
    """dist.init_process_group under mpiexec, ranks and rendezvous from MPI (ddlfast/integrations/torch_ddp.py).

    backend="ddlfast" (registered when ddlfast.torch is imported; ddlfast/integrations/torch_backend.py): DDP,
    FSDP2's Python path and dist.* collectives then run on ddlfast. The default stays gloo (for the DDP hooks).
    Plain `torch.distributed.init_process_group("ddlfast")` works as well under mpiexec once ddlfast.torch is
    imported."""
    _init_from_mpi(backend=backend, **kwargs)


__all__ = [
    "DistributedOptimizer", "GradientReducer", "HookState", "allreduce_hook", "bf16_hook", "broadcast_parameters",
    "distribute", "fp16_hook", "init_process_group",
]
