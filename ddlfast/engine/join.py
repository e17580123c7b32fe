"""ddlfast.join(): a rank that has run out of data joins, and the others' collectives go on without it (Horovod's
hvd.join(), DDP's Join context).

A joined rank agrees on JOIN_LAYOUT, round after round. While another rank is at a collective, that agreement fails
on every rank and the ranks exchange descriptions (Agreement.disagreed); every rank then makes the same decision
from the same descriptions (agreement.join_problem): for an allreduce of host arrays with sum or average, the
joined ranks run the same allreduce with zeros and the others agree again (so an average still divides by the
whole world, as Horovod's does); for anything else the ranks that did not join raise the same DdlfastError and the
joined ranks wait on. Once every rank is inside join(), the agreement passes and every rank learns the last rank
to join (the one whose join came latest in the context's order of collectives; the highest rank among equals).
Every wait is the agreement's, so it is stall-limited: the ranks that did not join must reach a collective within
DDLFAST_TIMEOUT_S.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ddlfast.buffers.dtypes import numpy_dtype
from ddlfast.engine import requests
from ddlfast.engine.agreement import JOIN_LAYOUT, join_problem
from ddlfast.engine.state import EngineState


def join(state: EngineState) -> Callable[[], int]:
    """The collective: returns the last rank to join."""

    def run() -> int:
        agreement, core = state.agreement, state.core
        entered = core.sequence
        while not core.agree(agreement.fingerprint(JOIN_LAYOUT)):
            descriptions = agreement.exchange(JOIN_LAYOUT, None)
            if join_problem(descriptions) is None:
                _with_zeros(state, next(d for d in descriptions if d["kind"] != "join"))
        entries = state.control.allgather_values(entered, "the order in which the ranks joined")
        return max(range(state.size), key=lambda r: (entries[r], r))

    return run


def _with_zeros(state: EngineState, call: dict) -> None:
    """This rank's part, zeros, in the allreduce the others described."""
    arrays = [np.zeros(tuple(shape), numpy_dtype(dtype)) for dtype, shape in call["arrays"]]
    request = requests.prepare(state, arrays, call["op"], tuple(call["dims"]), None, ",".join(call["compression"]),
                               False, None)
    agreement = state.agreement
    previous, agreement.name = agreement.name, call.get("name")
    try:
        requests.execute(state, request)
    finally:
        agreement.name = previous
