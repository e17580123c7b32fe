"""Files ddlfast writes, written so that a planted symbolic link (or any other file at the name) is never followed.

Every file goes to a temporary file created with O_EXCL in the target's own directory (`tempfile.mkstemp`, mode
0600), then `os.replace` renames it over the name: a rename replaces a link, it never writes through it, and a
reader never sees half a file. The probe cache (ddlfast/topology/probe.py) and the timeline
(ddlfast/engine/timeline.py) both write through here.

This module imports nothing from ddlfast.
"""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path


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
