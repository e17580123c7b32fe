"""The planner's cost model against docs/topology.md's formulas, its parsing, its choice rule and its CLI."""

from __future__ import annotations

import json

import pytest

from ddlfast import config, plan
from ddlfast.topology import cost_model
from ddlfast.topology.cost_model import Cluster, Link, PlanError, Prediction, predict

S = 64 * 2**20


@pytest.mark.parametrize(
    ("text", "value"),
    [("102MB", 102 * 2**20), ("64MiB", 64 * 2**20), ("64M", 64 * 2**20), ("4096", 4096), ("8KiB", 8192)],
)
def test_parse_bytes(text: str, value: int) -> None:
    """One size parser: plan --bytes reads sizes as --sizes and DDLFAST_*_BYTES do (config.parse_size)."""
    assert cost_model.parse_bytes(text) == value == config.parse_size(text, "x")


@pytest.mark.parametrize(
    ("text", "value"),
    [("40GB/s", 40e9), ("100Gbit/s", 12.5e9), ("1gbit", 125e6), ("10Gb/s", 1.25e9), ("25Gbps", 3.125e9)],
)
def test_parse_rate(text: str, value: float) -> None:
    assert cost_model.parse_rate(text) == pytest.approx(value)


def test_parse_link_either_order_and_errors() -> None:
    link = cost_model.parse_link("100Gbit/s,5us")
    assert link == cost_model.parse_link("5us,100Gbit/s")
    assert (link.alpha, link.beta) == (pytest.approx(5e-6), pytest.approx(1 / 12.5e9))
    for bad in ("100Gbit/s", "5us,2us", "fast,5us", ""):
        with pytest.raises(PlanError):
            cost_model.parse_link(bad)
    with pytest.raises(PlanError):
        cost_model.parse_bytes("12 parsecs")


def _one_tier(p: int, alpha: float, beta: float, gamma: float) -> Cluster:
    link = Link(alpha, beta)
    return Cluster(hosts=1, ranks_per_host=p, intra=link, inter=link, gamma=gamma)


@pytest.mark.parametrize("p", [2, 3, 8, 12])
def test_flat_ring_is_designs_formula(p: int) -> None:
    a, b, g = 3e-6, 1e-9, 2e-10
    expected = 2 * (p - 1) * a + 2 * (p - 1) / p * S * b + (p - 1) / p * S * g
    assert predict(_one_tier(p, a, b, g), (p,), S).seconds == pytest.approx(expected)


@pytest.mark.parametrize("dims", [(2, 2, 2), (4, 2), (3, 4), (2, 3, 2)])
def test_k_dim_ring_is_designs_formula_with_equal_links(dims: tuple[int, ...]) -> None:
    a, b, g = 3e-6, 1e-9, 2e-10
    p = 1
    for d in dims:
        p *= d
    expected, before = 0.0, 1
    for d in dims:
        before *= d
        expected += 2 * (d - 1) * a + 2 * (d - 1) / before * S * b + (d - 1) / before * S * g
    assert predict(_one_tier(p, a, b, g), dims, S).seconds == pytest.approx(expected)


def test_slow_shared_host_link_two_hosts_by_four() -> None:
    """docs/topology.md: over the slow link the 2D ring moves S bytes per host, a flat ring 1.75 S."""
    beta = 1 / 125e6
    cluster = Cluster(hosts=2, ranks_per_host=4, intra=Link(0.0, 0.0), inter=Link(0.0, beta), gamma=0.0)
    assert predict(cluster, (8,), S).seconds == pytest.approx(1.75 * S * beta)
    assert predict(cluster, (4, 2), S).seconds == pytest.approx(1.0 * S * beta)
    assert cost_model.link_bound(cluster, S) == pytest.approx(S * beta)
    assert cost_model.plan(cluster, S)[0].dims in {(4, 2), (2, 2, 2)}


def test_group_uplink_favours_the_rack_dimension() -> None:
    fast, slow = Link(1e-6, 1 / 12.5e9), Link(10e-6, 1 / 1.25e9)
    cluster = Cluster(hosts=8, ranks_per_host=2, intra=Link(1e-6, 1e-11), inter=fast, hosts_per_group=4, group=slow)
    pick, _ = cost_model.plan(cluster, S)
    # the last dimension crosses racks (2 groups), and nothing before it does
    assert pick.dims[-1] == 2 and predict(cluster, pick.dims, S).seconds < predict(cluster, (16,), S).seconds


def test_factorizations() -> None:
    assert cost_model.factorizations(1, 3) == [()]
    assert sorted(cost_model.factorizations(8, 3)) == [(2, 2, 2), (2, 4), (4, 2), (8,)]
    assert cost_model.all_shapes(1) == [(1,)]
    assert (7,) in cost_model.all_shapes(7) and len(cost_model.all_shapes(7)) == 1


def test_choose_prefers_fewer_dims_on_a_near_tie() -> None:
    near = [Prediction((2, 2), 1.000), Prediction((4,), 1.01), Prediction((8,), 2.0)]
    assert cost_model.choose(near).dims == (4,)
    assert cost_model.choose([Prediction((2, 2), 1.0), Prediction((4,), 1.5)]).dims == (2, 2)


def test_one_host_auto_is_flat() -> None:
    cluster = Cluster(hosts=1, ranks_per_host=8)
    assert cost_model.plan(cluster, S)[0].dims == (8,)


def test_many_hosts_pick_a_multi_dimensional_ring() -> None:
    cluster = Cluster(hosts=1024, ranks_per_host=4, intra=cost_model.parse_link("40GB/s,2us"),
                      inter=cost_model.parse_link("100Gbit/s,5us"), gamma=1 / 100e9)
    pick, _ = cost_model.plan(cluster, 102e6)
    flat = predict(cluster, (4096,), 102e6)
    assert len(pick.dims) >= 2 and flat.seconds / pick.seconds > 2


def test_step_efficiency() -> None:
    assert cost_model.step_efficiency(0.2, 0.02) == pytest.approx(0.2 / 0.22)
    assert cost_model.step_efficiency(0.2, 0.02, overlap=0.5) == 1.0
    assert cost_model.step_efficiency(0.0, 0.02) == 0.0


def test_predict_rejects_wrong_product() -> None:
    with pytest.raises(PlanError, match="multiply"):
        predict(Cluster(hosts=2, ranks_per_host=2), (3,), S)
    with pytest.raises(PlanError, match="does not divide"):
        Cluster(hosts=4, ranks_per_host=1, hosts_per_group=3)


def test_cli_described_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--hosts", "64", "--ranks-per-host", "4", "--intra", "40GB/s,2us", "--inter", "100Gbit/s,5us",
            "--bytes", "102MB", "--compute-ms", "200"]
    assert plan.main(argv) == 0
    out = capsys.readouterr().out
    assert "<- pick (auto)" in out and "scaling efficiency" in out and "host-link bound" in out
    assert plan.main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cluster"]["ranks"] == 256 and 0.5 < data["scaling_efficiency"] < 1
    assert data["pick"] in {c["dims"] for c in data["candidates"]}


def test_cli_bad_quantity(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan.main(["--hosts", "2", "--inter", "fast,5us"]) == 2
    assert "cannot read 'fast'" in capsys.readouterr().err


# ---------------------------------------------------------------- the algorithm per call size


def test_direct_reduce_scatter_costs_one_latency_step_and_the_rings_bytes() -> None:
    a, b, g = 3e-6, 1e-9, 2e-10
    for p in (3, 5, 8):
        ring = predict(_one_tier(p, a, b, g), (p,), S).seconds
        direct = predict(_one_tier(p, a, b, g), (p,), S, (1,)).seconds
        assert direct == pytest.approx(ring - (p - 2) * a)


def test_direct_across_a_shared_host_link_pays_every_block_that_leaves_the_host() -> None:
    """A flat direct step over 2 hosts x 4 sends 16 blocks over each host's link, the ring 1 per step."""
    slow = Link(50e-6, 1 / 125e6)
    cluster = Cluster(hosts=2, ranks_per_host=4, inter=slow)
    assert predict(cluster, (8,), S, (1,)).seconds > predict(cluster, (8,), S).seconds


@pytest.mark.parametrize("p", [3, 5, 6, 7])
def test_auto_takes_direct_where_latency_dominates_and_the_ring_for_large_sizes(p: int) -> None:
    cluster = Cluster(hosts=1, ranks_per_host=p)
    medium = cost_model.choose_algorithm(cluster, (p,), 16 << 10)
    assert medium.name == "direct" and medium.direct == (1,), str(medium)
    assert medium.seconds < predict(cluster, (p,), 16 << 10).seconds
    large = cost_model.choose_algorithm(cluster, (p,), 64 << 20)
    assert (large.name, large.dims, large.direct) == ("ring", (p,), ()), "a saving under the tie fraction"


def test_auto_takes_all_two_dims_only_where_the_shape_may_change() -> None:
    cluster = Cluster(hosts=1, ranks_per_host=8)
    assert cost_model.choose_algorithm(cluster, (8,), 16 << 10).dims == (2, 2, 2)
    kept = cost_model.choose_algorithm(cluster, (8,), 16 << 10, reshape=False)
    assert kept.dims == (8,)
    compressed = cost_model.choose_algorithm(cluster, (8,), 16 << 10, compressed=(True,))
    assert compressed.dims == (8,)


def test_compressed_dimension_takes_direct_unless_five_percent_slower() -> None:
    cluster = Cluster(hosts=3, ranks_per_host=4)
    plain = cost_model.choose_algorithm(cluster, (4, 3), 64 << 20)
    wire = cost_model.choose_algorithm(cluster, (4, 3), 64 << 20, compressed=(False, True))
    assert plain.direct == () and wire.direct == (0, 1), (str(plain), str(wire))


def test_forced_algorithms_and_their_refusals() -> None:
    cluster = Cluster(hosts=1, ranks_per_host=6)
    assert cost_model.choose_algorithm(cluster, (3, 2), 1 << 20, "direct").direct == (1, 1)
    assert cost_model.choose_algorithm(cluster, (6,), 1 << 20, "ring") == cost_model.Algorithm("ring", (6,))
    assert cost_model.choose_algorithm(Cluster(1, 8), (8,), 1 << 20, "rabenseifner").dims == (2, 2, 2)
    with pytest.raises(PlanError, match="power-of-two"):
        cost_model.choose_algorithm(cluster, (6,), 1 << 20, "rabenseifner")
    assert cost_model.choose_algorithm(None, (6,), 1 << 20).name == "ring"  # an irregular placement
    assert cost_model.choose_algorithm(Cluster(1, 1), (1,), 1 << 20, "rabenseifner").dims == (1,)  # one rank


def test_algorithm_names_read_as_the_plan_prints_them() -> None:
    assert str(cost_model.Algorithm("direct", (4, 2), (1, 0))) == "ring 4x2, direct reduce-scatter in dim 1"
    assert str(cost_model.Algorithm("direct", (5,), (1,))) == "direct 5"
    assert str(cost_model.Algorithm("rabenseifner", (2, 2))) == "rabenseifner 2x2"
