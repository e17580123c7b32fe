"""Two emulated hosts (network namespaces, tbf-shaped links) running one MPICH job: topology detection sees
the hosts, auto picks the host-aligned ring, renumbering and fallbacks work, and results are exact.

Runs where root and `ip`/`tc`/`unshare` are available (CI runs as root); always tears the namespaces down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.emulation.netns import EmulatedCluster, available

PROGRAM = Path(__file__).parent / "programs" / "emulated_topology.py"
RATE_BYTES_PER_S = 125e6  # 1gbit
reason = available()
pytestmark = [pytest.mark.mpi, pytest.mark.skipif(reason is not None, reason=f"host emulation {reason}")]


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmulatedCluster]:
    emulated = EmulatedCluster(hosts=2, rate="1gbit")
    with emulated:
        yield emulated
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert emulated.prefix not in listed and emulated.prefix not in links, "emulated hosts were not torn down"


def _run(cluster: EmulatedCluster, slots: list[int], *args: str, ranks: int | None = None) -> tuple[dict, str]:
    result = cluster.run(slots, [sys.executable, str(PROGRAM), *args], timeout=90, ranks=ranks)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    lines = result.stdout.splitlines()
    assert any(line.startswith("0 failures") for line in lines), result.stdout[-3000:]
    return json.loads(next(line for line in lines if line.startswith("{"))), result.stderr


def test_two_hosts_by_two_ranks(cluster: EmulatedCluster) -> None:
    info, _ = _run(cluster, [2, 2], "--dims", "auto,flat,2x2,1x4")
    assert info["hosts"] == 2 and info["ranks_per_host"] == [2, 2] and info["contiguous"]
    assert info["auto_dims"] == "2x2"
    assert info["processor_names"] == [cluster.namespace(0)] * 2 + [cluster.namespace(1)] * 2
    assert info["shared_memory"] is False  # hosts apart: the agreement's messages go through the shaper too
    # The links were measured through the shaper (not around it through shared memory) ...
    assert info["links"]["source"] == "probe"
    inter_rate = 1 / info["links"]["inter"][1]
    assert 0.5 * RATE_BYTES_PER_S < inter_rate < 1.1 * RATE_BYTES_PER_S, inter_rate
    # ... and the host's ranks talk faster among themselves (shared memory, unshaped; by a wide margin when
    # the machine is quiet, less when it is busy).
    assert 1 / info["links"]["intra"][1] > 1.5 * inter_rate
    _assert_cores_shared(info, ranks=4)


def _assert_cores_shared(info: dict, ranks: int) -> None:
    """MPI sees hosts of their own, but every emulated host runs on this machine's cores: the ranks count as
    competing for them where they outnumber them (the plan and the transport's spin, MpiTransport::choose_spin)."""
    crowded = ranks > len(os.sched_getaffinity(0))  # the launched ranks inherit this process's cores
    assert info["oversubscribed"] is crowded, info
    assert info["spin_us"] == [0.0 if crowded else 200.0] * ranks, info


def test_one_rank_per_emulated_host_has_a_core(cluster: EmulatedCluster) -> None:
    info, _ = _run(cluster, [1, 1], "--dims", "auto", "--count", "100003")
    assert info["hosts"] == 2 and info["ranks_per_host"] == [1, 1]
    _assert_cores_shared(info, ranks=2)


def test_round_robin_placement_is_renumbered(cluster: EmulatedCluster) -> None:
    info, _ = _run(cluster, [1, 1], "--dims", "auto,flat", "--count", "100003", ranks=4)
    assert info["host_of_rank"] == [0, 1, 0, 1] and not info["contiguous"]
    assert info["order"] == [0, 2, 1, 3] and info["auto_dims"] == "2x2"


def test_irregular_placement_is_flat_with_a_warning(cluster: EmulatedCluster) -> None:
    info, stderr = _run(cluster, [3, 1], "--dims", "auto", "--count", "100003", "--straddle", "2x2")
    assert info["ranks_per_host"] == [3, 1] and info["auto_dims"] == "4"
    assert "TopologyWarning" in stderr and "ranks per host differ" in stderr
