"""Runs on every rank: the latency path (allreduce of at most DDLFAST_SMALL_BYTES inside the per-call agreement's
own butterfly messages, src/transport/agreement_exchange.cc) and its agreement.

1. Every op x every dtype, allreduce and fused_allreduce([x]), at the small-message limit's edges (the last
   count the latency path takes, the first the ring takes) and at odd counts, against NumPy references
   (ops_cases.py's) and bit-identical on every rank.
2. Disagreements found inside the butterfly, each after the layout was cached, each on one rank: another count
   (also one that halves against ones that do not, when DDLFAST_HALVING_BYTES=400),
   another op, another name=, an integer average against a sum (twice the bytes on the wire), a buffer on the
   ring path against one on the latency path, a broadcast or barrier against an allreduce, a refusal (bad input)
   against a latency call. Every rank must raise DdlfastError, every rank's array must be untouched, and the
   context must work afterwards.
3. Broadcast and allgather up to the limit, which ride in the agreement's messages too: results at the edges,
   and disagreements on one rank (folded_cases).

Prints "N cases on P ranks, F failures"; exits non-zero on any failure.
"""

from __future__ import annotations

import os
import sys

import numpy as np
from harness import report_results
from mpi4py import MPI
from ops_cases import DTYPES, OPS, expect_error, run_op

import ddlfast

LIMIT = 4096  # DDLFAST_SMALL_BYTES for the edge cases


def op_results(comm: MPI.Intracomm, cases: list[tuple[str, str, int]], case: int) -> list[tuple[str, str | None]]:
    """Each (dtype name, op, count) through allreduce and fused_allreduce([x]) (ops_cases.run_op), numbered from
    `case` + 1."""
    results = []
    for name, op, count in cases:
        for api in ("allreduce", "fused"):
            case += 1
            try:
                failure = run_op(name, op, count, api, case, comm)
            except ddlfast.DdlfastError as error:
                failure = f"raised {error}"
            results.append((f"{op} {name}[{count}] {api}", failure))
    return results


def op_cases(comm: MPI.Intracomm) -> list[tuple[str, str | None]]:
    os.environ["DDLFAST_SMALL_BYTES"] = str(LIMIT)
    cases = []
    for name, dtype in DTYPES.items():
        edge = LIMIT // dtype.itemsize
        cases += [(name, op, count) for op in OPS for count in (1, 2, 13, edge - 1, edge, edge + 1)]
    return op_results(comm, cases, 10_000)


def untouched_after_error(comm: MPI.Intracomm, label: str, arrays: dict, call, *needles: str) -> tuple:
    """`call` must raise on every rank naming `needles`, and leave every array as it was."""
    before = {key: array.copy() for key, array in arrays.items()}
    failure = expect_error(comm, call, *needles)
    if failure is None:
        changed = [key for key, array in arrays.items() if not np.array_equal(array, before[key], equal_nan=True)]
        if changed:
            failure = f"rank {comm.Get_rank()} wrote into {changed} although the ranks disagreed"
    return (label, failure)


def disagreement_cases(comm: MPI.Intracomm) -> list[tuple[str, str | None]]:
    rank, world = comm.Get_rank(), comm.Get_size()
    results: list[tuple[str, str | None]] = []
    if world < 2:
        return results
    os.environ["DDLFAST_SMALL_BYTES"] = str(LIMIT)
    odd = world - 1  # the rank that differs
    x = np.arange(100, dtype=np.float32) + rank
    for _ in range(3):  # the layout is cached (and the latency path warm) before anything differs
        y = x.copy()
        ddlfast.allreduce(y)
    longer = np.arange(101, dtype=np.float32)
    results.append(untouched_after_error(
        comm, "another count on one rank", {"x": x, "longer": longer},
        lambda: ddlfast.allreduce(longer if rank == odd else x), "disagree"))
    if os.environ.get("DDLFAST_HALVING_BYTES") == "400":  # x: 400 bytes, halved; 99 elements: whole
        results.append(untouched_after_error(
            comm, "one rank below DDLFAST_HALVING_BYTES, the others halving", {"x": x},
            lambda: ddlfast.allreduce(x[:99] if rank == odd else x), "disagree"))
    results.append(untouched_after_error(
        comm, "another op on one rank", {"x": x},
        lambda: ddlfast.allreduce(x, op="max" if rank == odd else "min"), "disagree"))
    results.append(untouched_after_error(
        comm, "another name on one rank", {"x": x},
        lambda: ddlfast.allreduce(x, name=7 if rank == odd else 6), "name"))
    ints = np.arange(64, dtype=np.int64) * (rank + 1)
    results.append(untouched_after_error(
        comm, "integer average against sum", {"ints": ints},
        lambda: ddlfast.allreduce(ints, op="average" if rank == odd else "sum"), "disagree"))
    big = np.ones(LIMIT, np.float32)  # 16 KiB: the ring, after an agreement of its own
    results.append(untouched_after_error(
        comm, "the ring on one rank, the latency path on the others", {"x": x, "big": big},
        lambda: ddlfast.allreduce(big if rank == odd else x), "disagree"))
    results.append(untouched_after_error(
        comm, "fused_allreduce with another count on one rank", {"x": x, "longer": longer},
        lambda: ddlfast.fused_allreduce([longer if rank == odd else x]), "disagree"))
    results.append(untouched_after_error(
        comm, "a broadcast against a small allreduce", {"x": x},
        lambda: ddlfast.broadcast(x, root=0) if rank == odd else ddlfast.allreduce(x), "different collectives"))
    results.append(untouched_after_error(
        comm, "a barrier against a small allreduce", {"x": x},
        lambda: ddlfast.barrier() if rank == odd else ddlfast.allreduce(x), "different collectives"))
    frozen = x.copy()
    frozen.flags.writeable = False
    results.append(untouched_after_error(
        comm, "bad input on one rank", {"x": x},
        lambda: ddlfast.allreduce(frozen if rank == odd else x), f"rank {odd}"))
    after = np.full(5, rank + 1.0, np.float32)
    ddlfast.allreduce(after)
    want = np.full(5, world * (world + 1) / 2, np.float32)
    results.append(("the context works after the disagreements",
                    None if np.array_equal(after, want) else f"got {after}"))
    return results


def folded_cases(comm: MPI.Intracomm) -> list[tuple[str, str | None]]:
    """Broadcast and allgather up to the limit ride in the agreement's messages (int64 words, each rank's own
    bytes, zeros elsewhere): every dtype and odd byte counts at the limit's edges against NumPy, bit-identical
    on every rank; then disagreements on one rank (another root, another size across the limit, another dtype),
    each an error on every rank with nothing written."""
    rank, world = comm.Get_rank(), comm.Get_size()
    results: list[tuple[str, str | None]] = []
    os.environ["DDLFAST_SMALL_BYTES"] = str(LIMIT)
    for dtype in (np.int8, np.float16, np.float32, np.int64, np.float64):
        itemsize = np.dtype(dtype).itemsize
        for count in (1, 3, LIMIT // itemsize - 1, LIMIT // itemsize, LIMIT // itemsize + 1):
            root = count % world
            x = (np.arange(count) % 97 + rank).astype(dtype)
            ddlfast.broadcast(x, root=root)
            want = (np.arange(count) % 97 + root).astype(dtype)
            failure = None if np.array_equal(x.view(np.uint8), want.view(np.uint8)) else f"rank {rank} got {x[:4]}"
            results.append((f"broadcast {np.dtype(dtype).name}[{count}] root {root}", failure))
            per_rank = max(1, count // world)
            mine = (np.arange(per_rank) % 89 + 3 * rank).astype(dtype)
            gathered = ddlfast.allgather(mine)
            want = np.concatenate([(np.arange(per_rank) % 89 + 3 * q).astype(dtype) for q in range(world)])
            failure = None if np.array_equal(gathered.view(np.uint8), want.view(np.uint8)) else "wrong bytes"
            results.append((f"allgather {np.dtype(dtype).name}[{per_rank}] per rank", failure))
    if world < 2:
        return results
    odd = world - 1
    x = np.arange(100, dtype=np.float32) + rank
    results.append(untouched_after_error(
        comm, "another broadcast root on one rank", {"x": x},
        lambda: ddlfast.broadcast(x, root=1 if rank == odd else 0), "root"))
    big = np.ones(LIMIT, np.float32)  # above the limit: MPI's broadcast after its own agreement
    results.append(untouched_after_error(
        comm, "a broadcast across the limit on one rank", {"x": x, "big": big},
        lambda: ddlfast.broadcast(big if rank == odd else x, root=0), "disagree"))
    results.append(untouched_after_error(
        comm, "an allgather of another dtype on one rank", {"x": x},
        lambda: ddlfast.allgather(x.astype(np.float64) if rank == odd else x), "disagree"))
    results.append(untouched_after_error(
        comm, "an allgather against a broadcast", {"x": x},
        lambda: ddlfast.allgather(x) if rank == odd else ddlfast.broadcast(x, root=0), "different collectives"))
    y = np.full(8, rank, np.int32)
    ddlfast.broadcast(y, root=odd)
    results.append(("usable after the disagreements", None if np.all(y == odd) else f"got {y}"))
    return results


def main() -> int:
    comm = MPI.COMM_WORLD
    return report_results(comm, op_cases(comm) + disagreement_cases(comm) + folded_cases(comm))


if __name__ == "__main__":
    sys.exit(main())
