"""What the torch integrations share: the dtypes ddlfast reduces as tensors, what it reduces for a tensor (a NumPy
view on the CPU, the tensor itself on a GPU), the stream a CUDA tensor's producer ran on, and the one byte
broadcast of several tensors (broadcast_bytes)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ddlfast.buffers.host import numpy_view

SUPPORTED_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16}

__all__ = ["SUPPORTED_DTYPES", "broadcast_bytes", "collective_view", "for_backward", "nbytes", "numpy_view",
           "stream_of"]


def collective_view(tensor: torch.Tensor) -> Any:
    """What ddlfast reduces: a NumPy view of a CPU tensor, the tensor itself on a GPU (detached when it requires
    grad: DLPack refuses such tensors; the detached tensor shares the storage)."""
    if tensor.device.type == "cuda":
        return tensor.detach() if tensor.requires_grad else tensor
    return numpy_view(tensor)


def stream_of(tensor: torch.Tensor) -> int | None:
    """The current stream of a CUDA tensor's device (where its producer ran); None on the CPU."""
    if tensor.device.type != "cuda":
        return None
    return torch.cuda.current_stream(tensor.device).cuda_stream


def for_backward(context: Any) -> contextlib.AbstractContextManager:
    """Where a gradient hook issues a collective: inside a backward pass, autograd may run the hook on a device
    thread of its own while the thread that called backward() waits for it, so the hook issues for that thread
    (Context.delegated()); outside one, the caller's thread is checked as usual (one issuing thread per context)."""
    if torch._C._current_graph_task_id() != -1:
        return context.delegated()
    return contextlib.nullcontext()


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def broadcast_bytes(tensors: Sequence[torch.Tensor], broadcast: Callable[[np.ndarray], object]) -> None:
    """Several tensors (any dtypes, CPU or GPU) in one broadcast: their bytes packed in order into one host
    buffer, `broadcast` (in place, on its uint8 NumPy view), then copied back into every tensor, in place. The
    caller puts each tensor's dtype and shape into the broadcast's agreement, not only the byte count."""
    flat = torch.empty(sum(nbytes(t) for t in tensors), dtype=torch.uint8)
    offset = 0
    for t in tensors:
        flat[offset:offset + nbytes(t)].copy_(t.detach().reshape(-1).cpu().view(torch.uint8))
        offset += nbytes(t)
    broadcast(flat.numpy())
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset:offset + nbytes(t)].to(t.device).view(t.dtype).view_as(t))
            offset += nbytes(t)
