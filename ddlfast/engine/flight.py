"""The flight recorder: each rank's last DDLFAST_FLIGHT_RECORDS collectives, written out when something goes wrong.

Every collective of a context passes one agreement, and the core keeps an entry for each in a fixed ring
(src/transport/flight_log.h): the sequence number every error message and census uses, the fingerprint agreed on,
the times of arrival, of the agreement's completion and of the end, this rank's wait for the others, and the
state (agreeing, running, done, failed, mismatch). That costs the latency path nothing in Python. This side adds
what only Python knows, looked up when the file is written: the layout behind each fingerprint (the agreement's
digest cache), the call's name=, the Python call site (the first frame outside ddlfast, torch.distributed and
threading, as an id the core stores) and the error a failed collective raised.

The file — `DDLFAST_FLIGHT_DIR/flight.rank<R>.json`, one per rank and context — is written on a stall, on a broken
context, on a mismatch, on SIGUSR1 and on request (`ddlfast.dump_flight_record()`), through ddlfast/files.py (a
planted link is replaced, never followed). A file that cannot be written costs a FlightWarning, never the
collective's own error. `python -m ddlfast.flight DIR` (ddlfast/flight.py) merges the ranks' files.

Writing a file must not change what the job does: rendering 10,000 records took 1.4 s, long enough for the other
ranks' next collective to hit a short stall limit. So on an error and on SIGUSR1 the caller's thread only copies
what the file needs (`capture`: the core's entries, the layouts and call sites they name), and a writer thread
renders and writes it; the exit and MPI_Abort wait for that thread (`finish_writes`). A file holds the newest
records that fit in MAX_FILE_BYTES, below the merge tool's cap.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import json
import os
import platform
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from ddlfast import _core, abort
from ddlfast.config import STRAGGLER_NOISE_S
from ddlfast.engine.agreement import describe
from ddlfast.files import replace_file

FORMAT = "ddlfast-flight-1"
MAX_STRAGGLER_WINDOW = 4096  # the collectives each rank's arrival log keeps (ArrivalLog::kCapacity)
STATES = ("agreeing", "running", "done", "failed", "mismatch")  # FlightState in src/transport/flight_log.h
MAX_SITES = 1 << 16  # distinct call sites remembered (then new ones are recorded without one)
MAX_ERRORS = 256  # failed collectives whose error text is kept
# A file stays below half of what `python -m ddlfast.flight` reads (its MAX_FILE_BYTES, 512 MiB); at the most
# records a rank keeps (config.MAX_FLIGHT_RECORDS) a file of ordinary calls is far smaller.
MAX_FILE_BYTES = 256 << 20
FINISH_WRITES_S = 60.0  # how long the exit, or MPI_Abort, waits for the writer thread at most
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_INTERNAL_PARTS = (os.sep + os.path.join("torch", "distributed") + os.sep,
                   os.sep + os.path.join("torch", "nn", "parallel") + os.sep,
                   os.sep + "threading.py", os.sep + "concurrent" + os.sep)
_context_numbers = itertools.count()
_recorders: weakref.WeakSet[FlightRecorder] = weakref.WeakSet()  # every live recorder, for SIGUSR1


class FlightWarning(UserWarning):
    """A flight record could not be written (the collective's own error, if any, is raised unchanged)."""


class FlightRecorder:
    def __init__(self, core: Any, capacity: int, directory: str | None,
                 layouts: Callable[[], Callable[[int], tuple]]) -> None:
        self.core = core
        self.rank, self.size = core.rank, core.size
        self.directory = directory
        self.layouts = layouts  # () -> (fingerprint -> (layout, name)): Agreement.known_layouts
        self.host = platform.node()
        self.hosts: tuple[str, ...] = ()  # each rank's host name, once the topology is known
        number = next(_context_numbers)
        self.file_name = f"flight.rank{self.rank}.json" if number == 0 else f"flight.rank{self.rank}.ctx{number}.json"
        self.call_sites = _core.CallSites(_is_internal, MAX_SITES)  # .submitted: the asynchronous work's (sited)
        self._queued: dict[int, tuple[float, str, int]] = {}  # submitted, not started: (when, what, site)
        self._tickets = itertools.count()
        self._errors: dict[int, tuple[str, list | None]] = {}  # sequence -> (error text, every rank's description)
        core.set_flight_capacity(capacity)
        core.use_call_sites(self.call_sites)  # the latency path's site, found in the core call (site=-2)
        _recorders.add(self)

    def sited(self, work: Callable[[], Any], site: int, description: str) -> Callable[[], Any]:
        """`work` (run on the communication thread) with the call site its caller submitted it from; until it
        starts, the file lists it as queued."""
        ticket = next(self._tickets)
        self._queued[ticket] = (time.perf_counter(), description, site)

        def with_site() -> Any:
            self._queued.pop(ticket, None)
            self.call_sites.submitted = site
            try:
                return work()
            finally:
                self.call_sites.submitted = -1
        return with_site

    def site(self) -> int:
        """The id of the caller's call site: the first frame of the stack that is not ddlfast's, torch's
        distributed code or threading (for asynchronous work, where it was submitted); -1 when there is none or
        too many sites were seen. Found in C (_core.CallSites)."""
        return self.call_sites.site()

    def failed(self, error: BaseException, descriptions: list | None = None) -> None:
        """The latest collective failed here with `error`: its text kept, and the file written (where
        DDLFAST_FLIGHT_DIR is set) for a stall, a broken context or a mismatch."""
        core = self.core
        core.flight_end(False)
        if len(self._errors) >= MAX_ERRORS:
            self._errors.pop(next(iter(self._errors)))
        # The first error of a collective is its cause; later ones (the broken context refusing) are not kept.
        self._errors.setdefault(core.sequence, (f"{type(error).__name__}: {error}", descriptions))
        if self.directory and isinstance(error, Exception):
            self.dump_in_background(type(error).__name__)

    def records(self) -> list[dict]:
        """The kept collectives, oldest first, as the file holds them."""
        return self.capture("records()").records()

    def _site_text(self, site: int) -> str | None:
        found = self.call_sites.of(site)
        if found is None:
            return None
        code, offset = found
        return f"{code.co_filename}:{_line_at(code, offset)} ({code.co_name})"

    def queued(self) -> list[dict]:
        """Asynchronous work submitted and not started, oldest first."""
        offset = time.time() - time.perf_counter()
        return [{"state": "queued", "what": what, "submitted": when + offset, "site": self._site_text(site)}
                for when, what, site in list(self._queued.values())]

    def capture(self, reason: str) -> FlightCapture:
        """What the file needs from the core and from state the caller's thread keeps changing, copied now (a
        few milliseconds at MAX_FLIGHT_RECORDS); the rendering, the slow part, can then run on another thread."""
        entries = self.core.flight_entries()
        header = {
            "format": FORMAT, "rank": self.rank, "size": self.size, "host": self.host, "pid": os.getpid(),
            "reason": reason, "written_at": time.time(), "sequence": self.core.sequence,
            "queued": self.queued(), "stragglers": straggler_table(self.core, self.hosts),
        }
        sites = {site: self._site_text(site) for site in {entry[2] for entry in entries}}
        clock_offset = time.time() - time.perf_counter()  # the core's steady clock is perf_counter's
        return FlightCapture(header, entries, clock_offset, self.layouts(), sites, dict(self._errors))

    def dump(self, reason: str, directory: str | None = None) -> str | None:
        """Writes this rank's file and returns its path, or None (no directory, or it could not be written: a
        FlightWarning says why)."""
        path = self._path(directory)
        return path and _write(path, self.capture(reason), self.rank)

    def dump_in_background(self, reason: str) -> None:
        """This rank's file, captured now and written by the writer thread: an error's dump must not hold the
        caller, whose next collective the other ranks wait for under the stall limit."""
        path = self._path(None)
        if path:
            write_later(path, functools.partial(_write, path, self.capture(reason), self.rank))

    def _path(self, directory: str | None) -> str | None:
        directory = directory or self.directory
        return os.path.join(directory, self.file_name) if directory else None


class FlightCapture:
    """One moment of a recorder (FlightRecorder.capture), rendered as the file's records and text."""

    def __init__(self, header: dict, entries: list[tuple], clock_offset: float, layouts: Callable[[int], tuple],
                 sites: dict[int, str | None], errors: dict[int, tuple[str, list | None]]) -> None:
        self.header, self.entries, self.clock_offset = header, entries, clock_offset
        self.layouts, self.sites, self.errors = layouts, sites, errors

    def records(self) -> list[dict]:
        """The kept collectives, oldest first."""
        return [self.record(entry) for entry in self.entries]

    def record(self, entry: tuple) -> dict:
        sequence, fingerprint, site, arrived, agreed, ended, wait, state = entry
        offset = self.clock_offset
        layout, name = self.layouts(fingerprint)
        try:
            description = describe(layout, sequence, name) if layout is not None else {"kind": "?"}
        except Exception:  # noqa: BLE001 (a layout of an unexpected shape must never cost the dump)
            description = {"kind": str(layout[0]) if layout else "?"}
        error, descriptions = self.errors.get(sequence, (None, None))
        return {
            "sequence": sequence, "kind": description.get("kind"), "layout": layout_text(description),
            "description": description, "site": self.sites.get(site), "arrived": arrived + offset,
            "agreed": agreed + offset if agreed else None, "ended": ended + offset if ended else None,
            "state": STATES[state] if 0 <= state < len(STATES) else str(state), "wait_s": wait,
            "error": error, "descriptions": descriptions,
        }

    def text(self, max_bytes: int = MAX_FILE_BYTES) -> str:
        """The file's JSON, at most about `max_bytes`: the newest records that fit (a record's size has no
        bound of its own: a fused call lists every array), the number left out in "records_left_out"."""
        kept: list[str] = []
        size = len(json.dumps(self.header, default=str)) + 64
        for entry in reversed(self.entries):
            text = json.dumps(self.record(entry), default=str)
            size += len(text) + 2
            if size > max_bytes:
                break
            kept.append(text)
        header = json.dumps({**self.header, "records_left_out": len(self.entries) - len(kept)}, default=str)
        return f'{header[:-1]}, "records": [{", ".join(reversed(kept))}]}}'


def _write(path: str, capture: FlightCapture, rank: int) -> str | None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        replace_file(path, capture.text())
    except Exception as error:  # noqa: BLE001 (a dump must never replace the collective's own error)
        warnings.warn(f"ddlfast: rank {rank} could not write its flight record {path}: "
                      f"{type(error).__name__}: {error}", FlightWarning, stacklevel=2)
        return None
    return path


# The writer thread: a file handed to it waits for the one being written, and a newer capture of the same file
# replaces one still waiting (a burst of errors costs one write at a time, of the latest).
_writes = threading.Condition()
_waiting: dict[str, Callable[[], object]] = {}
_writer_running = False
_exit_wait_registered = False


def write_later(path: str, write: Callable[[], object]) -> None:
    """Runs `write` (which must not raise) on the writer thread; inline where no thread can start (at
    interpreter shutdown)."""
    global _writer_running, _exit_wait_registered
    with _writes:
        _waiting[path] = write
        if _writer_running:
            return
        try:
            threading.Thread(target=_write_waiting, name="ddlfast-flight-writer", daemon=True).start()
        except RuntimeError:
            del _waiting[path]
            inline = True
        else:
            _writer_running, inline = True, False
        if not _exit_wait_registered:
            # Registered at the first write, after ddlfast.api's exit handler, so it runs before that one (which
            # may end the process without returning after a loss of ranks).
            atexit.register(finish_writes)
            _exit_wait_registered = True
    if inline:
        write()


def _write_waiting() -> None:
    global _writer_running
    while True:
        with _writes:
            if not _waiting:
                _writer_running = False
                _writes.notify_all()
                return
            write = _waiting.pop(next(iter(_waiting)))
        try:
            write()
        except Exception as error:  # noqa: BLE001 (a FlightWarning a filter made an error: the files after it still go)
            sys.stderr.write(f"ddlfast: the flight record writer: {type(error).__name__}: {error}\n")


def finish_writes(timeout_s: float = FINISH_WRITES_S) -> bool:
    """Waits, at most `timeout_s`, for the writer thread to write every file handed to it (at exit, and before
    MPI_Abort ends the job); whether it did."""
    with _writes:
        return _writes.wait_for(lambda: not _writer_running, timeout_s)


def _no_writes_in_a_child() -> None:
    """A fork() child has no writer thread, whatever its parent's was doing: its exit must not wait for one."""
    global _writes, _writer_running
    _writes, _writer_running = threading.Condition(), False
    _waiting.clear()


abort.before_abort(finish_writes)
os.register_at_fork(after_in_child=_no_writes_in_a_child)


def _is_internal(code: Any) -> bool:
    """Whether a code object's frames are ddlfast's own, torch's distributed code or threading (skipped when
    looking for the user's call site)."""
    filename = code.co_filename
    return filename.startswith(_PACKAGE_DIR) or any(part in filename for part in _INTERNAL_PARTS)


def _line_at(code: Any, offset: int) -> int | None:
    """The source line of the instruction at byte `offset` of `code` (what frame.f_lineno would have said)."""
    for start, end, line in code.co_lines():
        if start <= offset < end:
            return line
    return code.co_firstlineno


def layout_text(description: dict) -> str:
    """'allreduce float32[25557032] op=sum', 'broadcast float32[10] root=0', 'barrier' ..."""
    parts = [str(description.get("kind"))]
    arrays = description.get("arrays") or ()
    if arrays:
        listed = ["{}[{}]".format(dtype, ",".join(map(str, shape))) for dtype, shape in list(arrays)[:4]]
        more = f" +{len(arrays) - 4} more" if len(arrays) > 4 else ""
        parts.append(" ".join(listed) + more)
    for field in ("op", "root", "dims", "compression", "name", "error"):
        value = description.get(field)
        if value not in (None, (), "none", ("none",)):
            shown = value if isinstance(value, str | int) else repr(value)
            parts.append(f"{field}={shown}" if field != "error" else f"({value})")
    return " ".join(parts)


def straggler_table(core: Any, hosts: tuple[str, ...], last: int = 100) -> list[dict]:
    """ddlfast.stragglers()'s rows from this rank's arrival log (the same on every rank, transport/arrivals.h): per
    rank, how many of the last `last` collectives it arrived at last (by more than STRAGGLER_NOISE_S) and how long
    in total it held the earliest rank (the most wait minus the least, in each of those), most held first."""
    size = core.size
    arrivals = [0] * size
    held = [0.0] * size
    for _sequence, rank, least, most in core.arrivals(last):
        if 0 <= rank < size and most - least > STRAGGLER_NOISE_S:
            arrivals[rank] += 1
            held[rank] += most - least
    rows: list[dict[str, Any]] = [{"rank": r, "host": hosts[r] if r < len(hosts) else "",
                                   "last_arrivals": arrivals[r], "held_s": held[r]} for r in range(size)]
    rows.sort(key=lambda row: (-row["held_s"], row["rank"]))
    return rows


def dump_all(reason: str) -> None:
    """Every live recorder's file (SIGUSR1), written by the writer thread."""
    for recorder in list(_recorders):
        recorder.dump_in_background(reason)


_signal_lock = threading.Lock()
_signal_installed = False


def install_signal_handler() -> None:
    """SIGUSR1 writes every live recorder's file (where DDLFAST_FLIGHT_DIR is set). Installed once, from the main
    thread, and only where SIGUSR1 still has its default action (an application's own handler is kept). A rank
    inside a ddlfast wait runs it within a few milliseconds (the wait's interrupt check)."""
    global _signal_installed
    if not hasattr(signal, "SIGUSR1") or threading.current_thread() is not threading.main_thread():
        return
    with _signal_lock:
        if _signal_installed or signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL:
            return
        signal.signal(signal.SIGUSR1, _on_signal)
        _signal_installed = True


def _on_signal(signum: int, frame: object) -> None:
    dump_all("SIGUSR1")
