"""ddlfast's collectives as named ranges in torch.profiler traces ("ddlfast:allreduce", ...), through
torch.autograd.profiler.record_function, while a torch profiler records. torch is never imported here: when it
is not imported already, nothing can be recording, and a collective pays one dictionary lookup."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

Method = TypeVar("Method", bound=Callable[..., Any])


_modules_get = sys.modules.get  # one lookup less per call
PROFILER = "torch.autograd.profiler"  # the module whose _is_profiler_enabled says whether a profiler records


def recording_range(label: str) -> Any:
    """A record_function range named `label` while a torch profiler records; None otherwise."""
    profiler = _modules_get(PROFILER)
    if profiler is None or not getattr(profiler, "_is_profiler_enabled", False):
        return None
    return profiler.record_function(label)


def traced(name: str) -> Callable[[Method], Method]:
    """Decorate a collective so it shows as "ddlfast:<name>" in a torch profiler trace (on the thread that
    called it: an asynchronous call's range is its submission)."""
    label = "ddlfast:" + name

    def decorate(method: Method) -> Method:
        @functools.wraps(method)
        def run(*args: Any, **kwargs: Any) -> Any:
            profiler = _modules_get(PROFILER)  # recording_range's test, inline: every collective pays it
            if profiler is None or not getattr(profiler, "_is_profiler_enabled", False):
                return method(*args, **kwargs)
            with profiler.record_function(label):
                return method(*args, **kwargs)

        return run  # type: ignore[return-value]

    return decorate
