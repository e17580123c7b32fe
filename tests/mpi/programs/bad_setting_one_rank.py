"""Runs on every rank: a DDLFAST_* value that fails validation on rank 1 alone. At context creation every rank
raises DdlfastError naming the variable and rank 1 (not the others waiting out the stall limit), and a new Context
on the same communicator then works; set after creation, on rank 1 alone, the next collective (every form, below and
above DDLFAST_SMALL_BYTES) raises on every rank, and the context stays usable. DDLFAST_TIMEOUT_S is short, so a
regression fails here by a stall error, never a hang."""

from __future__ import annotations

import functools
import os

import numpy as np
from harness import comm, expect, rank, report_and_exit, same_everywhere, world

import ddlfast

BAD_AT_CREATION = (("DDLFAST_STRAGGLER_WARN_S", "nan"), ("DDLFAST_FLIGHT_RECORDS", "-1"),
                   ("DDLFAST_CHUNK_BYTES", "lots"), ("DDLFAST_TIMEOUT_S", "inf"), ("DDLFAST_NOT_A_SETTING", "1"))
BAD_PER_CALL = (("DDLFAST_SMALL_BYTES", "x"), ("DDLFAST_TIMEOUT_S", "nan"), ("DDLFAST_CHUNK_BYTES", "-1"))
SIZES = (10, 3 * 4096)  # below and above DDLFAST_SMALL_BYTES (8 KiB)
LAUNCHED_WITH = dict(os.environ)


def restore(variable: str) -> None:
    if variable in LAUNCHED_WITH:
        os.environ[variable] = LAUNCHED_WITH[variable]
    else:
        os.environ.pop(variable, None)


def raised_everywhere(label: str, call, *needles: str) -> None:
    try:
        call()
        text = None
    except ddlfast.DdlfastError as error:
        text = str(error)
    texts = comm.allgather(text)
    if expect(all(t is not None for t in texts), f"{label}: raised per rank: {[t is not None for t in texts]}"):
        mine = texts[0] if rank == 1 else text  # rank 1 may raise its own error; the others name it
        expect(all(n in mine for n in needles), f"{label}: {mine!r} lacks {needles}")


def works(label: str, context: ddlfast.Context) -> None:
    x = np.arange(5000, dtype=np.float32) + rank
    context.allreduce(x)
    want = np.arange(5000, dtype=np.float32) * world + sum(range(world))
    expect(np.array_equal(x, want) and same_everywhere(x), f"{label}: a good allreduce afterwards is wrong")


for variable, value in BAD_AT_CREATION:
    if rank == 1:
        os.environ[variable] = value
    raised_everywhere(f"{variable}={value} at creation", lambda: ddlfast.Context(comm), variable, "rank 1")
    restore(variable)
    works(f"a new Context after {variable}", ddlfast.Context(comm))

context = ddlfast.Context(comm)
calls = {
    "allreduce": lambda x: context.allreduce(x),
    "fused_allreduce": lambda x: context.fused_allreduce([x, x.copy()]),
    "allreduce_async": lambda x: context.allreduce_async(x).wait(),
    "reduce_scatter": lambda x: context.reduce_scatter(x),
    "allgather": lambda x: context.allgather(x),
    "broadcast": lambda x: context.broadcast(x),
}
for variable, value in BAD_PER_CALL:
    for size in SIZES:
        for label, call in calls.items():
            x = np.ones(size * world, np.float32)
            if rank == 1:
                os.environ[variable] = value
            try:
                raised_everywhere(f"{variable}={value} then {label}[{x.size}]", functools.partial(call, x), variable)
            finally:
                restore(variable)
            works(f"after {variable} in {label}", context)
report_and_exit("bad setting on one rank: ")
