"""What the loaded build says about itself."""

from __future__ import annotations

import os
import shutil

import ddlfast


def test_build_info_reports_the_essentials() -> None:
    info = ddlfast.build_info()
    for key in ("compiler", "kernel_paths", "kernel_selected", "cuda", "mpi_library", "small_message_handoff"):
        assert key in info, key
    assert info["kernel_selected"] in info["kernel_paths"]
    assert "scalar" in info["kernel_paths"]
    assert "MPI" in info["mpi_library"] or "Open MPI" in info["mpi_library"]


def test_cuda_is_built_wherever_nvcc_is_found() -> None:
    nvcc = shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc")
    if os.environ.get("DDLFAST_CUDA", "auto") == "off":
        assert ddlfast.has_cuda() is False
    elif nvcc:
        assert ddlfast.has_cuda() is True, "nvcc is installed but the CUDA kernels were not built"
    else:
        assert ddlfast.has_cuda() is False
