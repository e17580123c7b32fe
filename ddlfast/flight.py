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

FORMAT = "ddlfast-flight-1"
_FILE = re.compile(r"^flight\.rank(\d+)(?:\.ctx(\d+))?\.json$")
MAX_FILE_BYTES = 512 << 20  # one rank's file at DDLFAST_FLIGHT_RECORDS' largest bound is well below


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


def load(directory: Path) -> dict[int, dict[int, dict]]:
    """{context number: {rank: file content}}; a file that is not a flight record is named on stderr and skipped."""
    contexts: dict[int, dict[int, dict]] = {}
    for path in sorted(directory.iterdir()):
        match = _FILE.match(path.name)
        if not match or not path.is_file():
            continue
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("records"), list):
                raise ValueError("not a ddlfast flight record")
        except (OSError, ValueError) as error:
            print(f"ddlfast.flight: skipping {path}: {error}", file=sys.stderr)
            continue
        contexts.setdefault(int(match.group(2) or 0), {})[int(match.group(1))] = data
    return contexts


def _site(record: dict) -> str:
    return f" at {record['site']}" if record.get("site") else ""


def _where(record: dict) -> str:
    return f"#{record['sequence']} ({record['layout']})"


def _latest(data: dict) -> dict | None:
    records = [r for r in data["records"] if isinstance(r, dict) and isinstance(r.get("sequence"), int)]
    return max(records, key=lambda r: r["sequence"]) if records else None


_STATE_TEXT = {
    "agreeing": "{be} waiting in {where} for the other ranks{site}",
    "running": "{be} inside {where}{site}",
    "failed": "failed in {where}{site}",
    "done": "{be} at collective {where}: finished it, and called no ddlfast collective since{site}",
}
_NOT_JOINED = re.compile(r"ranks? ([\d,\-]+) did not join")


def parse_ranges(text: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5]."""
    ranks: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        if first.isdigit() and (not last or last.isdigit()):
            ranks.extend(range(int(first), int(last or first) + 1))
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
        text = _STATE_TEXT.get(state, state + " in {where}{site}")
        lines.append(f"{_ranks_text(ranks)} " + text.format(be="is" if len(ranks) == 1 else "are",
                                                             where=_where(record), site=_site(record)))
    for rank, data in sorted(files.items()):
        queued = [q for q in data.get("queued") or [] if isinstance(q, dict)]
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
        for match in _NOT_JOINED.finditer((record or {}).get("error") or ""):
            for missing_rank in parse_ranges(match.group(1)):
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
            if isinstance(record, dict) and isinstance(record.get("sequence"), int):
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
    held = [row for row in rows if isinstance(row, dict) and row.get("held_s", 0) > 0]
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
    contexts = load(args.directory)
    if not contexts:
        print(f"ddlfast.flight: no flight records (flight.rank<N>.json) in {args.directory}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({str(k): v for k, v in contexts.items()}))
        return 0
    for number, files in sorted(contexts.items()):
        print("\n".join(report(files, number)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
