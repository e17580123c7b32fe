"""The main job (README command 1) on a short run: data-parallel training on 4 ranks reaches the accuracy of
single-process training with the same global batch (within 1 point), and the PyTorch part trains too."""

from __future__ import annotations

import re
import sys

import pytest

from tests.mpi.launcher import mpi_command


@pytest.mark.mpi
def test_demo_matches_single_process_accuracy() -> None:
    import subprocess

    command = [*mpi_command(4), sys.executable, "-m", "ddlfast.demo", "--epochs", "4", "--skip-bench"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    found = re.search(r"accuracy (\d\.\d+) \(single process, same global batch: (\d\.\d+), difference", output)
    assert found, output[-6000:]
    parallel, single = float(found.group(1)), float(found.group(2))
    assert abs(parallel - single) <= 0.01, f"4 ranks {parallel:.4f} vs single process {single:.4f}"
    assert single > 0.8, f"the short run should already learn the digits (single process: {single:.4f})"
    torch_accuracy = re.search(r"\[2\] PyTorch.*?accuracy (\d\.\d+)", output, re.DOTALL)
    assert torch_accuracy and float(torch_accuracy.group(1)) > 0.5, output[-6000:]
