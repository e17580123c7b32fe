"""A rank that dies (exit without finalize, or SIGKILL) mid-collective or before
joining one: the job must exit non-zero within 30 s of the death, not hang.

Under hydra (the pip mpich wheel's mpiexec) the process manager notices the
dead process and kills the rest of the job ("BAD TERMINATION ... CLEANING UP
REMAINING PROCESSES"); that takes well under a second. With
`mpiexec -disable-auto-cleanup` (or a launcher that does not clean up) only
ddlfast's stall limit frees the survivors: each raises DdlfastTimeoutError
after DDLFAST_TIMEOUT_S (plus the census naming the missing rank), and the
job must still end.

Each test prints its measured time from the death to the end of mpiexec.
mpiexec runs in its own session so that a hang is cleaned up entirely
(killpg), never leaving ranks spinning on the CI machine.

What the tests assert on must survive MPI_Abort: the exit status, the time,
the victim's DEATH line (printed seconds before any abort) and the files the
survivors write before raising (--record). Not the survivors' output: when
one rank aborts, hydra kills the others and its proxies, and lines already
printed (flushed) but not yet forwarded by the proxy are lost.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.mpi.launcher import PROGRAMS, launcher_kind, mpi_command, no_cleanup_flags

DEADLINE_S = 30.0  # the limit from a rank's death to the job's end
STALL_LIMIT_S = 3  # DDLFAST_TIMEOUT_S where only ddlfast can notice the death
STARTUP_S = 60.0  # start-up and warm-up before the death, on a loaded 2-core machine


def run_until_death(ranks: int, *args: str, mpiexec_flags: tuple[str, ...] = (), python_flags: tuple[str, ...] = (),
                    env: dict | None = None) -> tuple[int | None, float | None, str]:
    """Runs rank_death.py; returns (mpiexec's exit code, or None if it was still running DEADLINE_S after the
    death; seconds from the death to the end of mpiexec; the output)."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    command = [*mpi_command(ranks, *mpiexec_flags), sys.executable, *python_flags,
               str(PROGRAMS / "rank_death.py"), *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                               start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True)
    reader.start()
    started = time.time()
    code = None
    while True:
        code = process.poll()
        now = time.time()
        if code is not None:
            break
        death = _death_time(lines)
        if now - started > STARTUP_S + DEADLINE_S or (death is not None and now - death > DEADLINE_S + 1):
            os.killpg(process.pid, signal.SIGKILL)  # every rank and hydra proxy, not only mpiexec
            process.wait()
            break
        time.sleep(0.02)
    ended = time.time()
    reader.join(timeout=10)
    death = _death_time(lines)
    return code, (ended - death if death is not None else None), "".join(lines)


def _death_time(lines: list[str]) -> float | None:
    for line in list(lines):
        if line.startswith("DEATH "):
            return float(line.split()[1])
    return None


def assert_ended_in_time(code: int | None, after_death: float | None, output: str, what: str) -> None:
    print(f"{what}: mpiexec exited {code} {after_death:.2f} s after the death" if after_death is not None
          else f"{what}: no death seen")
    for line in re.findall(r"^rank \d+: .*$", output, re.MULTILINE):
        print("   ", line[:300])
    assert after_death is not None, f"{what}: the victim never died\n{output[-4000:]}"
    assert code is not None, f"{what}: still running {DEADLINE_S:.0f} s after the death\n{output[-4000:]}"
    assert code != 0, f"{what}: mpiexec exited 0 although a rank died\n{output[-4000:]}"
    assert after_death < DEADLINE_S, f"{what}: ended {after_death:.1f} s after the death\n{output[-4000:]}"


@pytest.mark.mpi
@pytest.mark.parametrize(("when", "how", "victim", "layout"), [
    ("mid", "exit", -1, "cached"),
    ("mid", "kill", 0, "cached"),
    ("before", "exit", -1, "cached"),
    ("before", "kill", 0, "new"),
], ids=["mid-exit-last", "mid-kill-rank0", "before-exit-last-ring", "before-kill-rank0-agreement"])
def test_job_ends_when_a_rank_dies(when: str, how: str, victim: int, layout: str) -> None:
    code, after_death, output = run_until_death(4, "--when", when, "--how", how, "--victim", str(victim),
                                                "--layout", layout)
    assert_ended_in_time(code, after_death, output, f"{when}/{how}/victim {victim}/{layout} layout")
    if when == "mid":
        assert "inside_collective=True" in output, output[-4000:]


def recorded(directory) -> dict[int, dict[str, str]]:
    """rank -> {"error": ..., "uncaught": ...}: what each survivor wrote before it raised (see rank_death.py)."""
    found: dict[int, dict[str, str]] = {}
    for path in directory.iterdir():
        complete = re.fullmatch(r"rank(\d+)\.(error|uncaught)", path.name)  # not a write cut short by an abort
        if complete:
            found.setdefault(int(complete.group(1)), {})[complete.group(2)] = path.read_text()
    return found


def assert_stalls_name_missing_ranks(records: dict[int, dict[str, str]], victim: int, output: str) -> None:
    """Some survivor raised; every stall report names a rank that had left: the victim, or one that failed with
    another error first (a neighbour of the victim may see MPI's error before any stall limit: under
    `python -m mpi4py` that error alone aborts the job)."""
    errors = {rank: r["error"] for rank, r in records.items() if "error" in r}
    assert errors and all(e.startswith("Ddlfast") for e in errors.values()), f"{errors}\n{output[-4000:]}"
    stalls = {rank: e for rank, e in errors.items() if e.startswith("DdlfastTimeoutError")}
    gone = {victim} | {rank for rank, e in errors.items() if not e.startswith("DdlfastTimeoutError")}
    for rank, message in stalls.items():
        named = {int(r) for r in re.findall(r"\branks? (\d+)", message.split(":", 1)[1])} - {rank}
        assert named & gone, f"rank {rank}'s stall names {sorted(named)}, not one of {sorted(gone)}: {message}"


def _no_cleanup_flags() -> tuple[str, ...]:
    """The launcher's flags that leave the survivors running (tests/mpi/launcher.py), or skip."""
    flags = no_cleanup_flags()
    if flags is None:
        pytest.skip(f"the {launcher_kind()} launcher has no way to keep the survivors of a dead rank running")
    return tuple(flags)


@pytest.mark.mpi
@pytest.mark.parametrize("when", ["mid", "before"])
def test_without_launcher_cleanup_the_stall_limit_ends_the_job(when: str, tmp_path) -> None:
    """-disable-auto-cleanup: nothing kills the survivors but ddlfast's stall limit. `python -m mpi4py` turns
    the uncaught DdlfastTimeoutError into MPI_Abort, which ends the job."""
    code, after_death, output = run_until_death(
        4, "--when", when, "--how", "exit", "--record", str(tmp_path), mpiexec_flags=_no_cleanup_flags(),
        python_flags=("-m", "mpi4py"), env={"DDLFAST_TIMEOUT_S": str(STALL_LIMIT_S)})
    assert_ended_in_time(code, after_death, output, f"{when}/exit, no launcher cleanup, python -m mpi4py")
    assert_stalls_name_missing_ranks(recorded(tmp_path), 3, output)


@pytest.mark.mpi
def test_without_launcher_cleanup_plain_python_ends_the_job(tmp_path) -> None:
    """A plain `python prog.py` survivor: the uncaught DdlfastBrokenError reaches ddlfast's excepthook, which
    calls MPI_Abort (otherwise MPI_Finalize would wait for the dead rank forever). The job ending in time shows
    the abort; the survivor's record shows the error that reached the hook (its "calling MPI_Abort" line may
    be lost with the job, see the module docstring)."""
    code, after_death, output = run_until_death(
        4, "--when", "mid", "--how", "exit", "--record", str(tmp_path), mpiexec_flags=_no_cleanup_flags(),
        env={"DDLFAST_TIMEOUT_S": str(STALL_LIMIT_S)})
    assert_ended_in_time(code, after_death, output, "mid/exit, no launcher cleanup, plain python")
    records = recorded(tmp_path)
    uncaught = [r["uncaught"] for r in records.values() if "uncaught" in r]
    # A stall (DdlfastTimeoutError), or the dead rank's neighbour's MPI error, after which it told the others
    # (DdlfastBrokenError): either, uncaught, makes the hook abort the job.
    assert any(u.startswith(("DdlfastTimeoutError", "DdlfastBrokenError")) for u in uncaught), \
        f"{records}\n{output[-4000:]}"
