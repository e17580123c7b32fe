"""Runs on every rank: each bad call must raise DdlfastError on every rank
with a message naming the problem, leave the arrays untouched, and leave the
context usable for the next good call."""

from __future__ import annotations

import numpy as np
from harness import failures, rank, report_and_exit, world

import ddlfast


def expect_error(name: str, call, *needles: str, arrays=()) -> None:
    before = [a.copy() for a in arrays]
    try:
        call()
    except ddlfast.DdlfastError as error:
        text = str(error)
        missing = [n for n in needles if n not in text]
        if missing:
            failures.append(f"rank {rank} {name}: message {text!r} lacks {missing}")
        if rank == 0:
            print(f"{name}: {text}")
    except Exception as error:  # noqa: BLE001 - any other exception type is a failure here
        failures.append(f"rank {rank} {name}: raised {type(error).__name__}: {error}")
    else:
        failures.append(f"rank {rank} {name}: no error raised")
    for original, now in zip(before, arrays, strict=True):
        if not np.array_equal(original, now):
            failures.append(f"rank {rank} {name}: array was modified although the call failed")


# Disagreements across ranks: every rank must raise, naming who passed what.
shape = 1000 if rank != 1 else 1007
a = np.ones(shape, np.float32)
expect_error("shape mismatch", lambda: ddlfast.fused_allreduce([a]), "array 0", "rank 1 passed float32[1007]",
             arrays=[a])
b = np.ones(10, np.float64 if rank == world - 1 else np.float32)
expect_error("dtype mismatch", lambda: ddlfast.fused_allreduce([b]), "array 0", "float64[10]", arrays=[b])
arrays = [np.ones(4, np.float32) for _ in range(2 if rank == 0 else 3)]
expect_error("count mismatch", lambda: ddlfast.fused_allreduce(arrays), "number of arrays", arrays=arrays)
c = np.ones(8, np.float32)
expect_error("op mismatch", lambda: ddlfast.allreduce(c, op="sum" if rank else "average"), "disagree on op",
             arrays=[c])

# Local problems: raised before any communication, on every rank alike.
d = np.ones(8, np.float32)
expect_error("dims product", lambda: ddlfast.allreduce(d, dims=(world + 1,)), "multiply to", arrays=[d])
expect_error("bad dims text", lambda: ddlfast.allreduce(d, dims="2by2"), "dims", arrays=[d])
expect_error("empty list", lambda: ddlfast.fused_allreduce([]), "empty")
expect_error("bad op", lambda: ddlfast.allreduce(d, op="mean"), "op='mean'")
strided = np.ones(16, np.float32)[::2]
expect_error("non-contiguous", lambda: ddlfast.fused_allreduce([d, strided]), "array 1", "C-contiguous")
frozen = np.ones(8, np.float32)
frozen.flags.writeable = False
expect_error("read-only", lambda: ddlfast.fused_allreduce([frozen]), "array 0", "read-only", arrays=[frozen])
# The same through allreduce(), whose latency path takes the buffer straight from NumPy.
expect_error("non-contiguous, one array", lambda: ddlfast.allreduce(strided), "array 0", "C-contiguous")
expect_error("read-only, one array", lambda: ddlfast.allreduce(frozen), "array 0", "read-only", arrays=[frozen])
for bad_dtype in (np.complex64, np.bool_, object):
    bad = np.zeros(4, dtype=bad_dtype)
    expect_error(f"dtype {np.dtype(bad_dtype).name}", lambda bad=bad: ddlfast.allreduce(bad), "cannot reduce")
expect_error("not an array", lambda: ddlfast.fused_allreduce([[1.0, 2.0]]), "array 0", "not a NumPy array")

# The context still works after all of the above.
good = np.full(100, rank + 1, np.int64)
ddlfast.allreduce(good)
if not np.all(good == world * (world + 1) // 2):
    failures.append(f"rank {rank}: allreduce after errors gave {good[:4]}")

report_and_exit()
