"""Runs on every rank: ddlfast.alltoall (NumPy and torch CPU; equal and per-rank splits; fused; async; below and
above DDLFAST_SMALL_BYTES; cut into rounds with control.MAX_MESSAGE_BYTES lowered), allgatherv (first dimensions
that differ per rank) and join() (allreduce sum/average with joined ranks' zeros, the last rank to join, any other
collective refused on the ranks that did not join). Bad input on one rank (splits that do not sum, a dtype or a
trailing shape that differs, receive_splits that disagree with the senders, out= of the wrong size) must raise
DdlfastError on every rank, and the context must stay usable after each.

Every expected value is computed here with NumPy from what every rank's input is (regenerated from seeds), and
every result is compared across ranks where it must be identical. Prints "N cases on P ranks, F failures".
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from harness import report_results
from mpi4py import MPI
from ops_cases import expect_error

import ddlfast
from ddlfast.engine import control

comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
results: list[tuple[str, str | None]] = []


def check(label: str, ok: bool, detail: str = "") -> None:
    results.append((label, None if ok else detail or "wrong result"))


def rows_from(source: int, dest: int, salt: int) -> int:
    """How many rows rank `source` sends rank `dest` (uneven, some zero)."""
    return (source * 7 + dest * 3 + salt) % 5


def block(source: int, dest: int, rows: int, width: int, dtype: np.dtype, salt: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * source + 10 * dest + salt)
    return rng.integers(-50, 50, size=(rows, width)).astype(dtype)


def alltoall_input(source: int, width: int, dtype: np.dtype, salt: int, equal: int | None) -> tuple:
    counts = [equal if equal is not None else rows_from(source, d, salt) for d in range(world)]
    parts = [block(source, d, counts[d], width, dtype, salt) for d in range(world)]
    return np.concatenate(parts), counts


def alltoall_expected(width: int, dtype: np.dtype, salt: int, equal: int | None) -> tuple:
    counts = [equal if equal is not None else rows_from(s, rank, salt) for s in range(world)]
    return np.concatenate([block(s, rank, counts[s], width, dtype, salt) for s in range(world)]), counts


def cases_alltoall() -> None:
    for dtype in (np.float32, np.int64, np.uint8, np.float64):
        for width in (3, 700):  # 700 x 8 bytes per row: above DDLFAST_SMALL_BYTES per block
            for equal in (None, 2):
                salt = width + np.dtype(dtype).itemsize
                array, counts = alltoall_input(rank, width, np.dtype(dtype), salt, equal)
                want, want_counts = alltoall_expected(width, np.dtype(dtype), salt, equal)
                got, got_counts = ddlfast.alltoall(array, None if equal else counts)
                label = f"alltoall {np.dtype(dtype).name} width {width} {'equal' if equal else 'splits'}"
                check(label, got.dtype == want.dtype and np.array_equal(got, want) and got_counts == want_counts,
                      f"got {got.shape} {got_counts}, want {want.shape} {want_counts}")
    # torch CPU, async, receive_splits + out=
    array, counts = alltoall_input(rank, 5, np.dtype(np.float32), 9, None)
    want, want_counts = alltoall_expected(5, np.dtype(np.float32), 9, None)
    got, got_counts = ddlfast.alltoall_async(torch.from_numpy(array), counts).wait()
    check("alltoall torch async", isinstance(got, torch.Tensor) and np.array_equal(got.numpy(), want)
          and got_counts == want_counts)
    out = torch.empty(len(want), 5)
    got, _ = ddlfast.alltoall(torch.from_numpy(array), counts, receive_splits=want_counts, out=out)
    check("alltoall out=", got is out and np.array_equal(out.numpy(), want))
    # fused: two arrays of different dtypes in one exchange
    a, ca = alltoall_input(rank, 4, np.dtype(np.int32), 11, None)
    b, cb = alltoall_input(rank, 900, np.dtype(np.float64), 12, None)
    (ga, gb), (sa, sb) = ddlfast.fused_alltoall_async([a, b], [ca, cb]).wait()
    wa, wca = alltoall_expected(4, np.dtype(np.int32), 11, None)
    wb, wcb = alltoall_expected(900, np.dtype(np.float64), 12, None)
    check("fused_alltoall", np.array_equal(ga, wa) and np.array_equal(gb, wb) and sa == wca and sb == wcb)
    # cut into rounds: MAX_MESSAGE_BYTES below a block
    saved = control.MAX_MESSAGE_BYTES
    control.MAX_MESSAGE_BYTES = 1000
    try:
        (ga, gb), _ = ddlfast.fused_alltoall([a, b], [ca, cb])
        check("fused_alltoall in rounds", np.array_equal(ga, wa) and np.array_equal(gb, wb))
        got = ddlfast.allgatherv(np.full((rank + 1, 300), rank, np.int32))
        want = np.concatenate([np.full((r + 1, 300), r, np.int32) for r in range(world)])
        check("allgatherv in rounds", np.array_equal(got, want))
    finally:
        control.MAX_MESSAGE_BYTES = saved


def cases_allgatherv() -> None:
    for width in (2, 3000):
        mine = np.arange((rank % 3) * width, dtype=np.float32).reshape(rank % 3, width) + rank
        want = np.concatenate([np.arange((r % 3) * width, dtype=np.float32).reshape(r % 3, width) + r
                               for r in range(world)])
        got = ddlfast.allgatherv(mine)
        check(f"allgatherv width {width}", np.array_equal(got, want), f"got {got.shape} want {want.shape}")
    got = ddlfast.allgatherv_async(torch.full((rank + 1, 2), float(rank))).wait()
    want = np.concatenate([np.full((r + 1, 2), float(r), np.float32) for r in range(world)])
    check("allgatherv torch async", isinstance(got, torch.Tensor) and np.array_equal(got.numpy(), want))
    a, b = np.full((rank, 3), rank, np.int16), np.full((2 * rank + 1,), rank, np.float64)
    ga, gb = ddlfast.fused_allgatherv([a, b])
    check("fused_allgatherv", np.array_equal(ga, np.concatenate([np.full((r, 3), r, np.int16) for r in range(world)]))
          and np.array_equal(gb, np.concatenate([np.full((2 * r + 1,), r, np.float64) for r in range(world)])))


def cases_join() -> None:
    small, large = (5, 3), (40, 300)  # the latency path and the ring (above DDLFAST_SMALL_BYTES)
    for first in range(world):
        for op in ("sum", "average"):
            for shape in (small, large):
                held = None  # the joined rank holds no result
                if rank == first:
                    last = ddlfast.join()
                else:
                    a = np.full(shape, rank + 1, np.float64)
                    b = np.full(shape, rank + 1, np.int32)
                    ddlfast.fused_allreduce([a, b], op=op)
                    h = ddlfast.allreduce_async(np.full(shape, 2.0, np.float32), op=op, name="named")
                    c = h.wait()
                    last = ddlfast.join()
                    total = sum(r + 1 for r in range(world) if r != first)
                    want = total / world if op == "average" else total
                    want_c = 2.0 * (world - 1) / world if op == "average" else 2.0 * (world - 1)
                    held = a.tobytes() + b.tobytes() + c.tobytes()
                    check(f"join {op} {shape} first {first}", np.allclose(a, want, rtol=1e-15)
                          and np.all(b == np.floor(want)) and np.allclose(c, want_c, rtol=1e-6),
                          f"{a.flat[0]} {b.flat[0]} {c.flat[0]} want {want} {want_c}")
                check(f"join {op} {shape} identical bits", len({h for h in comm.allgather(held) if h}) <= 1)
                lasts = comm.allgather(last)
                check(f"join last rank first {first}", len(set(lasts)) == 1
                      and (world == 1 or lasts[0] != first), f"{lasts}")
        # several buckets (the agreement before the buckets, not inside one core call), and an async fused call
        os.environ["DDLFAST_BUCKET_BYTES"] = "16384"
        try:
            if rank == first:
                ddlfast.join()
            else:
                a, b = np.full((40, 300), 2.0), np.full((10, 300), 3.0, np.float32)
                ddlfast.fused_allreduce_async([a, b], op="sum").wait()
                ddlfast.join()
                check(f"join with several buckets first {first}", np.all(a == 2.0 * (world - 1))
                      and np.all(b == 3.0 * (world - 1)), f"{a.flat[0]} {b.flat[0]}")
        finally:
            del os.environ["DDLFAST_BUCKET_BYTES"]
        # any other collective while a rank is inside join(): an error on the others; the joined rank waits on
        if world > 1:
            if rank == first:
                ddlfast.join()
            else:
                error = None
                try:
                    ddlfast.allgather(np.zeros(3))
                except ddlfast.DdlfastError as raised:
                    error = str(raised)
                check("allgather while joined", error is not None and "join" in error, f"{error}")
                ddlfast.join()


def cases_bad_input() -> None:
    array = np.zeros((world * 2, 3), np.float32)
    bad_splits = [2] * world if rank != world - 1 else [1] * world
    got, _ = ddlfast.alltoall(np.full((world,), rank, np.int64))  # the context is still usable
    check("usable after the errors", np.array_equal(got, np.arange(world)))
    results.append(("bad splits on one rank", expect_error(comm, lambda: ddlfast.alltoall(array, bad_splits),
                                                           "splits")))
    if world == 1:
        return  # nothing can differ between ranks
    dtype = np.float64 if rank == 0 else np.float32
    results.append(("dtype differs", expect_error(comm, lambda: ddlfast.alltoall(np.zeros((world, 3), dtype)),
                                                  "alltoall")))
    width = 4 if rank == 0 else 3
    results.append(("trailing shape differs", expect_error(
        comm, lambda: ddlfast.allgatherv(np.zeros((rank, width), np.float32)), "allgatherv")))
    expected = [2] * world if rank != 0 or world == 1 else [1] + [2] * (world - 1)
    if world > 1:
        results.append(("receive_splits disagree", expect_error(
            comm, lambda: ddlfast.alltoall(array, receive_splits=expected), "block sizes disagree")))
    results.append(("out= needs receive_splits", expect_error(
        comm, lambda: ddlfast.alltoall(array, out=np.zeros_like(array) if rank == 0 else None), "receive_splits")))
    results.append(("not divisible", expect_error(
        comm, lambda: ddlfast.alltoall(np.zeros((world * 2 + (rank == 0),), np.int8)), "splits")))
    results.append(("async bad splits", expect_error(
        comm, lambda: ddlfast.alltoall_async(array, bad_splits).wait(), "splits")))
    got, _ = ddlfast.alltoall(np.full((world,), rank, np.int64))  # the context is still usable
    check("usable after the errors", np.array_equal(got, np.arange(world)))


def main() -> int:
    cases_alltoall()
    cases_allgatherv()
    cases_join()
    cases_bad_input()
    return report_results(comm, results)


if __name__ == "__main__":
    sys.exit(main())
