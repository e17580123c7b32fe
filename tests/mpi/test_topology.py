"""Topology detection, the probe and the planner under mpiexec on one host (multi-host: tests/emulation)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.mpi.launcher import mpi_command, run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize(("ranks", "mode"), [(1, "sync"), (3, "sync"), (4, "async")])
def test_one_host_auto_is_flat_and_correct(ranks: int, mode: str, tmp_path) -> None:
    result = run_mpi(ranks, "topology_cases.py", mode, env={"DDLFAST_CACHE_DIR": str(tmp_path)}, timeout=120)
    assert "0 failures" in result.stdout, result.stdout
    info = json.loads(result.stdout.splitlines()[0])
    assert info["hosts"] == 1 and info["auto_dims"] == str(ranks) and info["warnings"] == []
    assert info["shared_memory"] == (ranks > 1)  # one host: the agreement runs in shared memory


@pytest.mark.mpi
def test_ring_dims_auto_from_the_environment() -> None:
    result = run_mpi(2, "one_allreduce.py", env={"DDLFAST_RING_DIMS": "auto"}, timeout=120)
    assert result.stdout.count("ok") == 2


@pytest.mark.mpi
def test_bad_topology_environment_is_a_clear_error() -> None:
    for variable, value in (("DDLFAST_HOSTS_PER_GROUP", "racks"), ("DDLFAST_PROBE", "maybe")):
        result = run_mpi(2, "one_allreduce.py", env={variable: value, "DDLFAST_RING_DIMS": "auto"}, check=False,
                         timeout=120)
        assert result.returncode != 0 and f"{variable}='{value}'" in result.stderr, result.stderr


@pytest.mark.mpi
def test_planner_measures_then_uses_its_cache(tmp_path) -> None:
    command = [*mpi_command(2), sys.executable, "-m", "ddlfast.plan", "--bytes", "1MiB", "--json"]
    env = {"DDLFAST_CACHE_DIR": str(tmp_path)}
    sources = []
    for _ in range(2):
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, **env})
        assert result.returncode == 0, result.stderr
        data = json.loads(result.stdout)
        sources.append(data["measured"]["links"]["source"])
        assert data["cluster"]["ranks"] == 2 and data["measured"]["links"]["intra"][1] > 0
    assert sources == ["probe", "cache"]
    assert len(list(tmp_path.glob("probe-*.json"))) == 1
    skipped = subprocess.run(command, capture_output=True, text=True, timeout=120,
                             env={**os.environ, **env, "DDLFAST_PROBE": "0"})
    assert json.loads(skipped.stdout)["measured"]["links"]["source"] == "defaults (DDLFAST_PROBE=0)"


@pytest.mark.mpi
def test_probe_with_an_unresponsive_peer_times_out() -> None:
    result = run_mpi(2, "topology_probe_timeout.py", timeout=60)
    times = [float(t) for t in re.findall(r"timeout after ([0-9.]+)s", result.stdout)]
    assert len(times) == 2, result.stdout
    assert all(t < 5 for t in times) and "DDLFAST_PROBE=0 skips the probe" in result.stdout
