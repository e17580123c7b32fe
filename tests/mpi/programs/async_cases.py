"""Runs on every rank: asynchronous handles, ordering, mixing with sync
calls, FusedBuffer views, broadcast, timeline and closed-context errors."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
from harness import comm, expect, failures, rank, report_and_exit, world

import ddlfast

# Several outstanding handles over many arrays, then a sync call queued behind them.
rng = np.random.default_rng(rank)
batches = [[rng.standard_normal(n).astype(np.float32) for n in (5, 1000, 77, 40_000)] for _ in range(4)]
inputs = [[a.copy() for a in batch] for batch in batches]
handles = [ddlfast.fused_allreduce_async(batch, op="average") for batch in batches]
sync_array = np.full(33, rank, np.int64)
ddlfast.allreduce(sync_array)  # queued behind the async ones on every rank
expect(all(h.done() for h in handles), "a sync call returned before earlier async handles completed")
expect(np.all(sync_array == world * (world - 1) // 2), f"sync allreduce gave {sync_array[:3]}")
everyone = comm.allgather(inputs)
for b, handle in enumerate(handles):
    result = handle.wait()
    expect(result is not None and all(r is a for r, a in zip(result, batches[b], strict=True)),
           "wait() did not return the caller's arrays")
    for i, got in enumerate(result):
        expected = np.mean([everyone[r][b][i].astype(np.float64) for r in range(world)], axis=0)
        expect(np.allclose(got, expected, rtol=1e-5, atol=1e-5), f"batch {b} array {i} wrong")
    again = handle.wait()  # waiting twice returns the same result
    expect(again is result, "second wait() returned something else")

# FusedBuffer: views into one flat buffer, reduced with no packing.
fused = ddlfast.FusedBuffer([(3, 4), (5,), (2, 2, 2)], dtype=np.float64)
for i, view in enumerate(fused.views):
    view[...] = rank + i
views = fused.allreduce_async(op="sum").wait()
expect(all(v.base is not None for v in views), "FusedBuffer views are not views")
for i, view in enumerate(views):
    expect(np.all(view == sum(r + i for r in range(world))), f"FusedBuffer view {i} = {view.ravel()[:3]}")

# Broadcast from the last rank.
params = np.full(10, float(rank), np.float32)
ddlfast.broadcast(params, root=world - 1)
expect(np.all(params == world - 1), f"broadcast gave {params[:3]}")

# Another Python thread: the default context's issuing thread is the main thread, so the other thread is
# refused at once (naming both threads); with a context of its own it works.
thread_result: dict = {}
def worker() -> None:
    arr = np.ones(100, np.float32)
    try:
        ddlfast.allreduce_async(arr)
        thread_result["refused"] = None
    except ddlfast.DdlfastError as error:
        thread_result["refused"] = str(error)
    own = ddlfast.Context(comm.Dup())
    thread_result["value"] = own.allreduce_async(arr).wait()
    own.close()
t = threading.Thread(target=worker, name="helper")
t.start()
t.join(60)
expect("value" in thread_result and np.all(thread_result["value"] == world), "allreduce_async from a thread failed")
refusal = thread_result.get("refused") or ""
expect("'helper'" in refusal and "'MainThread'" in refusal and "one Context per thread" in refusal,
       f"a second thread on the default context: {refusal!r}")

# A closed context: done handles keep results, new work is refused with DdlfastError.
context = ddlfast.Context(comm)
handle = context.allreduce_async(np.ones(8, np.float32))
context.close()
expect(handle.done() and np.all(handle.wait() == world), "close() did not finish submitted work")
try:
    context.allreduce_async(np.ones(8, np.float32))
    failures.append(f"rank {rank}: closed context accepted work")
except ddlfast.DdlfastError as error:
    expect("closed" in str(error), f"closed-context error says {error}")

# Timeline: a valid Chrome trace with engine phases, pack and unpack.
timeline_base = os.environ.get("DDLFAST_TIMELINE")
if timeline_base:
    ddlfast.default_context().close()
    with open(f"{timeline_base}.rank{rank}.json") as file:
        events = json.load(file)
    names = {e["name"] for e in events}
    for needed in ("pack", "unpack", "wait"):
        expect(needed in names, f"timeline lacks {needed}: {sorted(names)[:10]}")
    expect(any(n.startswith("reduce_scatter") for n in names) or world == 1, f"no reduce_scatter in {names}")
    expect(all(e["ph"] == "M" or (e["ph"] == "X" and e["dur"] >= 0) for e in events), "malformed timeline event")
    expect(any(e["ph"] == "M" and e["args"].get("name", "").startswith(f"rank {rank} (") for e in events),
           "the trace does not name its process by rank and host")

report_and_exit()
