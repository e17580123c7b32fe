"""The GPU path end to end on a GPU the ranks share (issue 31), three measurements in one run:

1. `fused_allreduce` of CuPy arrays (ddlfast's GPU ring: chunks staged D2H -> MPI -> H2D -> reduce kernel,
   pipelined on ddlfast's streams) against the same data through host NumPy copies and the host engine
   (`cupy.asnumpy`, `fused_allreduce` of the NumPy array, `.set`), medians of the slowest rank, same run. Every
   result is checked against a reference computed with CuPy alone (data whose sums are exact in float32, so any
   order of addition must give the same bits) and for identical bits on every rank.
2. Overlap with compute: matrix products on the caller's stream while a collective runs on ddlfast's streams:
   each alone and both together; hidden = (products + collective - both) / min(products, collective).
3. A CUDA trace (torch.profiler, CUPTI) on rank 0 of one GPU-path call, alone and beside the products: how long
   copies D2H, copies H2D, ddlfast's kernels and the products ran, and how long each pair ran at the same time.

Run: mpiexec -n 2 python bench/gpu_pipeline.py [--sizes 1,16,64,256] [--iters 5] [--trace DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable

import cupy as cp
import numpy as np
from mpi4py import MPI

import ddlfast

comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
cp.cuda.Device(rank % cp.cuda.runtime.getDeviceCount()).use()


def synchronize() -> None:
    cp.cuda.Device().synchronize()


def slowest_median(run: Callable[[], None], reset: Callable[[], None], iters: int, warmup: int = 2) -> float:
    """Median over iterations of the slowest rank's time for run() (reset() runs untimed before each)."""
    times = []
    for i in range(warmup + iters):
        reset()
        synchronize()
        comm.Barrier()
        start = time.perf_counter()
        run()
        synchronize()
        elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        if i >= warmup:
            times.append(elapsed)
    return float(np.median(times))


def exact_inputs(elements: int) -> cp.ndarray:
    """Multiples of 1/4 below 2**12: every partial sum of up to 64 ranks is exact in float32."""
    return ((cp.arange(elements, dtype=cp.int64) * 7 + 3 * rank) % 4001).astype(cp.float32) * 0.25


def check(result: cp.ndarray, label: str) -> list[str]:
    elements = result.size
    base = (cp.arange(elements, dtype=cp.int64) * 7)
    want = sum(((base + 3 * r) % 4001).astype(cp.float64) * 0.25 for r in range(world)).astype(cp.float32)
    problems = []
    if not bool(cp.array_equal(result, want)):
        bad = int(cp.count_nonzero(result != want))
        problems.append(f"rank {rank} {label}: {bad} of {elements} elements differ from the CuPy reference")
    digest = hashlib.sha256(cp.asnumpy(result).tobytes()).hexdigest()
    if len(set(comm.allgather(digest))) != 1:
        problems.append(f"rank {rank} {label}: ranks hold different bits")
    return problems


def routes(mebibytes: int, iters: int) -> tuple[dict, list[str]]:
    elements = (mebibytes << 20) // 4
    original = exact_inputs(elements)
    x = cp.empty_like(original)

    def reset() -> None:
        x[...] = original

    def gpu() -> None:
        ddlfast.fused_allreduce([x])

    def host() -> None:
        copy = cp.asnumpy(x)
        ddlfast.fused_allreduce([copy])
        x.set(copy)

    problems = []
    for name, run in (("gpu", gpu), ("host copies", host)):
        reset()
        run()
        synchronize()
        problems += check(x, f"{mebibytes} MiB {name}")
    # Alternate the two routes, so drift hits both alike.
    gpu_times, host_times = [], []
    for _ in range(2):
        gpu_times.append(slowest_median(gpu, reset, iters))
        host_times.append(slowest_median(host, reset, iters))
    row = {"mebibytes": mebibytes, "gpu_s": float(np.median(gpu_times)), "host_s": float(np.median(host_times))}
    row["host_over_gpu"] = row["host_s"] / row["gpu_s"]
    row["gpu_busbw_gbs"] = 2 * (world - 1) / world * (mebibytes << 20) / row["gpu_s"] / 1e9
    return row, problems


def products(size: int, count: int, stream: cp.cuda.Stream, a: cp.ndarray) -> None:
    with stream:
        for _ in range(count):
            a @ a


def overlap(mebibytes: int, iters: int) -> dict:
    """Products on the caller's stream beside a collective on ddlfast's streams."""
    elements = (mebibytes << 20) // 4
    original = exact_inputs(elements)
    collective_stream, compute_stream = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    with collective_stream:
        x = original.copy()
    size = 4096
    a = cp.random.default_rng(rank).standard_normal((size, size), dtype=cp.float32)

    def reset() -> None:
        with collective_stream:
            x[...] = original

    def collective() -> None:
        ddlfast.fused_allreduce([x], stream=collective_stream.ptr)

    collective_s = slowest_median(collective, reset, iters)
    one = slowest_median(lambda: products(size, 1, compute_stream, a), lambda: None, iters)
    count = max(1, round(collective_s / one))

    def compute() -> None:
        products(size, count, compute_stream, a)

    def both() -> None:
        products(size, count, compute_stream, a)  # enqueued first: the GPU runs them while the host drives MPI
        collective()

    compute_s = slowest_median(compute, lambda: None, iters)
    both_s = slowest_median(both, reset, iters)
    reset()
    collective()
    synchronize()
    problems = check(x, f"{mebibytes} MiB beside products")
    hidden = (compute_s + collective_s - both_s) / min(compute_s, collective_s)
    return {"mebibytes": mebibytes, "products": count, "product_size": size, "collective_s": collective_s,
            "compute_s": compute_s, "both_s": both_s, "hidden": hidden, "problems": problems}


def intervals(events: list[dict], kind: Callable[[dict], bool]) -> list[tuple[float, float]]:
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if kind(e))
    merged: list[tuple[float, float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def together(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def trace(mebibytes: int, directory: str | None, with_products: bool) -> dict | None:
    """One GPU-path call under torch.profiler on rank 0 (the others run the same call unprofiled)."""
    elements = (mebibytes << 20) // 4
    x = exact_inputs(elements)
    stream = cp.cuda.Stream(non_blocking=True)
    a = cp.random.default_rng(rank).standard_normal((4096, 4096), dtype=cp.float32)
    ddlfast.fused_allreduce([x])  # warm
    x[...] = exact_inputs(elements)
    synchronize()
    comm.Barrier()

    def call() -> None:
        if with_products:
            products(4096, 20, stream, a)
        ddlfast.fused_allreduce([x])
        synchronize()

    if rank != 0:
        call()
        comm.Barrier()
        return None
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        call()
        comm.Barrier()
        return {"error": "torch is not installed: no CUDA trace"}
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        call()
    comm.Barrier()
    name = f"trace_{mebibytes}MiB_{'products' if with_products else 'alone'}_P{world}.json"
    path = os.path.join(directory or ".", name)
    profiler.export_chrome_trace(path)
    with open(path) as f:
        loaded = json.load(f)
    events = [e for e in (loaded["traceEvents"] if isinstance(loaded, dict) else loaded)
              if e.get("ph") == "X" and "dur" in e]
    gpu_events = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kinds = {
        "D2H": intervals(gpu_events, lambda e: "DtoH" in e["name"] or "Device -> Pinned" in e["name"]),
        "H2D": intervals(gpu_events, lambda e: "HtoD" in e["name"] or "Pinned -> Device" in e["name"]),
        "ddlfast kernels": intervals(gpu_events, lambda e: e.get("cat") == "kernel" and "gemm" not in
                                     e["name"].lower()),
        "products": intervals(gpu_events, lambda e: e.get("cat") == "kernel" and "gemm" in e["name"].lower()),
    }
    busy = {k: sum(end - start for start, end in v) / 1e3 for k, v in kinds.items()}  # ms
    names = list(kinds)
    pairs = {f"{p} & {q}": together(kinds[p], kinds[q]) / 1e3 for i, p in enumerate(names) for q in names[i + 1:]}
    span = [e["ts"] for e in gpu_events] + [e["ts"] + e["dur"] for e in gpu_events]
    streams = sorted({str(e.get("args", {}).get("stream")) for e in gpu_events})
    return {"file": name, "span_ms": (max(span) - min(span)) / 1e3 if span else 0.0, "busy_ms": busy,
            "together_ms": pairs, "streams": streams, "kernel_names": sorted({e["name"][:60] for e in gpu_events
                                                                             if e.get("cat") == "kernel"})[:12]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,16,64,256", help="MiB, comma-separated")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--overlap-mib", type=int, default=64)
    parser.add_argument("--trace", default=None, help="directory for the CUDA traces (rank 0)")
    parser.add_argument("--json", default=None, help="write the results here (rank 0)")
    args = parser.parse_args()
    results: dict = {"ranks": world, "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                     "rows": [], "problems": []}
    for mebibytes in (int(s) for s in args.sizes.split(",")):
        row, problems = routes(mebibytes, args.iters)
        results["rows"].append(row)
        results["problems"] += problems
        if rank == 0:
            print(f"{mebibytes:5d} MiB  gpu {row['gpu_s'] * 1e3:9.2f} ms  host copies {row['host_s'] * 1e3:9.2f} ms"
                  f"  host/gpu {row['host_over_gpu']:5.2f}x  gpu busbw {row['gpu_busbw_gbs']:6.2f} GB/s", flush=True)
    result = overlap(args.overlap_mib, args.iters)
    results["problems"] += result.pop("problems")
    results["overlap"] = result
    if rank == 0:
        print(f"overlap at {result['mebibytes']} MiB: collective {result['collective_s'] * 1e3:.2f} ms, "
              f"{result['products']} products of {result['product_size']}^2 {result['compute_s'] * 1e3:.2f} ms, "
              f"both {result['both_s'] * 1e3:.2f} ms: hidden {result['hidden']:.0%}", flush=True)
    for with_products in (False, True):
        traced = trace(args.overlap_mib, args.trace, with_products)
        if rank == 0:
            results["trace_products" if with_products else "trace"] = traced
            print(f"trace ({'beside products' if with_products else 'alone'}): {json.dumps(traced)}", flush=True)
    problems = comm.gather(results["problems"])
    if rank == 0:
        flat = [p for ps in problems for p in ps]
        results["problems"] = flat
        for problem in flat[:20]:
            print(problem, flush=True)
        print(f"{len(flat)} failures", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    return 1 if comm.bcast(bool(results["problems"]) if rank == 0 else None) else 0


if __name__ == "__main__":
    sys.exit(main())
