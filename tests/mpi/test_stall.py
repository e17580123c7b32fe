"""A rank that never joins: the others raise DdlfastTimeoutError naming it, no hang."""

from __future__ import annotations

import re

import pytest

from tests.mpi.launcher import run_mpi

TIMEOUT_S = 3


@pytest.mark.mpi
@pytest.mark.parametrize(("mode", "shared"), [
    *((mode, "1") for mode in ("new-context", "new-layout", "cached-layout", "cached-latency", "cached-halving")),
    ("cached-latency", "0"), ("cached-halving", "0"),
])
def test_missing_rank_is_named_within_the_timeout(mode: str, shared: str) -> None:
    # cached-halving: the latency path's halving form (its 400 bytes halve from 400 up); shared: the agreement in
    # shared memory (this host's default) or in the butterfly's messages
    env = {"DDLFAST_TIMEOUT_S": str(TIMEOUT_S), "DDLFAST_HALVING_BYTES": "400" if mode == "cached-halving" else "0",
           "DDLFAST_SHARED_MEMORY": shared}
    result = run_mpi(4, "stall.py", mode, str(TIMEOUT_S), env=env, timeout=120)
    # Ranks' lines can interleave on the shared pipe: every message ends with the same sentence.
    reports = re.findall(r"rank (\d): after ([\d.]+) s: (.*?out of step\.)", result.stdout)
    assert len(reports) == 3, result.stdout
    for _rank, elapsed, message in reports:
        # The census answers within 2 s of the first rank's stall limit; ranks that answer wait for its verdict.
        assert float(elapsed) < TIMEOUT_S + 2 + 3, result.stdout
        assert "did not join" in message or "never called" in message, message
        if mode != "new-context":
            assert "rank 3 did not join" in message, message
