"""torchrun by mistake (issue 25 item 2), with the real launcher: torchrun starts processes that MPI sees alone, and
ddlfast's first collective raises DdlfastError in each, saying how to launch, instead of every process training
alone as rank 0 of 1 and exiting 0 (tests/unit/test_launch.py has every launcher signal)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

PROGRAM = """import numpy as np, ddlfast
value = ddlfast.allreduce(np.ones(2))[0]
print(f"trained alone: {value}", flush=True)
"""


@pytest.mark.mpi
def test_torchrun_is_refused_with_how_to_launch(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(PROGRAM)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDLFAST_")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "trained alone: 1.0" not in output
    assert "MPI sees 1 process, but torchrun started 2 (WORLD_SIZE=2)" in output, output[-3000:]
    assert "mpiexec -n 2 python your_script.py" in output
    allowed = subprocess.run(command, capture_output=True, text=True, timeout=180,
                             env={**env, "DDLFAST_ALLOW_SINGLE": "1"})
    assert allowed.returncode == 0 and allowed.stdout.count("trained alone: 1.0") == 2, allowed.stdout + allowed.stderr
