"""The direct reduce-scatter against the ring at the engine level (no Python API in between, so neither path
pays the other's Python costs): per size, the core's allreduce with the ring's reduce-scatter, with the direct
one in every dimension, and MPI_Allreduce, alternating every iteration; median of the slowest rank's time per
iteration, and each ddlfast time as a ratio to MPI's from the same run. A report, not a test
(tests/mpi/test_direct.py asserts).

    .venv/bin/mpiexec -n 5 .venv/bin/python bench/direct_step.py [--sizes 64KiB,1MiB] [--dims 5] [--iters 50]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ddlfast
from bench.alternating import alternating_medians
from ddlfast import _core, config
from ddlfast.ops import OPS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="16KiB,64KiB,256KiB,1MiB,16MiB")
    parser.add_argument("--dims", default="flat", help="ring dims: flat or a shape such as 3x2")
    parser.add_argument("--iters", type=int, default=40)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    dims = (world,) if args.dims == "flat" else config.parse_dims(args.dims, "--dims")
    settings = config.load_settings()
    core = ddlfast.Context(comm)._state.core  # the engine itself: the algorithms without the API around them
    if rank == 0:
        print(f"# P={world} dims={'x'.join(map(str, dims))} chunk={settings.chunk_bytes} "
              f"receives_in_flight={settings.receives_in_flight}; median us (ratio to MPI_Allreduce, > 1 faster)")
    for nbytes in (config.parse_size(s, "--sizes") for s in args.sizes.split(",")):
        x = np.ones(nbytes // 4, np.float32)

        def engine(direct: tuple[int, ...], x: np.ndarray = x) -> None:
            options = _core.CallOptions(dims, settings.chunk_bytes, settings.receives_in_flight, 0, (), (), direct)
            core.allreduce(x.ctypes.data, x.size, 0, OPS["sum"], options)

        paths = {"ring": lambda: engine(()), "direct": lambda: engine((1,) * len(dims)),
                 "MPI_Allreduce": lambda x=x: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)}
        median = {name: seconds * 1e6 for name, seconds in alternating_medians(comm, paths, args.iters, 3).items()}
        if rank == 0:
            mpi = median["MPI_Allreduce"]
            cells = [f"{name} {us:9.1f} (x{mpi / us:.2f})" for name, us in median.items() if name != "MPI_Allreduce"]
            print(f"{config.format_size(nbytes):>9}: " + "  ".join(cells) + f"  MPI {mpi:9.1f}", flush=True)


if __name__ == "__main__":
    main()
