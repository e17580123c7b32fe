"""A corrupted or planted probe cache under mpiexec: rank 0 warns and probes again, no rank fails or waits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.mpi.launcher import mpiexec

BAD = {
    "nested": "[" * 60_000 + "]" * 60_000,  # json.loads would hit RecursionError on rank 0 alone
    "nan": '{"intra": [NaN, 1e-10], "inter": null, "group": null, "gamma": 2e-10}',
    "truncated": '{"intra": [2e-6, 1e-10], "inter": nu',
}


def plan(tmp_path) -> subprocess.CompletedProcess:
    command = [mpiexec(), "-n", "2", sys.executable, "-m", "ddlfast.plan", "--bytes", "1MiB", "--json"]
    env = {**os.environ, "DDLFAST_CACHE_DIR": str(tmp_path / "cache"), "DDLFAST_PROBE_TIMEOUT_S": "60"}
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.mpi
@pytest.mark.parametrize("damage", [*BAD, "symlink"])
def test_bad_cache_is_ignored_on_every_rank(tmp_path, damage: str) -> None:
    first = plan(tmp_path)
    assert first.returncode == 0, first.stderr
    (cache,) = (tmp_path / "cache").glob("probe-*.json")
    victim = tmp_path / "victim"
    if damage == "symlink":
        victim.write_text("precious")
        cache.unlink()
        cache.symlink_to(victim)
    else:
        cache.write_text(BAD[damage])
    second = plan(tmp_path)
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout)["measured"]["links"]["source"] == "probe"
    assert "CacheWarning" in second.stderr and "measuring again" in second.stderr, second.stderr
    assert not cache.is_symlink() and json.loads(cache.read_text())["intra"][1] > 0  # replaced by a good one
    if damage == "symlink":
        assert victim.read_text() == "precious"
    third = plan(tmp_path)
    assert json.loads(third.stdout)["measured"]["links"]["source"] == "cache"
