"""Which process holds a Context's MPI state: a fork() child refuses every collective.

A child made by fork() inherits the parent's memory, MPI's included, but not its MPI connection: a collective
there runs on state that belongs to the parent (on Open MPI: wrong sums, then a segfault). Each Context records
the pid that created it; after a fork, `os.register_at_fork` marks every live context in the child, so the
per-call check stays the one compare it already is (ddlfast/context.py, `Context._check_caller`), and close()
and the exit hooks do nothing there (no MPI call, no abort of the parent's job).

This module imports nothing from ddlfast.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable

# What to call in a fork() child, per live context (weak: a context that is gone is skipped).
_on_fork: list[weakref.WeakMethod] = []


def track(on_fork: Callable[[], None]) -> int:
    """Call the bound method `on_fork` in every fork() child while its object lives; returns this process's pid
    (the object's creator)."""
    _on_fork[:] = [ref for ref in _on_fork if ref() is not None]
    _on_fork.append(weakref.WeakMethod(on_fork))
    return os.getpid()


def in_child(creator_pid: int) -> bool:
    """Whether this process is not the one with pid `creator_pid` (a fork() child of it)."""
    return os.getpid() != creator_pid


def _after_fork_in_child() -> None:
    for ref in list(_on_fork):
        method = ref()
        if method is not None:
            method()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
