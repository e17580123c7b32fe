"""reproducible=True on real ranks (tests/mpi/programs/reproducible_cases.py): the bits of the canonical order
(rank order at each element's owner), computed independently in NumPy, across every ring shape of P,
DDLFAST_ALGORITHM, chunk, bucket and small-message sizes, fused and separate and asynchronous calls, allreduce
and reduce_scatter, float32/float64/float16/bfloat16 and the fp16/bf16 wire; and the errors on every rank (a rank
passing another reproducible=, a bad value, a user codec). With DDLFAST_EMULATED_HOSTS, the same on the canonical
chain across hosts (src/engine/chain_phase.h)."""

from __future__ import annotations

import pytest

from tests.mpi.launcher import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize(("ranks", "scope", "hosts"), [(4, "full", 0), (6, "short", 0), (8, "short", 0),
                                                     (4, "short", 2), (6, "short", 3), (8, "short", 2)])
def test_reproducible(ranks: int, scope: str, hosts: int) -> None:
    """hosts: DDLFAST_EMULATED_HOSTS, so that allreduce runs the canonical chain host by host (0: one host)."""
    env = {"DDLFAST_EMULATED_HOSTS": str(hosts)} if hosts else None
    result = run_mpi(ranks, "reproducible_cases.py", *(["short"] if scope == "short" else []), timeout=600, env=env)
    assert " 0 failures" in result.stdout, result.stdout
