"""The k-dimensional ring schedule, proved by simulating every rank in one process.

`_testing.ring_schedule(dims, rank, count)` gives one rank's phases; all ranks run phase i, step s together,
each sending its `send` range to its successor and receiving into its `recv` range from its predecessor
(added in for reduce-scatter, copied for allgather). The simulation below executes that literally, with
snapshot semantics (every send of a step is taken before any receive of that step is applied), on values
and on per-element contribution counts, and checks the result is a correct, exactly-once allreduce.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ddlfast
from ddlfast import _testing

DIMS = [(8,), (2, 4), (4, 2), (2, 2, 2), (3, 5, 2), (1, 8), (8, 1), (7,), (1,), (2, 3), (6,), (7, 1), (1, 1, 3),
        (2, 1, 3), (5, 3), (16,), (2, 2, 2, 2), (4, 4), (1, 1)]


def counts_for(p: int) -> list[int]:
    return sorted({0, 1, 2, p - 1, p, p + 1, 2 * p - 1, 2 * p + 3, 13, 97, 1000, 3 * p * p + 5})


CASES = [(dims, count) for dims in DIMS for count in counts_for(math.prod(dims))]


def case_id(case: tuple[tuple[int, ...], int]) -> str:
    dims, count = case
    return "x".join(map(str, dims)) + f"-n{count}"


def coords(rank: int, dims: tuple[int, ...]) -> list[int]:
    """Mixed radix, dimension 1 fastest (written independently of the core)."""
    result = []
    for d in dims:
        result.append(rank % d)
        rank //= d
    return result


def rank_of(c: list[int], dims: tuple[int, ...]) -> int:
    rank, stride = 0, 1
    for ci, d in zip(c, dims, strict=True):
        rank += ci * stride
        stride *= d
    return rank


def neighbour(rank: int, dims: tuple[int, ...], dim: int, delta: int) -> int:
    c = coords(rank, dims)
    c[dim] = (c[dim] + delta) % dims[dim]
    return rank_of(c, dims)


def schedules(dims: tuple[int, ...], count: int,
              block_counts: list[int] | None = None) -> list[tuple[list[dict], tuple[int, int]]]:
    return [_testing.ring_schedule(dims, rank, count, block_counts) for rank in range(math.prod(dims))]


def simulate(scheds, buffers: list[np.ndarray], stop_before_allgather: bool = False) -> list[np.ndarray]:
    """Executes the schedule on copies of `buffers` (one per rank, first axis = elements)."""
    buffers = [b.copy() for b in buffers]
    p = len(scheds)
    for phase_index in range(len(scheds[0][0])):
        phases = [scheds[r][0][phase_index] for r in range(p)]
        if stop_before_allgather and phases[0]["kind"] == "allgather":
            break
        for step in range(len(phases[0]["steps"])):
            outgoing = []
            for r in range(p):
                offset, n = phases[r]["steps"][step][0]
                outgoing.append(buffers[r][offset : offset + n].copy())  # snapshot before any receive
            for r in range(p):
                offset, n = phases[r]["steps"][step][1]
                incoming = outgoing[phases[r]["predecessor"]]
                assert incoming.shape[0] == n, f"rank {r} expects {n} elements, its predecessor sends {len(incoming)}"
                if phases[r]["kind"] == "reduce_scatter":
                    buffers[r][offset : offset + n] += incoming
                else:
                    buffers[r][offset : offset + n] = incoming
    return buffers


def check_structure(dims: tuple[int, ...], count: int, scheds, uniform: bool = True) -> None:
    """Everything that can be checked without data flowing."""
    p = math.prod(dims)
    nontrivial = [i for i, d in enumerate(dims) if d > 1]
    expected = [("reduce_scatter", i) for i in nontrivial] + [("allgather", i) for i in reversed(nontrivial)]
    for r, (phases, (own_offset, own_n)) in enumerate(scheds):
        assert [(ph["kind"], ph["dim"]) for ph in phases] == expected, f"rank {r}: phase order"
        assert 0 <= own_offset and own_offset + own_n <= count
        for index, ph in enumerate(phases):
            d = dims[ph["dim"]]
            where = f"rank {r} {ph['kind']} dim {ph['dim']}"
            assert ph["successor"] == neighbour(r, dims, ph["dim"], +1), where
            assert ph["predecessor"] == neighbour(r, dims, ph["dim"], -1), where
            assert scheds[ph["predecessor"]][0][index]["successor"] == r, where
            assert len(ph["steps"]) == d - 1, where
            for s, (send, recv) in enumerate(ph["steps"]):
                for offset, n in (send, recv):
                    assert offset >= 0 and n >= 0 and offset + n <= count, f"{where} step {s}: out of bounds"
                if recv[1] and send[1]:
                    assert send[0] + send[1] <= recv[0] or recv[0] + recv[1] <= send[0], f"{where}: send/recv overlap"
                if s + 1 < len(ph["steps"]):
                    assert recv == ph["steps"][s + 1][0], f"{where} step {s}: recv is not the next step's send"
                # What a rank receives is exactly what its predecessor sends, range for range.
                pred_send = scheds[ph["predecessor"]][0][index]["steps"][s][0]
                assert pred_send == recv, f"{where} step {s}: receives {recv}, predecessor sends {pred_send}"
        rs = [ph for ph in phases if ph["kind"] == "reduce_scatter"]
        ag = [ph for ph in phases if ph["kind"] == "allgather"]
        if rs:
            assert rs[-1]["steps"][-1][1] == (own_offset, own_n), f"rank {r}: owned is not the last block reduced"
            assert ag[0]["steps"][0][0] == (own_offset, own_n), f"rank {r}: allgather does not start from owned"
        else:
            assert (own_offset, own_n) == (0, count)

    # The owned slices partition [0, count), with sizes as even as possible.
    owned = sorted(own for _, own in scheds)
    assert sum(n for _, n in owned) == count
    cursor = 0
    for offset, n in owned:
        if n:
            assert offset == cursor, f"owned slices {owned} leave a gap or overlap at {cursor}"
            cursor += n
    assert cursor == count
    if uniform:
        assert {n for _, n in owned} <= {count // p, -(-count // p)}, f"unbalanced owned slices {owned}"

    # Bandwidth-optimal in aggregate: every element crosses p-1 links in each half (telescoping sum),
    # and each rank's share is exact when p divides count.
    for kind in ("reduce_scatter", "allgather"):
        per_rank = [
            sum(send[1] for ph in phases if ph["kind"] == kind for send, _ in ph["steps"]) for phases, _ in scheds
        ]
        assert sum(per_rank) == count * (p - 1), f"{kind}: {per_rank}"
        if uniform and count % p == 0:
            assert per_rank == [count // p * (p - 1)] * p, f"{kind}: {per_rank}"


def check_allreduce(dims: tuple[int, ...], count: int, seed: int = 0, block_counts: list[int] | None = None) -> None:
    p = math.prod(dims)
    scheds = schedules(dims, count, block_counts)
    check_structure(dims, count, scheds, uniform=block_counts is None)
    owned = [own for _, own in scheds]

    # Provenance: element i of rank r counts how often each rank's input has been added into it.
    provenance = []
    for r in range(p):
        counts = np.zeros((count, p), dtype=np.int64)
        counts[:, r] = 1
        provenance.append(counts)
    ones = np.ones((count, p), dtype=np.int64)
    half = simulate(scheds, provenance, stop_before_allgather=True)
    for r, (offset, n) in enumerate(owned):
        got = half[r][offset : offset + n]
        assert np.array_equal(got, ones[:n]), f"rank {r}: owned slice is not reduced exactly once from each rank"
    final = simulate(scheds, provenance)
    for r in range(p):
        bad = np.flatnonzero((final[r] != 1).any(axis=1))
        assert bad.size == 0, f"rank {r}: elements {bad[:8]} have contributions {final[r][bad[:3]].tolist()}"

    # Values: exact integer sums everywhere, and float sums with identical bits on every rank.
    rng = np.random.default_rng([seed, p, count])
    ints = [rng.integers(-(2**40), 2**40, size=count) for _ in range(p)]
    total = np.sum(ints, axis=0)
    half = simulate(scheds, ints, stop_before_allgather=True)
    for r, (offset, n) in enumerate(owned):
        assert np.array_equal(half[r][offset : offset + n], total[offset : offset + n]), f"rank {r}: owned slice"
    for r, result in enumerate(simulate(scheds, ints)):
        assert np.array_equal(result, total), f"rank {r}: wrong sum"
    floats = [rng.standard_normal(count).astype(np.float32) for _ in range(p)]
    results = simulate(scheds, floats)
    for r, result in enumerate(results):
        assert np.array_equal(result.view(np.uint32), results[0].view(np.uint32)), f"rank {r} differs from rank 0"
    np.testing.assert_allclose(results[0], np.sum(floats, axis=0, dtype=np.float64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_schedule_is_an_exactly_once_allreduce(case: tuple[tuple[int, ...], int]) -> None:
    check_allreduce(*case)


@given(
    dims=st.lists(st.integers(1, 5), min_size=1, max_size=4).filter(lambda ds: math.prod(ds) <= 48),
    count=st.integers(0, 300),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
def test_schedule_property_random_shapes(dims: list[int], count: int, seed: int) -> None:
    check_allreduce(tuple(dims), count, seed)


@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_one_dimension_is_the_classic_ring(p: int) -> None:
    count = 4 * p + 1
    base, extra = divmod(count, p)
    blocks = [(b * base + min(b, extra), base + (b < extra)) for b in range(p)]  # larger blocks first
    assert blocks[0][1] == base + 1 and sum(n for _, n in blocks) == count
    for r in range(p):
        phases, owned = _testing.ring_schedule((p,), r, count)
        assert [ph["kind"] for ph in phases] == ["reduce_scatter", "allgather"]
        assert phases[0]["successor"] == (r + 1) % p and phases[0]["predecessor"] == (r - 1) % p
        assert owned == blocks[r]
        # Reduce-scatter passes each block one hop per step and ends on the block it owns.
        sent = [send for send, _ in phases[0]["steps"]]
        assert sent == [blocks[(r - s - 1) % p] for s in range(p - 1)]
        assert [send for send, _ in phases[1]["steps"]] == [blocks[(r - s) % p] for s in range(p - 1)]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_all_dimensions_two_is_recursive_halving_doubling(k: int) -> None:
    dims, count = (2,) * k, 3 * 2**k + 1
    for r in range(2**k):
        phases, (_, owned_n) = _testing.ring_schedule(dims, r, count)
        assert len(phases) == 2 * k
        partners = [ph["successor"] for ph in phases]
        assert partners == [r ^ (1 << i) for i in range(k)] + [r ^ (1 << i) for i in reversed(range(k))]
        assert all(ph["predecessor"] == ph["successor"] for ph in phases)
        # Halving: reduce-scatter step i sends half of a segment of count / 2^i elements.
        sizes = [ph["steps"][0][0][1] for ph in phases[:k]]
        assert all(n in (count >> (i + 1), (count >> (i + 1)) + 1) for i, n in enumerate(sizes)), sizes
        assert owned_n in (count // 2**k, count // 2**k + 1)


def test_two_dimensions_rings_stay_inside_rows_and_columns() -> None:
    """2x4: dimension 1 rings are {0,1}, {2,3}, ...; dimension 2 rings are {0,2,4,6} and {1,3,5,7}."""
    dims = (2, 4)
    for r in range(8):
        phases, _ = _testing.ring_schedule(dims, r, 64)
        first, second = phases[0], phases[1]
        assert (first["dim"], second["dim"]) == (0, 1)
        assert first["successor"] == r ^ 1
        assert second["successor"] == (r + 2) % 8 and second["predecessor"] == (r - 2) % 8
        # After the first dimension a rank works on half the buffer, after the second on an eighth.
        assert sum(send[1] for send, _ in first["steps"]) == 32
        assert sum(send[1] for send, _ in second["steps"]) == 3 * 8


def test_schedule_is_deterministic_and_independent_of_the_caller() -> None:
    assert _testing.ring_schedule((3, 5, 2), 17, 1001) == _testing.ring_schedule([3, 5, 2], 17, 1001)


@pytest.mark.parametrize(
    ("dims", "rank", "needle"),
    [
        ((), 0, "empty"),
        ((0,), 0, "0"),
        ((2, 0), 0, "0"),
        ((-1,), 0, "-1"),
        ((-2, -2), 0, "-2"),  # the product is positive, the dimensions are not
        ((2, 2), 4, "rank 4"),
        ((2, 2), -1, "rank -1"),
        ((3,), 3, "rank 3"),
    ],
)
def test_invalid_dims_or_rank_raise(dims: tuple[int, ...], rank: int, needle: str) -> None:
    with pytest.raises(ddlfast.DdlfastError, match=needle):
        _testing.ring_schedule(dims, rank, 10)


def test_huge_dims_raise_ddlfast_error() -> None:
    with pytest.raises(ddlfast.DdlfastError):
        _testing.ring_schedule((1 << 16, 1 << 16), 0, 10)


# -- explicit block sizes (reduce-scatter with counts=, and the rank-to-block mapping) ---------------------------


def block_order(dims: tuple[int, ...]) -> list[int]:
    """Positions in the order their blocks lie: coordinate 1 most significant (dimension 1 cuts first)."""
    return sorted(range(math.prod(dims)), key=lambda v: coords(v, dims))


@pytest.mark.parametrize("dims", DIMS, ids=lambda d: "x".join(map(str, d)))
def test_block_order_is_coordinate_one_most_significant(dims: tuple[int, ...]) -> None:
    assert _testing.block_order(dims) == block_order(dims)


def check_block_counts(dims: tuple[int, ...], block_counts: list[int], seed: int = 0) -> None:
    """Each position ends the reduce-scatter owning exactly its block, in block order, reduced exactly once from
    every rank, and the whole schedule is still an exactly-once allreduce."""
    count = sum(block_counts)
    check_allreduce(dims, count, seed, block_counts)
    start = 0
    for position in block_order(dims):
        _, owned = _testing.ring_schedule(dims, position, count, block_counts)
        assert owned == (start, block_counts[position]), f"position {position}"
        start += block_counts[position]


UNEVEN = [((4,), [3, 0, 5, 1]), ((2, 2), [0, 0, 0, 7]), ((2, 3), [1, 2, 3, 0, 4, 0]),
          ((3, 1, 2), [5, 0, 1, 1, 2, 9]), ((2, 2, 2), [1, 1, 1, 1, 1, 1, 1, 1]), ((1,), [6]), ((5,), [0, 0, 0, 0, 0]),
          ((2, 4), [8, 1, 0, 3, 2, 7, 0, 1])]


@pytest.mark.parametrize(("dims", "block_counts"), UNEVEN, ids=lambda v: str(v))
def test_explicit_block_counts(dims: tuple[int, ...], block_counts: list[int]) -> None:
    check_block_counts(dims, block_counts)


@given(
    dims=st.lists(st.integers(1, 4), min_size=1, max_size=3).filter(lambda ds: math.prod(ds) <= 24),
    data=st.data(),
)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
def test_explicit_block_counts_property(dims: list[int], data: st.DataObject) -> None:
    p = math.prod(dims)
    block_counts = data.draw(st.lists(st.integers(0, 12), min_size=p, max_size=p))
    check_block_counts(tuple(dims), block_counts, seed=sum(block_counts))


@pytest.mark.parametrize("dims", [(8,), (2, 4), (3, 5, 2), (2, 1, 3)], ids=lambda d: "x".join(map(str, d)))
def test_near_equal_split_is_the_special_case(dims: tuple[int, ...]) -> None:
    """The count form gives the same schedule as the explicit form with the near-equal owned sizes."""
    p = math.prod(dims)
    for count in (0, 1, p + 3, 97):
        owned = [_testing.ring_schedule(dims, r, count)[1][1] for r in range(p)]
        for r in range(p):
            assert _testing.ring_schedule(dims, r, count) == _testing.ring_schedule(dims, r, count, owned)


@pytest.mark.parametrize(("block_counts", "count"), [([1, 2], 4), ([1, 2, 3], 6), ([-1, 2, 2, 1], 4)])
def test_bad_block_counts_raise(block_counts: list[int], count: int) -> None:
    with pytest.raises(ddlfast.DdlfastError, match="block_counts|negative"):
        _testing.ring_schedule((2, 2), 0, count, block_counts)
