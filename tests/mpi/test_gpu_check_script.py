"""scripts/gpu_check.sh's host A/B (steps hostab, with BASE), which a device session runs on 16 cores: each tree's
bench runs from that tree, so the two builds are really the two builds (`python -m` puts the working directory
first on the path: run from the repository, both calls measured this tree)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mpi.launcher import launcher_flags, mpiexec

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.mpi
def test_hostab_runs_each_tree_from_itself(tmp_path: Path) -> None:
    base = tmp_path / "base"
    shutil.copytree(ROOT / "ddlfast", base / "ddlfast", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "bench", base / "bench", ignore=shutil.ignore_patterns("__pycache__", "emulation",
                                                                                  "simulation"))
    out = tmp_path / "out"
    env = dict(os.environ, STEPS="hostab", BASE=str(base), HOST_PS="2", ROUNDS="2", HOST_SIZES="4KiB",
               HOST_COLLECTIVES="allreduce allgather",
               PYTHON=sys.executable, MPIEXEC=" ".join([mpiexec(), *launcher_flags()]))
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out)], capture_output=True,
                            text=True, timeout=600, env=env)
    log = (out / "gpu_check.log").read_text()
    assert result.returncode == 0, result.stdout + result.stderr + log
    steps = log.split("===== ")[1:]
    benches = [s for s in steps if s.startswith("hostab_")]
    latencies = [s for s in steps if s.startswith("latency_")]
    # Two rounds of (this tree, base), the order swapped in the second; each ran its own ddlfast and measured.
    # Each collective in turn (HOST_COLLECTIVES), its bench run with --collective.
    assert [s.split(":")[0] for s in benches] == [
        f"hostab_r{r}_{c}_P2_{t}" for r, c in ((1, "allreduce"), (1, "allgather"), (2, "allreduce"), (2, "allgather"))
        for t in ((ROOT.name, "base") if r == 1 else ("base", ROOT.name))]
    assert all(("MPI_Allgather" in s) == ("_allgather_" in s.split(":")[0]) for s in benches), benches
    for step in benches:
        tree = base if "_base:" in step else ROOT
        assert f"{tree / 'ddlfast' / '__init__.py'}\n" in step, step
        assert "  4096 " in step and "exit 0" in step, step
    assert len(latencies) == 8 and all("MPI_Allreduce" in s and "exit 0" in s for s in latencies), latencies
    summary = (out / "summary.txt").read_text()
    assert summary.count("exit 0") == 16 and "exit 1" not in summary
