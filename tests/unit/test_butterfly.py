"""The butterfly of the latency path and the per-call agreement (src/algo/butterfly.h), proved by simulating
every rank in one process, as transport/agreement_exchange.cc runs it: the fold, the steps, the result back.

Checked for every rank count up to 70 and a few large ones: partners are mutual, every rank ends with every
rank's value exactly once, both partners of an exchange combine the same operands (so the same bits), and a
mismatch between any two ranks reaches every rank."""

from __future__ import annotations

from collections import Counter

import pytest

from ddlfast import _testing
from ddlfast.errors import DdlfastError

SIZES = list(range(1, 71)) + [96, 127, 128, 129, 255, 1000, 1024, 1025]


def plans(size: int) -> list[tuple[str, int, list[int]]]:
    return [_testing.butterfly_plan(rank, size) for rank in range(size)]


def simulate(size: int, values: list, combine) -> list:
    """Each rank's final value when each holds values[rank] and pairs combine (lower rank's value first)."""
    plan = plans(size)
    held = list(values)
    for rank, (role, partner, _) in enumerate(plan):  # the fold: the odd rank of a pair takes its partner's value
        if role == "fold_in":
            held[rank] = combine(held[partner], held[rank])
    steps = max((len(p[2]) for p in plan), default=0)
    for step in range(steps):
        before = list(held)  # every message of a step is sent before any is taken
        for rank, (role, _, partners) in enumerate(plan):
            if role == "fold_out":
                continue
            peer = partners[step]
            low, high = (peer, rank) if peer < rank else (rank, peer)
            held[rank] = combine(before[low], before[high])
    for rank, (role, partner, _) in enumerate(plan):  # the result goes back to the folded rank
        if role == "fold_out":
            held[rank] = held[partner]
    return held


@pytest.mark.parametrize("size", SIZES)
def test_partners_are_mutual_and_steps_equal(size: int) -> None:
    plan = plans(size)
    exchanging = [rank for rank, p in enumerate(plan) if p[0] != "fold_out"]
    power = 1 << (size.bit_length() - 1)
    assert len(exchanging) == power
    for rank, (role, partner, partners) in enumerate(plan):
        if role == "fold_out":
            assert partners == [] and plan[partner][0] == "fold_in" and plan[partner][1] == rank
        else:
            assert len(partners) == power.bit_length() - 1
            for step, peer in enumerate(partners):
                assert peer != rank and plan[peer][0] != "fold_out" and plan[peer][2][step] == rank


@pytest.mark.parametrize("size", SIZES)
def test_every_rank_gets_every_value_once_in_the_same_order(size: int) -> None:
    # Values as the exact expression each rank builds: every rank must build the very same one.
    final = simulate(size, [f"v{r}" for r in range(size)], lambda a, b: f"({a}+{b})")
    assert len(set(final)) == 1
    counts = Counter(simulate(size, [Counter({r: 1}) for r in range(size)], lambda a, b: a + b)[0])
    assert counts == Counter({r: 1 for r in range(size)})


@pytest.mark.parametrize("size", [s for s in SIZES if 2 <= s <= 40])
def test_a_mismatch_anywhere_reaches_every_rank(size: int) -> None:
    """The agreement's flag: a rank ORs in every difference it sees between its partner's fingerprint and its
    own, and passes the flag on; with any two fingerprints different, every rank must end flagged."""
    plan = plans(size)
    for odd in range(size):
        fingerprints = [0] * size
        fingerprints[odd] = 1
        flags = [False] * size
        for rank, (role, partner, _) in enumerate(plan):
            if role == "fold_in":
                flags[rank] = fingerprints[partner] != fingerprints[rank]
        steps = max(len(p[2]) for p in plan)
        for step in range(steps):
            before = list(flags)
            for rank, (role, _, partners) in enumerate(plan):
                if role != "fold_out":
                    peer = partners[step]
                    flags[rank] = before[rank] or before[peer] or fingerprints[peer] != fingerprints[rank]
        for rank, (role, partner, _) in enumerate(plan):
            if role == "fold_out":
                flags[rank] = flags[partner] or fingerprints[partner] != fingerprints[rank]
        assert all(flags), (size, odd, flags)


def test_bad_rank_is_refused() -> None:
    with pytest.raises(DdlfastError, match="rank 3 of 3"):
        _testing.butterfly_plan(3, 3)
