"""Start a program under `mpiexec -n P` from pytest (as CuPy's MPI tests do)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PROGRAMS = Path(__file__).parent / "programs"


def mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else "mpiexec"


def run_mpi(ranks: int, program: str, *args: str, timeout: float = 300, env: dict | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """Run tests/mpi/programs/<program> on `ranks` processes; fail the test with its output if it fails."""
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        full_env.update(env)
    command = [mpiexec(), "-n", str(ranks), sys.executable, str(PROGRAMS / program), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=full_env)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} exited {result.returncode}\n--- stdout ---\n{result.stdout[-6000:]}"
            f"\n--- stderr ---\n{result.stderr[-6000:]}"
        )
    return result
