"""Files ddlfast writes, written so that a planted symbolic link (or any other file at the name) is never followed.

Every file goes to a temporary file created with O_EXCL in the target's own directory (`tempfile.mkstemp`, mode
0600), then `os.replace` renames it over the name: a rename replaces a link, it never writes through it, and a
reader never sees half a file. The probe cache (ddlfast/topology/probe.py) and the timeline
(ddlfast/engine/timeline.py) both write through here.

The tools that read such files back (python -m ddlfast.flight, ddlfast.timeline) read them through
`read_json_file`: a regular file only (a FIFO or device at the name is refused, never waited on), its size checked
on the open descriptor before anything is read, and strict JSON (no NaN or Infinity, nesting that fits the stack).

This module imports nothing from ddlfast.
"""

from __future__ import annotations

import io
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, TypeGuard


def replace_file(path: str | os.PathLike, data: bytes | str) -> None:
    """Write `data` as the whole content of `path`, atomically, never through a link. Raises OSError."""
    create_file(path, data).close()


def create_file(path: str | os.PathLike, data: bytes | str) -> io.BufferedRandom:
    """A new file at `path` holding `data`, left open for reading and writing (a file ddlfast keeps extending, such
    as the timeline): written to a temporary file created with O_EXCL (mode 0600) beside it, then renamed over the
    name, so the returned file is the one ddlfast made, never a link's target, and later writes go through the
    open descriptor, never the name again. Raises OSError."""
    target = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    descriptor, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    file = os.fdopen(descriptor, "rb+")
    try:
        file.write(payload)
        file.flush()
        os.replace(temporary, target)  # renames over a link, never through it
    except BaseException:
        file.close()
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    return file


def read_json_file(path: str | os.PathLike, max_bytes: int) -> Any:
    """The strict JSON document in the regular file `path`, of at most `max_bytes` bytes. Raises ValueError (its
    message names the problem, not the path) or OSError."""
    # O_NONBLOCK: opening a FIFO planted at the name returns at once (and is refused below) instead of waiting
    # for a writer that never comes.
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(descriptor, "rb") as file:
        status = os.fstat(descriptor)  # of what was opened, not of what the name points to a moment later
        if not stat.S_ISREG(status.st_mode):
            raise ValueError("not a regular file")
        if status.st_size > max_bytes:
            raise ValueError(f"{status.st_size} bytes, larger than the {max_bytes} bytes accepted")
        data = file.read(max_bytes + 1)  # the file may have grown since fstat
    if len(data) > max_bytes:
        raise ValueError(f"larger than the {max_bytes} bytes accepted")
    return strict_json(data)


def is_json_int(value: object) -> TypeGuard[int]:
    """An integer of a parsed JSON document (JSON's true and false are not counts)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_json_number(value: object, limit: float) -> bool:
    """A number of a parsed JSON document of at most `limit` in size (strict_json refused NaN and Infinity; a huge
    integer is refused here, so that a reader's arithmetic on it stays finite)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and abs(value) <= limit


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def strict_json(data: bytes | str) -> Any:
    """json.loads as RFC 8259 reads it: NaN, Infinity and -Infinity refused; nesting too deep for the parser's
    recursion is a ValueError, not a RecursionError. Raises ValueError."""
    try:
        return json.loads(data, parse_constant=_refuse_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except UnicodeDecodeError as error:  # a ValueError already; said shorter
        raise ValueError(f"not UTF-8 text ({error.reason} at byte {error.start})") from None
