"""python -m ddlfast.horovodrun: horovodrun's flags mapped onto each MPI's launcher spelling; refused flags."""

from __future__ import annotations

import sys

import pytest

from ddlfast.horovodrun import command_for


def test_open_mpi_spelling() -> None:
    line = command_for(["-np", "4", "-H", "a:2,b:2", "-p", "2222", "-x", "NCCL_DEBUG=INFO", "train.py", "--lr",
                        "0.1"], mpiexec="mpiexec", flavour="openmpi")
    assert line == ["mpiexec", "-n", "4", "--host", "a:2,b:2", "--mca", "plm_rsh_args", "-p 2222",
                    "-x", "NCCL_DEBUG=INFO", sys.executable, "train.py", "--lr", "0.1"]


def test_mpich_spelling() -> None:
    line = command_for(["--num-proc", "2", "--hostfile", "hosts", "python", "train.py"], mpiexec="mpiexec",
                       flavour="mpich")
    assert line == ["mpiexec", "-n", "2", "-f", "hosts", "python", "train.py"]


@pytest.mark.parametrize("flag", ["--gloo", "--min-np=2", "--host-discovery-script"])
def test_refused_flags(flag: str) -> None:
    with pytest.raises(SystemExit, match="not supported"):
        command_for(["-np", "2", flag, "train.py"], mpiexec="mpiexec", flavour="mpich")
