"""PyTorch integration (CPU tensors, and CUDA tensors in a CUDA build): gradient bucketing with hooks, so each
bucket is allreduced while backward is still computing the next ones.

    import ddlfast.torch as dt
    reducer = dt.distribute(model)               # registers the hooks
    dt.broadcast_parameters(model)               # every rank starts equal
    optimizer = dt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), reducer)
    loss.backward(); optimizer.step()            # step() waits for the buckets first

Gradients live in per-bucket flat buffers (DDP's gradient_as_bucket_view):
no packing. Parameters that received no gradient in a step are zero-filled
at synchronize() (documented behaviour, like DDP with unused parameters), so
the job never hangs on them.

CUDA parameters (all on one device): the buckets live on that device and go to
the GPU path as tensors (DLPack / __cuda_array_interface__); each is ordered
after the stream backward ran on when its hook fired (torch's current stream),
never by a device-wide synchronize.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from ddlfast.api import default_context
from ddlfast.bucketing import assign_buckets
from ddlfast.config import load_settings
from ddlfast.context import Context
from ddlfast.errors import DdlfastError
from ddlfast.worker import Handle

_SUPPORTED = {torch.float32, torch.float64, torch.float16, torch.bfloat16}


def _collective_view(tensor: torch.Tensor) -> Any:
    """What ddlfast reduces: a NumPy view of a CPU tensor, the tensor itself on a GPU."""
    return tensor if tensor.device.type == "cuda" else _numpy_view(tensor)


def _stream_of(tensor: torch.Tensor) -> int | None:
    """The current stream of a CUDA tensor's device (where its producer ran); None on the CPU."""
    if tensor.device.type != "cuda":
        return None
    return torch.cuda.current_stream(tensor.device).cuda_stream


def _numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy array sharing the tensor's memory (bfloat16 through ml_dtypes)."""
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


class _GradBucket:
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        total = sum(p.numel() for p in params)
        self.flat = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        self.flat_view = _collective_view(self.flat)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            self.views.append(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.pending = len(params)
        self.handle: Handle | None = None


class GradientReducer:
    """Owns the hooks and buckets of one model; see the module docstring."""

    def __init__(self, model: torch.nn.Module, *, op: str = "average", dims: object = None,
                 bucket_bytes: int | None = None, first_bucket_bytes: int | None = None,
                 context: Context | None = None) -> None:
        self.context = context or default_context()
        self.op, self.dims = op, dims
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise DdlfastError("the model has no parameters that require gradients")
        devices = sorted({str(p.device) for p in params})
        if len(devices) > 1:
            raise DdlfastError(f"parameters on {', '.join(devices)}: one reducer takes parameters of one device")
        for p in params:
            if p.device.type not in ("cpu", "cuda"):
                raise DdlfastError(f"parameter on {p.device}: ddlfast takes CPU or CUDA tensors")
            if p.dtype not in _SUPPORTED:
                raise DdlfastError(f"parameter of dtype {p.dtype} cannot be reduced")
        settings = load_settings()
        buckets = assign_buckets(
            [p.dtype for p in params], [p.numel() * p.element_size() for p in params],
            bucket_bytes or settings.bucket_bytes, first_bucket_bytes or settings.first_bucket_bytes,
        )
        self.buckets = [_GradBucket([params[i] for i in b.indices]) for b in buckets]
        self._slot: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, position)
        for b, bucket in enumerate(self.buckets):
            for position, p in enumerate(bucket.params):
                self._slot[id(p)] = (b, position)
                p.grad = bucket.views[position]
        self._ready: list[set[int]] = [set() for _ in self.buckets]
        self._next_to_submit = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
        self.exposed_s = 0.0  # time synchronize() spent waiting: communication not hidden behind backward
        self.communication_s = 0.0  # time the communication thread spent on this model's buckets

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        b, position = self._slot[id(param)]
        bucket = self.buckets[b]
        view = bucket.views[position]
        if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)  # the optimizer replaced the grad (zero_grad(set_to_none=True))
            param.grad = view
        if position in self._ready[b]:
            return
        self._ready[b].add(position)
        if len(self._ready[b]) == len(bucket.params):
            self._submit_ready()

    def _submit_ready(self) -> None:
        # Buckets go out strictly in index order on every rank, whatever order
        # their gradients arrived in, so all ranks submit the same sequence.
        while (self._next_to_submit < len(self.buckets)
               and len(self._ready[self._next_to_submit]) == len(self.buckets[self._next_to_submit].params)):
            bucket = self.buckets[self._next_to_submit]
            bucket.handle = self.context.fused_allreduce_async([bucket.flat_view], op=self.op, dims=self.dims,
                                                               stream=_stream_of(bucket.flat))
            self._next_to_submit += 1

    def synchronize(self) -> None:
        """Submit what backward did not (unused parameters: zero gradients) and wait for every bucket."""
        for b, bucket in enumerate(self.buckets):
            for position, p in enumerate(bucket.params):
                if position not in self._ready[b]:
                    bucket.views[position].zero_()
                    p.grad = bucket.views[position]
                    self._ready[b].add(position)
        self._submit_ready()
        start = time.perf_counter()
        try:
            for bucket in self.buckets:
                if bucket.handle is not None:
                    bucket.handle.wait()
                    self.communication_s += bucket.handle.duration_s
        finally:
            self.exposed_s += time.perf_counter() - start
            for bucket in self.buckets:
                bucket.handle = None
            self._ready = [set() for _ in self.buckets]
            self._next_to_submit = 0
        for bucket in self.buckets:  # grads stay bucket views for the next step
            for position, p in enumerate(bucket.params):
                if p.grad is None or p.grad.data_ptr() != bucket.views[position].data_ptr():
                    p.grad = bucket.views[position]

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def distribute(model: torch.nn.Module, **options: Any) -> GradientReducer:
    """Register gradient hooks on `model`; returns the reducer to synchronize()."""
    return GradientReducer(model, **options)


class DistributedOptimizer:
    """Wraps an optimizer: step() first waits for the averaged gradients."""

    def __init__(self, optimizer: torch.optim.Optimizer, reducer: GradientReducer) -> None:
        self.optimizer = optimizer
        self.reducer = reducer

    def step(self, closure: Any = None) -> Any:
        self.reducer.synchronize()
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = False) -> None:
        # Keep the bucket views as the grads (set_to_none=False) so nothing is copied.
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


def broadcast_parameters(params: torch.nn.Module | dict | Iterable[torch.Tensor], root: int = 0,
                         context: Context | None = None) -> None:
    """Copy root's parameters (and buffers, for a module) to every rank, in place."""
    context = context or default_context()
    if isinstance(params, torch.nn.Module):
        tensors = list(params.state_dict().values())
    elif isinstance(params, dict):
        tensors = list(params.values())
    else:
        tensors = list(params)
    with torch.no_grad():
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type not in ("cpu", "cuda"):
                raise DdlfastError(f"broadcast_parameters takes CPU or CUDA tensors, got {type(tensor).__name__}")
            if tensor.numel() == 0:
                continue
            if not tensor.is_contiguous():
                raise DdlfastError("broadcast_parameters needs contiguous tensors")
            # GPU tensors go through a host copy: a one-off at start-up, any dtype (bool buffers too).
            host = tensor.detach().cpu() if tensor.device.type == "cuda" else tensor.detach()
            view = host.view(torch.uint8) if host.dtype == torch.bool else host
            array = _numpy_view(view).reshape(-1).view(np.uint8)
            context.broadcast_bytes(array, root)
            if tensor.device.type == "cuda":
                tensor.copy_(host)
