"""A process MPI sees alone while its launcher started several is refused at context creation (issue 25 item 2):
one case per launcher signal, the override, and the plain single process that stays valid."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ddlfast import launch
from ddlfast.errors import DdlfastError

# (the environment a launcher leaves, what the error must say)
SIGNALS = {
    "torchrun WORLD_SIZE": ({"WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "abc"}, ["torchrun started 4", "mpiexec -n 4"]),
    "torchrun LOCAL_WORLD_SIZE": ({"LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "abc"},
                                  ["torchrun started 2", "LOCAL_WORLD_SIZE=2", "torchrun does not start MPI"]),
    "WORLD_SIZE without torchrun": ({"WORLD_SIZE": "8"}, ["torchrun or a similar launcher", "mpiexec -n 8"]),
    "srun step": ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4"},
                  ["srun started 4", "srun is not wired to this MPI", "--mpi=pmix"]),
    "Slurm allocation": ({"SLURM_NTASKS": "16"}, ["Slurm started 16", "srun --mpi", "mpiexec -n 16"]),
    "PMI": ({"PMI_SIZE": "3", "PMI_RANK": "0"}, ["PMI_SIZE=3", "that MPI's mpiexec"]),
    "Open MPI": ({"OMPI_COMM_WORLD_SIZE": "2"}, ["Open MPI's mpirun started 2", "another MPI"]),
}


@pytest.mark.parametrize("signal", sorted(SIGNALS))
def test_alone_under_a_launcher_is_refused(signal: str) -> None:
    environ, phrases = SIGNALS[signal]
    with pytest.raises(DdlfastError) as raised:
        launch.check_not_alone(1, environ)
    message = str(raised.value)
    for phrase in [*phrases, "MPI sees 1 process", "DDLFAST_ALLOW_SINGLE=1"]:
        assert phrase in message, f"{phrase!r} not in {message!r}"


@pytest.mark.parametrize("signal", sorted(SIGNALS))
def test_allow_single_overrides(signal: str) -> None:
    environ, _ = SIGNALS[signal]
    launch.check_not_alone(1, {**environ, "DDLFAST_ALLOW_SINGLE": "1"})
    with pytest.raises(DdlfastError):  # "0" is the default, spelled out
        launch.check_not_alone(1, {**environ, "DDLFAST_ALLOW_SINGLE": "0"})


@pytest.mark.parametrize("environ", [
    {},  # a plain `python script.py`
    {"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "x"},  # torchrun --nproc-per-node 1
    {"SLURM_NTASKS": "1", "PMI_SIZE": "1", "OMPI_COMM_WORLD_SIZE": "1"},
    {"WORLD_SIZE": "", "SLURM_NTASKS": "not a number"},  # nothing that counts processes
])
def test_one_process_stays_valid(environ: dict[str, str]) -> None:
    launch.check_not_alone(1, environ)


def test_several_mpi_processes_are_never_refused() -> None:
    launch.check_not_alone(4, {"WORLD_SIZE": "8", "SLURM_NTASKS": "2"})


def test_allow_single_is_validated() -> None:
    with pytest.raises(DdlfastError, match="DDLFAST_ALLOW_SINGLE='maybe'"):
        launch.check_not_alone(1, {"WORLD_SIZE": "4", "DDLFAST_ALLOW_SINGLE": "maybe"})


# The real path: a fresh process creates the default context through a collective (one MPI singleton).
PROGRAM = "import numpy as np, ddlfast; print('sum', ddlfast.allreduce(np.ones(3))[0])"


def run_single(environ: dict[str, str]) -> subprocess.CompletedProcess:
    env = {name: value for name, value in os.environ.items()
           if name not in {n for signal in SIGNALS.values() for n in signal[0]} and not name.startswith("DDLFAST_")}
    env.update(environ)
    return subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("signal", ["torchrun WORLD_SIZE", "Slurm allocation", "Open MPI"])
def test_context_creation_refuses_and_allows(signal: str) -> None:
    environ, phrases = SIGNALS[signal]
    refused = run_single(environ)
    assert refused.returncode != 0
    assert "DdlfastError" in refused.stderr and phrases[0] in refused.stderr, refused.stderr
    allowed = run_single({**environ, "DDLFAST_ALLOW_SINGLE": "1"})
    assert allowed.returncode == 0 and "sum 1.0" in allowed.stdout, allowed.stderr
    plain = run_single({})
    assert plain.returncode == 0 and "sum 1.0" in plain.stdout, plain.stderr
