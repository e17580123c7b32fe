"""Placement, renumbering, auto's choice and the dims checks, without MPI (placements are made up)."""

from __future__ import annotations

import warnings

import pytest

from ddlfast.config import (
    CREATION_AGREEMENT_BYTES,
    DEFAULT_HALVING_BYTES,
    HALVING_REACH_BYTES,
    MAX_LATENCY_BYTES,
    MAX_LATENCY_REACH_BYTES,
)
from ddlfast.errors import DdlfastError
from ddlfast.topology.cost_model import Link
from ddlfast.topology.placement import (
    Placement,
    TopologyWarning,
    crowded_ranks,
    decide,
    hosts_per_group,
    probe_pairs,
)
from ddlfast.topology.probe import Links

SLOW = Links(Link(1e-6, 1e-10), Link(20e-6, 8e-9), None, 1e-10, "test")


def _placement(*host_of_rank: int) -> Placement:
    hosts = max(host_of_rank) + 1
    return Placement(tuple(host_of_rank), tuple(f"node{h}" for h in range(hosts)))


def test_block_placement_is_contiguous() -> None:
    p = _placement(0, 0, 1, 1)
    assert p.hosts == 2 and p.ranks_per_host == (2, 2) and p.regular and p.contiguous
    assert p.order == (0, 1, 2, 3)


def test_round_robin_placement_is_renumbered_host_contiguous() -> None:
    p = _placement(0, 1, 0, 1, 0, 1)
    assert not p.contiguous
    assert p.order == (0, 2, 4, 1, 3, 5)
    topology = decide(0, p, 1, SLOW, 64 << 20)
    assert topology.order == (0, 2, 4, 1, 3, 5)
    assert topology.auto_dims == (3, 2)  # each dimension-1 ring on one host, then across the slow link


def test_contiguous_placement_needs_no_order() -> None:
    assert decide(0, _placement(0, 0, 1, 1), 1, SLOW, 64 << 20).order == ()


def test_auto_on_a_slow_network_is_host_aligned() -> None:
    topology = decide(0, _placement(0, 0, 0, 0, 1, 1, 1, 1), 1, SLOW, 64 << 20)
    assert topology.auto_dims in {(4, 2), (2, 2, 2)}
    assert topology.resolve("auto") == topology.auto_dims
    assert topology.resolve("flat") == (8,)
    assert topology.candidates[0].seconds <= topology.candidates[-1].seconds


def test_irregular_placement_falls_back_to_flat_with_a_warning() -> None:
    topology = decide(0, _placement(0, 0, 0, 1), 1, SLOW, 64 << 20)
    assert topology.auto_dims == (4,) and topology.cluster is None
    with pytest.warns(TopologyWarning, match="ranks per host differ"):
        assert topology.resolve("auto") == (4,)
    assert "3,1" in topology.describe()


def test_warnings_only_on_rank_zero() -> None:
    topology = decide(1, _placement(0, 0, 0, 1), 1, SLOW, 64 << 20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert topology.resolve("auto") == (4,)


def test_explicit_dims_checked_against_placement() -> None:
    topology = decide(0, _placement(0, 0, 0, 1, 1, 1), 1, SLOW, 64 << 20)
    assert topology.resolve((3, 2)) == (3, 2)
    assert topology.resolve((1, 6)) == (1, 6)  # one ring over both whole hosts
    assert topology.resolve((6,)) == (6,)
    with pytest.raises(DdlfastError, match="multiply to 4 but the communicator has 6"):
        topology.resolve((2, 2))
    with pytest.raises(DdlfastError, match=r"dimension-1 rings of 2 ranks would split hosts.*auto \(here 3x2\)"):
        topology.resolve((2, 3))


def test_dims_covering_whole_hosts_are_fine() -> None:
    p = _placement(0, 0, 1, 1, 2, 2, 3, 3)
    assert not p.ring_straddles_hosts(4) and not p.ring_straddles_hosts(2) and not p.ring_straddles_hosts(8)
    assert _placement(0, 0, 0, 1, 1, 1).ring_straddles_hosts(4)


def test_hosts_per_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DDLFAST_HOSTS_PER_GROUP", raising=False)
    assert hosts_per_group(8) == (1, None)
    monkeypatch.setenv("DDLFAST_HOSTS_PER_GROUP", "4")
    assert hosts_per_group(8) == (4, None)
    value, warning = hosts_per_group(6)
    assert value == 1 and "does not divide the 6 hosts" in warning
    monkeypatch.setenv("DDLFAST_HOSTS_PER_GROUP", "racks")
    with pytest.raises(DdlfastError, match="DDLFAST_HOSTS_PER_GROUP='racks'"):
        hosts_per_group(8)


def test_groups_make_a_third_dimension() -> None:
    links = Links(Link(1e-6, 1e-10), Link(10e-6, 1e-9), Link(50e-6, 1e-8), 1e-10, "test")
    topology = decide(0, _placement(*[h for h in range(8) for _ in range(2)]), 4, links, 64 << 20)
    assert topology.auto_dims[-1] == 2  # last dimension = the two groups over their slow uplinks
    assert "groups of 4 hosts" in topology.describe()


def test_probe_pairs() -> None:
    block = _placement(0, 0, 1, 1, 2, 2, 3, 3)
    assert probe_pairs(block, 2, False) == {"intra": (0, 1), "inter": (0, 2), "group": (0, 4)}
    assert probe_pairs(_placement(0, 1, 0, 1), 1, False) == {"intra": (0, 2), "inter": (0, 1)}
    assert probe_pairs(_placement(0, 0, 0), 1, False) == {}  # one host: auto has nothing to choose
    assert probe_pairs(_placement(0, 0, 0), 1, True) == {"intra": (0, 1)}
    assert probe_pairs(_placement(0, 0, 1), 1, False) == {}  # irregular: flat regardless


def test_as_dict_is_json_ready() -> None:
    import json

    data = decide(0, _placement(0, 1, 0, 1), 1, SLOW, 64 << 20).as_dict()
    assert json.loads(json.dumps(data))["auto_dims"] == "2x2"
    assert data["order"] == [0, 2, 1, 3] and data["links"]["source"] == "test"


@pytest.mark.parametrize(("crowded", "oversubscribed"),
                         [((), False), ((False, False), False), ((False, True), True), ((True, True), True)])
def test_oversubscribed_is_some_host_with_crowded_ranks(crowded: tuple[bool, ...], oversubscribed: bool) -> None:
    assert Placement((0, 0, 1, 1), ("a", "b"), crowded).oversubscribed is oversubscribed


@pytest.mark.parametrize(("cores", "expected"), [
    # 2 ranks on one machine's 2 cores (the same mask): a core each
    ([("m", "01", 2)] * 2, [False, False]),
    # 4 there: crowded, also where MPI sees two hosts (the machine is the kernel's, not MPI's host)
    ([("m", "01", 2)] * 4, [True] * 4),
    # pinned to a core each (--bind-to core): not crowded; 2 on each core: crowded
    ([("m", "0", 1), ("m", "1", 1)], [False, False]),
    ([("m", "0", 1), ("m", "1", 1)] * 2, [True] * 4),
    # the same mask on another machine is other cores
    ([("m", "01", 2)] * 2 + [("n", "01", 2)] * 2, [False] * 4),
    # one machine's ranks on a mask of 4 cores and one on its own core
    ([("m", "0123", 4)] * 3 + [("m", "4", 1)], [False] * 4),
])
def test_crowded_ranks_share_one_machine_and_mask(cores: list[tuple[str, str, int]], expected: list[bool]) -> None:
    assert crowded_ranks(cores) == expected


def test_latency_reach_grows_under_auto_on_an_oversubscribed_placement() -> None:
    crowded = decide(0, Placement((0, 0, 0, 0), ("a",), (True,)), 1, SLOW, 64 << 20)
    roomy = decide(0, Placement((0, 0, 0, 0), ("a",), (False,)), 1, SLOW, 64 << 20)
    assert crowded.latency_reach(8 << 10) == MAX_LATENCY_BYTES
    assert crowded.latency_reach(1 << 20) == 1 << 20  # never below DDLFAST_SMALL_BYTES
    assert crowded.latency_reach(8 << 10, "ring") == 8 << 10  # only auto chooses
    assert roomy.latency_reach(8 << 10) == 8 << 10
    assert crowded.algorithms()[64 << 10] == "latency path" and roomy.algorithms()[64 << 10] != "latency path"


def test_the_latency_path_halves_where_every_rank_has_a_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """Halving (DDLFAST_HALVING_BYTES=auto): from DEFAULT_HALVING_BYTES on one host with a core per rank, never
    where ranks outnumber cores; the latency path then reaches HALVING_REACH_BYTES under auto for P > 2."""
    monkeypatch.delenv("DDLFAST_HALVING_BYTES", raising=False)
    crowded = decide(0, Placement((0, 0, 0, 0), ("a",), (True,)), 1, SLOW, 64 << 20)
    roomy = decide(0, Placement((0, 0, 0, 0), ("a",), (False,)), 1, SLOW, 64 << 20)
    pair = decide(0, Placement((0, 0), ("a",), (False,)), 1, SLOW, 64 << 20)
    two_hosts = decide(0, Placement((0, 0, 1, 1), ("a", "b"), (False, False)), 1, SLOW, 64 << 20)
    assert crowded.halving_bytes() == 0 and roomy.halving_bytes() == DEFAULT_HALVING_BYTES
    assert two_hosts.latency_reach(8 << 10, "auto", 0) >= 8 << 10  # across hosts the cost model decides
    assert roomy.halving_bytes(0) == 0 and crowded.halving_bytes(512) == 512  # DDLFAST_HALVING_BYTES decides
    halving = roomy.halving_bytes()
    assert roomy.latency_reach(8 << 10, "auto", halving) == HALVING_REACH_BYTES
    assert roomy.latency_reach(8 << 10, "auto", 0) == 8 << 10  # no halving: no reach beyond the limit
    assert roomy.latency_reach(8 << 10, "direct", halving) == 8 << 10  # only auto chooses
    assert pair.latency_reach(8 << 10, "auto", pair.halving_bytes()) == 8 << 10  # P=2: the ring's one step
    assert crowded.latency_reach(8 << 10, "auto", 0) == MAX_LATENCY_BYTES
    shown = roomy.algorithms()
    assert shown[4 << 10] == "latency path" and shown[64 << 10] != "latency path"
    monkeypatch.setenv("DDLFAST_HALVING_BYTES", "4KiB")
    assert roomy.algorithms()[4 << 10] == "latency path, halving"


def test_the_latency_path_reaches_farther_in_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the agreement in shared memory (Topology.shared_memory, from Core.shared_memory): on one host with a core
    per rank, reach MAX_LATENCY_BYTES at every P, halving from DEFAULT_HALVING_BYTES for P > 2 and never at P = 2
    (the whole payload is one exchange through the segment there); oversubscribed, halving
    from SHARED_OVERSUBSCRIBED_HALVING_BYTES and reach SHARED_OVERSUBSCRIBED_REACH_BYTES (MAX_LATENCY_BYTES
    without halving), the context's capacity following it; across hosts the cost model as before."""
    from dataclasses import replace

    from ddlfast.config import SHARED_OVERSUBSCRIBED_HALVING_BYTES, SHARED_OVERSUBSCRIBED_REACH_BYTES

    monkeypatch.delenv("DDLFAST_HALVING_BYTES", raising=False)

    def shared(placement: Placement):
        return replace(decide(0, placement, 1, SLOW, 64 << 20), shared_memory=True)

    crowded = shared(Placement((0, 0, 0, 0), ("a",), (True,)))
    roomy = shared(Placement((0, 0, 0, 0), ("a",), (False,)))
    pair = shared(Placement((0, 0), ("a",), (False,)))
    assert roomy.halving_bytes() == DEFAULT_HALVING_BYTES and pair.halving_bytes() == 0
    assert pair.halving_bytes(4 << 10) == 4 << 10  # DDLFAST_HALVING_BYTES decides
    assert roomy.latency_reach(8 << 10, "auto", roomy.halving_bytes()) == MAX_LATENCY_BYTES
    assert pair.latency_reach(8 << 10, "auto", pair.halving_bytes()) == MAX_LATENCY_BYTES
    assert pair.algorithms()[MAX_LATENCY_BYTES] == "latency path"
    assert roomy.agreement_capacity() == CREATION_AGREEMENT_BYTES  # nothing grows
    assert crowded.halving_bytes() == SHARED_OVERSUBSCRIBED_HALVING_BYTES
    assert crowded.latency_reach(8 << 10, "auto", crowded.halving_bytes()) == SHARED_OVERSUBSCRIBED_REACH_BYTES
    assert crowded.latency_reach(8 << 10, "auto", 0) == MAX_LATENCY_BYTES
    assert crowded.latency_reach(8 << 10, "ring", crowded.halving_bytes()) == 8 << 10  # only auto chooses
    assert crowded.agreement_capacity() == SHARED_OVERSUBSCRIBED_REACH_BYTES
    assert crowded.algorithms()[1 << 20] == "latency path, halving"
    assert crowded.algorithms()[16 << 20] != "latency path, halving"
    two_hosts = Placement((0, 0, 1, 1), ("a", "b"), (False, False))  # emulated hosts sharing memory: the model decides
    assert shared(two_hosts).latency_plan() == decide(0, two_hosts, 1, SLOW, 64 << 20).latency_plan()


@pytest.mark.parametrize("hosts", [2, 8, 64])
def test_across_hosts_the_cost_model_chooses_halving_and_reach(hosts: int) -> None:
    """Across hosts (cost_model.latency_plan): halving from the first size from which the model's halving form
    stays faster than the whole payload, and the latency path up to the last size at which it beats the agreement
    plus auto's algorithm."""
    from ddlfast.topology.cost_model import LATENCY_SIZES, halving_seconds, latency_seconds, predict_call

    topology = decide(0, Placement(tuple(r // 4 for r in range(4 * hosts)), tuple(map(str, range(hosts))),
                                   (False,) * hosts), 1, SLOW, 64 << 20)
    cluster, small = topology.cluster, 8 << 10
    halving = topology.halving_bytes()

    def whole(n: int) -> float:  # the whole payload behind the header in every step, its copies included
        return latency_seconds(cluster, n, 0)

    for n in LATENCY_SIZES:
        if halving and n >= halving:
            assert halving_seconds(cluster, n) < whole(n)
    if halving > LATENCY_SIZES[0]:
        below = halving // 2
        assert halving_seconds(cluster, below) >= whole(below)
    reach = topology.latency_reach(small, "auto", halving)
    assert small <= reach <= MAX_LATENCY_REACH_BYTES
    assert topology.agreement_capacity() == max(CREATION_AGREEMENT_BYTES, topology.latency_reach(halving_bytes=halving))

    def agreed(n: int) -> float:
        choice = topology.algorithm(n, small_bytes=0)
        return predict_call(cluster, choice.dims, n, 0, choice.direct)

    def latency(n: int) -> float:
        return halving_seconds(cluster, n) if halving and n >= halving else whole(n)

    # The reach is the last size at which the latency path wins; below it, it takes exactly the sizes it wins at.
    assert all(latency(n) > agreed(n) for n in LATENCY_SIZES if n > reach)
    assert reach == small or latency(reach) <= agreed(reach)
    for n in LATENCY_SIZES:
        wins = n <= reach and latency(n) <= agreed(n)
        assert topology.latency_takes(n, small, "auto", halving) == (n <= small or wins)


# 8 hosts of one rank on a network where the model's latency path and auto's algorithm cross twice below the reach.
CROSSING = Links(None, Link(1.47e-6, 1.0e-9), None, 1e-11, "test")


def test_across_hosts_the_latency_path_takes_only_the_sizes_it_wins() -> None:
    """Where the latency path loses at one size and wins again at a larger one, it takes the sizes it wins at
    (Topology.latency_takes), not every size up to its reach nor only those below the first loss; at or below
    DDLFAST_SMALL_BYTES always, and under another DDLFAST_ALGORITHM nothing more."""
    topology = decide(0, Placement(tuple(range(8)), tuple(map(str, range(8))), (False,) * 8), 1, CROSSING, 64 << 20)
    halving = topology.halving_bytes()
    assert topology.latency_reach(8 << 10, "auto", halving) == 512 << 10
    takes = {n: topology.latency_takes(n, 8 << 10, "auto", halving) for n in (128 << 10, 256 << 10, 512 << 10)}
    assert takes == {128 << 10: True, 256 << 10: False, 512 << 10: True}
    assert not topology.latency_takes((512 << 10) + 4, 8 << 10, "auto", halving)  # past the reach
    assert topology.latency_takes(256 << 10, 256 << 10, "auto", halving)  # DDLFAST_SMALL_BYTES decides
    assert not topology.latency_takes(128 << 10, 8 << 10, "ring", halving)
    assert topology.agreement_capacity() == 512 << 10


def test_emulated_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    """DDLFAST_EMULATED_HOSTS: the placement is that many hosts of consecutive ranks; one that does not divide
    the rank count is refused, naming the variable."""
    from mpi4py import MPI

    from ddlfast.topology.placement import detect_placement

    monkeypatch.setenv("DDLFAST_EMULATED_HOSTS", "1")
    placement = detect_placement(MPI.COMM_SELF)
    assert placement.host_of_rank == (0,) and placement.host_names == ("emulated-host-0",)
    monkeypatch.setenv("DDLFAST_EMULATED_HOSTS", "2")
    with pytest.raises(DdlfastError, match="DDLFAST_EMULATED_HOSTS=2 on rank 0 must divide the 1 ranks"):
        detect_placement(MPI.COMM_SELF)
