"""What the CUDA tests need to know: is the GPU module built, is there a device, is CuPy installed; and
how to start a program of tests/cuda/programs under mpiexec."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddlfast.buffers import device as device_arrays
from tests.mpi.launcher import mpi_command

PROGRAMS = Path(__file__).parent / "programs"

BUILT = device_arrays.built_with_cuda()
DEVICES = device_arrays.device_count()
NO_DEVICE_REASON = "" if DEVICES else (device_arrays.cuda_module().no_device_reason() if BUILT
                                       else "ddlfast was built without CUDA")

needs_build = pytest.mark.skipif(not BUILT, reason="ddlfast was built without CUDA (no nvcc at build time)")
needs_device = pytest.mark.skipif(DEVICES == 0, reason=f"no CUDA device: {NO_DEVICE_REASON}")


def has_cupy() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or CuPy failing to find a driver
        return False
    return True


def run_program(ranks: int, program: str, *args: str, timeout: float = 300,
                env: dict | None = None) -> subprocess.CompletedProcess:
    """Run tests/cuda/programs/<program> on `ranks` processes; fail the test with its output if it fails."""
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[2]),
                                                           full_env.get("PYTHONPATH")]))
    if env:
        full_env.update(env)
    command = [*mpi_command(ranks), sys.executable, str(PROGRAMS / program), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=full_env)
    if result.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} exited {result.returncode}\n--- stdout ---\n{result.stdout[-6000:]}"
            f"\n--- stderr ---\n{result.stderr[-6000:]}"
        )
    return result
