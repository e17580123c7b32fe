"""DDLFAST_TIMELINE=path: a Chrome/Perfetto trace per rank (path.rank<N>.json;
further contexts in the same process write path.rank<N>.ctx<K>.json).

Events: each collective as one slice labelled with its number, kind and arrays
(thread "collectives"), with this rank's wait for the others drawn inside it;
pack, each dimension's reduce-scatter and allgather (from the compiled engine),
unpack, and the caller's waits. The process is named by rank and host. The file
stays a valid JSON array at every flush and stops growing at
DDLFAST_TIMELINE_MAX_EVENTS events. `python -m ddlfast.timeline` merges the
ranks' files into one trace (ddlfast/timeline.py).
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import threading

from ddlfast import config
from ddlfast.errors import DdlfastError
from ddlfast.files import create_file

DEFAULT_MAX_EVENTS = 100_000
_context_numbers = itertools.count()  # so two contexts never overwrite each other's file


class Timeline:
    def __init__(self, path: str, rank: int, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        number = next(_context_numbers)
        self.path = f"{path}.rank{rank}.json" if number == 0 else f"{path}.rank{rank}.ctx{number}.json"
        self.rank = rank
        self.max_events = max_events
        self._events: list[dict] = []
        self._written = 2  # the metadata events
        self._lock = threading.Lock()
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory):
            raise DdlfastError(f"DDLFAST_TIMELINE={path!r}: directory {directory} does not exist")
        # The process's name and order in a merged trace: the file's first events.
        named = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank} ({platform.node()})"}},
                 {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}}]
        try:  # a fresh file of our own: a link planted at the name is replaced, never followed (ddlfast/files.py)
            self._file = create_file(self.path, json.dumps(named))
        except OSError as error:
            raise DdlfastError(f"DDLFAST_TIMELINE={path!r}: cannot create {self.path}: {error}") from None

    @staticmethod
    def from_env(rank: int) -> Timeline | None:
        path = config.timeline_path()
        if not path:
            return None
        return Timeline(path, rank, config.timeline_max_events())

    def add(self, name: str, start_s: float, end_s: float, thread: str = "comm", **args: object) -> None:
        with self._lock:
            if self._written + len(self._events) >= self.max_events:
                return
            self._events.append({
                "name": name, "ph": "X", "pid": self.rank, "tid": thread,
                "ts": start_s * 1e6, "dur": max(0.0, end_s - start_s) * 1e6, "args": args,
            })

    def collective(self, sequence: int, label: str, arrived: float, ended: float, wait: float) -> None:
        """One collective's slice (from its flight entry, ddlfast/engine/flight.py), its wait for the other ranks
        inside it: the numbers the merged trace attributes stragglers with."""
        self.add(f"#{sequence} {label}", arrived, ended, thread="collectives", sequence=sequence, wait_s=wait)
        if wait > 0:
            self.add("waiting for the other ranks", arrived, arrived + wait, thread="collectives", sequence=sequence,
                     wait=True)

    def flush(self) -> None:
        """Rewrite the file as one JSON array (cheap enough per step: events are bounded)."""
        with self._lock:
            if not self._events:
                return
            file = self._file  # the descriptor opened at creation: the name is never opened again
            file.seek(-1, os.SEEK_END)  # drop the closing bracket
            prefix = ","  # behind the metadata events at least
            file.write((prefix + ",".join(json.dumps(e) for e in self._events) + "]").encode())
            file.flush()
            self._written += len(self._events)
            self._events.clear()
