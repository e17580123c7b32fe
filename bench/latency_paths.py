"""allreduce(x) and fused_allreduce([x]) beside MPI_Allreduce, alternating every iteration; median of the slowest
rank's time per iteration. The trust issue's price-of-checking measurement (name=: the price of a named call).

    .venv/bin/mpiexec -n 2 .venv/bin/python bench/latency_paths.py [--sizes 4KiB,1MiB,64MiB]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import ddlfast
from ddlfast.config import parse_size


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="4KiB,1MiB,64MiB")
    parser.add_argument("--budget", default="256MiB", help="bytes per size and path (sets the iterations)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    budget = parse_size(args.budget, "--budget")
    for nbytes in (parse_size(s, "--sizes") for s in args.sizes.split(",")):
        x = np.ones(nbytes // 4, np.float32)
        steps = iter(range(1 << 62))  # name= as a trainer passes its step: a new name every call
        paths = {"allreduce": lambda x=x: ddlfast.allreduce(x),
                 "allreduce(name=step)": lambda x=x, s=steps: ddlfast.allreduce(x, name=next(s)),
                 "fused_allreduce([x])": lambda x=x: ddlfast.fused_allreduce([x]),
                 "MPI_Allreduce": lambda x=x: comm.Allreduce(MPI.IN_PLACE, x)}
        times: dict[str, list[float]] = {name: [] for name in paths}
        for action in paths.values():  # warm-up: contexts, plans, pages
            for _ in range(3):
                action()
        for _ in range(max(5, min(2000, budget // max(nbytes, 1)))):
            for name, action in paths.items():
                x[...] = 1
                comm.Barrier()
                start = time.perf_counter()
                action()
                times[name].append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
        if comm.rank == 0:
            median = {name: float(np.median(t)) * 1e6 for name, t in times.items()}
            mpi = median["MPI_Allreduce"]
            cells = [f"{name} {us:9.1f} us" + (f" ({us / mpi:4.2f}x MPI's time)" if name != "MPI_Allreduce" else "")
                     for name, us in median.items()]
            print(f"P={comm.size} {nbytes:>9} B  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
