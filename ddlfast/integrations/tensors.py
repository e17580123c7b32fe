"""What the torch integrations share: the dtypes ddlfast reduces as tensors, what it reduces for a tensor (a NumPy
view on the CPU, the tensor itself on a GPU) and the stream a CUDA tensor's producer ran on."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ddlfast.buffers.host import numpy_view

SUPPORTED_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16}

__all__ = ["SUPPORTED_DTYPES", "collective_view", "for_backward", "numpy_view", "stream_of"]


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
