"""The host-aware canonical order of bench/emulation/host_chain.py (issue 27's cheaper reproducible=True across
hosts) gives reproducible=True's bits: tests/mpi/programs/host_chain_cases.py. Its speed: bench/emulation."""

from __future__ import annotations

import pytest

from tests.mpi.launcher import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [4, 6])
def test_host_chain_gives_the_canonical_bits(ranks: int) -> None:
    result = run_mpi(ranks, "host_chain_cases.py", timeout=300)
    assert " 0 failures" in result.stdout, result.stdout
