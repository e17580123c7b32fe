"""The bench scripts' timing loop: paths alternate every iteration, each call timed alone after a Barrier, and
an iteration's time is the slowest rank's; returns the median per path in seconds."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from mpi4py import MPI


def alternating_medians(comm: MPI.Comm, paths: dict[str, Callable[[], object]], iters: int, warmup: int,
                        reset: Callable[[], None] = lambda: None) -> dict[str, float]:
    samples = np.zeros((iters, len(paths)))
    for i in range(iters + warmup):
        for column, run in enumerate(paths.values()):
            reset()  # not timed
            comm.Barrier()
            start = MPI.Wtime()
            run()
            if i >= warmup:
                samples[i - warmup, column] = MPI.Wtime() - start
    comm.Allreduce(MPI.IN_PLACE, samples, op=MPI.MAX)
    return dict(zip(paths, np.median(samples, axis=0), strict=True))
