"""Which MPI library ddlfast was compiled against, which one mpi4py runs on, and the check that they match.

ddlfast's core calls MPI's C API on communicators that mpi4py made, so both must use one MPI library. Two builds of
different MPIs load side by side without complaint and then crash (an Open MPI `MPI_Comm` is a pointer, an MPICH
one an int) or abort in `MPI_Init`. So `import ddlfast` compares the MPI recorded at build time (`_mpi_build.py`,
written by setup.py from the `mpi.h` it compiled with) with `MPI.Get_library_version()` and raises `DdlfastError`
saying how to rebuild.

Libraries of one ABI family interoperate: MPICH, Intel MPI, MVAPICH and Cray MPICH share MPICH's ABI; Open MPI
and IBM Spectrum MPI share Open MPI's. Within one vendor the major version must match as well.

This module imports nothing from ddlfast at the top: setup.py loads it by path before ddlfast is built.
"""

from __future__ import annotations

import re
import runpy
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Beside the compiled modules (read by path: a staged copy of the package must not find the source tree's record
# through an editable install's finder).
RECORD = Path(__file__).with_name("_mpi_build.py")

# (vendor, ABI family, pattern of Get_library_version's first lines giving the version)
_LIBRARY_PATTERNS = [
    ("Spectrum MPI", "openmpi", r"Spectrum MPI\s+v?(\d[\w.]*)"),
    ("Open MPI", "openmpi", r"Open MPI v?(\d[\w.]*)"),
    ("Intel MPI", "mpich", r"Intel\(R\) MPI Library\s+(\d[\w.]*)"),
    ("MVAPICH", "mpich", r"MVAPICH\d?\s+Version\s*:?\s*(\d[\w.]*)"),
    ("Cray MPICH", "mpich", r"CRAY MPICH version\s+(\d[\w.]*)"),
    ("MPICH", "mpich", r"MPICH Version:\s*(\d[\w.]*)"),
]
# (vendor, ABI family, version macro of mpi.h); the first one defined wins
_HEADER_MACROS = [
    ("Intel MPI", "mpich", "I_MPI_VERSION"),
    ("MVAPICH", "mpich", "MVAPICH2_VERSION"),
    ("MVAPICH", "mpich", "MVAPICH_VERSION"),
    ("MPICH", "mpich", "MPICH_VERSION"),
]


@dataclass(frozen=True)
class MpiIdentity:
    vendor: str  # "Open MPI", "MPICH", "Intel MPI", ... or "unknown"
    family: str  # ABI family: "openmpi", "mpich" or "unknown"
    version: str  # "4.1.4", or "" when not known

    @property
    def major(self) -> str:
        return self.version.split(".")[0]

    def __str__(self) -> str:
        return f"{self.vendor} {self.version}".strip()


def from_library_version(text: str) -> MpiIdentity:
    """The identity in `MPI_Get_library_version`'s text (mpi4py's `MPI.Get_library_version()`)."""
    for vendor, family, pattern in _LIBRARY_PATTERNS:
        match = re.search(pattern, text)
        if match:
            return MpiIdentity(vendor, family, match.group(1).rstrip("."))
    first_line = text.strip().splitlines()[0] if text.strip() else "?"
    return MpiIdentity("unknown", "unknown", first_line.strip("\0 "))


def from_header_macros(macros: dict[str, str]) -> MpiIdentity:
    """The identity from `mpi.h`'s macros (`mpicc -E -dM`)."""
    if "OPEN_MPI" in macros:
        version = ".".join(macros.get(f"OMPI_{part}_VERSION", "?") for part in ("MAJOR", "MINOR", "RELEASE"))
        return MpiIdentity("Open MPI", "openmpi", version)
    for vendor, family, macro in _HEADER_MACROS:
        if macro in macros:
            return MpiIdentity(vendor, family, macros[macro].strip('"'))
    return MpiIdentity("unknown", "unknown", "")


def header_identity(mpicc: str) -> MpiIdentity:
    """The MPI whose `mpi.h` the compiler wrapper `mpicc` compiles against."""
    result = subprocess.run([mpicc, "-E", "-dM", "-x", "c", "-"], input="#include <mpi.h>\n", capture_output=True,
                            text=True, check=True)
    macros = {}
    for line in result.stdout.splitlines():
        parts = line.split(None, 2)
        if len(parts) >= 2 and parts[0] == "#define":
            macros[parts[1]] = parts[2] if len(parts) == 3 else ""
    return from_header_macros(macros)


def compatible(built: MpiIdentity, running: MpiIdentity) -> bool:
    """Whether a core compiled against `built` can run on `running` (unknown libraries are given the benefit)."""
    if "unknown" in (built.family, running.family):
        return True
    if built.family != running.family:
        return False
    if built.vendor == running.vendor and built.major and running.major:
        return built.major == running.major
    return True


def built_with() -> tuple[MpiIdentity, str] | None:
    """(the MPI this build was compiled against, its mpicc), or None for a build that did not record it."""
    if not RECORD.exists():
        return None
    values = runpy.run_path(str(RECORD))
    return MpiIdentity(values["VENDOR"], values["FAMILY"], values["VERSION"]), values["MPICC"]


def running_on() -> MpiIdentity:
    """The MPI library mpi4py runs on."""
    from mpi4py import MPI

    return from_library_version(MPI.Get_library_version())


def verify() -> None:
    """Raises DdlfastError when ddlfast's core and mpi4py were built for different MPI libraries."""
    recorded = built_with()
    if recorded is None:
        return
    built, mpicc = recorded
    running = running_on()
    if compatible(built, running):
        return
    from ddlfast.errors import DdlfastError

    raise DdlfastError(
        f"ddlfast was compiled against {built} ({mpicc}) but mpi4py runs on {running}; both must use one MPI "
        "library. Rebuild both for one MPI: `DDLFAST_MPI=system bash scripts/setup.sh` (or DDLFAST_MPI=/path/to/mpicc,"
        " or DDLFAST_MPI=wheel for the pip mpich wheel), or by hand: `MPICC=<mpicc> pip install --no-cache-dir "
        "--no-binary=mpi4py --force-reinstall mpi4py` then `DDLFAST_MPICC=<mpicc> pip install --no-build-isolation "
        "--no-deps -e .` (docs/mpi.md)")
