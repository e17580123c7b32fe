"""The straggler targets of docs/observe.md, on one machine:

1. a delay before each collective on one rank (default 20 ms on the last of 4): in how many of `--calls` calls
   each rank's arrival log names it (>= 99 % is the target);
2. no delay: in how many calls any rank is named (a rank held the others more than STRAGGLER_NOISE_S; < 1 %);
3. the price of the flight recorder at 4 KiB: allreduce with DDLFAST_FLIGHT_RECORDS=2000 and =0 (two contexts on
   the same communicator) beside MPI_Allreduce, alternating every iteration; median of the slowest rank's time.

The price of the waits in the agreement's header is measured against main with bench/latency_paths.py run on both
trees (the header is the same with or without the recorder).

    .venv/bin/mpiexec -n 4 .venv/bin/python bench/stragglers.py [--calls 200] [--delay-ms 20] [--iterations 3000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from mpi4py import MPI

import ddlfast
from ddlfast.config import STRAGGLER_NOISE_S


def named(ctx: ddlfast.Context, calls: int) -> list[int]:
    """How many of the last `calls` collectives named each rank (held the others above the noise)."""
    rows = ctx.stragglers(last=calls)
    counts = [0] * ctx.size
    for row in rows:
        counts[row["rank"]] = row["last_arrivals"]
    return counts


def attribution(comm: MPI.Intracomm, calls: int, delay_s: float, slow: int) -> None:
    rank, world = comm.Get_rank(), comm.Get_size()
    ctx = ddlfast.Context(comm)
    x = np.ones(1024, np.float32)
    for _ in range(10):
        ctx.allreduce(x)
    for _ in range(calls):
        if rank == slow:
            time.sleep(delay_s)
        ctx.allreduce(x)
    with_delay = named(ctx, calls)
    for _ in range(calls):
        ctx.allreduce(x)
    without = named(ctx, calls)
    ctx.close()
    if rank == 0:
        others = sum(with_delay) - with_delay[slow]
        print(f"P={world}: {delay_s * 1e3:g} ms before each of {calls} calls on rank {slow}: named in "
              f"{with_delay[slow]} ({100 * with_delay[slow] / calls:.1f} %), others named {others}; no delay: "
              f"some rank named in {sum(without)} of {calls} ({100 * sum(without) / calls:.1f} %; "
              f"noise threshold {STRAGGLER_NOISE_S * 1e3:g} ms)", flush=True)


def flight_price(comm: MPI.Intracomm, iterations: int) -> None:
    os.environ["DDLFAST_FLIGHT_RECORDS"] = "0"
    off = ddlfast.Context(comm)
    os.environ["DDLFAST_FLIGHT_RECORDS"] = "2000"
    on = ddlfast.Context(comm)
    del os.environ["DDLFAST_FLIGHT_RECORDS"]
    x = np.ones(1024, np.float32)
    paths = {"recorder on": lambda: on.allreduce(x), "recorder off": lambda: off.allreduce(x),
             "MPI_Allreduce": lambda: comm.Allreduce(MPI.IN_PLACE, x)}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for action in paths.values():
        for _ in range(20):
            action()
    names = list(paths)
    for i in range(iterations):
        # The two ddlfast contexts swap places every iteration: the first call after MPI's own is slower by about
        # 1 %, which a fixed order charged to the recorder.
        order = names if i % 2 == 0 else [names[1], names[0], names[2]]
        for name in order:
            action = paths[name]
            comm.Barrier()
            start = time.perf_counter()
            action()
            times[name].append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    if comm.Get_rank() == 0:
        median = {name: statistics.median(values) * 1e6 for name, values in times.items()}
        print(f"P={comm.Get_size()} 4 KiB allreduce: recorder on {median['recorder on']:.1f} us, off "
              f"{median['recorder off']:.1f} us ({100 * (median['recorder on'] / median['recorder off'] - 1):+.1f} %), "
              f"MPI_Allreduce {median['MPI_Allreduce']:.1f} us", flush=True)
    on.close()
    off.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--iterations", type=int, default=3000)
    parser.add_argument("--skip-attribution", action="store_true")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if not args.skip_attribution:
        attribution(comm, args.calls, args.delay_ms / 1e3, comm.Get_size() - 1)
    flight_price(comm, args.iterations)


if __name__ == "__main__":
    main()
