"""ddlfast and mpi4py must run on one MPI library: how the two are identified and compared (ddlfast/mpi_check.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ddlfast
from ddlfast import info, mpi_check
from ddlfast.mpi_check import MpiIdentity, compatible, from_header_macros, from_library_version

OPEN_MPI_4 = "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4, May 26, 2022\0"
MPICH_5 = "MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25 20:45:26 UTC 2026\nMPICH ABI:          18:2:6\n"


@pytest.mark.parametrize(("text", "vendor", "family", "version"), [
    (OPEN_MPI_4, "Open MPI", "openmpi", "4.1.4"),
    ("Open MPI v5.0.11, package: Open MPI runner@host Distribution, ident: 5.0.11", "Open MPI", "openmpi", "5.0.11"),
    (MPICH_5, "MPICH", "mpich", "5.0.2"),
    ("MPICH Version:\t4.0.2\nMPICH Release date:\tThu May 19 13:44:10 CDT 2022\n", "MPICH", "mpich", "4.0.2"),
    ("Intel(R) MPI Library 2021.6 for Linux* OS\n", "Intel MPI", "mpich", "2021.6"),
    ("MVAPICH2 Version      :\t2.3.7\n", "MVAPICH", "mpich", "2.3.7"),
    ("MPI VERSION    : CRAY MPICH version 8.1.25.17 (ANL base 3.4a2)\n", "Cray MPICH", "mpich", "8.1.25.17"),
    ("IBM Spectrum MPI 10.04.00.03\n", "Spectrum MPI", "openmpi", "10.04.00.03"),
    ("Some Other MPI 1.0\n", "unknown", "unknown", "Some Other MPI 1.0"),
])
def test_library_version_strings(text: str, vendor: str, family: str, version: str) -> None:
    assert from_library_version(text) == MpiIdentity(vendor, family, version)


def test_header_macros() -> None:
    open_mpi = {"OPEN_MPI": "1", "OMPI_MAJOR_VERSION": "4", "OMPI_MINOR_VERSION": "1", "OMPI_RELEASE_VERSION": "4"}
    assert from_header_macros(open_mpi) == MpiIdentity("Open MPI", "openmpi", "4.1.4")
    assert from_header_macros({"MPICH_VERSION": '"5.0.2"'}) == MpiIdentity("MPICH", "mpich", "5.0.2")
    intel = {"MPICH_VERSION": '"3.4a2"', "I_MPI_VERSION": '"2021.6.0"'}
    assert from_header_macros(intel) == MpiIdentity("Intel MPI", "mpich", "2021.6.0")


def test_compatibility_is_the_abi_family_and_the_vendors_major_version() -> None:
    ompi4, ompi5 = MpiIdentity("Open MPI", "openmpi", "4.1.4"), MpiIdentity("Open MPI", "openmpi", "5.0.11")
    mpich4, mpich5 = MpiIdentity("MPICH", "mpich", "4.0.2"), MpiIdentity("MPICH", "mpich", "5.0.2")
    assert compatible(ompi4, from_library_version(OPEN_MPI_4))
    assert not compatible(ompi4, mpich5) and not compatible(mpich5, ompi4)
    assert not compatible(ompi4, ompi5) and not compatible(mpich4, mpich5)
    assert compatible(mpich5, MpiIdentity("Intel MPI", "mpich", "2021.6"))  # MPICH ABI
    assert compatible(mpich5, MpiIdentity("unknown", "unknown", "?"))


def test_the_loaded_build_matches_mpi4py_and_says_so() -> None:
    recorded = mpi_check.built_with()
    assert recorded is not None, "setup.py did not write ddlfast/_mpi_build.py"
    assert compatible(recorded[0], mpi_check.running_on())
    facts = info.mpi_facts()
    assert facts["ddlfast_built_against"] == str(recorded[0])
    assert "\0" not in ddlfast.build_info()["mpi_library"]
    assert not ddlfast.build_info()["mpi_library"].endswith(" ")


def test_a_build_for_another_mpi_is_refused_at_import(tmp_path: Path) -> None:
    """A copy of the package whose record names the other ABI family: `import ddlfast` raises DdlfastError saying
    how to rebuild (the check runs before the compiled core is loaded, so the copy needs none)."""
    running = mpi_check.running_on()
    other = ("MPICH", "mpich", "5.0.2") if running.family == "openmpi" else ("Open MPI", "openmpi", "4.1.4")
    package = tmp_path / "ddlfast"
    package.mkdir()
    for source in Path(ddlfast.__file__).parent.glob("*.py"):
        shutil.copy(source, package)
    (package / "_mpi_build.py").write_text(
        f"MPICC = '/opt/other/bin/mpicc'\nVENDOR = {other[0]!r}\nFAMILY = {other[1]!r}\nVERSION = {other[2]!r}\n")
    program = textwrap.dedent("""
        try:
            import ddlfast
        except Exception as error:
            print(type(error).__name__, error)
        else:
            print("imported", ddlfast.__file__)
    """)
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path)
    assert result.stdout.startswith("DdlfastError"), result.stdout + result.stderr
    assert f"compiled against {other[0]} {other[2]} (/opt/other/bin/mpicc)" in result.stdout
    assert f"mpi4py runs on {running}" in result.stdout
    assert "DDLFAST_MPI=system bash scripts/setup.sh" in result.stdout
