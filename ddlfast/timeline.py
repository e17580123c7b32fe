"""python -m ddlfast.timeline PREFIX: the ranks' DDLFAST_TIMELINE files merged into one Chrome/Perfetto trace.

DDLFAST_TIMELINE=PREFIX makes each rank write PREFIX.rank<R>.json (ddlfast/engine/timeline.py): a process per rank,
named by rank and host, each collective as one slice labelled with its number, kind and arrays, this rank's wait
for the others drawn inside it, and the engine's phases (pack, each dimension's reduce-scatter and allgather,
unpack). This merges them into PREFIX.json (or -o): one trace, open it in https://ui.perfetto.dev or
chrome://tracing. On the way it

- aligns the ranks' clocks: every rank completes a collective's agreement at nearly the same moment, so each rank's
  offset is the median difference of those moments against rank 0's (ranks on other hosts need no common clock);
- attributes every collective: the rank that waited least arrived last, and held the others for the difference of
  the waits; each slice says who that was, and an instant event on the straggler's track marks it where that hold
  is above the noise (STRAGGLER_NOISE_S, as ddlfast.stragglers());
- keeps at most --max-events events (default 1,000,000; a documented cap, so the trace stays loadable).

The output is written through ddlfast/files.py: a planted link at its name is replaced, never followed.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from ddlfast.config import STRAGGLER_NOISE_S
from ddlfast.files import is_json_int, is_json_number, read_json_file, replace_file

DEFAULT_MAX_EVENTS = 1_000_000
MAX_FILE_BYTES = 2 << 30
# Timestamps and durations (microseconds) and waits (seconds): a real one is far below (the epoch is 1.8e15 us).
# Bounded so that the merge's sums and differences stay finite and the output strict JSON.
MAX_NUMBER = 1e17


def rank_files(prefix: str) -> dict[int, Path]:
    """{rank: path} of PREFIX.rank<R>.json (the first context of each process; PREFIX may be a directory, for
    the files in it with any prefix)."""
    base = Path(prefix)
    if base.is_dir():
        directory, pattern = base, re.compile(r"^.*\.rank([0-9]{1,9})\.json$")
    else:
        directory, pattern = base.parent, re.compile("^" + re.escape(base.name) + r"\.rank([0-9]{1,9})\.json$")
    found: dict[int, Path] = {}
    for path in sorted(directory.iterdir()):
        match = pattern.match(path.name)
        if match:  # a directory or FIFO at the name is named by _read, not passed over
            found.setdefault(int(match.group(1)), path)
    return found


class TraceError(ValueError):
    """A rank's file that is not a trace ddlfast writes (one line, exit status 2)."""


def _read(path: Path) -> list[dict]:
    try:
        return checked_events(read_json_file(path, MAX_FILE_BYTES))
    except (OSError, ValueError) as error:
        raise TraceError(f"{path}: {error}") from None


def checked_events(events: object) -> list[dict]:
    """`events` if it is a rank's trace of the writer's form (ddlfast/engine/timeline.py): a list of events, each
    with the fields the merge reads of the type it reads. Raises ValueError naming the first event that is not."""
    if not isinstance(events, list):
        raise ValueError("not a trace (a JSON array of events)")
    for index, event in enumerate(events):
        if not isinstance(event, dict) or not isinstance(event.get("ph"), str):
            raise ValueError(f"event {index} is not a trace event (an object with a ph)")
        if event["ph"] != "M" and not is_json_number(event.get("ts"), MAX_NUMBER):
            raise ValueError(f"event {index}: ts is not a number up to {MAX_NUMBER:g}")
        if "dur" in event and not is_json_number(event["dur"], MAX_NUMBER):
            raise ValueError(f"event {index}: dur is not a number up to {MAX_NUMBER:g}")
        args = event.get("args", {})
        if not isinstance(args, dict):
            raise ValueError(f"event {index}: args is not an object")
        if "sequence" in args and not is_json_int(args["sequence"]):
            raise ValueError(f"event {index}: args.sequence is not an integer")
        if "wait_s" in args and not is_json_number(args["wait_s"], MAX_NUMBER):
            raise ValueError(f"event {index}: args.wait_s is not a number up to {MAX_NUMBER:g}")
    return events


def _agreed_at(events: list[dict]) -> dict[int, float]:
    """sequence -> when this rank's wait in that collective's agreement ended (its own clock, microseconds)."""
    moments = {}
    for event in events:
        args = event.get("args") or {}
        if event["ph"] != "M" and args.get("wait") and isinstance(args.get("sequence"), int):  # M: no ts
            moments[args["sequence"]] = float(event["ts"]) + float(event.get("dur", 0))
    return moments


def merge(per_rank: dict[int, list[dict]], max_events: int = DEFAULT_MAX_EVENTS) -> dict:
    """One trace (Chrome's JSON object format) from each rank's events."""
    moments = {rank: _agreed_at(events) for rank, events in per_rank.items()}
    reference = moments.get(min(per_rank), {}) if per_rank else {}
    offsets = {}
    for rank, own in moments.items():
        common = [reference[s] - own[s] for s in own if s in reference]
        offsets[rank] = statistics.median(common) if common else 0.0
    # Who arrived last at each collective: the rank that waited least (each rank's own wait, no clocks compared).
    waits: dict[int, dict[int, float]] = {}
    for rank, events in per_rank.items():
        for event in events:
            args = event.get("args") or {}
            if "wait_s" in args and isinstance(args.get("sequence"), int):
                waits.setdefault(args["sequence"], {})[rank] = float(args["wait_s"])
    stragglers = {}
    for sequence, by_rank in waits.items():
        if len(by_rank) > 1:
            last = min(by_rank, key=lambda r: (by_rank[r], r))
            stragglers[sequence] = (last, max(by_rank.values()) - by_rank[last])
    merged: list[dict] = []
    kept = 0
    dropped = 0
    for rank in sorted(per_rank):
        for event in per_rank[rank]:
            if kept >= max_events:
                dropped += 1
                continue
            event = dict(event, pid=rank)
            if event.get("ph") != "M":
                event["ts"] = float(event.get("ts", 0)) + offsets[rank]
                args = event.get("args") or {}
                number = args.get("sequence")
                if "wait_s" in args and isinstance(number, int) and number in stragglers:
                    last, held = stragglers[number]
                    event["args"] = dict(args, last_to_arrive=last, held_others_ms=round(held * 1e3, 3))
                    if last == rank and held > STRAGGLER_NOISE_S and kept + 1 < max_events:
                        merged.append({"name": f"held the others {held * 1e3:.1f} ms", "ph": "i", "s": "p",
                                       "pid": rank, "tid": "collectives", "ts": event["ts"],
                                       "args": {"sequence": number}})
                        kept += 1
            merged.append(event)
            kept += 1
    return {"traceEvents": merged, "displayTimeUnit": "ms",
            "otherData": {"ranks": sorted(per_rank), "clock_offsets_us": {str(r): o for r, o in offsets.items()},
                          "dropped_events": dropped, "max_events": max_events}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddlfast.timeline",
                                     description="Merge the ranks' DDLFAST_TIMELINE files into one Chrome/Perfetto "
                                                 "trace (process per rank, collectives labelled, stragglers marked).")
    parser.add_argument("prefix", help="DDLFAST_TIMELINE's value (or the directory of the files)")
    parser.add_argument("-o", "--output", help="the merged trace (default: PREFIX.json, or DIR/merged.json)")
    parser.add_argument("--max-events", type=int, default=DEFAULT_MAX_EVENTS,
                        help=f"the most events the trace keeps (default {DEFAULT_MAX_EVENTS})")
    args = parser.parse_args(argv)
    if args.max_events < 1:
        print("ddlfast.timeline: --max-events must be at least 1", file=sys.stderr)
        return 2
    base = Path(args.prefix)
    if not base.is_dir() and not base.parent.is_dir():
        print(f"ddlfast.timeline: no directory {base.parent}", file=sys.stderr)
        return 2
    files = rank_files(args.prefix)
    if not files:
        print(f"ddlfast.timeline: no files {args.prefix}.rank<N>.json", file=sys.stderr)
        return 1
    try:
        per_rank = {rank: _read(path) for rank, path in files.items()}
    except TraceError as error:
        print(f"ddlfast.timeline: {error}", file=sys.stderr)
        return 2
    trace = merge(per_rank, args.max_events)
    output = args.output or (str(base / "merged.json") if base.is_dir() else f"{args.prefix}.json")
    try:
        replace_file(output, json.dumps(trace, allow_nan=False))  # strict JSON, as Perfetto reads it
    except OSError as error:
        print(f"ddlfast.timeline: cannot write {output}: {error}", file=sys.stderr)
        return 1
    dropped = trace["otherData"]["dropped_events"]
    print(f"ddlfast.timeline: {len(trace['traceEvents'])} events of {len(files)} ranks in {output}"
          + (f" ({dropped} beyond --max-events left out)" if dropped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
