"""MPI program: time ddlfast's ring shapes beside comm.Allreduce on whatever cluster it runs on.

    mpiexec -n 4 python bench/emulation/measure.py --bytes 64MiB --iters 7 --variants auto,flat,mpi

Variants run alternately, iteration by iteration, so they see the same conditions. Each call is preceded by a
buffer reset and a Barrier (untimed); an iteration's time is the slowest rank's; the median is reported. Rank 0
prints one JSON object: the detected topology, per-variant times, the dims each ran, and the planner's
prediction for each shape from the probed links. --check also verifies every result exactly (small integers).

A variant is 'mpi' or `[ALGORITHM:]DIMS[@CODEC][+reproducible]`: DIMS as DDLFAST_RING_DIMS ('auto', 'flat',
'2x2'), CODEC as compression= ('fp16', 'auto@none;fp16' per dimension), ALGORITHM a DDLFAST_ALGORITHM value
for that variant's calls alone (ddlfast reads its settings at each call), +reproducible passes
reproducible=True. E.g. the default 16-bit path against the fp16 ring: 'auto@fp16,ring:auto@fp16'. 'chain' is
the host-aware canonical order (bench/emulation/host_chain.py, 2 hosts): its result must equal the
'+reproducible' variants' bit for bit (a failure otherwise). The report names the algorithm each variant ran.
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
from host_chain import HostChain  # a sibling module (this file runs as a script)
from mpi4py import MPI

import ddlfast
from ddlfast import topology
from ddlfast.config import parse_dims
from ddlfast.topology.cost_model import link_bound, parse_bytes, predict


def parse_variant(variant: str) -> tuple[str | None, str, str, bool]:
    """(algorithm or None, dims, codec, reproducible) of `[ALGORITHM:]DIMS[@CODEC][+reproducible]`."""
    body, plus, flag = variant.partition("+")
    if plus and flag != "reproducible":
        raise SystemExit(f"measure.py: unknown flag +{flag} in variant {variant!r}")
    algorithm, colon, rest = body.partition(":")
    if not colon:
        algorithm, rest = "", body
    dims, _, codec = rest.partition("@")
    return algorithm or None, dims, codec, bool(plus)


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
    chain = HostChain(comm, comm.size // 2) if "chain" in variants else None
    reproducible_bits: dict[str, bytes] = {}  # this iteration's result of each bit-reproducible variant

    def run(variant: str) -> None:
        """'mpi', or ddlfast dims with an optional wire codec: 'auto', 'flat', '2x2@fp16', 'auto@none;fp16'."""
        if variant == "mpi":
            comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
        elif variant == "chain":
            chain.allreduce(buffer)
        else:
            algorithm, dims, codec, reproducible = parse_variant(variant)
            with algorithm_set(algorithm):
                context.allreduce(buffer, dims=dims, compression=codec.replace(";", ",") or None,
                                  reproducible=reproducible or None)

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
            if variant == "chain" or variant.endswith("+reproducible"):
                reproducible_bits[variant] = buffer.tobytes()
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
    for variant in variants:
        dims = None if variant in ("mpi", "chain") else info.resolve(parse_dims(parse_variant(variant)[1]))
        entry = {"median_s": median(times[variant]), "times_s": times[variant]}
        if variant in errors:
            entry["relative_error_vs_mpi"] = errors[variant]
        if dims is not None:
            entry["dims"] = "x".join(map(str, dims))
            if info.cluster is not None:
                entry["predicted_s"] = predict(info.cluster, dims, nbytes).seconds
        report["variants"][variant] = entry
    # What each (size, algorithm setting, wire) ran; reproducible=True runs its own flat direct order instead.
    report["algorithms"] = sorted({f"DDLFAST_ALGORITHM={key[2]}, compressed={key[-1]}: {choice}"
                                   for key, choice in context._state._algorithm_cache.items()})
    print(json.dumps(report), flush=True)
    print(f"{failures} failures", flush=True)


if __name__ == "__main__":
    main()
