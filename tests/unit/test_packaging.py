"""What a pip user gets (issue 25 item 1): one version, the metadata, and an sdist that carries everything the
build compiles. scripts/sdist_check.sh (CI) installs that sdist into a fresh venv and runs it on 2 ranks."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import ddlfast
from ddlfast import mpi_check

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_one_version_single_sourced() -> None:
    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    assert SETUPTOOLS["dynamic"]["version"] == {"attr": "ddlfast.__version__"}
    assert f"## {ddlfast.__version__} " in (ROOT / "CHANGELOG.md").read_text()
    assert "__version__" not in (ROOT / "setup.py").read_text()


def test_metadata() -> None:
    assert PROJECT["license"] == "Apache-2.0" and "Apache License" in (ROOT / "LICENSE").read_text()
    assert any(dependency.startswith("ml_dtypes") for dependency in PROJECT["dependencies"])
    assert {"torch", "bench", "cupy"} <= set(PROJECT["optional-dependencies"])
    assert PROJECT["classifiers"] and PROJECT["urls"] and PROJECT["readme"] == "README.md"


def test_build_records_why_cuda_kernels_are_or_are_not_there() -> None:
    line = mpi_check.recorded_fact("CUDA_KERNELS")
    if line is None:
        pytest.skip("this build predates the record (run scripts/setup.sh)")
    expected = "CUDA kernels compiled: nvcc found" if ddlfast.has_cuda() else "no CUDA kernels: "
    assert line.startswith(expected), line


def tracked(*patterns: str) -> set[str]:
    listing = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(listing.stdout.split())


def test_sdist_carries_every_source_the_build_compiles(tmp_path: Path) -> None:
    pytest.importorskip("build")
    built = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(tmp_path),
                            str(ROOT)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (sdist,) = tmp_path.glob("ddlfast-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    needed = tracked("src", "ddlfast/*.pyx", "ddlfast/*.pxd", "ddlfast/*.pxi", "ddlfast/*.py") | {
        "CMakeLists.txt", "setup.py", "pyproject.toml", "LICENSE", "CHANGELOG.md", "README.md"}
    if not needed:
        pytest.skip("not a git checkout")
    assert needed - names == set()
    assert "ddlfast/_mpi_build.py" not in names  # a build's record of its MPI, not a source
