"""Ends the whole job when a stall error goes uncaught.

After DdlfastTimeoutError (or any DdlfastBrokenError) the communicator is unusable: a peer is gone or
wedged, and MPI_Finalize at interpreter exit would wait for it forever. When
such an error reaches the top of the main thread uncaught, ddlfast prints the
traceback as usual and then calls MPI_Abort on COMM_WORLD, so the launcher
ends every rank with a non-zero exit instead of leaving survivors blocked.
Other DdlfastErrors (bad input) are raised on every rank alike and leave the
communicator healthy, so they exit normally. DDLFAST_ABORT_ON_STALL=0 turns
this off (for programs that install their own handling).
"""

from __future__ import annotations

import os
import sys
from types import TracebackType

from ddlfast import config
from ddlfast.error_report import present
from ddlfast.errors import DdlfastBrokenError

_installed = False


def abort_on_stall_enabled() -> bool:
    return config.abort_on_stall()


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
        if isinstance(error, DdlfastBrokenError):  # a stall (DdlfastTimeoutError) or a collective abandoned
            from mpi4py import MPI

            if MPI.Is_initialized() and not MPI.Is_finalized():
                sys.stderr.write(f"ddlfast: uncaught {type(error).__name__}, the communicator is broken: "
                                 "calling MPI_Abort to end the job (DDLFAST_ABORT_ON_STALL=0 disables this)\n")
                sys.stderr.flush()
                sys.stdout.flush()
                MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook
