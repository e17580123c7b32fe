"""MPI program: time ddlfast's ring shapes beside comm.Allreduce on whatever cluster it runs on.

    mpiexec -n 4 python bench/emulation/measure.py --bytes 64MiB --iters 7 --variants auto,flat,mpi

Variants run alternately, iteration by iteration, so they see the same conditions. Each call is preceded by a
buffer reset and a Barrier (untimed); an iteration's time is the slowest rank's; the median is reported. Rank 0
prints one JSON object: the detected topology, per-variant times, the dims each ran, and the planner's
prediction for each shape from the probed links. --check also verifies every result exactly (small integers).

A variant is 'mpi' or `[ALGORITHM:]DIMS[@CODEC][+reproducible|+flat-reproducible]`: DIMS as DDLFAST_RING_DIMS
('auto', 'flat', '2x2'), CODEC as compression= ('fp16', 'auto@none;fp16' per dimension), ALGORITHM a
DDLFAST_ALGORITHM value for that variant's calls alone (ddlfast reads its settings at each call), +reproducible
passes reproducible=True (across hosts: the canonical chain, src/engine/chain_phase.h), +flat-reproducible the
same on a Context created with DDLFAST_EMULATED_HOSTS=1, which sees one host and so runs the flat canonical
order: the chain's baseline. Every reproducible variant's result must equal the others' bit for bit (a failure
otherwise). E.g. the default 16-bit path against the fp16 ring: 'auto@fp16,ring:auto@fp16'; the chain against
the flat order and the plain path: 'auto,auto+reproducible,auto+flat-reproducible'. --reduce-scatter times
reduce_scatter (this rank's block of the sum; 'mpi': MPI_Reduce_scatter_block) instead of allreduce. The report
names the algorithm each variant ran.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Iterator
from statistics import median

import numpy as np
from mpi4py import MPI

import ddlfast
from ddlfast import topology
from ddlfast.config import load_settings, parse_dims
from ddlfast.topology.cost_model import link_bound, parse_bytes, predict


def parse_variant(variant: str) -> tuple[str | None, str, str, str]:
    """(algorithm or None, dims, codec, flag: '', 'reproducible' or 'flat-reproducible') of a variant."""
    body, plus, flag = variant.partition("+")
    if plus and flag not in ("reproducible", "flat-reproducible"):
        raise SystemExit(f"measure.py: unknown flag +{flag} in variant {variant!r}")
    algorithm, colon, rest = body.partition(":")
    if not colon:
        algorithm, rest = "", body
    dims, _, codec = rest.partition("@")
    return algorithm or None, dims, codec, flag


@contextlib.contextmanager
def algorithm_set(algorithm: str | None) -> Iterator[None]:
    """DDLFAST_ALGORITHM=algorithm for the calls inside (ddlfast reads it at each call); None: as it was."""
    saved = os.environ.get("DDLFAST_ALGORITHM")
    if algorithm is not None:
        os.environ["DDLFAST_ALGORITHM"] = algorithm
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("DDLFAST_ALGORITHM", None)
        else:
            os.environ["DDLFAST_ALGORITHM"] = saved


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", default="64MiB")
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--variants", default="auto,flat,mpi")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--reduce-scatter", action="store_true", help="time reduce_scatter instead of allreduce")
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

    context = ddlfast.Context(comm)
    one_host = None  # +flat-reproducible's context: created seeing one host
    if any(v.endswith("+flat-reproducible") for v in variants):
        os.environ["DDLFAST_EMULATED_HOSTS"] = "1"
        try:
            one_host = ddlfast.Context(comm)
        finally:
            del os.environ["DDLFAST_EMULATED_HOSTS"]
    reproducible_bits: dict[str, bytes] = {}  # this iteration's result of each bit-reproducible variant

    block = slice(comm.rank * (count // comm.size), (comm.rank + 1) * (count // comm.size))
    if args.reduce_scatter:
        expected = expected[block]  # this rank's block of the sum

    def run(variant: str) -> np.ndarray:
        """'mpi', or ddlfast dims with an optional wire codec: 'auto', 'flat', '2x2@fp16', 'auto@none;fp16'.
        Returns the result: the buffer (allreduce, in place), or this rank's block (--reduce-scatter)."""
        if variant == "mpi":
            if args.reduce_scatter:
                out = np.empty(count // comm.size, np.float32)
                comm.Reduce_scatter_block(buffer, out, op=MPI.SUM)
                return out
            comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
            return buffer
        algorithm, dims, codec, flag = parse_variant(variant)
        on = one_host if flag == "flat-reproducible" else context
        collective = on.reduce_scatter if args.reduce_scatter else on.allreduce
        with algorithm_set(algorithm):
            return collective(buffer, dims=dims, compression=codec.replace(";", ",") or None,
                              reproducible=bool(flag) or None)

    for iteration in range(args.warmup + args.iters):
        for variant in variants:
            buffer[...] = pristine
            comm.Barrier()
            start = time.perf_counter()
            result = run(variant)
            elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if iteration >= args.warmup:
                times[variant].append(elapsed)
            if args.data == "random":
                errors[variant] = float(np.linalg.norm(result - expected) / np.linalg.norm(expected))
                exact_enough = "@" in variant or np.allclose(result, expected, rtol=1e-4, atol=1e-4)
            else:
                exact_enough = np.array_equal(result, expected)
            if args.check and not exact_enough:
                failures += 1
                print(f"rank {comm.rank}: {variant} gave a wrong result", flush=True)
            if "reproducible" in variant:
                reproducible_bits[variant] = result.tobytes()
        if len(set(reproducible_bits.values())) > 1:
            failures += 1
            print(f"rank {comm.rank}: {sorted(reproducible_bits)} differ bit-wise", flush=True)
        reproducible_bits.clear()
    failures = comm.allreduce(failures)
    if comm.rank != 0:
        return
    nbytes = count * 4
    report = {"bytes": nbytes, "ranks": comm.size, "topology": info.as_dict(), "failures": failures,
              "link_bound_s": link_bound(info.cluster, nbytes) if info.cluster and info.placement.hosts > 1 else None,
              "variants": {}}
    chain_hosts = context._state.chain_hosts(load_settings())
    for variant in variants:
        dims = None if variant == "mpi" else info.resolve(parse_dims(parse_variant(variant)[1]))
        entry = {"median_s": median(times[variant]), "times_s": times[variant]}
        if variant in errors:
            entry["relative_error_vs_mpi"] = errors[variant]
        if "reproducible" in variant:  # its own canonical order, whatever the dims
            hosts = 1 if variant.endswith("+flat-reproducible") else chain_hosts
            entry["dims"] = f"chain {comm.size // hosts}x{hosts}" if hosts > 1 else f"flat {comm.size}"
        elif dims is not None:
            entry["dims"] = "x".join(map(str, dims))
            if info.cluster is not None:
                entry["predicted_s"] = predict(info.cluster, dims, nbytes).seconds
        report["variants"][variant] = entry
    # What each (size, algorithm setting, wire) ran; reproducible=True runs its own canonical order instead.
    report["algorithms"] = sorted({f"DDLFAST_ALGORITHM={key[2]}, compressed={key[-1]}: {choice}"
                                   for key, choice in context._state._algorithm_cache.items()})
    print(json.dumps(report), flush=True)
    print(f"{failures} failures", flush=True)


if __name__ == "__main__":
    main()
