"""How an uncaught DdlfastError reads: one short report per rank instead of P tracebacks through ddlfast.

What the user sees (DDLFAST_DEBUG=1 restores Python's own traceback, every frame and the whole chain):

    ddlfast: rank 2: DdlfastError at train.py:41 (step): <the message: what, where, the fix>
      train.py:12 in main -> train.py:41 in step    (the user's frames; ddlfast's own left out)

An error that every rank raised alike (DdlfastConsistentError: the ranks' arguments disagree) is printed once, by
the communicator's rank 0, for "ranks 0-N"; each other rank says in one line that it raised the same. ddlfast's
excepthook (ddlfast/abort.py) calls `present` first; it returns False for anything that is not a DdlfastError.
"""

from __future__ import annotations

import os
import sys
import traceback
from types import TracebackType

from ddlfast import config
from ddlfast.errors import DdlfastConsistentError, DdlfastError

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _user_frames(trace: TracebackType | None) -> list[traceback.FrameSummary]:
    return [frame for frame in traceback.extract_tb(trace) if not frame.filename.startswith(_PACKAGE_DIR)]


def _world_rank() -> int | None:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return None
    return mpi.COMM_WORLD.Get_rank()


def report(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> str:
    """The text `present` prints for this rank ("" when another rank prints it)."""
    rank = getattr(error, "rank", None)
    size = getattr(error, "size", None)
    if rank is None:
        rank = _world_rank()
    who = "" if rank is None else f"rank {rank}: "
    if isinstance(error, DdlfastConsistentError) and rank is not None and size:
        if rank != 0:
            return (f"ddlfast: rank {rank}: the same {kind.__name__} as every rank of its communicator (its rank 0 "
                    "prints it; DDLFAST_DEBUG=1 prints it everywhere)\n")
        who = f"ranks 0-{size - 1}: " if size > 1 else who
    frames = _user_frames(trace)
    where = f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""
    text = f"ddlfast: {who}{kind.__name__}{where}: {error}\n"
    if len(frames) > 1:
        text += "  " + " -> ".join(f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"
                                   for f in frames[-6:]) + "\n"
    return text + "  (ddlfast's own frames left out; DDLFAST_DEBUG=1 shows the whole traceback)\n"


def present(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> bool:
    """Print the short report of an uncaught DdlfastError; False (nothing printed) for any other exception or
    under DDLFAST_DEBUG=1, where Python's own traceback is wanted."""
    if not isinstance(error, DdlfastError):
        return False
    try:
        if config.debug():
            return False
    except DdlfastError:
        return False  # a bad DDLFAST_DEBUG: the full traceback, and the variable's own error comes elsewhere
    sys.stderr.write(report(kind, error, trace))
    sys.stderr.flush()
    return True
