"""The flight recorder on one rank (ddlfast/engine/flight.py over the core's entries, src/transport/flight_log.h):
states, call sites, the ring's bound, queued asynchronous work, errors kept per collective, the file and its
safety. The multi-rank cases (stalls, mismatches, the merged report) are tests/mpi/test_observe.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from mpi4py import MPI

import ddlfast
from ddlfast.flight import parse_ranges, rank_ranges


@pytest.fixture
def context(monkeypatch, tmp_path):
    monkeypatch.setenv("DDLFAST_FLIGHT_RECORDS", "5")
    monkeypatch.setenv("DDLFAST_FLIGHT_DIR", str(tmp_path / "flight"))
    ctx = ddlfast.Context(MPI.COMM_SELF)
    yield ctx
    ctx.close()


def test_records_states_sites_and_bound(context) -> None:
    x = np.ones(10, np.float32)
    for _ in range(7):
        context.allreduce(x)  # the latency path: the core records it alone
    context.barrier()
    records = context._state.flight.records()
    assert len(records) == 5  # DDLFAST_FLIGHT_RECORDS
    assert [r["sequence"] for r in records] == list(range(records[0]["sequence"], records[0]["sequence"] + 5))
    assert all(r["state"] == "done" for r in records)
    assert records[-1]["kind"] == "barrier" and records[-2]["layout"].startswith("allreduce float32[10] op=sum")
    assert all(r["site"] and r["site"].startswith(__file__) for r in records), records
    assert all(r["arrived"] <= r["ended"] for r in records)


def test_each_call_gets_its_own_line(context) -> None:
    """The latency path finds its caller's site in the core call (CallSites remembers the last walk): calls of one
    plan from two lines, interleaved, and from a helper, each name their own line."""
    x = np.ones(10, np.float32)

    def helper() -> None:
        context.allreduce(x)  # line A

    for _ in range(2):
        context.allreduce(x)  # line B
        helper()
        context.allreduce(x)  # line C
    lines = {mark: number for number, text in enumerate(open(__file__).read().splitlines(), 1)
             for mark in ("A", "B", "C") if text.endswith(f"# line {mark}")}
    where = {"A": "helper", "B": "test_each_call_gets_its_own_line", "C": "test_each_call_gets_its_own_line"}
    sites = [r["site"] for r in context._state.flight.records()]  # the last 5 of B A C B A C
    assert sites == [f"{__file__}:{lines[m]} ({where[m]})" for m in "ACBAC"], sites


def test_the_interpreter_frames_walk_as_the_public_calls() -> None:
    """CallSites reads CPython 3.11's own frames (no frame object per frame); the public calls give the same
    (code, instruction offset) at every depth, including after internal frames and through a generator."""
    from ddlfast import _core

    fast = _core.CallSites(lambda code: code.co_name in ("inner", "middle"), 100)
    public = _core.CallSites(lambda code: code.co_name in ("inner", "middle"), 100, True)
    assert public.reads_interpreter_frames is False
    if (3, 11) <= sys.version_info[:2] < (3, 12):
        assert fast.reads_interpreter_frames

    def inner(sites):
        return sites.of(sites.site())

    def middle(sites):
        return inner(sites)

    def generator(sites):
        yield middle(sites)

    for depth_first in (inner, middle, lambda sites: next(generator(sites))):
        found = [depth_first(sites) for sites in (fast, public)]
        assert found[0] == found[1] and found[0] is not None, found
    repeated = {fast.site() for _ in range(3)}  # one line, one instruction: one site, from the memo after the first
    assert len(repeated) == 1 and min(repeated) >= 0
    fast.submitted = 7
    assert fast.site() == 7
    fast.submitted = -1
    none_outside = _core.CallSites(lambda code: True, 100)  # every frame internal: no site
    assert none_outside.site() == -1


def test_queued_work_is_listed_until_it_starts(context) -> None:
    flight = context._state.flight
    ran = []
    work = flight.sited(lambda: ran.append(flight.queued()), flight.site(), "allreduce_async of float32[3]")
    queued = flight.queued()
    assert [q["what"] for q in queued] == ["allreduce_async of float32[3]"] and queued[0]["site"].startswith(__file__)
    work()
    assert ran == [[]] and flight.queued() == []


def test_the_first_error_of_a_collective_is_kept(context) -> None:
    flight = context._state.flight
    context.barrier()
    flight.failed(ddlfast.DdlfastTimeoutError("rank 3 did not join"))
    flight.failed(ddlfast.DdlfastBrokenError("refused afterwards"))
    latest = flight.records()[-1]
    assert latest["error"] == "DdlfastTimeoutError: rank 3 did not join"


def test_dump_replaces_a_planted_link(context, tmp_path) -> None:
    directory = tmp_path / "flight"
    directory.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("mine")
    (directory / context._state.flight.file_name).symlink_to(victim)
    context.barrier()
    path = context.dump_flight_record()
    assert victim.read_text() == "mine" and not os.path.islink(path)
    data = json.loads(open(path).read())
    assert data["format"] == "ddlfast-flight-1" and data["reason"] == "dump_flight_record()"
    assert data["records"][-1]["kind"] == "barrier" and data["stragglers"][0]["rank"] == 0


def test_an_unwritable_directory_is_a_warning(context, tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.warns(ddlfast.FlightWarning, match="could not write its flight record"):
        assert context.dump_flight_record(str(blocker / "sub")) is None


def test_off(monkeypatch) -> None:
    monkeypatch.setenv("DDLFAST_FLIGHT_RECORDS", "0")
    ctx = ddlfast.Context(MPI.COMM_SELF)
    try:
        assert ctx._state.flight is None
        ctx.allreduce(np.ones(3))
        with pytest.raises(ddlfast.DdlfastError, match="DDLFAST_FLIGHT_RECORDS=0"):
            ctx.dump_flight_record("/tmp")
    finally:
        ctx.close()


def test_rank_ranges_round_trip() -> None:
    for ranks in ([0], [0, 1, 2, 5], [3, 7, 8, 9, 11], list(range(1024))):
        assert parse_ranges(rank_ranges(ranks)) == ranks
    assert rank_ranges([0, 1, 2, 5]) == "0-2,5"


@pytest.fixture
def held_writes(monkeypatch):
    """The writer's file writes held until `release` is set; each records the thread it ran on."""
    from ddlfast.engine import flight

    release, started, threads = threading.Event(), threading.Event(), []
    write = flight.replace_file

    def held(path, text) -> None:
        threads.append(threading.current_thread())
        started.set()
        release.wait(HOLD_S)  # were the write on the caller's thread, the caller would be held here
        write(path, text)

    monkeypatch.setattr(flight, "replace_file", held)
    yield release, started, threads
    release.set()
    assert flight.finish_writes()


HOLD_S = 30.0


def test_an_errors_record_is_written_off_the_callers_thread(context, held_writes) -> None:
    """A mismatch or a stall writes the record, which took 1.4 s at 10,000 records: long enough for the other
    ranks' next collective to hit a short stall limit. The caller's next collective must not wait for it."""
    from ddlfast.engine.flight import finish_writes

    release, started, threads = held_writes
    flight = context._state.flight
    context.barrier()
    flight.failed(ddlfast.DdlfastConsistentError("rank 1 passed int32"))  # as the agreement calls it
    x = np.ones(10, np.float32)
    context.allreduce(x)  # the next collective, while the record is still being written
    path = os.path.join(flight.directory, flight.file_name)
    assert started.wait(HOLD_S) and not os.path.exists(path)
    assert threads == [threads[0]] and threads[0] is not threading.current_thread()
    release.set()
    assert finish_writes()
    data = json.loads(open(path).read())
    assert data["reason"] == "DdlfastConsistentError" and data["records"][-1]["kind"] == "barrier"
    assert data["records"][-1]["error"] == "DdlfastConsistentError: rank 1 passed int32"


def test_a_burst_of_errors_writes_the_latest_record_once_more(context, held_writes) -> None:
    """Errors while a record is being written: the newest capture replaces any still waiting, so the writer
    falls behind by at most one file."""
    from ddlfast.engine.flight import finish_writes

    release, started, threads = held_writes
    flight = context._state.flight
    for n in range(4):
        context.barrier()
        flight.failed(ddlfast.DdlfastTimeoutError(f"stall {n}"))
        if n == 0:
            assert started.wait(HOLD_S)  # the writer holds the first; the others arrive while it does
    release.set()
    assert finish_writes()
    assert len(threads) == 2  # the first capture, then the last one
    data = json.loads(open(os.path.join(flight.directory, flight.file_name)).read())
    assert data["records"][-1]["error"] == "DdlfastTimeoutError: stall 3"


def test_the_exit_waits_for_a_record_being_written(tmp_path) -> None:
    """A process that ends right after the error (the usual end of a stall) still leaves its record: the exit
    waits for the writer thread. Here the write is held until an exit handler registered after the error lets
    it go, so the record exists only if the exit waited for it."""
    program = f"""
import atexit, threading
import ddlfast
from ddlfast.engine import flight
from mpi4py import MPI
release = threading.Event()
write = flight.replace_file
flight.replace_file = lambda path, text: (release.wait({HOLD_S}), write(path, text))
context = ddlfast.Context(MPI.COMM_SELF)
context.barrier()
context._state.flight.failed(ddlfast.DdlfastTimeoutError("rank 1 did not join"))
atexit.register(release.set)  # runs first at exit (exit handlers run last registered first)
"""
    environment = dict(os.environ, DDLFAST_FLIGHT_DIR=str(tmp_path), DDLFAST_FLIGHT_RECORDS="10")
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300,
                            env=environment)
    assert result.returncode == 0, result.stderr
    data = json.loads((tmp_path / "flight.rank0.json").read_text())
    assert data["records"][-1]["error"] == "DdlfastTimeoutError: rank 1 did not join"


def test_mpi_abort_waits_for_a_record_being_written(tmp_path) -> None:
    """An uncaught stall error ends the job with MPI_Abort (ddlfast/abort.py), which would cut the writer thread
    short: it waits for it first. The held write is let go as the abort begins (a callback put before the
    flight recorder's), so the record exists only if the abort waited for it."""
    program = f"""
import threading
import ddlfast
from ddlfast import abort
from ddlfast.engine import flight
from mpi4py import MPI
release = threading.Event()
write = flight.replace_file
flight.replace_file = lambda path, text: (release.wait({HOLD_S}), write(path, text))
abort._before_abort.insert(0, release.set)
context = ddlfast.Context(MPI.COMM_SELF)
context.barrier()
error = ddlfast.DdlfastTimeoutError("rank 1 did not join")
context._state.flight.failed(error)
raise error
"""
    environment = dict(os.environ, DDLFAST_FLIGHT_DIR=str(tmp_path), DDLFAST_FLIGHT_RECORDS="10",
                       DDLFAST_ABORT_ON_STALL="1")
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300,
                            env=environment)
    assert result.returncode != 0 and "calling MPI_Abort" in result.stderr, result.stderr
    data = json.loads((tmp_path / "flight.rank0.json").read_text())
    assert data["records"][-1]["error"] == "DdlfastTimeoutError: rank 1 did not join"


def test_a_file_holds_the_newest_records_that_fit(context) -> None:
    """A record's size has no bound of its own (a fused call lists every array): the file keeps the newest
    records that fit its budget, says how many it left out, and its budget is below what the merge tool reads."""
    from ddlfast import flight as merge_tool
    from ddlfast.engine.flight import MAX_FILE_BYTES

    for _ in range(5):
        context.fused_allreduce([np.ones(3, np.float32) for _ in range(50)])
    capture = context._state.flight.capture("test")
    whole = capture.text()
    assert json.loads(whole)["records_left_out"] == 0
    budget = len(whole) // 2
    data = json.loads(capture.text(budget))
    assert 0 < len(data["records"]) < 5 and data["records_left_out"] == 5 - len(data["records"])
    assert data["records"] == json.loads(whole)["records"][-len(data["records"]):]
    assert len(capture.text(budget)) <= budget
    assert MAX_FILE_BYTES <= merge_tool.MAX_FILE_BYTES // 2


def test_the_most_records_fit_the_merge_tool(monkeypatch, tmp_path) -> None:
    """DDLFAST_FLIGHT_RECORDS' largest value makes a file of ordinary calls (named, from a long path) that the
    merge tool reads; one above it is refused, naming the variable and the limit."""
    from ddlfast import config
    from ddlfast import flight as merge_tool

    monkeypatch.setenv("DDLFAST_FLIGHT_RECORDS", "200")
    context = ddlfast.Context(MPI.COMM_SELF)
    try:
        arrays = [np.ones(10, np.float32), np.ones((3, 5), np.float64)]
        for step in range(200):
            context.fused_allreduce(arrays, name=f"train/step-{step:09d}")
        per_record = len(context._state.flight.capture("test").text()) / 200
    finally:
        context.close()
    assert per_record * config.MAX_FLIGHT_RECORDS < merge_tool.MAX_FILE_BYTES / 4, per_record
    too_many = str(config.MAX_FLIGHT_RECORDS + 1)
    with pytest.raises(ddlfast.DdlfastError, match=rf"DDLFAST_FLIGHT_RECORDS='{too_many}'.* 0 to "
                                                    rf"{config.MAX_FLIGHT_RECORDS}"):
        config.flight_records({"DDLFAST_FLIGHT_RECORDS": too_many})
