"""ddlfast's collectives as named ranges in profiler traces ("ddlfast:allreduce", ...): through
torch.autograd.profiler.record_function while a torch profiler records, and as NVTX ranges (torch.cuda.nvtx,
seen by Nsight Systems and by torch.profiler's CUDA activity) where ddlfast was built with its CUDA kernels and
torch.cuda is imported and has a device. torch is never imported here: when it is not imported already, nothing
can be recording, and a collective pays one dictionary lookup (a build without CUDA: one global read more)."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

Method = TypeVar("Method", bound=Callable[..., Any])


_modules_get = sys.modules.get  # one lookup less per call
PROFILER = "torch.autograd.profiler"  # the module whose _is_profiler_enabled says whether a profiler records
TORCH_CUDA = "torch.cuda"
LABEL_PREFIX = "ddlfast:"
# torch.cuda.nvtx once NVTX ranges are wanted; False once they never can be (no CUDA kernels in this build, or
# torch.cuda without a device); None while that is not known yet (torch.cuda not imported).
_nvtx: Any = None
_cuda_build: bool | None = None  # whether this build has CUDA kernels, asked of the core once


def range_label(name: str) -> str:
    """The one name of a collective's range, in torch.profiler and in NVTX alike: "ddlfast:allreduce"."""
    return LABEL_PREFIX + name


def nvtx_wanted(cuda_build: bool, torch_cuda: Any) -> bool | None:
    """Whether NVTX ranges are opened: True, False (never in this process), or None (not known yet: torch.cuda
    is not imported). `torch_cuda` is the imported torch.cuda module, or None."""
    if not cuda_build:
        return False
    if torch_cuda is None:
        return None
    try:
        return bool(torch_cuda.is_available())
    except Exception:  # noqa: BLE001 - a driver that cannot answer: no device to annotate
        return False


def _decide_nvtx() -> Any:
    """torch.cuda.nvtx when wanted, else False; None (decided later) while torch.cuda is not imported."""
    global _nvtx, _cuda_build
    if _cuda_build is None:
        from ddlfast import _core

        _cuda_build = bool(_core.build_facts()["cuda"])
    wanted = nvtx_wanted(_cuda_build, _modules_get(TORCH_CUDA))
    if wanted is None:
        return None
    if wanted:
        import torch.cuda.nvtx as nvtx  # torch.cuda is imported already: this is its submodule

        _nvtx = nvtx
    else:
        _nvtx = False
    return _nvtx


def recording_range(label: str) -> Any:
    """A range named `label`: record_function's while a torch profiler records, and an NVTX range where those
    are wanted; None when neither."""
    nvtx = _nvtx
    if nvtx is None and _modules_get(TORCH_CUDA) is not None:  # else undecided, and no range: one lookup a call
        nvtx = _decide_nvtx()
    profiler: Any = _modules_get(PROFILER)
    recording = profiler is not None and getattr(profiler, "_is_profiler_enabled", False)
    if not nvtx:
        return profiler.record_function(label) if recording else None
    return _both_ranges(nvtx, profiler if recording else None, label)


@contextlib.contextmanager
def _both_ranges(nvtx: Any, profiler: Any, label: str) -> Iterator[None]:
    nvtx.range_push(label)
    try:
        if profiler is None:
            yield
        else:
            with profiler.record_function(label):
                yield
    finally:
        nvtx.range_pop()


def traced(name: str) -> Callable[[Method], Method]:
    """Decorate a collective so it shows as "ddlfast:<name>" in a torch profiler trace (on the thread that
    called it: an asynchronous call's range is its submission), and as an NVTX range of that name where NVTX
    ranges are wanted (nvtx_wanted)."""
    label = range_label(name)

    def decorate(method: Method) -> Method:
        @functools.wraps(method)
        def run(*args: Any, **kwargs: Any) -> Any:
            nvtx = _nvtx
            if nvtx is None and _modules_get(TORCH_CUDA) is not None:  # recording_range's test, inline
                nvtx = _decide_nvtx()
            profiler: Any = _modules_get(PROFILER)  # recording_range's test, inline: every collective pays it
            recording = profiler is not None and getattr(profiler, "_is_profiler_enabled", False)
            if not nvtx and not recording:
                return method(*args, **kwargs)
            if nvtx:
                nvtx.range_push(label)
            try:
                if recording:
                    with profiler.record_function(label):
                        return method(*args, **kwargs)
                return method(*args, **kwargs)
            finally:
                if nvtx:
                    nvtx.range_pop()

        return run  # type: ignore[return-value]

    return decorate
