"""The flight recorder on one rank (ddlfast/engine/flight.py over the core's entries, src/transport/flight_log.h):
states, call sites, the ring's bound, queued asynchronous work, errors kept per collective, the file and its
safety. The multi-rank cases (stalls, mismatches, the merged report) are tests/mpi/test_observe.py."""

from __future__ import annotations

import json
import os
import sys

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
