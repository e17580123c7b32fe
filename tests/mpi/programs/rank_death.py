"""Runs on every rank: one rank dies, the job must end (non-zero) instead of hanging.

    rank_death.py --when mid|before --how exit|kill [--victim R] [--count N] [--layout new|cached]
                  [--record DIR]

mid:    every rank loops over large allreduces; 0.3 s in, a timer thread on
        the victim ends its process while its main thread is inside the
        collective (the core releases the GIL, so the timer runs then).
before: the victim dies without ever joining; the others enter an allreduce
        (its layout already agreed: the ring waits; or new: the agreement waits).
exit:   os._exit(1) (no MPI_Finalize, no Python cleanup); kill: SIGKILL itself.

The victim prints "DEATH <unix time> ..." just before it dies, so the test can
time how long the job takes to end after the death. A survivor that gets an
error prints "rank R: <seconds> s after the first call ...: <Type>: <message>" and
re-raises it (the process exits non-zero). Under hydra's default the
launcher kills the survivors first; with `mpiexec -disable-auto-cleanup`
only ddlfast's stall limit (DDLFAST_TIMEOUT_S) frees them.

--record DIR: each survivor also writes DIR/rank<R>.error ("<Type>: <message>")
before re-raising, and DIR/rank<R>.uncaught when the error reaches
sys.excepthook (just before ddlfast's hook calls MPI_Abort). Unlike output,
which travels through the launcher and is lost when MPI_Abort tears the job
down before the launcher forwarded it, a file written before the abort stays.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

import ddlfast


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--when", choices=["mid", "before"], required=True)
    parser.add_argument("--how", choices=["exit", "kill"], required=True)
    parser.add_argument("--victim", type=int, default=-1, help="rank that dies (default: the last)")
    parser.add_argument("--count", type=int, default=4_000_000, help="float32 elements per allreduce")
    parser.add_argument("--layout", choices=["new", "cached"], default="cached")
    parser.add_argument("--record", help="directory for what each survivor raised (see the docstring)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    if args.record:
        record_uncaught(os.path.join(args.record, f"rank{rank}"))
    victim = args.victim % world
    array = np.ones(args.count, np.float32)
    ddlfast.allreduce(array)  # contexts created and the layout agreed on every rank
    comm.Barrier()
    inside = threading.Event()  # set while this rank's main thread is inside the collective
    death_time = [0.0]

    def die() -> None:
        death_time[0] = time.time()
        print(f"DEATH {death_time[0]:.6f} rank {rank} when={args.when} how={args.how} "
              f"inside_collective={inside.is_set()}", flush=True)
        if args.how == "exit":
            os._exit(1)
        os.kill(os.getpid(), signal.SIGKILL)

    if rank == victim:
        if args.when == "before":
            time.sleep(0.5)  # the others are waiting in the collective by now
            die()
        threading.Timer(0.3, die).start()
    if args.when == "before" and args.layout == "new":
        array = np.ones(args.count + 1, np.float32)  # a layout never agreed: the agreement step waits
    start = time.time()
    calls = 0
    try:
        while time.time() - start < 120:
            inside.set()
            ddlfast.allreduce(array)
            inside.clear()
            calls += 1
    except Exception as error:
        if args.record:
            record(os.path.join(args.record, f"rank{rank}.error"), error)
        # The victim's death time is not known here; `start` is within 0.5 s of it.
        print(f"rank {rank}: {time.time() - start:.2f} s after the first call, after {calls} calls: "
              f"{type(error).__name__}: {error}", flush=True)
        raise
    print(f"rank {rank}: FAIL, still running 120 s after rank {victim} died", flush=True)
    sys.exit(2)


def record(path: str, error: BaseException) -> None:
    """Whole or not at all: another rank's MPI_Abort may kill this one mid-write, and an empty file that open()
    created must not read as a record (it did once, in a fresh-clone CI run)."""
    partial = path + ".partial"
    with open(partial, "w") as file:
        file.write(f"{type(error).__name__}: {error}")
    os.replace(partial, path)  # atomic: the record appears complete, or not at all


def record_uncaught(prefix: str) -> None:
    """Runs before the hook in place (ddlfast's, which calls MPI_Abort after a DdlfastTimeoutError)."""
    chained = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, trace: object) -> None:
        record(prefix + ".uncaught", error)
        chained(kind, error, trace)

    sys.excepthook = hook


if __name__ == "__main__":
    main()
