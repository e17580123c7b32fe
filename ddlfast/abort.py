"""Ends the whole job when a stall error goes uncaught.

After DdlfastTimeoutError (or any DdlfastBrokenError) the communicator is unusable: a peer is gone or
wedged, and MPI_Finalize at interpreter exit would wait for it forever. When
such an error reaches the top of the main thread uncaught, ddlfast prints the
traceback as usual and then calls MPI_Abort on COMM_WORLD, so the launcher
ends every rank with a non-zero exit instead of leaving survivors blocked.
Other DdlfastErrors (bad input) are raised on every rank alike and leave the
communicator healthy, so they exit normally. DDLFAST_ABORT_ON_STALL=0 turns
this off (for programs that install their own handling).

This is ddlfast's one sys.excepthook. Code that learns of a broken communicator by other means registers a check
with `when_broken` (the torch backend: a stall that reaches the user through torch's C++, in DDP's backward,
arrives as torch's RuntimeError); any uncaught exception while a check reports a reason ends the job the same way.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import TracebackType

from ddlfast import config
from ddlfast.error_report import present
from ddlfast.errors import DdlfastBrokenError

_installed = False
_broken_checks: list[Callable[[], str | None]] = []
_before_abort: list[Callable[[], object]] = []


def abort_on_stall_enabled() -> bool:
    return config.abort_on_stall()


def when_broken(check: Callable[[], str | None]) -> None:
    """Registers `check`: it returns why something ddlfast runs is broken ("the ddlfast process group is broken
    (<reason>)"), or None. Called only once an exception went uncaught."""
    _broken_checks.append(check)


def before_abort(callback: Callable[[], object]) -> None:
    """Registers `callback`, called before MPI_Abort ends the job (the flight recorder finishes writing its files,
    which MPI_Abort would otherwise cut short)."""
    _before_abort.append(callback)


def _abort_reason(kind: type[BaseException], error: BaseException) -> str | None:
    if isinstance(error, DdlfastBrokenError):  # a stall (DdlfastTimeoutError) or a collective abandoned
        return f"uncaught {type(error).__name__}, the communicator is broken"
    for check in _broken_checks:
        broken = check()
        if broken:
            return f"uncaught {kind.__name__} while {broken}"
    return None


def install() -> None:
    """Chains a sys.excepthook that aborts the job after an uncaught DdlfastBrokenError (once per process)."""
    global _installed
    if _installed or not abort_on_stall_enabled():
        return
    _installed = True
    previous = sys.excepthook
    installed_in = os.getpid()

    def hook(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        if not present(kind, error, trace):  # a DdlfastError reads as one short report (ddlfast/error_report.py)
            previous(kind, error, trace)
        if os.getpid() != installed_in:
            return  # a fork() child: COMM_WORLD is the parent's job, which it must not abort
        reason = _abort_reason(kind, error)
        if reason is not None:
            from mpi4py import MPI

            if MPI.Is_initialized() and not MPI.Is_finalized():
                sys.stderr.write(f"ddlfast: {reason}: calling MPI_Abort to end the job (DDLFAST_ABORT_ON_STALL=0 "
                                 "disables this)\n")
                sys.stderr.flush()
                sys.stdout.flush()
                for callback in _before_abort:
                    callback()
                MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook
