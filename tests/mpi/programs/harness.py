"""The one harness of the multi-rank test programs (as CuPy's single comm runner): every rank collects its
failures, they are gathered to rank 0, which prints them under the summary line the pytest side looks for
("<summary><n> failures"), and every rank exits 1 if any rank failed, else 0.

    from harness import comm, rank, world, fail, expect, case, same_everywhere, report_and_exit

Programs import it as a sibling module (the program's folder is first on sys.path under mpiexec)."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from typing import NoReturn

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
failures: list[str] = []


def fail(case: str, message: str) -> None:
    """Record a failure of this rank ("rank R [case]: message")."""
    failures.append(f"rank {rank} [{case}]: {message}")


def expect(condition: object, message: str) -> bool:
    """Record "rank R: message" unless condition holds; returns whether it held."""
    if not condition:
        failures.append(f"rank {rank}: {message}")
    return bool(condition)


def case(function: Callable[[], None]) -> Callable[[], None]:
    """Run a case now (as a decorator); an exception it raises is reported as its failure."""
    try:
        function()
    except Exception as error:  # noqa: BLE001 - reported as this case's failure
        fail(function.__name__, f"raised {type(error).__name__}: {error}")
    return function


def digest(value: object) -> str:
    """sha256 of an array's bytes (any layout) or of bytes."""
    data = value if isinstance(value, bytes) else np.ascontiguousarray(value).tobytes()
    return hashlib.sha256(data).hexdigest()


def close_to_reference(case: str, index: int, value: np.ndarray, expected: object, rtol: float, atol: float) -> bool:
    """Record a failure of result `index` of `case` unless it has the reference's shape and its values within
    the tolerances (0: exact); returns whether it passed."""
    if value.shape != np.shape(expected):
        fail(case, f"result {index}: shape {value.shape}, expected {np.shape(expected)}")
        return False
    if not np.allclose(value, expected, rtol=rtol, atol=atol):
        fail(case, f"result {index} differs from NumPy by {np.abs(value - expected).max():.3g}")
        return False
    return True


def same_everywhere(value: object, on: MPI.Comm = comm) -> bool:
    """Whether every rank of `on` holds the same bits (collective)."""
    return len(set(on.allgather(digest(value)))) == 1


def gather_failures(own: list[str] | None = None) -> list[str]:
    """Every rank's failures (this rank's `own`, default the module's list), in rank order (collective)."""
    return [f for per_rank in comm.allgather(failures if own is None else own) for f in per_rank]


def report(summary: str = "", *, own: list[str] | None = None, limit: int = 40) -> int:
    """Gathers the failures, prints "<summary><n> failures" and the first `limit` of them on rank 0; the exit
    status every rank should return (collective)."""
    everyone = gather_failures(own)
    if rank == 0:
        print(f"{summary}{len(everyone)} failures", flush=True)
        if everyone:
            print("\n".join(everyone[:limit]), flush=True)
    return 1 if everyone else 0


def report_results(on: MPI.Intracomm, results: list[tuple[str, str | None]]) -> int:
    """The (label, failure or None) form: every rank prints its own failures and "rank R: <n> cases on P ranks,
    <f> failures" (the pytest side counts one " 0 failures" per rank); this rank's exit status."""
    failed = [(label, failure) for label, failure in results if failure]
    for label, failure in failed[:40]:
        print(f"rank {on.Get_rank()} FAIL {label}: {failure}")
    print(f"rank {on.Get_rank()}: {len(results)} cases on {on.Get_size()} ranks, {len(failed)} failures", flush=True)
    return 1 if failed else 0


def report_and_exit(summary: str = "", *, before_exit: Callable[[], None] = lambda: None,
                    own: list[str] | None = None) -> NoReturn:
    status = report(summary, own=own)
    before_exit()
    sys.exit(status)
