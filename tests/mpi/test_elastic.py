"""Lose ranks, keep training (docs/elastic.md): 4 ranks train under `mpirun --with-ft ulfm` with ddlfast.elastic,
ranks SIGKILL themselves at seeded points (in the agreement, mid-ring, in an async call, between steps, in a
commit, in the recovery's sync, rank 0), and the survivors must finish with parameters bit-identical to a NumPy
reference that runs the same steps on the world sizes they lived through, and to each other.

Runs where ddlfast is built against an MPI with the fault-tolerance extension and the launcher is Open MPI 5's
(CI's second-MPI stage, scripts/test_second_mpi.sh); skips elsewhere. Without ULFM the elastic API refuses,
saying how to launch (also checked here, on any MPI).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from ddlfast import _core
from tests.mpi.launcher import PROGRAMS, launcher_kind, mpi_command, run_mpi
from tests.mpi.programs.elastic_train import elastic_reference

RANKS = 4
TIMEOUT_S = 180  # the whole job, start-up included, on a loaded 2-core machine (a hang ends there)

_rng = random.Random(28)  # the seeded kill steps


def _step(low: int, high: int, async_step: bool = False) -> int:
    while True:
        step = _rng.randrange(low, high)
        if (step % 3 == 2) == async_step:
            return step


CASES = {
    "agreement": f"2:agreement:{_step(1, 29)}",
    "mid_ring": f"2:ring:{_step(1, 29)}",
    "async": f"2:async:{_step(1, 29, async_step=True)}",
    "between_steps": f"2:between:{_step(1, 29)}",
    "two_failures": f"2:ring:{_step(3, 14)},1:between:{_step(16, 28)}",
    "in_commit": f"2:commit:{5 * _rng.randrange(1, 5)}",
    "in_recovery_sync": f"2:ring:{_step(3, 25)},1:sync:0",
    "rank_0": f"0:ring:{_step(1, 29)}",
}

needs_ulfm = pytest.mark.skipif(not _core.ulfm_built or launcher_kind() != "prrte",
                                reason="needs ddlfast built against Open MPI 5 (its ULFM) and its mpirun")


@needs_ulfm
@pytest.mark.parametrize("case", list(CASES))
def test_survivors_finish_bit_identical(case: str, tmp_path) -> None:
    kills = CASES[case]
    victims = {int(spec.split(":")[0]) for spec in kills.split(",")}
    output = _run_ulfm(RANKS, "elastic_train.py", str(tmp_path), kills)
    survivors = sorted(set(range(RANKS)) - victims)
    files = {r: tmp_path / f"rank{r}.npz" for r in survivors}
    missing = [r for r, path in files.items() if not path.exists()]
    assert not missing, f"{case} ({kills}): survivors {missing} did not finish\n{output[-6000:]}"
    assert not any((tmp_path / f"rank{r}.npz").exists() for r in victims), output[-3000:]
    results = {r: np.load(path) for r, path in files.items()}
    history = [tuple(map(int, row)) for row in results[survivors[0]]["history"]]
    assert len(history) >= 1, output[-3000:]
    assert history[-1][1] == RANKS - len(victims), history
    reference = elastic_reference(history, RANKS)
    for r, result in results.items():
        assert [tuple(map(int, row)) for row in result["history"]] == history, (r, output[-3000:])
        assert int(result["size"]) == RANKS - len(victims)
        np.testing.assert_array_equal(result["params"], reference, err_msg=f"rank {r}, {case} ({kills})")
        assert result["params"].tobytes() == reference.tobytes()
    assert sorted(int(results[r]["rank"]) for r in survivors) == list(range(len(survivors)))
    deaths = [float(t) for t in re.findall(r"^DEATH (\S+)", output, re.M)]
    resumed = re.findall(r"^RESUMED (\S+) (\S+) rank (\d+)", output, re.M)
    def since_death(moment: str) -> str:
        return f"{float(moment) - max(d for d in deaths if d <= float(moment)):.2f}"

    print(f"{case} ({kills}): history {history}; seconds from the kill to the survivors' restored and synced "
          "state / their next completed step:", [f"{since_death(synced)}/{since_death(done)}"
                                                   for synced, done, _ in resumed])


def test_elastic_refuses_without_ulfm() -> None:
    """MPICH, or Open MPI launched without --with-ft ulfm: the elastic API says what to launch with."""
    result = run_mpi(2, "elastic_refusal.py")
    assert result.stdout.count("REFUSED") == 2, result.stdout
    assert "--with-ft ulfm" in result.stdout


@needs_ulfm
@pytest.mark.parametrize("mode", ["caught", "creation"])
def test_caught_loss_leaves_a_consistent_context(mode: str) -> None:
    """Survivors that catch RanksLostError themselves and carry on (also when the rank died while the context
    was created): the new world is consistent."""
    result = _run_ulfm(RANKS, "elastic_raw.py", mode)
    assert result.count("CONSISTENT") == 3, result


@needs_ulfm
def test_torch_state_and_distributed_optimizer(tmp_path) -> None:
    """TorchState with ddlfast.torch's hooks and DistributedOptimizer: rank 2 dies in a step's gradient
    allreduce; the survivors' weights are bit-identical to each other and match a float64 torch reference that
    changes the world's size where they did (to 1e-12: the rank average's summation order is ddlfast's)."""
    pytest.importorskip("torch")
    from tests.mpi.programs.elastic_torch import torch_reference

    output = _run_ulfm(RANKS, "elastic_torch.py", str(tmp_path))
    results = {r: np.load(tmp_path / f"rank{r}.npz") for r in (0, 1, 3) if (tmp_path / f"rank{r}.npz").exists()}
    assert sorted(results) == [0, 1, 3], output[-6000:]
    history = [tuple(map(int, row)) for row in results[0]["history"]]
    assert history and history[-1][1] == 3, history
    reference = torch_reference(history, RANKS)
    for r, result in results.items():
        assert result["weight"].tobytes() == results[0]["weight"].tobytes(), r
        np.testing.assert_allclose(result["weight"], reference, rtol=1e-12, atol=1e-14)


@needs_ulfm
@pytest.mark.parametrize("victim", [0])  # rank 0: the old store's host; any other rank is the same path
def test_ddp_on_the_ddlfast_backend(victim: int, tmp_path) -> None:
    """DistributedDataParallel on the "ddlfast" torch.distributed backend: a rank (rank 0 too: the old store's
    host) dies while the others are in DDP's gradient allreduce; elastic.run rebuilds the process group on the
    survivors and the training function builds its DDP anew. The survivors' parameters are bit-identical to a
    NumPy reference that changes the world's size where they did, and to each other."""
    pytest.importorskip("torch")
    from tests.mpi.programs.elastic_ddp import ddp_reference

    kill_step = 7
    output = _run_ulfm(RANKS, "elastic_ddp.py", str(tmp_path), str(victim), str(kill_step))
    survivors = sorted(set(range(RANKS)) - {victim})
    results = {r: np.load(tmp_path / f"rank{r}.npz") for r in survivors if (tmp_path / f"rank{r}.npz").exists()}
    assert sorted(results) == survivors, output[-6000:]
    assert not (tmp_path / f"rank{victim}.npz").exists(), output[-3000:]
    history = [tuple(map(int, row)) for row in results[survivors[0]]["history"]]
    assert len(history) == 1 and history[0][1] == RANKS - 1 and history[0][0] <= kill_step, history
    reference = ddp_reference(history, RANKS)
    for r, result in results.items():
        assert [tuple(map(int, row)) for row in result["history"]] == history, (r, output[-3000:])
        assert int(result["size"]) == RANKS - 1
        assert result["params"].tobytes() == reference.tobytes(), f"rank {r}\n{output[-3000:]}"
    assert sorted(int(result["rank"]) for result in results.values()) == list(range(RANKS - 1))


@needs_ulfm
def test_regrow_replaces_a_lost_rank(tmp_path) -> None:
    """run(regrow=True): rank 2 dies mid-ring; the survivors spawn a replacement, which joins as rank 3 and gets
    the state through the sync; all 4 finish with parameters bit-identical to an uninterrupted 4-rank run."""
    kill_step = 12
    output = _run_ulfm(RANKS, "elastic_grow.py", str(tmp_path), "2", str(kill_step))
    names = ["rank0", "rank1", "rank3", f"replacement{RANKS - 1}"]
    missing = [name for name in names if not (tmp_path / f"{name}.npz").exists()]
    assert not missing, f"{missing} did not finish\n{output[-6000:]}"
    assert not (tmp_path / "rank2.npz").exists(), output[-3000:]
    results = {name: np.load(tmp_path / f"{name}.npz") for name in names}
    history = [tuple(map(int, row)) for row in results["rank0"]["history"]]
    assert len(history) == 1 and history[0][1] == RANKS and history[0][0] <= kill_step, history
    reference = elastic_reference(history, RANKS)
    for name, result in results.items():
        assert int(result["size"]) == RANKS, name
        assert result["params"].tobytes() == reference.tobytes(), f"{name}\n{output[-3000:]}"
    assert sorted(int(result["rank"]) for result in results.values()) == list(range(RANKS))


@needs_ulfm
def test_sync_refuses_rank_dependent_commits() -> None:
    result = _run_ulfm(2, "elastic_raw.py", "divergent")
    assert result.count(": REFUSED") == 2 and "NOT REFUSED" not in result, result
    assert result.count("REGROW REFUSED") == 2, result


@needs_ulfm
def test_sync_accepts_identical_sets_and_default_repr_objects() -> None:
    """Identical commits whose repr() differs per process (a set of strings, an object at its own address) are
    found identical: the fingerprint encodes the state, not its repr."""
    result = _run_ulfm(2, "elastic_raw.py", "identical")
    assert result.count(": SYNCED") == 2 and "NOT SYNCED" not in result, result


def _run_ulfm(ranks: int, program: str, *args: str) -> str:
    command = [*mpi_command(ranks, "--with-ft", "ulfm"), sys.executable, str(PROGRAMS / program), *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", DDLFAST_TIMEOUT_S="10")
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env, start_new_session=True)
    try:
        return process.communicate(timeout=TIMEOUT_S)[0]
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"{program} {args} hung\n{process.communicate()[0][-6000:]}")
