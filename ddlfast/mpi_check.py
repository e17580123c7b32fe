"""Which MPI library ddlfast was compiled against, which one mpi4py runs on, and the check that they match.

ddlfast's core calls MPI's C API on communicators that mpi4py made, so both must use one MPI library. Two builds of
different MPIs load side by side without complaint and then crash (an Open MPI `MPI_Comm` is a pointer, an MPICH
one an int) or abort in `MPI_Init`. So `import ddlfast` compares the MPI recorded at build time (`_mpi_build.py`,
written by setup.py from the `mpi.h` it compiled with) with `MPI.Get_library_version()` and raises `DdlfastError`
saying how to rebuild.

Libraries of one ABI family interoperate: MPICH, Intel MPI, MVAPICH and Cray MPICH share MPICH's ABI; Open MPI
and IBM Spectrum MPI share Open MPI's. Within one vendor the major version must match as well.

Every compiled module is checked, not only the core: the record lists the modules that build made (file name and
size), and a compiled module beside them that it did not make — a `_cuda` module an earlier build for another MPI
left behind, which imports with `RuntimeWarning: mpi4py.MPI.Comm size changed` and then runs on the wrong MPI's
handles — is refused at import (ImportError naming it and how to rebuild) and named once in a warning.

This module imports nothing from ddlfast at the top: setup.py loads it by path before ddlfast is built.
"""

from __future__ import annotations

import importlib.abc
import re
import runpy
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

# Beside the compiled modules (read by path: a staged copy of the package must not find the source tree's record
# through an editable install's finder).
RECORD = Path(__file__).with_name("_mpi_build.py")

# The package's compiled modules (setup.py builds them all in one CMake build).
COMPILED_MODULES = ("_core", "_cuda", "_testing", "_testing_cuda")

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


def recorded_fact(name: str) -> object:
    """One value setup.py recorded about this build (e.g. CUDA_KERNELS), or None."""
    return runpy.run_path(str(RECORD)).get(name) if RECORD.exists() else None


def stale_modules(directory: Path | None = None, record: Path | None = None) -> list[str]:
    """Compiled modules in the package the recorded build did not make (file names); [] for a build that did not
    record its modules."""
    record = RECORD if record is None else record
    if not record.exists():
        return []
    built = runpy.run_path(str(record)).get("MODULES")
    if built is None:
        return []
    directory = record.parent if directory is None else directory
    stale = []
    for name in COMPILED_MODULES:
        for path in sorted(directory.glob(f"{name}.*.so")):
            if built.get(path.name) != path.stat().st_size:
                stale.append(path.name)
    return stale


class StaleModuleWarning(RuntimeWarning):
    """A compiled module of ddlfast that the current build did not make was found and is refused."""


class _RefuseStale(importlib.abc.MetaPathFinder):
    """Import of a stale compiled module raises ImportError saying why (ddlfast.buffers.device then runs without
    CUDA, as for a build without it), instead of loading a module compiled for another MPI."""

    def __init__(self, refused: dict[str, str]) -> None:
        self.refused = refused

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name in self.refused:
            raise ImportError(self.refused[name], name=name)
        return None


def refuse_stale_modules(directory: Path | None = None, record: Path | None = None) -> list[str]:
    """Refuse (and name, in one StaleModuleWarning) every stale compiled module; returns their file names. A
    stale core is an error: nothing works without it."""
    stale = stale_modules(directory, record)
    if not stale:
        return []
    recorded = built_with()
    built = f"the build against {recorded[0]}" if recorded else "the current build"
    fix = ("delete it, or rebuild: `bash scripts/setup.sh` (DDLFAST_MPI=... for another MPI; docs/mpi.md) removes "
           "modules a build does not make")
    refused = {}
    for file_name in stale:
        module = "ddlfast." + file_name.split(".")[0]
        message = (f"ddlfast: {module} ({file_name}) was not made by {built}; it is left over from an earlier build, "
                   f"maybe for another MPI library, and is not loaded: {fix}")
        if module == "ddlfast._core":
            from ddlfast.errors import DdlfastError

            raise DdlfastError(message)
        refused[module] = message
    sys.meta_path.insert(0, _RefuseStale(refused))
    warnings.warn("; ".join(refused.values()), StaleModuleWarning, stacklevel=3)
    return stale


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
        refuse_stale_modules()  # the core matches; every other compiled module must be this build's too
        return
    from ddlfast.errors import DdlfastError

    raise DdlfastError(
        f"ddlfast was compiled against {built} ({mpicc}) but mpi4py runs on {running}; both must use one MPI "
        "library. Rebuild both for one MPI: `DDLFAST_MPI=system bash scripts/setup.sh` (or DDLFAST_MPI=/path/to/mpicc,"
        " or DDLFAST_MPI=wheel for the pip mpich wheel), or by hand: `MPICC=<mpicc> pip install --no-cache-dir "
        "--no-binary=mpi4py --force-reinstall mpi4py` then `DDLFAST_MPICC=<mpicc> pip install --no-build-isolation "
        "--no-deps -e .` (docs/mpi.md)")
