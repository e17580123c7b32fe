"""python -m ddlfast.flight DIR: the ranks' flight records merged into one report (docs/observe.md).

Each rank writes DIR/flight.rank<R>.json (ddlfast/engine/flight.py) on a stall, a broken context, a mismatch,
SIGUSR1 or ddlfast.dump_flight_record(). This reads them all and says in one screen who is stuck where and who is
out of step: which collective each rank is in and in what state, which ranks wrote nothing (and what the others'
errors say of them), the first collective where ranks passed different arguments, and who held the others.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ddlfast.files import is_json_int, is_json_number, read_json_file

FORMAT = "ddlfast-flight-1"
# Rank and context numbers of up to 9 digits: int() of a name's digits stays cheap and an error, not a traceback.
_FILE = re.compile(r"^flight\.rank([0-9]{1,9})(?:\.ctx([0-9]{1,9}))?\.json$")
MAX_FILE_BYTES = 512 << 20  # one rank's file at DDLFAST_FLIGHT_RECORDS' largest bound is well below
# The report lists every rank of the job (who wrote nothing): a claimed size is bounded before any list is made.
MAX_RANKS = 1 << 20
MAX_NUMBER = 1e18  # times (seconds since the epoch), waits and counts: any real one is far below


def rank_ranges(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    start = previous = None
    for rank in ordered + [None]:
        if rank is not None and previous is not None and rank == previous + 1:
            previous = rank
            continue
        if start is not None:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = rank
    return ",".join(parts)


def _ranks_text(ranks: Iterable[int]) -> str:
    ranks = sorted(set(ranks))
    return f"rank{'s' if len(ranks) > 1 else ''} {rank_ranges(ranks)}"


class RecordError(ValueError):
    """A file named as a flight record that is not one ddlfast could have written (one line, exit status 2)."""


def load(directory: Path) -> dict[int, dict[int, dict]]:
    """{context number: {rank: file content}}, every file checked to be of the writer's form (`checked`) before the
    report reads a field of it. Raises RecordError naming the first file that is not."""
    contexts: dict[int, dict[int, dict]] = {}
    for path in sorted(directory.iterdir()):
        match = _FILE.match(path.name)
        if not match:
            continue
        rank = int(match.group(1))
        try:
            data = checked(read_json_file(path, MAX_FILE_BYTES), rank)
        except (OSError, ValueError) as error:
            raise RecordError(f"{path}: {error}") from None
        contexts.setdefault(int(match.group(2) or 0), {})[rank] = data
    return contexts


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise RecordError(what)


def _text_or_none(value: object) -> bool:
    return value is None or isinstance(value, str)


def checked(data: object, rank: int) -> dict:
    """`data` if it is a flight record of the writer's form (ddlfast/engine/flight.py FlightRecorder.snapshot) for
    `rank`: every field the report reads of the type it reads, numbers finite and bounded, the job's size within
    MAX_RANKS (the report lists every rank). Raises RecordError naming the first field that is not."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise RecordError(f"not a ddlfast flight record ({FORMAT})")
    size = data.get("size")
    if not is_json_int(size) or not 1 <= size <= MAX_RANKS:
        raise RecordError(f"size {size!r:.40} is not a rank count from 1 to {MAX_RANKS}")
    _require(rank < size, f"rank {rank} (its name) is not below its size {size}")
    _require(isinstance(data.get("reason", ""), str), "reason is not text")
    records = data.get("records")
    if not isinstance(records, list):
        raise RecordError("records is not a list")
    for index, record in enumerate(records):
        where = f"records[{index}]"
        if not isinstance(record, dict):
            raise RecordError(f"{where} is not an object")
        _require(is_json_int(record.get("sequence")) and record["sequence"] >= 0, f"{where}: sequence is not a count")
        for field in ("state", "layout"):
            _require(isinstance(record.get(field), str), f"{where}: {field} is not text")
        for field in ("site", "error"):
            _require(_text_or_none(record.get(field)), f"{where}: {field} is not text")
        for field in ("arrived", "agreed", "ended", "wait_s"):
            _require(record.get(field) is None or is_json_number(record[field], MAX_NUMBER),
                     f"{where}: {field} is not a number")
        descriptions = record.get("descriptions") or []
        if not isinstance(descriptions, list) or len(descriptions) > size:
            raise RecordError(f"{where}: descriptions is not a list of at most {size} ranks")
        for number, description in enumerate(descriptions):
            _require(_readable(description, number), f"{where}: descriptions[{number}] is not a collective's "
                                                     "description ddlfast writes")
    queued = data.get("queued") or []
    _require(isinstance(queued, list) and all(isinstance(q, dict) and _text_or_none(q.get("what"))
                                              and _text_or_none(q.get("site")) for q in queued),
             "queued is not a list of {what, site}")
    stragglers = data.get("stragglers") or []
    _require(isinstance(stragglers, list), "stragglers is not a list")
    for index, row in enumerate(stragglers):
        _require(isinstance(row, dict) and is_json_int(row.get("rank")) and is_json_int(row.get("last_arrivals"))
                 and is_json_number(row.get("held_s"), MAX_NUMBER) and isinstance(row.get("host", ""), str),
                 f"stragglers[{index}] is not a row of rank, host, last_arrivals, held_s")
    return data


def _readable(description: object, rank: int) -> bool:
    from ddlfast.engine.agreement import readable  # the check a peer's description passes in a live job

    return readable(description, rank).get("kind") != "invalid"


def _site(record: dict) -> str:
    return f" at {record['site']}" if record.get("site") else ""


def _where(record: dict) -> str:
    return f"#{record['sequence']} ({record['layout']})"


def _latest(data: dict) -> dict | None:
    return max(data["records"], key=lambda r: r["sequence"]) if data["records"] else None


_STATE_TEXT = {
    "agreeing": "{be} waiting in {where} for the other ranks{site}",
    "running": "{be} inside {where}{site}",
    "failed": "failed in {where}{site}",
    "done": "{be} at collective {where}: finished it, and called no ddlfast collective since{site}",
}
_NOT_JOINED = re.compile(r"ranks? ([0-9,\-]+) did not join")
_RANGE = re.compile(r"([0-9]{1,9})(?:-([0-9]{1,9}))?")
# A census names the missing ranks as ranges: at most a few MB at MAX_RANKS; an error text may be longer.
MAX_CENSUS_CHARS = 8 << 20


def parse_ranges(text: str, limit: int = MAX_RANKS) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5]: each rank once, in order, those at or above `limit` (the job's size) left out.
    The text comes from a file (an error message), so the work is bounded by `limit`, not by the ranges named."""
    longest: dict[int, int] = {}  # first rank of a span -> the last rank of the longest span from it
    for part in text.split(","):
        match = _RANGE.fullmatch(part)
        if match:
            first, last = int(match.group(1)), min(int(match.group(2) or match.group(1)), limit - 1)
            if first <= last:
                longest[first] = max(longest.get(first, last), last)
    ranks: list[int] = []
    for first in sorted(longest):
        ranks.extend(range(max(first, ranks[-1] + 1 if ranks else 0), longest[first] + 1))
    return ranks


def report(files: dict[int, dict], context: int = 0) -> list[str]:
    """The merged report of one context's files, as lines."""
    size = max(int(d.get("size", 0)) for d in files.values())
    lines = [f"ddlfast flight records{'' if context == 0 else f' (context {context})'}: "
             f"{len(files)} of {size} ranks wrote one"]
    for reason in sorted({d.get("reason", "?") for d in files.values()}):
        ranks = [r for r, d in files.items() if d.get("reason", "?") == reason]
        lines.append(f"  {_ranks_text(ranks)} wrote it on: {reason}")
    lines.append("")
    # Where each rank is: grouped by (collective, state), the furthest behind first.
    latest: dict[int, Any] = {rank: _latest(data) for rank, data in files.items()}
    groups: dict[tuple, list[int]] = {}
    for rank, record in latest.items():
        key = (-1, "none", "", "") if record is None else (record["sequence"], record["state"], record["layout"],
                                                           record.get("site") or "")
        groups.setdefault(key, []).append(rank)
    for (sequence, state, _, _), ranks in sorted(groups.items()):
        if sequence < 0:
            lines.append(f"{_ranks_text(ranks)}: no collective recorded")
            continue
        record = latest[ranks[0]]
        # An unknown state is the file's text: never a format string (its braces would be read as fields)
        text = _STATE_TEXT.get(state, "{state} in {where}{site}")
        lines.append(f"{_ranks_text(ranks)} " + text.format(be="is" if len(ranks) == 1 else "are", state=state,
                                                             where=_where(record), site=_site(record)))
    for rank, data in sorted(files.items()):
        queued = data.get("queued") or []
        if queued:
            first = queued[0]
            lines.append(f"rank {rank} has {len(queued)} asynchronous collective{'s' if len(queued) > 1 else ''} "
                         f"queued behind it, not started (first: {first.get('what')}"
                         f"{' at ' + first['site'] if first.get('site') else ''})")
    missing = [r for r in range(size) if r not in files]
    if missing:
        lines.append(f"{_ranks_text(missing)} wrote no flight record (the process is gone, stuck outside ddlfast, "
                     "or has no DDLFAST_FLIGHT_DIR)")
    # The errors the ranks' latest collectives failed with (a stall's census names the ranks it missed).
    errors: dict[str, list[int]] = {}
    for rank, record in latest.items():
        if record is not None and record.get("error"):
            errors.setdefault(record["error"], []).append(rank)
    for error, ranks in errors.items():
        lines.append(f"{_ranks_text(ranks)} failed with: {error}")
    # The headline: the ranks the stall census found missing, and where the others waited for them.
    named: dict[int, list[int]] = {}
    for rank, record in latest.items():
        for match in _NOT_JOINED.finditer(((record or {}).get("error") or "")[:MAX_CENSUS_CHARS]):
            for missing_rank in parse_ranges(match.group(1), size):
                named.setdefault(missing_rank, []).append(rank)
    headline = []
    for missing_rank, by in sorted(named.items()):
        waited = latest[by[0]]
        headline.append(f"STUCK: rank {missing_rank} never arrived at collective {_where(waited)}; "
                        f"{_ranks_text(by)} waited for it there{_site(waited)}")
        if missing_rank in latest and latest[missing_rank] is not None:
            own = latest[missing_rank]
            headline.append(f"  rank {missing_rank}'s own record: its last collective is {_where(own)}, "
                            f"{own['state']}{_site(own)}")
    if headline:
        lines[1:1] = headline + [""]
    lines.extend(_mismatch(files))
    lines.extend(_stragglers(files))
    return lines


def _mismatch(files: dict[int, dict]) -> list[str]:
    """The first collective where ranks passed different arguments: from the records of one sequence number
    across files, or from the descriptions a mismatch error carried (every rank's, in any one file)."""
    by_sequence: dict[int, dict[int, dict]] = {}
    for rank, data in files.items():
        for record in data["records"]:
            by_sequence.setdefault(record["sequence"], {})[rank] = record
    for sequence in sorted(by_sequence):
        records = by_sequence[sequence]
        described = next((r["descriptions"] for r in records.values() if r.get("descriptions")), None)
        if described is not None:
            layouts = {rank: _description_text(d) for rank, d in enumerate(described)}
        elif len({r["layout"] for r in records.values()}) > 1:
            layouts = {rank: r["layout"] for rank, r in records.items()}
        else:
            continue
        if len(set(layouts.values())) < 2:
            continue
        counts: dict[str, list[int]] = {}
        for rank, text in layouts.items():
            counts.setdefault(text, []).append(rank)
        common = max(counts, key=lambda text: len(counts[text]))
        lines = []
        for text, ranks in counts.items():
            if text == common:
                continue
            sites = sorted({str(records[r]["site"]) for r in ranks if r in records and records[r].get("site")})
            at = f" (at {', '.join(sites)})" if sites else ""
            lines.append(f"{_ranks_text(ranks)} passed {text} to #{sequence}{at} where "
                         f"{_ranks_text(counts[common]) if len(counts) > 2 else 'the others'} passed {common}")
        return ["", "out of step:"] + ["  " + line for line in lines]
    return []


def _description_text(description: object) -> str:
    from ddlfast.engine.flight import layout_text  # the writer's own rendering of a description

    return layout_text(description) if isinstance(description, dict) else repr(description)


def _stragglers(files: dict[int, dict]) -> list[str]:
    rows = max((d.get("stragglers") or [] for d in files.values()), key=len, default=[])
    held = [row for row in rows if row["held_s"] > 0]
    if not held:
        return []
    lines = ["", "who held the others (last 100 collectives before the dump):"]
    for row in held[:5]:
        lines.append(f"  rank {row['rank']} ({row.get('host', '')}): arrived last in {row['last_arrivals']}, "
                     f"held the others {row['held_s']:.3f} s")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddlfast.flight",
                                     description="Merge the ranks' flight records (DDLFAST_FLIGHT_DIR) into one "
                                                 "report: who is stuck where, who is out of step.")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--json", action="store_true", help="the merged records as JSON, not the report")
    args = parser.parse_args(argv)
    if not args.directory.is_dir():
        print(f"ddlfast.flight: {args.directory} is not a directory", file=sys.stderr)
        return 2
    try:
        contexts = load(args.directory)
    except (OSError, RecordError) as error:
        print(f"ddlfast.flight: {error}", file=sys.stderr)
        return 2
    if not contexts:
        print(f"ddlfast.flight: no flight records (flight.rank<N>.json) in {args.directory}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({str(k): v for k, v in contexts.items()}, allow_nan=False))
        return 0
    for number, files in sorted(contexts.items()):
        print("\n".join(report(files, number)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
