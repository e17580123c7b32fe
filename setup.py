"""Drives CMakeLists.txt (the one build) from pip / setuptools.

Environment:
  DDLFAST_CUDA   auto (default) | on | off
  DDLFAST_MPICC  the MPI compiler wrapper to build against (default: the one
                 next to this Python, i.e. the pip `mpich` wheel's, else PATH)
  DDLFAST_SANITIZE=1  ASan/UBSan build of the core
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def find_mpicc() -> str:
    explicit = os.environ.get("DDLFAST_MPICC")
    if explicit:
        return explicit
    beside_python = Path(sys.executable).parent / "mpicc"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("mpicc")
    if not found:
        sys.exit("ddlfast: no mpicc found; `pip install mpich` or set DDLFAST_MPICC")
    return found


class CMakeExtension(Extension):
    def __init__(self, name: str, optional: bool = False) -> None:
        super().__init__(name, sources=[], optional=optional)


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        if ext.name == "ddlfast._cuda":
            return  # one CMake build makes both modules; _cuda only where CUDA was found (hence optional)
        cuda = os.environ.get("DDLFAST_CUDA", "auto").lower()
        if cuda not in ("auto", "on", "off"):
            sys.exit(f"ddlfast: DDLFAST_CUDA must be auto, on or off, not {cuda!r}")
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        # A stable folder, so rebuilds are incremental.
        build_dir = ROOT / "build" / f"cmake-{cuda}"
        build_dir.mkdir(parents=True, exist_ok=True)
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DMPI_C_COMPILER={find_mpicc()}",
            f"-DDDLFAST_CUDA={cuda}",
            f"-DDDLFAST_SANITIZE={'ON' if os.environ.get('DDLFAST_SANITIZE') == '1' else 'OFF'}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
        ]
        subprocess.run(configure, check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--parallel", "2"], check=True)


setup(ext_modules=[CMakeExtension("ddlfast._core"), CMakeExtension("ddlfast._cuda", optional=True)], cmdclass={"build_ext": CMakeBuild})
