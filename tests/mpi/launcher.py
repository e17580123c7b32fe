"""Start a program under `mpiexec -n P` from pytest (as CuPy's MPI tests do).

The one place that knows the launcher: which `mpiexec` (the one in the venv beside this Python, which
scripts/setup.sh points at the venv's MPI, else PATH's), what kind it is, and the flags it needs:

- MPICH's hydra (the pip mpich wheel, Debian's mpich): none; `-disable-auto-cleanup` keeps survivors of a dead
  rank alive.
- Open MPI's mpirun, "orte" (4.x) or "prrte" (5.x): `--oversubscribe` (tests start more ranks than cores) and,
  as root, `--allow-run-as-root`. What keeps the survivors of a dead rank running: on 4.x `--mca
  orte_abort_on_non_zero_status 0` (`--enable-recovery` does too, but then mpirun exits 0 although ranks died);
  on 5.x none that works: `--enable-recovery` keeps them, but then the survivors' MPI_Abort does not reliably end
  the job (in 1 of 2 runs the job was still there 30 s after every survivor had aborted), and PRRTE's
  `--runtime-options error-nonzero-status=false` makes mpirun exit 0 and keeps no survivors of a killed rank.
- Any other launcher: no flags; the tests that need survivors kept alive skip, naming it.

`python tests/mpi/launcher.py` prints the launcher's flags (scripts/demo.sh uses them).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

PROGRAMS = Path(__file__).parent / "programs"


def mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else "mpiexec"


@functools.cache
def launcher_kind() -> str:
    """"hydra", "orte" (Open MPI 4), "prrte" (Open MPI 5) or "unknown", from `mpiexec --version`."""
    try:
        version = subprocess.run([mpiexec(), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = version.stdout + version.stderr
    if "HYDRA" in text:
        return "hydra"
    if "OpenRTE" in text:
        return "orte"
    if "Open MPI" in text or "PRRTE" in text:
        return "prrte"
    return "unknown"


def launcher_flags() -> list[str]:
    """Flags every launch needs."""
    if launcher_kind() in ("orte", "prrte"):
        return ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    return []


def no_cleanup_flags() -> list[str] | None:
    """Flags that keep the other ranks running when one dies, or None where the launcher has none."""
    return {"hydra": ["-disable-auto-cleanup"], "orte": ["--mca", "orte_abort_on_non_zero_status", "0"]}.get(
        launcher_kind())


def mpi_command(ranks: int, *extra_flags: str) -> list[str]:
    """[mpiexec, its flags, extra_flags, -n, ranks]: prefix it to the program to run."""
    return [mpiexec(), *launcher_flags(), *extra_flags, "-n", str(ranks)]


def run_mpi(ranks: int, program: str, *args: str, timeout: float = 300, env: dict | None = None,
            check: bool = True, prefix: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """Run tests/mpi/programs/<program> on `ranks` processes; fail the test with its output if it fails.
    `prefix`: a command that runs the launcher (as `unshare`, `taskset`)."""
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        full_env.update(env)
    command = [*prefix, *mpi_command(ranks), sys.executable, str(PROGRAMS / program), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=full_env)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} exited {result.returncode}\n--- stdout ---\n{result.stdout[-6000:]}"
            f"\n--- stderr ---\n{result.stderr[-6000:]}"
        )
    return result


if __name__ == "__main__":
    print(" ".join(launcher_flags()))
