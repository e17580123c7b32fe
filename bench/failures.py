"""Every failure case of the reliability issue, under `mpiexec -n 4`: the exact error each rank sees and the
time from the call to the error. A report, not a test (tests/mpi/test_bad_input.py and test_stall.py assert).

    .venv/bin/mpiexec -n 4 .venv/bin/python bench/failures.py [--timeout 3]

Cases that disagree across ranks are passed differently by rank 1 only (after every rank used both layouts, so
nothing is "new"); the failure mid-collective runs on a context of its own (it leaves that context broken); the
stall case (rank 3 never calls) runs last, because afterwards the communicator is out of step.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import ddlfast

comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()


def mismatched(odd: Callable[[], list], usual: Callable[[], list], **options: object) -> Callable[[], object]:
    return lambda: ddlfast.fused_allreduce(odd() if rank == 1 else usual(), **options)


def same_everywhere(call: Callable[[], object]) -> Callable[[], object]:
    return call


def bad_env() -> object:
    os.environ["DDLFAST_CHUNK_BYTES"] = "-5"
    try:
        return ddlfast.allreduce(np.ones(10, np.float32))
    finally:
        del os.environ["DDLFAST_CHUNK_BYTES"]


def typo_env() -> object:
    os.environ["DDLFAST_BUKET_BYTES"] = "1MiB"
    try:
        return ddlfast.Context(comm)
    finally:
        del os.environ["DDLFAST_BUKET_BYTES"]


CACHED_F32, CACHED_I32 = np.ones(3000, np.float32), np.ones(3000, np.int32)


class FailingCodec:
    def compress(self, bucket: np.ndarray, state: dict) -> list:
        if rank == 1:
            raise RuntimeError("injected codec failure")
        return [bucket.copy()]

    def decompress(self, payloads: list, bucket: np.ndarray, state: dict) -> None:
        bucket[...] = sum(p[0] for p in payloads)


def codec_failure_on_own_context() -> object:
    context = ddlfast.Context(comm)
    return context.fused_allreduce([np.ones(10, np.float32)], compression=FailingCodec())


def chunk_differs() -> object:
    if rank == 1:
        os.environ["DDLFAST_CHUNK_BYTES"] = "64KiB"
    try:
        return ddlfast.allreduce(np.ones(100_000, np.float32))
    finally:
        os.environ.pop("DDLFAST_CHUNK_BYTES", None)


CASES: list[tuple[str, Callable[[], object]]] = [
    ("dtype mismatch after both layouts were cached",
     lambda: ddlfast.allreduce(CACHED_I32 if rank == 1 else CACHED_F32)),
    ("small-path length mismatch", mismatched(lambda: [np.ones(9, np.float32)], lambda: [np.ones(8, np.float32)])),
    ("strided array on rank 1 only", lambda: ddlfast.allreduce(np.ones(2000, np.float32)[::2] if rank == 1
                                                               else np.ones(1000, np.float32))),
    ("same array twice on rank 1", mismatched(lambda: [CACHED_F32, CACHED_F32],
                                              lambda: [CACHED_F32, CACHED_F32.copy()])),
    ("broadcast: every rank names itself root", lambda: ddlfast.broadcast(np.ones(10, np.float32), root=rank)),
    ("DDLFAST_CHUNK_BYTES differs on rank 1", chunk_differs),
    ("shape mismatch", mismatched(lambda: [np.ones(1007, np.float32)], lambda: [np.ones(1000, np.float32)])),
    ("dtype mismatch", mismatched(lambda: [np.ones(1000, np.float64)], lambda: [np.ones(1000, np.float32)])),
    ("array count mismatch", mismatched(lambda: [np.ones(10, np.float32)] * 3, lambda: [np.ones(10, np.float32)] * 2)),
    ("op mismatch", lambda: ddlfast.fused_allreduce([np.ones(10, np.float32)],
                                                    op="average" if rank == 1 else "sum")),
    ("compression mismatch", lambda: ddlfast.fused_allreduce([np.ones(10, np.float32)],
                                                             compression="fp16" if rank == 1 else "none")),
    ("unsupported dtype", same_everywhere(lambda: ddlfast.fused_allreduce([np.ones(4, np.complex64)]))),
    ("bool dtype", same_everywhere(lambda: ddlfast.allreduce(np.ones(4, bool)))),
    ("non-contiguous", same_everywhere(lambda: ddlfast.allreduce(np.ones((8, 8), np.float32)[:, ::2]))),
    ("read-only", same_everywhere(lambda: ddlfast.allreduce(np.frombuffer(b"\0" * 16, np.float32)))),
    ("empty list", same_everywhere(lambda: ddlfast.fused_allreduce([]))),
    ("dims product != world", same_everywhere(lambda: ddlfast.allreduce(np.ones(4, np.float32), dims="3x5"))),
    ("malformed env value", same_everywhere(bad_env)),
    ("unknown env name", same_everywhere(typo_env)),
    ("user codec fails mid-collective on rank 1 (own context)", codec_failure_on_own_context),
]


def report(name: str, call: Callable[[], object]) -> None:
    comm.Barrier()
    start = time.perf_counter()
    try:
        call()
        outcome = "no error"
    except ddlfast.DdlfastError as error:
        outcome = f"{type(error).__name__}: {error}"
    except Exception as error:  # noqa: BLE001 - reported, it is what this bench shows
        outcome = f"NOT A DdlfastError {type(error).__name__}: {error}"
    elapsed = time.perf_counter() - start
    lines = comm.gather((rank, elapsed, outcome), root=0)
    if rank == 0:
        print(f"\n== {name}")
        for r, seconds, text in lines:
            print(f"  rank {r} after {seconds * 1e3:8.1f} ms: {text}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=3.0, help="DDLFAST_TIMEOUT_S for the stall case")
    args = parser.parse_args()
    ddlfast.allreduce(np.ones(4, np.float32))  # the default context exists on every rank
    ddlfast.allreduce(CACHED_F32)  # both layouts are agreed before they are mixed
    ddlfast.allreduce(CACHED_I32)
    for name, call in CASES:
        report(name, call)
    os.environ["DDLFAST_TIMEOUT_S"] = str(args.timeout)
    stalled = np.ones(1 << 20, np.float32)
    ddlfast.allreduce(stalled)  # this layout is agreed: the stall below is in the ring itself
    if rank == world - 1:
        time.sleep(args.timeout * 3)  # never joins the next collective
        os._exit(0)
    start = time.perf_counter()
    try:
        ddlfast.allreduce(stalled)
        outcome = "no error"
    except ddlfast.DdlfastError as error:
        outcome = f"{type(error).__name__}: {error}"
    print(f"== stall (rank {world - 1} never calls; DDLFAST_TIMEOUT_S={args.timeout:g}): rank {rank} after "
          f"{time.perf_counter() - start:.2f} s: {outcome}", flush=True)
    os._exit(0)  # the communicator is out of step after a stall: MPI_Finalize could wait for rank 3's messages


if __name__ == "__main__":
    main()
