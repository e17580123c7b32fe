"""reproducible=True on real ranks (tests/mpi/programs/reproducible_cases.py): the bits of the canonical order
(rank order at each element's owner), computed independently in NumPy, across every ring shape of P,
DDLFAST_ALGORITHM, chunk, bucket and small-message sizes, fused and separate and asynchronous calls, allreduce
and reduce_scatter, float32/float64/float16/bfloat16 and the fp16/bf16 wire; and the errors on every rank (a rank
passing another reproducible=, a bad value, a user codec)."""

from __future__ import annotations

import pytest

from tests.mpi.launcher import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize(("ranks", "scope"), [(4, "full"), (6, "short"), (8, "short")])
def test_reproducible(ranks: int, scope: str) -> None:
    result = run_mpi(ranks, "reproducible_cases.py", *(["short"] if scope == "short" else []), timeout=600)
    assert " 0 failures" in result.stdout, result.stdout
