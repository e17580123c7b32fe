"""The latency path: small allreduces inside the per-call agreement's butterfly (src/transport/
agreement_exchange.cc) or, on one host, its slots in shared memory (shared_agreement.cc), every op and dtype at
the small-message limit's edges against NumPy, and disagreements found inside the exchange on one rank after the
layout was cached: an error on every rank, no data written, the context usable (tests/mpi/programs/
latency_cases.py). Rank counts that fold (3, 5, 6, 7) and that do not; each with the whole payload in every step,
with recursive halving and doubling from 400 bytes up (DDLFAST_HALVING_BYTES; the program then adds a
disagreement across that threshold: one rank halving, the others not), and halving every payload, down to one
element (blocks of none)."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.mpi.launcher import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("shared", ["1", "0"])
@pytest.mark.parametrize("halving", ["0", "400", "1"])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 8])
def test_latency_path_results_and_disagreements(ranks: int, halving: str, shared: str) -> None:
    """shared: in memory the ranks share (this host's default), or the butterfly's messages (as across hosts)."""
    env = {"DDLFAST_HALVING_BYTES": halving, "DDLFAST_SHARED_MEMORY": shared}
    result = run_mpi(ranks, "latency_cases.py", timeout=900, env=env)
    assert result.stdout.count(" 0 failures") == ranks, result.stdout


# A private /dev/shm of this size holds MPICH's own segments (2 MiB) and the creation's slots at P = 2 (0.5 MiB),
# not the reach's (2 x 2 x 4 MiB). Open MPI's shared-memory transport wants 16 MiB there: its backing file goes to
# /tmp instead (MPICH ignores the variable).
SMALL_DEV_SHM = "8m"
OPEN_MPI_BACKING = {"OMPI_MCA_btl_sm_backing_directory": "/tmp"}


@pytest.mark.mpi
def test_shared_memory_slots_that_cannot_grow() -> None:
    """Where /dev/shm cannot hold the slots of the reach's capacity (a container's 64 MiB at P = 8), every rank
    keeps its smaller slots and the agreement stays in shared memory; calls past them take the ring, with the
    right numbers (shared_memory_cases.py --slots-cannot-grow). Two ranks on one core (`taskset`), so the policy
    is the oversubscribed one on any machine, in a mount namespace (`unshare -m`) with a small tmpfs on /dev/shm."""
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("taskset")):
        pytest.skip("needs root, unshare and taskset (a private /dev/shm of a chosen size)")
    mount = f"mount -t tmpfs -o size={SMALL_DEV_SHM} tmpfs /dev/shm && exec taskset -c 0 \"$@\""
    result = run_mpi(2, "shared_memory_cases.py", "--slots-cannot-grow", timeout=600,
                     env={"DDLFAST_FLIGHT_RECORDS": "16", **OPEN_MPI_BACKING},
                     prefix=["unshare", "-m", "sh", "-c", mount, "sh"])
    assert result.stdout.count(" 0 failures") == 2, result.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("halving", ["auto", "100000"])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_latency_path_past_its_creation_capacity(tmp_path, ranks: int, halving: str) -> None:
    """Across (emulated) hosts on a slow network the cost model sends allreduces up to MAX_LATENCY_REACH_BYTES to
    the latency path, and every rank's agreement messages grow to carry them (tests/mpi/programs/
    latency_reach_cases.py): results, the path taken, and disagreements, whole and halving."""
    env = {"DDLFAST_EMULATED_HOSTS": str(ranks), "DDLFAST_CACHE_DIR": str(tmp_path), "DDLFAST_PROBE": "1",
           "DDLFAST_FLIGHT_RECORDS": "16", "DDLFAST_HALVING_BYTES": halving}
    result = run_mpi(ranks, "latency_reach_cases.py", timeout=900, env=env)
    assert result.stdout.count(" 0 failures") == ranks, result.stdout


@pytest.mark.mpi
def test_latency_path_takes_the_sizes_it_wins_across_hosts(tmp_path) -> None:
    """8 emulated hosts on a network where the model's latency path wins at 128 KiB, loses at 256 KiB and wins at
    512 KiB: the engine takes each size as the topology says, with the right numbers, and a rank at the ring's size
    against the others at a latency size raises on every rank (latency_reach_cases.py --crossing)."""
    env = {"DDLFAST_EMULATED_HOSTS": "8", "DDLFAST_CACHE_DIR": str(tmp_path), "DDLFAST_PROBE": "1",
           "DDLFAST_FLIGHT_RECORDS": "16"}
    result = run_mpi(8, "latency_reach_cases.py", "--crossing", timeout=900, env=env)
    assert result.stdout.count(" 0 failures") == 8, result.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_latency_path_in_shared_memory(ranks: int) -> None:
    """All ranks on this host: the agreement runs in shared memory, on or off alike on every rank, and the latency
    path reaches as far as this host's policy says, the segment mapped anew at that capacity
    (tests/mpi/programs/shared_memory_cases.py): results, the path taken, and disagreements at the reach."""
    result = run_mpi(ranks, "shared_memory_cases.py", timeout=900, env={"DDLFAST_FLIGHT_RECORDS": "16"})
    assert result.stdout.count(" 0 failures") == ranks, result.stdout
