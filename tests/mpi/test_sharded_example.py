"""The sharded-training example (examples/sharded_training.py) at a small size: reduce-scattered gradients,
sharded Adam and allgathered parameters reach the loss of the unsharded run, with identical parameters on every
rank. P=3 pads the flat buffer (the parameter count is not a multiple of 3)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mpi.launcher import mpi_command

EXAMPLE = Path(__file__).parents[2] / "examples" / "sharded_training.py"


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_sharded_training_reaches_the_unsharded_loss(ranks: int) -> None:
    command = [*mpi_command(ranks), sys.executable, str(EXAMPLE), "--width", "24", "--hidden", "40", "--steps", "6",
               "--lr", "0.01", "--check"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "parameters identical on every rank: True; same loss" in output, output[-3000:]
    losses = re.findall(r"^\s*\d+\s+(\d+\.\d+)\s+(\d+\.\d+)$", output, re.MULTILINE)
    assert len(losses) == 6, output[-3000:]
    assert float(losses[-1][0]) < float(losses[0][0]), "the loss must fall"


@pytest.mark.mpi
def test_the_quick_command_in_its_docstring_passes() -> None:
    """The small command the example's docstring gives runs and passes its own --check (it printed MISMATCH)."""
    quick = re.search(r"mpiexec -n (\d+) python examples/sharded_training.py (.*--check)", EXAMPLE.read_text())
    assert quick, "the docstring no longer gives a quick command"
    command = [*mpi_command(int(quick.group(1))), sys.executable, str(EXAMPLE), *quick.group(2).split()]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "same loss" in result.stdout, (result.stdout + result.stderr)[-3000:]
