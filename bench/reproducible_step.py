"""What reproducible=True costs: per size, ddlfast.allreduce(x) on the plain path (DDLFAST_ALGORITHM's choice on
the default dims) and ddlfast.allreduce(x, reproducible=True) (one flat ring in rank order, direct reduce-scatter,
src/engine/direct_phase.h), alternating every iteration; the median of the slowest rank's time per iteration and
the ratio reproducible / plain from the same run. A report, not a test (tests/mpi/test_reproducible.py asserts
the bits).

    .venv/bin/mpiexec -n 4 .venv/bin/python bench/reproducible_step.py [--sizes 1MiB,64MiB] [--iters 15]
        [--compression fp16]
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
from ddlfast import config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="64KiB,1MiB,64MiB")
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--compression", default="none", help="none, fp16 or bf16 (both paths)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        settings = config.load_settings()
        print(f"# P={world} compression={args.compression} chunk={settings.chunk_bytes}; median ms of the slowest "
              "rank; ratio reproducible / plain (< 1.1 is the target)")
    for nbytes in (config.parse_size(s, "--sizes") for s in args.sizes.split(",")):
        pristine = np.random.default_rng(rank).standard_normal(nbytes // 4).astype(np.float32)
        x = pristine.copy()
        paths = {
            "plain": lambda x=x: ddlfast.allreduce(x, compression=args.compression),
            "reproducible": lambda x=x: ddlfast.allreduce(x, compression=args.compression, reproducible=True),
        }
        median = {name: seconds * 1e3 for name, seconds in alternating_medians(
            comm, paths, args.iters, 2, lambda x=x, pristine=pristine: x.__setitem__(Ellipsis, pristine)).items()}
        if rank == 0:
            print(f"{config.format_size(nbytes):>9}: plain {median['plain']:9.2f}  reproducible "
                  f"{median['reproducible']:9.2f}  ratio {median['reproducible'] / median['plain']:.3f}", flush=True)


if __name__ == "__main__":
    main()
