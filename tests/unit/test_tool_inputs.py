"""Every command-line tool given malformed or hostile input (issue 46, defects 6-8; docs/trust.md, "Tool input"):
one line naming the problem, exit status 2, no traceback, no hang, and any output it does write strict JSON.

The fuzzers start from valid input made as the tools' users make it (a flight record dumped by a context, traces
written by the engine's Timeline, a shipped platform, a working command line) and break it: truncated, fields of
another type, keys dropped, huge numbers, NaN and Infinity, deep nesting, wrong top-level types, binary garbage, a
sparse file claiming 10^10 bytes, directories, FIFOs and links in place of files, and every option given hostile
values. The random draws use a fixed seed, so every run tries the same cases. Each tool runs as a user runs it, in a
subprocess; its timeout is a hang guard, not a timing assertion. Cases of one tool run several at a time."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
from mpi4py import MPI

import ddlfast
from ddlfast import flight, simulate
from ddlfast.engine.timeline import Timeline

ROOT = Path(__file__).resolve().parents[2]
SEED = 46
HANG_GUARD_S = 120  # a tool that hangs fails the test instead of hanging the suite; no case comes near it
RANDOM_CASES = 16  # random mutations per tool, besides the listed ones
CLAIMED_BYTES = 10**10  # a sparse file's size: nothing may read or allocate it


def _run(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess | None:
    """`python -m module args` as a user runs it; None where it ran past the hang guard. Outside any launcher
    (a child inheriting this process's launcher environment would try to join its job)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_"))}
    try:
        return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=ROOT,
                              env=clean | (env or {}), timeout=HANG_GUARD_S, errors="replace")
    except subprocess.TimeoutExpired:
        return None


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} in the output: not strict JSON")


def strict_json(text: str) -> object:
    """json.loads that refuses NaN and Infinity, as every strict reader does (Perfetto, jq)."""
    return json.loads(text, parse_constant=_refuse_constant)


def one_line_refusal(result: subprocess.CompletedProcess | None, tool: str) -> str | None:
    """None if `result` is a refusal by the rule (exit 2, nothing on stdout, one line on stderr naming the tool,
    no traceback); else what is wrong."""
    if result is None:
        return f"ran past the {HANG_GUARD_S} s hang guard"
    if "Traceback" in result.stderr:
        return f"traceback: {result.stderr[-800:]}"
    lines = result.stderr.splitlines()
    if result.returncode != 2 or result.stdout or len(lines) != 1 or not lines[0].startswith(f"ddlfast.{tool}: "):
        return f"exit {result.returncode}, stdout {result.stdout[-300:]!r}, stderr {result.stderr[-600:]!r}"
    return None


def refusal(result: subprocess.CompletedProcess | None, tool: str) -> str | None:
    """None if `result` is the tool's one-line refusal, or argparse's refusal of an option (exit 2, its usage,
    then one `prog: error: ...` line, argparse's convention); else what is wrong."""
    if result is None or not result.stderr.startswith("usage:"):
        return one_line_refusal(result, tool)
    if "Traceback" in result.stderr or result.returncode != 2 or ": error: " not in result.stderr.splitlines()[-1]:
        return f"exit {result.returncode}, stderr {result.stderr[-800:]!r}"
    return None


# -- mutations of a JSON document ------------------------------------------------------------------------------


@dataclass
class Case:
    """One malformed input: `write(path)` puts it at `path`; `refused`: whatever the tool does with the rest, this
    input must be refused (some random mutations leave a file the tool may read, e.g. a field it never reads)."""

    name: str
    write: Callable[[Path], object]
    refused: bool


def _bytes(data: bytes) -> Callable[[Path], object]:
    return lambda path: path.write_bytes(data)


def _document(value: object) -> Callable[[Path], object]:
    return _bytes(json.dumps(value).encode())  # json.dumps writes NaN and Infinity, as a careless writer would


def _paths(value: object, prefix: tuple = ()) -> Iterator[tuple]:
    """Every place in a JSON document (keys and indices from the root), the root itself left out."""
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield (*prefix, key)
        yield from _paths(child, (*prefix, key))


def _replaced(document: object, path: tuple, new: object) -> object:
    copy = json.loads(json.dumps(document))
    parent = copy
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = new
    return copy


def _dropped(document: object, path: tuple) -> object:
    copy = json.loads(json.dumps(document))
    parent = copy
    for key in path[:-1]:
        parent = parent[key]
    del parent[path[-1]]
    return copy


DEEP = 100_000  # past any JSON parser's recursion
OTHER_TYPES: list[object] = [None, True, "text", 7, 2.5, [], {}, -1, [[]], {"k": None}]
HUGE_NUMBERS = ["1" + "0" * 30, "-" + "9" * 30, "1e308", "-1e308", "1" + "0" * 400]


def _with_raw(document: object, path: tuple, raw: str) -> bytes:
    """The document with the value at `path` replaced by `raw` JSON text (numbers and nesting json.dumps would
    not write)."""
    marker = "@@raw@@"
    return json.dumps(_replaced(document, path, marker)).replace(json.dumps(marker), raw, 1).encode()


def json_mutations(document: object, rng: random.Random, top_level_list_valid: bool) -> list[Case]:
    """The mutations every JSON input gets: the listed ones (each refused) and RANDOM_CASES drawn ones."""
    text = json.dumps(document).encode()
    paths = list(_paths(document))
    numbers = [p for p in paths if isinstance(_at(document, p), int | float) and not isinstance(_at(document, p), bool)]
    cases = [Case(f"truncated to {n} of {len(text)} bytes", _bytes(text[:n]), True)
             for n in sorted({0, 1, len(text) // 2, len(text) - 1, rng.randrange(1, len(text))})]
    top_levels: list[object] = [[], {}, "text", 3, None, True]
    cases += [Case(f"top level {value!r}", _document(value), not (value == [] and top_level_list_valid))
              for value in top_levels]
    cases += [
        Case("binary garbage", _bytes(bytes(rng.randrange(256) for _ in range(4096))), True),
        Case("invalid UTF-8 in a string", _bytes(text.replace(b'"', b'"\xff\xfe', 1)), True),
        Case(f"nested {DEEP} deep at the top", _bytes(b"[" * DEEP + b"]" * DEEP), True),
        Case(f"nested {DEEP} deep in a field", _bytes(_with_raw(document, rng.choice(paths), "[" * DEEP + "]" * DEEP)),
             True),
        Case(f"a sparse file claiming {CLAIMED_BYTES} bytes", _sparse, True),
        Case("a directory in place of the file", lambda path: path.mkdir(), True),
        Case("a FIFO in place of the file", lambda path: os.mkfifo(path), True),
        Case("a link to /dev/zero", lambda path: path.symlink_to("/dev/zero"), True),
        Case("a dangling link", lambda path: path.symlink_to(path.parent / "nowhere"), True),
    ]
    for constant in ("NaN", "Infinity", "-Infinity"):
        where = rng.choice(numbers)
        cases.append(Case(f"{constant} at {where}", _bytes(_with_raw(document, where, constant)), True))
    for _ in range(RANDOM_CASES):
        kind = rng.randrange(4)
        where = rng.choice(paths)
        if kind == 0:
            new = rng.choice([v for v in OTHER_TYPES if type(v) is not type(_at(document, where))])
            cases.append(Case(f"{where} = {new!r}", _document(_replaced(document, where, new)), False))
        elif kind == 1:
            cases.append(Case(f"{where} dropped", _document(_dropped(document, where)), False))
        elif kind == 2:
            number = rng.choice(HUGE_NUMBERS)
            at = rng.choice(numbers)
            cases.append(Case(f"{at} = {number[:12]}...", _bytes(_with_raw(document, at, number)), False))
        else:
            depth = rng.choice([50, 500, 900])
            nested = _with_raw(document, where, "[" * depth + "]" * depth)
            cases.append(Case(f"{where} nested {depth} deep", _bytes(nested), False))
    return cases


def _at(document: object, path: tuple) -> object:
    for key in path:
        document = document[key]  # type: ignore[index]
    return document


def _sparse(path: Path) -> None:
    with open(path, "wb") as file:
        file.truncate(CLAIMED_BYTES)  # a hole: no disk used, but stat says 10^10 bytes


Item = TypeVar("Item")


def _run_all(cases: Sequence[tuple[str, Item]], check: Callable[[int, Item], str | None]) -> None:
    """check(number, item) of every (name, item), several at a time (each is mostly a subprocess waiting to start);
    the test fails naming every case that failed."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        outcomes = list(pool.map(lambda number: check(number, cases[number][1]), range(len(cases))))
    failures = [f"{cases[n][0]}: {problem}" for n, problem in enumerate(outcomes) if problem]
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)


# -- python -m ddlfast.flight ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flight_files(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """Three ranks' records, from a real one: a context's own dump (ddlfast/engine/flight.py), as rank 0 of 3; rank
    1 stalled waiting for rank 2 and saw a mismatch in every rank's descriptions; rank 2 one collective behind;
    a queued asynchronous call and a straggler row, so the report takes every path it has."""
    directory = tmp_path_factory.mktemp("flight-source")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DDLFAST_FLIGHT_RECORDS", "8")
        ctx = ddlfast.Context(MPI.COMM_SELF)
        try:
            for count in (10, 20, 10):
                ctx.allreduce(np.ones(count, np.float32))
            ctx.barrier()
            written = ctx.dump_flight_record(str(directory))
        finally:
            ctx.close()
    assert written is not None
    record = json.loads(Path(written).read_text())
    latest = record["records"][-2]  # an allreduce: it has arrays to differ in
    other = json.loads(json.dumps(latest["description"]))
    other["arrays"] = [["int32", shape] for _, shape in other["arrays"]]
    files = {}
    for rank in range(3):
        data = json.loads(json.dumps(record)) | {"rank": rank, "size": 3}
        if rank < 2:
            data["records"][-1] |= {"state": "agreeing", "error": f"DdlfastTimeoutError: rank 2 did not join #"
                                                                  f"{data['records'][-1]['sequence']}"}
        else:
            data["records"] = data["records"][:-1]
        files[rank] = data
    files[1]["records"][-2]["descriptions"] = [latest["description"], other, latest["description"]]
    files[0]["queued"] = [{"state": "queued", "what": "allreduce_async of float32[3]", "submitted": 1.0,
                           "site": None}]
    files[0]["stragglers"][0]["held_s"] = 0.5
    return files


def _write_flight(directory: Path, files: dict[int, dict]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for rank, data in files.items():
        (directory / f"flight.rank{rank}.json").write_text(json.dumps(data))


def test_flight_reads_the_valid_records(flight_files: dict[int, dict], tmp_path: Path) -> None:
    """The fuzzer's starting point is read, and the report says what the records hold (the check is not so
    strict that it refuses the writer's own files)."""
    _write_flight(tmp_path, flight_files)
    report = _run("ddlfast.flight", str(tmp_path))
    assert report is not None and report.returncode == 0, report
    assert "STUCK: rank 2 never arrived" in report.stdout and "out of step:" in report.stdout, report.stdout
    assert "who held the others" in report.stdout and "queued behind it" in report.stdout, report.stdout
    merged = _run("ddlfast.flight", str(tmp_path), "--json")
    assert merged is not None and merged.returncode == 0
    assert set(strict_json(merged.stdout)["0"]) == {"0", "1", "2"}  # type: ignore[index]


def _flight_targeted(files: dict[int, dict]) -> list[tuple[str, int, object]]:
    """(name, rank, content) of the issue's cases: each field the report reads, of a type it cannot read."""
    def change(rank: int, path: tuple, value: object) -> object:
        return _replaced(files[rank], path, value)

    last = len(files[1]["records"]) - 1
    return [
        ("size 10^10 (every rank listed)", 0, change(0, ("size",), 10**10)),
        ("size 0", 0, change(0, ("size",), 0)),
        ("size as text", 0, change(0, ("size",), "3")),
        ("size true", 0, change(0, ("size",), True)),
        ("rank above the size", 2, change(2, ("size",), 2)),
        ("another format", 0, change(0, ("format",), "ddlfast-flight-2")),
        ("records an object", 0, change(0, ("records",), {})),
        ("a record a number", 1, change(1, ("records", 0), 5)),
        ("sequence as text", 1, change(1, ("records", last, "sequence"), "12")),
        ("state missing", 1, _dropped(files[1], ("records", last, "state"))),
        ("layout a number", 1, change(1, ("records", last, "layout"), 5)),
        ("error an object", 1, change(1, ("records", last, "error"), {"a": 1})),
        ("wait_s as text", 1, change(1, ("records", last, "wait_s"), "long")),
        ("descriptions an object", 1, change(1, ("records", last - 1, "descriptions"), {"0": {}})),
        ("a description of another form", 1, change(1, ("records", last - 1, "descriptions"), [{"kind": 3}])),
        ("more descriptions than ranks", 1, change(1, ("records", last - 1, "descriptions"), [{}] * 4)),
        ("queued a text", 0, change(0, ("queued",), "x")),
        ("a queued call's what a list", 0, change(0, ("queued", 0, "what"), [1])),
        ("held_s as text", 0, change(0, ("stragglers", 0, "held_s"), "slow")),
        ("a straggler row without its rank", 0, _dropped(files[0], ("stragglers", 0, "rank"))),
    ]


def test_flight_refuses_every_malformed_record(flight_files: dict[int, dict], tmp_path: Path) -> None:
    """Defect 6: each of the issue's malformed records (a KeyError, TypeError, MemoryError or RecursionError
    before; a claimed size of 10^10 ran until killed) is one line and exit status 2."""
    def check(number: int, case: tuple[int, object]) -> str | None:
        rank, content = case
        directory = tmp_path / str(number)
        _write_flight(directory, flight_files)
        (directory / f"flight.rank{rank}.json").write_text(json.dumps(content))
        return one_line_refusal(_run("ddlfast.flight", str(directory)), "flight")

    _run_all([(name, (rank, content)) for name, rank, content in _flight_targeted(flight_files)], check)


def test_flight_fuzz(flight_files: dict[int, dict], tmp_path: Path) -> None:
    """Mutations of one rank's file (the rank drawn too): a refusal by the rule, or a report, and then a --json
    that is strict JSON. Never a traceback or a hang."""
    rng = random.Random(SEED)
    cases = [(case, rng.randrange(3)) for case in json_mutations(flight_files[0], rng, top_level_list_valid=False)]
    # Text the report parses: a stall census naming a billion ranks, and a state with format fields.
    census = _replaced(flight_files[1], ("records", -1, "error"), "DdlfastTimeoutError: ranks 0-999999999,5 did not "
                                                                 "join")
    braces = _replaced(flight_files[1], ("records", -1, "state"), "{0}{be.__class__}{missing}")
    cases += [(Case("a census naming ranks 0-999999999", _document(census), False), 1),
              (Case("a state with format fields", _document(braces), False), 1),
              (Case("a link to a valid record", lambda path: path.symlink_to(path.parent / "valid.json"), False), 0)]

    def check(number: int, item: tuple[Case, int]) -> str | None:
        case, rank = item
        directory = tmp_path / str(number)
        _write_flight(directory, flight_files)
        (directory / "valid.json").write_text(json.dumps(flight_files[0]))  # no flight.rank name: not read
        target = directory / f"flight.rank{rank}.json"
        target.unlink()
        case.write(target)
        report = _run("ddlfast.flight", str(directory))
        if case.refused or report is None or report.returncode != 0:
            return one_line_refusal(report, "flight")
        if "Traceback" in report.stderr or not report.stdout.startswith("ddlfast flight records"):
            return f"report: {report.stdout[-300:]!r} {report.stderr[-300:]!r}"
        merged = _run("ddlfast.flight", str(directory), "--json")
        try:
            strict_json(merged.stdout if merged is not None else "")
        except ValueError as error:
            return f"--json is not strict JSON ({error})"
        return None

    _run_all([(f"rank {rank}: {case.name}", (case, rank)) for case, rank in cases], check)


def test_flight_ranges_are_bounded_by_the_job() -> None:
    """A census's range comes from a file: the ranks it names stop at the job's size, each once."""
    assert flight.parse_ranges("0-999999999,5,3-4", 8) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert flight.parse_ranges("5,1-2,2-3,x,9" * 3, 10) == [1, 2, 3, 5, 9]
    assert flight.parse_ranges("1" * 5000) == []  # too many digits to be a rank: no int() of it
    assert flight.parse_ranges("5-2,7") == [7]  # a reversed range names nobody


# -- python -m ddlfast.timeline --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trace_events(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list]:
    """Two ranks' events, written by the engine's Timeline: six collectives where rank 1 arrived last at the odd
    ones (it waited least there), and a pack phase."""
    directory = tmp_path_factory.mktemp("trace-source")
    events = {}
    for rank in range(2):
        timeline = Timeline(str(directory / "run"), rank)
        for sequence in range(1, 7):
            start = 10.0 + sequence
            wait = 0.002 if rank == 1 and sequence % 2 else 0.03
            timeline.collective(sequence, f"allreduce float32[{sequence * 10}] op=sum", start, start + 0.05, wait)
            timeline.add("pack", start, start + 0.001, arrays=1, bytes=40)
        timeline.flush()
        events[rank] = json.loads(Path(timeline.path).read_text())
    return events


def _write_trace(directory: Path, events: dict[int, list]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for rank, content in events.items():
        (directory / f"run.rank{rank}.json").write_text(json.dumps(content))
    return directory / "run"


def test_timeline_merges_the_valid_traces(trace_events: dict[int, list], tmp_path: Path) -> None:
    prefix = _write_trace(tmp_path, trace_events)
    merged = _run("ddlfast.timeline", str(prefix))
    assert merged is not None and merged.returncode == 0, merged
    trace = strict_json((tmp_path / "run.json").read_text())
    assert any(e.get("args", {}).get("last_to_arrive") == 1 for e in trace["traceEvents"])  # type: ignore[index]


def test_timeline_refuses_nan_and_infinity(trace_events: dict[int, list], tmp_path: Path) -> None:
    """Defect 7: NaN and Infinity timestamps, and numbers whose sums overflow to infinity, gave an output that was
    not JSON; now the file is refused and nothing is written."""
    values = ["NaN", "Infinity", "-Infinity", "1e308"]
    for index, value in enumerate(values):
        directory = tmp_path / str(index)
        prefix = _write_trace(directory, trace_events)
        (directory / "run.rank1.json").write_bytes(_with_raw(trace_events[1], (3, "ts"), value))
        result = _run("ddlfast.timeline", str(prefix))
        assert one_line_refusal(result, "timeline") is None, (value, result)
        assert not (directory / "run.json").exists()


def test_timeline_fuzz(trace_events: dict[int, list], tmp_path: Path) -> None:
    """Defect 7: mutations of one rank's trace, the merge included (the read was in a `try`, the merge was not):
    a refusal by the rule and no output file, or a merged trace that is strict JSON."""
    rng = random.Random(SEED)
    cases = json_mutations(trace_events[1], rng, top_level_list_valid=True)
    collective = next(i for i, e in enumerate(trace_events[1]) if e.get("args", {}).get("wait"))
    targeted: list[tuple[str, tuple, object]] = [
        ("ts as text", (collective, "ts"), "soon"), ("ts missing", (collective, "ts"), None),
        ("an event a number", (collective,), 5), ("args a list", (collective, "args"), []),
        ("sequence as text", (collective, "args", "sequence"), "3"),
        ("wait_s huge", (collective, "args", "wait_s"), 1e300), ("dur as text", (collective, "dur"), "x")]
    for name, path, value in targeted:
        content = (_dropped(trace_events[1], path) if value is None else _replaced(trace_events[1], path, value))
        cases.append(Case(name, _document(content), True))

    def check(number: int, case: Case) -> str | None:
        directory = tmp_path / str(number)
        prefix = _write_trace(directory, trace_events)
        (directory / "run.rank1.json").unlink()
        case.write(directory / "run.rank1.json")
        output = directory / "out" / "merged.json"
        output.parent.mkdir()
        result = _run("ddlfast.timeline", str(prefix), "-o", str(output))
        if case.refused or result is None or result.returncode != 0:
            problem = one_line_refusal(result, "timeline")
            return problem or (f"wrote {output} all the same" if output.exists() else None)
        try:
            trace = strict_json(output.read_text())
        except (OSError, ValueError) as error:
            return f"exit 0, output not strict JSON ({error})"
        return None if isinstance(trace, dict) and isinstance(trace.get("traceEvents"), list) else "no traceEvents"

    _run_all([(case.name, case) for case in cases], check)


# -- python -m ddlfast.plan and python -m ddlfast.simulate: their options --------------------------------------

HOSTILE_VALUES = ["", "0", "-1", "nan", "inf", "-inf", "1e308", "1e10", "10000000000", "9" * 5000, "abc", "1.5",
                  "\u0663", "0x10", "64MiB", "1000000GiB", "-0", " 4 "]
PLAN_VALID = ["--hosts", "8", "--ranks-per-host", "4", "--bytes", "64MiB", "--json"]
PLAN_OPTIONS = ["--hosts", "--ranks-per-host", "--hosts-per-group", "--intra", "--inter", "--group", "--reduce-rate",
                "--bytes", "--compute-ms", "--overlap", "--max-dims", "--top"]
PLAN_REFUSED = [
    ["--hosts", "10000000000"], ["--hosts", "1000003", "--ranks-per-host", "1"], ["--hosts", "16385"],
    ["--hosts", "4096", "--ranks-per-host", "5"], ["--hosts", "0"], ["--ranks-per-host", "10000000000"],
    ["--max-dims", "0"], ["--max-dims", "-1"], ["--max-dims", "33"], ["--compute-ms", "nan"], ["--compute-ms", "inf"],
    ["--compute-ms", "-1"], ["--overlap", "nan"], ["--overlap", "2"], ["--bytes", "lots"], ["--bytes", "9" * 40],
    ["--intra", "0GB/s,1us"], ["--inter", "1e999GB/s,5us"], ["--inter", "10GB/s,1e999s"], ["--reduce-rate", "0B/s"],
    ["--hosts-per-group", "3"], ["--hosts-per-group", "0"],
]


def _options(valid: list[str], changed: list[str]) -> list[str]:
    """`valid` with the options of `changed` replaced (or added)."""
    args = list(valid)
    for option, value in zip(changed[::2], changed[1::2], strict=True):
        if option in args:
            args[args.index(option) + 1] = value
        else:
            args += [option, value]
    return args


def _drawn_options(options: list[str], rng: random.Random) -> list[list[str]]:
    return [[option, rng.choice(HOSTILE_VALUES)] for option in (rng.choice(options) for _ in range(RANDOM_CASES))]


def test_plan_refuses_what_it_cannot_plan_in_seconds() -> None:
    """Defect 8: --hosts 10^10 and 1000003 prime hosts ran past a minute, --max-dims 0 was a ValueError traceback,
    NaN compute and zero rates a traceback or NaN in the JSON: refused before any prediction, the limit named."""
    _run_all([(" ".join(args)[:80], args) for args in PLAN_REFUSED],
             lambda _, args: one_line_refusal(_run("ddlfast.plan", *_options(PLAN_VALID, args)), "plan"))
    assert "at most 16384 ranks" in _run("ddlfast.plan", "--hosts", "1000003").stderr  # type: ignore[union-attr]


def test_plan_fuzz() -> None:
    """Hostile values for each option: a refusal (the tool's one line, or argparse's usage and error line), or a
    plan whose --json is strict JSON."""
    drawn = _drawn_options(PLAN_OPTIONS, random.Random(SEED))

    def check(_: int, changed: list[str]) -> str | None:
        result = _run("ddlfast.plan", *_options(PLAN_VALID, changed))
        if result is None or result.returncode != 0:
            return refusal(result, "plan")
        try:
            strict_json(result.stdout)
        except ValueError as error:
            return f"exit 0, output not strict JSON ({error})"
        return None

    _run_all([(" ".join(changed)[:80], changed) for changed in drawn], check)


SIMULATE_VALID = ["--platform", "ddl-64x4", "--ranks", "16", "--sizes", "4KiB,1MiB"]
SIMULATE_OPTIONS = ["--platform", "--ranks", "--sizes", "--dims", "--builtins", "--builtin-memory-gib", "--iters",
                    "--warmup", "--missing-rank", "--stall-limit"]
SIMULATE_REFUSED = [
    ["--sizes", "1000000GiB"], ["--sizes", "10000000000"], ["--sizes", "9" * 5000], ["--sizes", "4KiB,lots"],
    ["--sizes", "2"], ["--ranks", "10000000000"], ["--ranks", "0"], ["--ranks", "-16"], ["--ranks", "4096"],
    ["--platform", "fattree-8gpu", "--ranks", "1024", "--sizes", "4GiB"], ["--dims", "9" * 5000],
    ["--dims", "0x16"], ["--dims", "4x4x"], ["--iters", "0"], ["--iters", "10000000000"], ["--warmup", "-1"],
    ["--warmup", "10000000000"], ["--builtin-memory-gib", "nan"], ["--builtin-memory-gib", "inf"],
    ["--builtin-memory-gib", "-1"], ["--stall-limit", "nan"], ["--stall-limit", "0"], ["--stall-limit", "inf"],
    ["--missing-rank", "9" * 50], ["--missing-rank", "5-2"], ["--missing-rank", "abc"], ["--builtins", "a b"],
    ["--builtins", "../x"], ["--platform", "no-such-platform"],
]


def _simulate(args: list[str], without_simgrid: Path) -> subprocess.CompletedProcess | None:
    """simulate where SimGrid cannot be found, so that every case ends before a simulation could start: input
    that passes the checks ends in "SimGrid is missing"."""
    return _run("ddlfast.simulate", *args, env={"PATH": str(without_simgrid)})


def test_simulate_refuses_huge_input_before_simgrid(tmp_path: Path) -> None:
    """Defect 8: --sizes 1000000GiB ended in a traceback after SimGrid aborted; huge --ranks, --sizes, counts and
    NaN limits are refused by the parser, naming the limit, before SimGrid is looked for."""
    def check(_: int, args: list[str]) -> str | None:
        result = _simulate(_options(SIMULATE_VALID, args), tmp_path)
        if result is not None and "SimGrid is missing" in result.stderr:
            return "passed the checks: refused only for want of SimGrid"
        return one_line_refusal(result, "simulate")

    _run_all([(" ".join(args)[:80], args) for args in SIMULATE_REFUSED], check)
    result = _simulate(_options(SIMULATE_VALID, ["--sizes", "1000000GiB"]), tmp_path)
    assert result is not None and "above the 4GiB per call the simulation holds" in result.stderr


def _platform_cases(rng: random.Random) -> list[Case]:
    """Malformed platform files from a shipped one (ddlfast/platforms/ddl-64x4.xml)."""
    text = (simulate.PLATFORMS / "ddl-64x4.xml").read_text()
    cluster = 'radical="0-63"'
    assert cluster in text and 'core="4"' in text

    def edited(old: str, new: str) -> Callable[[Path], object]:
        return lambda path: path.write_text(text.replace(old, new, 1))

    return [
        Case("truncated", lambda path: path.write_text(text[: rng.randrange(10, len(text) // 2)]), True),
        Case("a radical of 10^10 hosts", edited(cluster, 'radical="0-9999999999"'), True),
        Case("a radical of 10^9 hosts", edited(cluster, 'radical="0-999999999"'), True),
        Case("a radical of letters", edited(cluster, 'radical="a-b"'), True),
        Case("a radical of Unicode digits", edited(cluster, 'radical="0-\u0663\u0663"'), True),
        Case("core of letters", edited('core="4"', 'core="four"'), True),
        Case("core 0", edited('core="4"', 'core="0"'), True),
        Case("core 10^30", edited('core="4"', 'core="' + "1" + "0" * 30 + '"'), True),
        Case("ranks per host 0", edited("</cluster>", '<prop id="ddlfast:ranks_per_host" value="0"/></cluster>'),
             True),
        Case("binary garbage", lambda path: path.write_bytes(bytes(rng.randrange(256) for _ in range(4096))), True),
        Case(f"nested {DEEP} deep", lambda path: path.write_text("<a>" * DEEP + "</a>" * DEEP), True),
        Case(f"a sparse file claiming {CLAIMED_BYTES} bytes", _sparse, True),
        Case("a directory", lambda path: path.mkdir(), True),
        Case("a FIFO", lambda path: os.mkfifo(path), True),
        Case("a link to /dev/zero", lambda path: path.symlink_to("/dev/zero"), True),
    ]


def test_simulate_fuzz(tmp_path: Path) -> None:
    """Malformed platform files and hostile values for each option: the one-line refusal (or argparse's), never
    a traceback or a hang."""
    rng = random.Random(SEED)
    without_simgrid = tmp_path / "empty"
    without_simgrid.mkdir()
    cases: list[tuple[str, list[str]]] = []
    for number, case in enumerate(_platform_cases(rng)):
        path = tmp_path / f"platform{number}.xml"
        case.write(path)
        cases.append((f"platform: {case.name}", ["--platform", str(path)]))
    cases += [(" ".join(changed)[:80], changed) for changed in _drawn_options(SIMULATE_OPTIONS, rng)]

    def check(_: int, changed: list[str]) -> str | None:
        result = _simulate(_options(SIMULATE_VALID, changed), without_simgrid)
        if changed[0] == "--platform" and result is not None and "SimGrid is missing" in result.stderr:
            return "a malformed platform passed the checks"
        return refusal(result, "simulate")

    _run_all(cases, check)


# -- the other tools: bench, info, demo, horovodrun ----------------------------------------------------------

OTHER_REFUSED = [
    ("ddlfast.bench", ["--sizes", "1000000GiB"]), ("ddlfast.bench", ["--sizes", "9" * 5000]),
    ("ddlfast.bench", ["--sizes", "nan"]), ("ddlfast.bench", ["--iters", "-1"]), ("ddlfast.bench", ["--dims", "0x0"]),
    ("ddlfast.bench", ["--dims", "9" * 5000]), ("ddlfast.bench", ["-b", "8", "-e", "1000000GiB"]),
    ("ddlfast.bench", ["-f", "0", "-b", "8"]), ("ddlfast.bench", ["--dtype", "float128"]),
    ("ddlfast.bench", ["--bogus"]), ("ddlfast.info", ["--bogus"]), ("ddlfast.demo", ["--epochs", "abc"]),
    ("ddlfast.demo", ["--sizes", "1000000GiB", "--skip-torch"]), ("ddlfast.demo", ["--batch", "0"]),
    ("ddlfast.demo", ["--lr", "nan"]), ("ddlfast.horovodrun", ["-np", "-1", "--dry-run", "train.py"]),
    ("ddlfast.horovodrun", ["-np", "abc", "--dry-run", "train.py"]), ("ddlfast.horovodrun", ["-np", "2", "--dry-run"]),
    ("ddlfast.horovodrun", ["-np", "2", "--elastic-timeout", "5", "train.py"]),
    ("ddlfast.flight", []), ("ddlfast.flight", ["/nonexistent/directory"]),
    ("ddlfast.timeline", ["/nonexistent/directory/run"]), ("ddlfast.timeline", ["run", "--max-events", "0"]),
    ("ddlfast.timeline", ["run", "--max-events", "9" * 5000]),
]


def test_other_tools_refuse_bad_arguments() -> None:
    """bench and demo ran out of memory allocating 1000000GiB (a traceback after the header), demo took NaN and a
    zero batch, horovodrun passed -np -1 to mpiexec: each bad command line is refused, exit status 2."""
    _run_all([(f"{module} {' '.join(args)[:60]}", (module, args)) for module, args in OTHER_REFUSED],
             lambda _, case: refusal(_run(case[0], *case[1]), case[0].removeprefix("ddlfast.")))
