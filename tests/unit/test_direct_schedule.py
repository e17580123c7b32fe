"""The direct reduce-scatter's schedule (RingPhase::direct, src/algo/ring_schedule.h), proved without MPI by
simulating every rank in one process, as tests/unit/test_schedule.py does for the ring: in a direct phase every
rank of a dimension's ring sends block j of its segment to the rank at coordinate j, which adds the d
contributions in coordinate order; the allgather phases stay the ring's."""

from __future__ import annotations

import itertools
import math
from functools import reduce

import numpy as np
import pytest

from ddlfast import _testing
from tests.unit.test_schedule import coords, counts_for, rank_of

DIMS = [(2,), (3,), (5,), (8,), (2, 4), (4, 2), (2, 2, 2), (3, 2), (2, 3), (5, 3), (1, 4), (4, 1), (1,)]


def masks(dims: tuple[int, ...]) -> list[tuple[int, ...]]:
    return list(itertools.product((0, 1), repeat=len(dims)))


def simulate(scheds, buffers: list[np.ndarray], stop_before_allgather: bool = False) -> list[np.ndarray]:
    """Executes ring and direct phases literally on copies of `buffers` (snapshot semantics per step); a direct
    owner adds the contributions in coordinate order, one at a time (float32 rounding after each)."""
    buffers = [b.copy() for b in buffers]
    p = len(scheds)
    for index in range(len(scheds[0][0])):
        phases = [scheds[r][0][index] for r in range(p)]
        if stop_before_allgather and phases[0]["kind"] == "allgather":
            break
        if phases[0].get("direct"):
            snapshot = [b.copy() for b in buffers]
            for r in range(p):
                phase = phases[r]
                offset, n = phase["blocks"][phase["coordinate"]]
                for j, peer in enumerate(phase["peers"]):
                    assert phases[peer]["blocks"] == phase["blocks"], f"rank {peer} cuts the segment differently"
                    assert phases[peer]["coordinate"] == j
                terms = [snapshot[peer][offset:offset + n] for peer in phase["peers"]]
                buffers[r][offset:offset + n] = reduce(lambda a, b: a + b, terms)
            continue
        for step in range(len(phases[0]["steps"])):
            outgoing = [buffers[r][o:o + n].copy() for r, ((o, n), _) in
                        ((r, phases[r]["steps"][step]) for r in range(p))]
            for r in range(p):
                offset, n = phases[r]["steps"][step][1]
                incoming = outgoing[phases[r]["predecessor"]]
                assert incoming.shape[0] == n
                if phases[r]["kind"] == "reduce_scatter":
                    buffers[r][offset:offset + n] += incoming
                else:
                    buffers[r][offset:offset + n] = incoming
    return buffers


@pytest.mark.parametrize("dims", DIMS, ids=lambda d: "x".join(map(str, d)))
def test_direct_schedule_is_an_exactly_once_allreduce(dims: tuple[int, ...]) -> None:
    p = math.prod(dims)
    for direct in masks(dims):
        for count in counts_for(p):
            scheds = [_testing.ring_schedule(dims, r, count, None, direct) for r in range(p)]
            ring = [_testing.ring_schedule(dims, r, count) for r in range(p)]
            for r in range(p):
                assert scheds[r][1] == ring[r][1], "the direct step must leave each rank the ring's owned block"
                for mine, theirs in zip(scheds[r][0], ring[r][0], strict=True):
                    assert mine["kind"] == theirs["kind"] and mine["dim"] == theirs["dim"]
                    if mine.get("direct"):
                        assert direct[mine["dim"]] and not mine["steps"]
                        check_peers(dims, r, mine)
                        # the ring's reduce-scatter cuts the same segment into the same blocks
                        ring_blocks = [send for send, _ in theirs["steps"]] + [theirs["steps"][-1][1]]
                        assert sorted(mine["blocks"]) == sorted(ring_blocks)
                        assert mine["blocks"][mine["coordinate"]] == theirs["steps"][-1][1]
                    else:
                        assert mine == theirs
            provenance = []
            for r in range(p):
                counts = np.zeros((count, p), dtype=np.int64)
                counts[:, r] = 1
                provenance.append(counts)
            half = simulate(scheds, provenance, stop_before_allgather=True)
            for r, (_, (offset, n)) in enumerate(scheds):
                assert np.array_equal(half[r][offset:offset + n], np.ones((n, p), np.int64))
            for r, result in enumerate(simulate(scheds, provenance)):
                assert np.all(result == 1), f"rank {r}: not every contribution exactly once"
            rng = np.random.default_rng([p, count, *direct])
            floats = [rng.standard_normal(count).astype(np.float32) for _ in range(p)]
            results = simulate(scheds, floats)
            for r, result in enumerate(results):
                assert np.array_equal(result.view(np.uint32), results[0].view(np.uint32)), f"rank {r} differs"


def check_peers(dims: tuple[int, ...], rank: int, phase: dict) -> None:
    """peers[j] is the rank whose coordinates equal this rank's but for coordinate j in the phase's dimension."""
    dim, mine = phase["dim"], coords(rank, dims)
    assert phase["coordinate"] == mine[dim]
    for j, peer in enumerate(phase["peers"]):
        expected = list(mine)
        expected[dim] = j
        assert peer == rank_of(expected, dims)
    starts = [offset for offset, _ in phase["blocks"]]
    assert starts == sorted(starts), "blocks lie in coordinate order"
    for (offset, n), (following, _) in zip(phase["blocks"], phase["blocks"][1:], strict=False):
        assert offset + n == following, "blocks tile the segment"


@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_flat_direct_sums_in_rank_order(p: int) -> None:
    """On one dimension the owner's sum is ((x0 + x1) + x2) + ...: the bits of that one order, not the ring's."""
    count = 7 * p + 3
    rng = np.random.default_rng(p)
    floats = [(rng.standard_normal(count) * 10.0 ** rng.integers(-3, 4, count)).astype(np.float32) for _ in range(p)]
    scheds = [_testing.ring_schedule((p,), r, count, None, (1,)) for r in range(p)]
    want = reduce(lambda a, b: a + b, floats)
    for result in simulate(scheds, floats):
        assert np.array_equal(result.view(np.uint32), want.view(np.uint32))
