"""ddlfast.horovod.torch, the Horovod drop-in (tests/mpi/programs/horovod_cases.py), and Horovod's own
test/parallel/test_torch.py through tests/horovod_shim where a local copy is named by DDLFAST_HOROVOD_TESTS (the
file is Horovod's: nothing is fetched; skipped otherwise). DDLFAST_HOROVOD_TESTS_ALL=1 runs the whole file instead
of the fast subset."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mpi.launcher import run_mpi
from tests.mpi.test_fuzz import run_seeded_fuzz

RUNNER = Path(__file__).resolve().parents[1] / "horovod_shim" / "run_horovod_tests.py"
# One test of each family: ops, names, allgather, broadcast, alltoall, join, process sets, optimizer, reducescatter.
FAST_SUBSET = ("test_horovod_allreduce_async_fused$|test_horovod_allreduce_duplicate_name_error|"
               "test_horovod_allgather_variable_size|test_horovod_broadcast_rank_error|test_horovod_alltoall$|"
               "test_horovod_join_allreduce|test_horovod_allreduce_process_sets|test_force_allreduce|"
               "test_horovod_grouped_reducescatter$")
# Failures that are the test file's, not the drop-in's (docs/horovod.md): torch 2.13's torch.optim.Muon, which the
# tests pick up from Optimizer.__subclasses__(), takes 2-D parameters only (Horovod itself fails alike); and a
# wall-clock assertion that a barrier took at least 5 s on every rank (it can take 5 s less the few milliseconds by
# which a rank left the previous allreduce later).
KNOWN = "test_broadcast_state,test_broadcast_state_options,test_force_allreduce,test_global_barrier_op"


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_horovod_dropin(ranks: int) -> None:
    result = run_mpi(ranks, "horovod_cases.py", timeout=300)
    assert result.stdout.count(" 0 failures") == ranks, result.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_horovods_own_tests(ranks: int) -> None:
    path = os.environ.get("DDLFAST_HOROVOD_TESTS")
    if not path or not Path(path).is_file():
        pytest.skip("DDLFAST_HOROVOD_TESTS does not name a local copy of Horovod's test/parallel/test_torch.py")
    subset = [] if os.environ.get("DDLFAST_HOROVOD_TESTS_ALL") == "1" else ["-k", FAST_SUBSET]
    result = subprocess.run([sys.executable, str(RUNNER), path, "-n", str(ranks), "--known", KNOWN, *subset],
                            capture_output=True, text=True, timeout=3600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_horovod_fuzz(ranks: int) -> None:
    """The drop-in's calls, seeded (programs/horovod_fuzz_cases.py): every op, scale factors, dtypes, sizes past
    the small-message limit, against NumPy and bit-identical across ranks; one case in four changes one setting
    that changes a result (or is wrong) on one rank, which every rank must raise on, naming it."""
    run_seeded_fuzz("horovod_fuzz_cases.py", ranks, cases=120, fault_chance=0.25)
