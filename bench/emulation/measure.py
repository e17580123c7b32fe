"""MPI program: time ddlfast's ring shapes beside comm.Allreduce on whatever cluster it runs on.

    mpiexec -n 4 python bench/emulation/measure.py --bytes 64MiB --iters 7 --variants auto,flat,mpi

Variants run alternately, iteration by iteration, so they see the same conditions. Each call is preceded by a
buffer reset and a Barrier (untimed); an iteration's time is the slowest rank's; the median is reported. Rank 0
prints one JSON object: the detected topology, per-variant times, the dims each ran, and the planner's
prediction for each shape from the probed links. --check also verifies every result exactly (small integers).
"""

from __future__ import annotations

import argparse
import json
import time
from statistics import median

import numpy as np
from mpi4py import MPI

import ddlfast
from ddlfast import topology
from ddlfast.config import parse_dims
from ddlfast.topology.cost_model import link_bound, parse_bytes, predict


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", default="64MiB")
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--variants", default="auto,flat,mpi")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--data", choices=("integers", "random"), default="integers",
                        help="random: normal floats, and every ddlfast variant's relative error against MPI's fp32 sum")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    info = topology()  # the first collective: detection and probe happen here, outside the timings
    count = parse_bytes(args.bytes) // 4
    if args.data == "random":
        pristine = np.random.default_rng(comm.rank).standard_normal(count).astype(np.float32)
        expected = pristine.copy()
        comm.Allreduce(MPI.IN_PLACE, expected, op=MPI.SUM)  # MPI's fp32 sum: the reference for the errors
    else:
        pristine = ((np.arange(count) % 7) * (comm.rank + 1)).astype(np.float32)
        expected = ((np.arange(count) % 7) * (comm.size * (comm.size + 1) // 2)).astype(np.float32)
    errors: dict[str, float] = {}
    buffer = np.empty_like(pristine)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    times: dict[str, list[float]] = {v: [] for v in variants}
    failures = 0

    def run(variant: str) -> None:
        """'mpi', or ddlfast dims with an optional wire codec: 'auto', 'flat', '2x2@fp16', 'auto@none;fp16'."""
        if variant == "mpi":
            comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
        else:
            dims, _, codec = variant.partition("@")
            ddlfast.allreduce(buffer, dims=dims, compression=codec.replace(";", ",") or None)

    for iteration in range(args.warmup + args.iters):
        for variant in variants:
            buffer[...] = pristine
            comm.Barrier()
            start = time.perf_counter()
            run(variant)
            elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if iteration >= args.warmup:
                times[variant].append(elapsed)
            if args.data == "random":
                errors[variant] = float(np.linalg.norm(buffer - expected) / np.linalg.norm(expected))
                exact_enough = "@" in variant or np.allclose(buffer, expected, rtol=1e-4, atol=1e-4)
            else:
                exact_enough = np.array_equal(buffer, expected)
            if args.check and not exact_enough:
                failures += 1
                print(f"rank {comm.rank}: {variant} gave a wrong result", flush=True)
    failures = comm.allreduce(failures)
    if comm.rank != 0:
        return
    nbytes = count * 4
    report = {"bytes": nbytes, "ranks": comm.size, "topology": info.as_dict(), "failures": failures,
              "link_bound_s": link_bound(info.cluster, nbytes) if info.cluster and info.placement.hosts > 1 else None,
              "variants": {}}
    for variant in variants:
        dims = None if variant == "mpi" else info.resolve(parse_dims(variant.partition("@")[0]))
        entry = {"median_s": median(times[variant]), "times_s": times[variant]}
        if variant in errors:
            entry["relative_error_vs_mpi"] = errors[variant]
        if dims is not None:
            entry["dims"] = "x".join(map(str, dims))
            if info.cluster is not None:
                entry["predicted_s"] = predict(info.cluster, dims, nbytes).seconds
        report["variants"][variant] = entry
    print(json.dumps(report), flush=True)
    print(f"{failures} failures", flush=True)


if __name__ == "__main__":
    main()
