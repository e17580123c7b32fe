"""Runs on every rank: many fused_allreduce calls over the same list of arrays,
with resident memory sampled as it goes (a leak per call shows as growth).

    soak.py [--iterations 10000] [--warmup 1000] [--preset ci|bench] [--async-every 10]

Each iteration refills the arrays in place with values whose sums and
averages are exact in every dtype ((rank + 1) * (iteration % 5 + 1)) and checks
every element; every 1000 iterations the ranks also compare a sha256 of the
results. Every `--async-every`-th call goes through fused_allreduce_async and
every 3rd averages. Resident memory (VmRSS from /proc/self/status) and the
number of live Python objects (after gc.collect()) are sampled every 1000
iterations from the end of the warm-up. Rank 0 prints one line per rank:

    SOAK rank R rss_kib warm=W end=E max=M growth_kib=G growth_pct=P objects warm=A end=B wrong=N

and "SOAK done: I iterations in T s, C calls/s, F failures". Exits non-zero on
wrong results (not on memory: the test judges the figures).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import sys
import time

import ml_dtypes
import numpy as np
from mpi4py import MPI

import ddlfast

# (dtype, shape) per array: a few small ones (packed, some below DDLFAST_SMALL_BYTES: MPI_Allreduce) and
# larger ones reduced in place by the ring.
PRESETS = {
    "ci": [("float32", (1000,)), ("float32", (17,)), ("float64", (300,)), ("int32", (2500,)),
           ("float32", (64, 64)), ("float16", (33,)), ("bfloat16", (129,)), ("int64", (5,))],
    "bench": [("float32", (1_000_000,)), ("float32", (512, 512)), ("float32", (4096,)), ("float32", (1000,)),
              ("float64", (100_000,)), ("int32", (300_000,)), ("float16", (200_000,)),
              ("bfloat16", (65_537,)), ("float32", (17,)), ("int64", (5,))],
}
DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
          "int32": np.int32, "int64": np.int64}
ENGINE = {  # several buckets per call, chunked ring steps, the MPI_Allreduce hand-off for small buckets
    "ci": {"DDLFAST_BUCKET_BYTES": "8KiB", "DDLFAST_FIRST_BUCKET_BYTES": "2KiB", "DDLFAST_CHUNK_BYTES": "4KiB"},
    "bench": {"DDLFAST_BUCKET_BYTES": "2MiB", "DDLFAST_FIRST_BUCKET_BYTES": "256KiB"},
}


def rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def live_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


def expected_value(dtype: str, factor: int, world: int, op: str) -> float:
    total = factor * world * (world + 1) // 2
    if op == "sum":
        return total
    return total // world if dtype.startswith("int") else total / world  # ints: floor of the exact sum


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=10_000)
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--preset", choices=list(PRESETS), default="ci")
    parser.add_argument("--async-every", type=int, default=10, help="0: never")
    parser.add_argument("--sample-every", type=int, default=1000)
    args = parser.parse_args()
    for name, value in ENGINE[args.preset].items():
        os.environ.setdefault(name, value)
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    arrays = [np.zeros(shape, DTYPES[dtype]) for dtype, shape in PRESETS[args.preset]]
    names = [dtype for dtype, _ in PRESETS[args.preset]]
    wrong = 0
    samples: list[tuple[int, int]] = []  # (iteration, rss KiB)
    objects: list[int] = []
    comm.Barrier()
    start = time.perf_counter()
    warm_time = start
    for iteration in range(1, args.iterations + 1):
        factor = iteration % 5 + 1
        op = "average" if iteration % 3 == 0 else "sum"
        for array in arrays:
            array.fill(factor * (rank + 1))
        if args.async_every and iteration % args.async_every == 0:
            ddlfast.fused_allreduce_async(arrays, op=op).wait()
        else:
            ddlfast.fused_allreduce(arrays, op=op)
        for name, array in zip(names, arrays, strict=True):
            want = expected_value(name, factor, world, op)
            if not np.all(array == array.dtype.type(want)):
                wrong += 1
                if wrong <= 5:
                    print(f"rank {rank} iteration {iteration}: {name}{list(array.shape)} {op} holds "
                          f"{array.reshape(-1)[:4].tolist()}, want {want}", flush=True)
        if iteration % 1000 == 0:
            digest = hashlib.sha256(b"".join(a.tobytes() for a in arrays)).hexdigest()
            if len(set(comm.allgather(digest))) != 1:
                wrong += 1
                print(f"rank {rank} iteration {iteration}: results differ in bits across ranks", flush=True)
        if (iteration >= args.warmup and (iteration - args.warmup) % args.sample_every == 0) \
                or iteration == args.iterations:
            if iteration == args.warmup:
                warm_time = time.perf_counter()
            samples.append((iteration, rss_kib()))
            if iteration in (args.warmup, args.iterations):
                objects.append(live_objects())
    elapsed = time.perf_counter() - start
    steady = time.perf_counter() - warm_time
    reports = comm.gather((rank, samples, objects, wrong), root=0)
    failures = sum(r[3] for r in reports) if rank == 0 else 0
    if rank == 0:
        for r, rank_samples, rank_objects, rank_wrong in reports:
            warm, end = rank_samples[0][1], rank_samples[-1][1]
            peak = max(s for _, s in rank_samples)
            print(f"SOAK rank {r} rss_kib warm={warm} end={end} max={peak} growth_kib={end - warm} "
                  f"growth_pct={100.0 * (end - warm) / warm:.3f} objects warm={rank_objects[0]} "
                  f"end={rank_objects[-1]} wrong={rank_wrong}")
            print(f"SOAK rank {r} samples " + " ".join(f"{i}:{s}" for i, s in rank_samples))
        steady_calls = args.iterations - args.warmup
        print(f"SOAK done: {args.iterations} iterations in {elapsed:.1f} s on {world} ranks, preset {args.preset}, "
              f"{sum(a.nbytes for a in arrays)} bytes in {len(arrays)} arrays per call, "
              f"{steady_calls / steady if steady > 0 else 0:.0f} calls/s after warm-up, {failures} failures")
    return 1 if comm.bcast(failures, root=0) else 0


if __name__ == "__main__":
    sys.exit(main())
