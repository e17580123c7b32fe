"""Runs on every rank: who the others waited for, the flight recorder and the merged timeline (docs/observe.md).

Modes (argv[1]; argv[2] is a scratch directory every rank shares):

- stragglers: rank P-2 sleeps 0.3 s before some collectives of every kind (latency-path and ring-path allreduce,
  fused, reduce_scatter, broadcast, async); ddlfast.stragglers() must name it on every rank, the same list
  everywhere, with one arrival per delayed call and at least 0.1 s held per call. Bad `last` on one rank, and ranks
  passing different `last`: DdlfastError on every rank. DDLFAST_STRAGGLER_WARN_S: rank 0 alone warns, naming it.
- stall: every rank records; rank P-1 writes its record on SIGUSR1 and then stops joining; the others' collective
  (a ring-sized allreduce) fails on the stall limit and each writes its record; `python -m ddlfast.flight` must
  say rank P-1 never arrived at that collective, which the others waited in, and where rank P-1 last was.
- mismatch: rank 1 passes int32 where the others pass float32 (above and below the small-message limit): every
  rank raises, every rank's record is written, and the merged report names rank 1, both layouts and the call
  site. A link planted at a rank's record path is replaced, not followed; a flight directory that cannot be
  written costs a FlightWarning and leaves the collective's own error unchanged.
- dump: a record being written holds no collective. Rank 0's file write is held until its next collectives are
  done; rank 1 passes int32 where rank 0 passes float32, then both run their next collectives under a 1 s stall
  limit, which rank 1 would hit were rank 0 writing its record on the caller's thread. Each record is written.
- timeline: DDLFAST_TIMELINE with a delayed rank; `python -m ddlfast.timeline` merges the files into one trace
  whose events are of Chrome's format (ph, ts, dur, pid, tid, name), a process per rank named by rank and host,
  each collective labelled, and the delayed rank marked as the one that held the others.

Prints "N cases on P ranks, F failures"; exits non-zero on any failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
from harness import report_results
from mpi4py import MPI
from ops_cases import expect_error

import ddlfast
from ddlfast.engine import flight
from ddlfast.engine.flight import finish_writes

DELAY_S = 0.3
HOLD_S = 30.0  # the longest a held record write waits for its release: far beyond the stall limit
LARGE = 1 << 16  # float32 elements: 256 KiB, above DDLFAST_SMALL_BYTES (the ring path)
SMALL = 1000  # 4000 bytes: the latency path


def same_everywhere(comm: MPI.Intracomm, value: object, label: str) -> str | None:
    values = comm.allgather(value)
    return None if all(v == values[0] for v in values) else f"{label} differs across ranks: {values}"


def tool(*args: str) -> subprocess.CompletedProcess:
    """`python -m ddlfast.<tool>` as a user runs it after the job: outside the launcher (a process that inherits
    this rank's launcher environment would try to join the job)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_"))}
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=120, env=env)


def merged_report(directory: Path) -> str:
    result = tool("ddlfast.flight", str(directory))
    return result.stdout + result.stderr


def stragglers_cases(comm: MPI.Intracomm) -> list[tuple[str, str | None]]:
    rank, world = comm.Get_rank(), comm.Get_size()
    slow = world - 2
    results = []
    ctx = ddlfast.Context(comm)
    small = np.full(SMALL, rank, np.float32)
    large = np.full(LARGE, rank, np.float32)
    calls = [
        lambda: ctx.allreduce(small),
        lambda: ctx.allreduce(large),
        lambda: ctx.fused_allreduce([small, large]),
        lambda: ctx.reduce_scatter(np.ones(LARGE * world, np.float32)),
        lambda: ctx.broadcast(large, root=0),
        lambda: ctx.allreduce_async(large).wait(),
    ]
    ctx.barrier()
    delayed = 0
    for round_ in range(2):
        for call in calls:
            if rank == slow and round_ == 1:
                time.sleep(DELAY_S)
            call()
            delayed += round_
    rows = ctx.stragglers(last=len(calls))
    results.append(("the same rows on every rank", same_everywhere(comm, rows, "stragglers()")))
    top = rows[0]
    failure = None
    if top["rank"] != slow or top["last_arrivals"] != len(calls) or top["held_s"] < 0.1 * len(calls):
        failure = f"rank {slow} was delayed {len(calls)} times by {DELAY_S} s, but stragglers() says {rows}"
    elif sorted(r["rank"] for r in rows) != list(range(world)) or any(r["host"] != MPI.Get_processor_name()
                                                                       for r in rows):
        failure = f"one row per rank with its host expected: {rows}"
    results.append(("the delayed rank is named", failure))
    # A window beyond the delayed calls still names it, and counts only those calls.
    rows = ctx.stragglers(last=4 * len(calls))
    results.append(("a wider window", None if rows[0]["rank"] == slow and rows[0]["last_arrivals"] >= len(calls)
                    else f"{rows}"))
    results.append(("last=0 on one rank", expect_error(
        comm, lambda: ctx.stragglers(last=0 if rank == 1 else 10), "last must be an int from 1 to 4096")))
    results.append(("different last on one rank", expect_error(
        comm, lambda: ctx.stragglers(last=7 if rank == 1 else 10), "rank")))
    results.append(("usable afterwards", None if len(ctx.stragglers(last=3)) == world else "no rows"))
    ctx.close()
    # DDLFAST_STRAGGLER_WARN_S: one warning on rank 0, naming the rank that held the others.
    os.environ["DDLFAST_STRAGGLER_WARN_S"] = "0.5"
    try:
        warned = warnings.catch_warnings(record=True)
        with warned as caught:
            warnings.simplefilter("always")
            ctx = ddlfast.Context(comm)
            for _ in range(4):
                if rank == slow:
                    time.sleep(DELAY_S)
                ctx.allreduce(small)
            ctx.allreduce(small)
            ctx.close()
        texts = [str(w.message) for w in caught if issubclass(w.category, ddlfast.StragglerWarning)]
        expected = [f"ddlfast: rank {slow} held the other ranks"] if rank == 0 else []
        ok = len(texts) == len(expected) and all(t.startswith(e) for t, e in zip(texts, expected, strict=True))
        results.append(("DDLFAST_STRAGGLER_WARN_S", None if ok else f"rank {rank} warned {texts}"))
    finally:
        del os.environ["DDLFAST_STRAGGLER_WARN_S"]
    return results


def stall_cases(comm: MPI.Intracomm, directory: Path) -> list[tuple[str, str | None]]:
    rank, world = comm.Get_rank(), comm.Get_size()
    gone = world - 1
    results = []
    os.environ.update(DDLFAST_FLIGHT_DIR=str(directory), DDLFAST_TIMEOUT_S="1", DDLFAST_ABORT_ON_STALL="0")
    ctx = ddlfast.Context(comm)
    large = np.ones(LARGE, np.float32)
    for _ in range(3):
        ctx.allreduce(np.ones(SMALL, np.float32))
        ctx.fused_allreduce([large, np.ones(7, np.float64)])
    ctx.allreduce_async(large).wait()  # run on the communication thread, recorded with the line that submitted it
    last_together = ctx._state.core.sequence
    if rank == gone:
        os.kill(os.getpid(), signal.SIGUSR1)  # what a user (or a job scheduler) sends a rank that seems stuck
        finish_writes()  # the handler hands the file to the writer thread
        ok = (directory / f"flight.rank{rank}.json").is_file()
        results.append(("SIGUSR1 writes the record", None if ok else "no file after SIGUSR1"))
        comm.Barrier()  # after the others gave up
    else:
        try:
            ctx.allreduce(large)
            failure = "no error although a rank stopped joining"
        except ddlfast.DdlfastTimeoutError as error:
            failure = None if f"rank {gone} did not join" in str(error) else f"the error does not name it: {error}"
        results.append(("the stall names the missing rank", failure))
        finish_writes()
        path = directory / f"flight.rank{rank}.json"
        record = json.loads(path.read_text()) if path.is_file() else None
        latest = record["records"][-1] if record and record["records"] else {}
        ok = (latest.get("sequence") == last_together + 1 and latest.get("state") == "failed"
              and f"rank {gone} did not join" in (latest.get("error") or "")
              and "observe_cases.py" in (latest.get("site") or "") and latest.get("layout", "").startswith(
                  f"allreduce float32[{LARGE}]"))
        results.append(("each live rank's record names it", None if ok else f"record {latest}"))
        submitted = [r for r in record["records"] if r["sequence"] == last_together] if record else []
        ok = bool(submitted) and submitted[0]["state"] == "done" and "observe_cases.py" in (submitted[0]["site"] or "")
        results.append(("an async call's site is where it was submitted", None if ok else f"{submitted}"))
        comm.Barrier()
    comm.Barrier()
    if rank == 0:
        text = merged_report(directory)
        expected = [f"STUCK: rank {gone} never arrived at collective #{last_together + 1} (allreduce float32[{LARGE}]",
                    f"ranks 0-{gone - 1} waited for it there at", "observe_cases.py",
                    f"rank {gone}'s own record: its last collective is #{last_together}"]
        missing = [e for e in expected if e not in text]
        results.append(("the merged report", f"lacks {missing}:\n{text}" if missing else None))
    for name in ("DDLFAST_FLIGHT_DIR", "DDLFAST_TIMEOUT_S", "DDLFAST_ABORT_ON_STALL"):
        del os.environ[name]
    return results


def mismatch_cases(comm: MPI.Intracomm, directory: Path) -> list[tuple[str, str | None]]:
    rank = comm.Get_rank()
    results = []
    os.environ["DDLFAST_FLIGHT_DIR"] = str(directory)
    victim = Path(directory.parent / f"victim.{rank}")
    victim.write_text("not ddlfast's")
    (directory / f"flight.rank{rank}.json").symlink_to(victim)  # planted before anything is written
    ctx = ddlfast.Context(comm)
    for count in (3000, LARGE):
        dtype = np.int32 if rank == 1 else np.float32
        results.append((f"mismatch of {count}", expect_error(comm, lambda c=count, d=dtype: ctx.allreduce(
            np.ones(c, d)), "rank 1 passed int32")))
    ctx.allreduce(np.ones(10, np.float32))  # the context is usable
    finish_writes()
    path = directory / f"flight.rank{rank}.json"
    ok = path.is_file() and not path.is_symlink() and victim.read_text() == "not ddlfast's"
    results.append(("a planted link is replaced, not followed", None if ok else "the link was followed"))
    comm.Barrier()
    if rank == 0:
        text = merged_report(directory)
        expected = ["rank 1 passed allreduce int32[3000]", "where the others passed allreduce float32[3000]",
                    "observe_cases.py"]
        missing = [e for e in expected if e not in text]
        results.append(("the merged report names the mismatch", f"lacks {missing}:\n{text}" if missing else None))
    # ddlfast.dump_flight_record() on request, and a directory that cannot be written.
    written = ctx.dump_flight_record(str(directory / "asked"))
    results.append(("dump_flight_record()", None if written and Path(written).is_file() else f"{written}"))
    blocker = directory.parent / f"not-a-directory.{rank}"
    blocker.write_text("")
    os.environ["DDLFAST_FLIGHT_DIR"] = str(blocker / "sub")
    ctx2 = ddlfast.Context(comm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        failure = expect_error(comm, lambda: ctx2.allreduce(np.ones(5, np.int32 if rank == 1 else np.float32)),
                               "rank 1 passed int32")
        finish_writes()  # the writer thread warns
    flight_warnings = [w for w in caught if issubclass(w.category, ddlfast.FlightWarning)]
    if failure is None and not flight_warnings:
        failure = "no FlightWarning for a directory that cannot be written"
    results.append(("an unwritable directory: a warning, the error unchanged", failure))
    ctx2.close()
    ctx.close()
    del os.environ["DDLFAST_FLIGHT_DIR"]
    return results


def dump_cases(comm: MPI.Intracomm, directory: Path) -> list[tuple[str, str | None]]:
    rank = comm.Get_rank()
    results = []
    os.environ.update(DDLFAST_FLIGHT_DIR=str(directory), DDLFAST_TIMEOUT_S="1", DDLFAST_ABORT_ON_STALL="0")
    ctx = ddlfast.Context(comm)
    release, started, writers = threading.Event(), threading.Event(), []
    write = flight.replace_file

    def held_write(path: str, text: str) -> None:
        writers.append(threading.current_thread())
        started.set()
        release.wait(HOLD_S)
        write(path, text)

    if rank == 0:
        flight.replace_file = held_write
    try:
        ctx.allreduce(np.ones(SMALL, np.int32 if rank == 1 else np.float32))
        failure = "no error although rank 1 passed int32"
    except ddlfast.DdlfastError as error:
        failure = None if "rank 1 passed int32" in str(error) else str(error)
    results.append(("the mismatch", failure))
    try:
        for _ in range(3):  # straight on: no rank waits for another's record
            ctx.allreduce(np.ones(LARGE, np.float32))
            ctx.barrier()
        failure = None
    except ddlfast.DdlfastError as error:
        failure = f"the next collectives failed while rank 0 wrote its record: {error}"
    results.append(("the next collectives run while a record is written", failure))
    if rank == 0:
        ok = started.wait(HOLD_S) and writers[0] is not threading.main_thread()
        written_by = [thread.name for thread in writers]
        results.append(("the record is written on another thread", None if ok else f"written by {written_by}"))
        release.set()
    finish_writes()
    flight.replace_file = write
    path = directory / f"flight.rank{rank}.json"
    records = json.loads(path.read_text())["records"] if path.is_file() else []
    ok = any((r.get("error") or "").startswith("DdlfastConsistentError: ") for r in records)
    results.append(("each rank's record holds the mismatch", None if ok else f"records {records[-3:]}"))
    ctx.close()
    for name in ("DDLFAST_FLIGHT_DIR", "DDLFAST_TIMEOUT_S", "DDLFAST_ABORT_ON_STALL"):
        del os.environ[name]
    return results


def timeline_cases(comm: MPI.Intracomm, directory: Path) -> list[tuple[str, str | None]]:
    rank, world = comm.Get_rank(), comm.Get_size()
    slow = world - 2
    results = []
    prefix = directory / "run"
    os.environ["DDLFAST_TIMELINE"] = str(prefix)
    ctx = ddlfast.Context(comm)
    delayed = []
    for step in range(6):
        if rank == slow and step % 2:
            time.sleep(DELAY_S)
        ctx.allreduce(np.ones(LARGE if step % 3 else SMALL, np.float32))
        if step % 2:
            delayed.append(ctx._state.core.sequence)
    ctx.close()
    del os.environ["DDLFAST_TIMELINE"]
    comm.Barrier()
    if rank == 0:
        output = directory / "merged.json"
        victim = directory / "victim"
        victim.write_text("keep")
        output.symlink_to(victim)
        run = tool("ddlfast.timeline", str(prefix), "-o", str(output))
        try:
            trace = json.loads(output.read_text())
            failure = check_trace(trace, world, slow, delayed)
        except (OSError, ValueError) as error:
            failure = f"{error}: {run.stdout} {run.stderr}"
        if failure is None and (output.is_symlink() or victim.read_text() != "keep"):
            failure = "the link at the output was followed"
        results.append(("the merged timeline", failure))
    return results


def check_trace(trace: dict, world: int, slow: int, delayed: list[int]) -> str | None:
    events = trace.get("traceEvents")
    if not isinstance(events, list) or not events:
        return "no traceEvents list"
    for event in events:  # Chrome's trace event format: the fields Perfetto's importer reads
        if event.get("ph") not in ("X", "M", "i") or not isinstance(event.get("pid"), int) or "name" not in event:
            return f"not a trace event: {event}"
        if event["ph"] != "M" and not isinstance(event.get("ts"), int | float):
            return f"no ts: {event}"
        if event["ph"] == "X" and not (isinstance(event.get("dur"), int | float) and event["dur"] >= 0):
            return f"no dur: {event}"
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    if sorted(names) != list(range(world)) or any(not names[r].startswith(f"rank {r} (") for r in names):
        return f"processes named {names}"
    collectives = [e for e in events if e["ph"] == "X" and e.get("tid") == "collectives" and e["name"].startswith("#")]
    if not any(f"allreduce float32[{LARGE}]" in e["name"] for e in collectives):
        return "no labelled ring-path allreduce"
    for sequence in delayed:
        slices = [e for e in collectives if e["args"].get("sequence") == sequence]
        if len(slices) != world or any(e["args"].get("last_to_arrive") != slow for e in slices):
            return f"collective #{sequence}: {slices}"
        if not any(e["ph"] == "i" and e["pid"] == slow and e["args"].get("sequence") == sequence for e in events):
            return f"no mark on rank {slow} for #{sequence}"
    if not any(e["name"] == "waiting for the other ranks" for e in events):
        return "no waits drawn"
    return None


def main() -> int:
    comm = MPI.COMM_WORLD
    mode, directory = sys.argv[1], Path(sys.argv[2])
    directory.mkdir(parents=True, exist_ok=True)
    cases = {"stragglers": lambda: stragglers_cases(comm), "stall": lambda: stall_cases(comm, directory),
             "mismatch": lambda: mismatch_cases(comm, directory), "dump": lambda: dump_cases(comm, directory),
             "timeline": lambda: timeline_cases(comm, directory)}
    return report_results(comm, cases[mode]())


if __name__ == "__main__":
    sys.exit(main())
