"""What the launcher says about the job, beside what MPI says: a process that MPI sees alone while its launcher
started several (torchrun, srun without the MPI plugin, another MPI's mpiexec) would train alone as rank 0 of 1
and exit 0, so creating a context there is an error that says how to launch.

Only the launchers' own variables are read here (no DDLFAST_* one: those are config.py's).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

from mpi4py import MPI

from ddlfast.config import allow_single
from ddlfast.errors import DdlfastError


class LaunchSignal(NamedTuple):
    launcher: str  # who started the processes, as the user knows it
    variable: str  # the variable that says so
    processes: int  # how many processes it says there are
    fix: str  # how to launch instead


_MPIEXEC = "`mpiexec -n {n} python your_script.py`"
_SRUN = ("srun wired to this MPI (`srun --mpi=pmix ...` or `--mpi=pmi2`, whichever plugin this MPI was built "
         "for; `srun --mpi=list` shows them), or " + _MPIEXEC + " inside the allocation")
# (launcher, variable, fix) in the order they are looked at; the first that counts more than one process wins.
_SIGNALS = (
    ("torchrun", "WORLD_SIZE", "torchrun does not start MPI: launch with " + _MPIEXEC + " instead"),
    ("torchrun", "LOCAL_WORLD_SIZE", "torchrun does not start MPI: launch with " + _MPIEXEC + " instead"),
    ("srun", "SLURM_STEP_NUM_TASKS", "srun is not wired to this MPI: use " + _SRUN),
    ("Slurm", "SLURM_NTASKS", "the allocation has {n} tasks but this process was started alone: use " + _SRUN),
    ("a PMI launcher (another MPI's mpiexec, or srun)", "PMI_SIZE",
     "the launcher is not the one of the MPI ddlfast and mpi4py use: launch with that MPI's mpiexec, " + _MPIEXEC),
    ("Open MPI's mpirun", "OMPI_COMM_WORLD_SIZE",
     "Open MPI's launcher started it, but ddlfast and mpi4py run on another MPI: launch with that MPI's "
     "mpiexec, " + _MPIEXEC),
)


def _count(raw: str | None) -> int:
    text = (raw or "").strip()
    return int(text) if text.isascii() and text.isdecimal() and len(text) < 10 else 0


def launch_signal(environ: Mapping[str, str] | None = None) -> LaunchSignal | None:
    """The first launcher variable that counts more than one process, or None."""
    env = os.environ if environ is None else environ
    torchrun = "TORCHELASTIC_RUN_ID" in env
    for launcher, variable, fix in _SIGNALS:
        processes = _count(env.get(variable))
        if processes > 1:
            if launcher == "torchrun" and not torchrun:
                launcher = "the environment (torchrun or a similar launcher)"
            return LaunchSignal(launcher, variable, processes, fix.format(n=processes))
    return None


def check_not_alone(mpi_processes: int, environ: Mapping[str, str] | None = None) -> None:
    """Raise DdlfastError when MPI sees one process but the launcher started several (DDLFAST_ALLOW_SINGLE=1
    allows it). A process that no launcher counts is a legitimate one-rank job."""
    if mpi_processes != 1 or allow_single(environ):
        return
    signal = launch_signal(environ)
    if signal is None:
        return
    raise DdlfastError(
        f"MPI sees 1 process, but {signal.launcher} started {signal.processes} ({signal.variable}="
        f"{signal.processes}): every process would run alone as rank 0 of 1 and nothing would be averaged; "
        f"{signal.fix}. To run each process alone on purpose, set "
        "DDLFAST_ALLOW_SINGLE=1")


def check_world() -> None:
    """check_not_alone for this process's MPI job (MPI.COMM_WORLD); a process another job spawned
    (MPI_Comm_spawn: a replacement for lost ranks, docs/elastic.md) is its own job of any size."""
    if MPI.Comm.Get_parent() == MPI.COMM_NULL:
        check_not_alone(MPI.COMM_WORLD.Get_size())

