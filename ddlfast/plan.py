"""`python -m ddlfast.plan`: the cost model's predicted allreduce time of every ring shape (docs/topology.md,
ddlfast/topology/cost_model.py) and its pick.

Two ways to run it:

    python -m ddlfast.plan --hosts 64 --ranks-per-host 4 --intra 40GB/s,2us --inter 100Gbit/s,5us \\
        --bytes 102000000 --compute-ms 200            # a described cluster, nothing is run
    mpiexec -n 8 python -m ddlfast.plan --bytes 64MiB   # this job: detected placement, probed links
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ddlfast.api import topology
from ddlfast.config import MAX_RING_DIMS, format_size
from ddlfast.topology.cost_model import (
    MAX_DIMS,
    SMPI_FACTORS,
    Cluster,
    MessageFactors,
    PlanError,
    auto_latency_plan,
    auto_latency_takes,
    choose_algorithm,
    format_rate,
    halves,
    latency_seconds,
    link_bound,
    parse_bytes,
    parse_link,
    parse_rate,
    plan,
    predict,
    predict_call,
    step_efficiency,
)
from ddlfast.topology.placement import SHOWN_SIZES

# The cost model's direct reduce-scatter is quadratic in a dimension's size: a prime rank count (a flat ring) of
# 16381 ranks plans in about 2 s, of 32749 in 18 s, of 1000003 not within minutes.
MAX_PLAN_RANKS = 16384
MAX_COMPUTE_MS = 1e9  # about 11 days a step: beyond any training step, and finite


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ddlfast.plan",
        description="Predict allreduce time for every ring shape (the cost model of docs/topology.md). With "
                    "--hosts: a described cluster; without: this MPI job's detected placement and probed links.",
    )
    parser.add_argument("--hosts", type=int, help="describe a cluster of this many hosts (else: measure this job)")
    parser.add_argument("--ranks-per-host", type=int, default=1)
    parser.add_argument("--hosts-per-group", type=int, default=1, help="hosts per rack (a third tier)")
    parser.add_argument("--intra", default="10GB/s,1us", help="link inside a host: rate,latency")
    parser.add_argument("--inter", default="10Gbit/s,20us", help="each host's network link: rate,latency")
    parser.add_argument("--group", help="each group's uplink, shared by its hosts: rate,latency")
    parser.add_argument("--reduce-rate", default="100GB/s",
                        help="bytes reduced per second, 1/gamma (GPU-class default; one CPU core does ~5GB/s)")
    parser.add_argument("--bytes", default="64MiB", help="allreduce size, e.g. 64MiB or 102000000 (gradients of a "
                        "step; KB/MB are binary, as everywhere in ddlfast)")
    parser.add_argument("--compute-ms", type=float, default=0.0, help="compute per step, for scaling efficiency")
    parser.add_argument("--overlap", type=float, default=0.0,
                        help="fraction of compute that communication can hide behind (0: none, 1: all of backward)")
    parser.add_argument("--smpi-factors", action="store_true",
                        help="scale each message's latency and rate by its size as SimGrid SMPI's network model does "
                             "(the factors python -m ddlfast.simulate gives the planner; docs/scale.md)")
    parser.add_argument("--max-dims", type=int, default=MAX_DIMS, help="longest shape considered")
    parser.add_argument("--top", type=int, default=12, help="rows listed (fastest first; flat and the pick always)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def described_cluster(args: argparse.Namespace) -> Cluster:
    return Cluster(
        hosts=args.hosts, ranks_per_host=args.ranks_per_host, intra=parse_link(args.intra),
        inter=parse_link(args.inter), gamma=1 / parse_rate(args.reduce_rate), hosts_per_group=args.hosts_per_group,
        group=parse_link(args.group) if args.group else None,
        factors=SMPI_FACTORS if args.smpi_factors else MessageFactors(),
    )


def report(cluster: Cluster, nbytes: float, compute_s: float, overlap: float, max_dims: int) -> dict:
    """Everything the CLI prints, as data."""
    pick, everything = plan(cluster, nbytes, max_dims)
    flat = predict(cluster, (cluster.ranks,), nbytes)
    halving = auto_latency_plan(cluster, pick.dims)[0]
    takes = auto_latency_takes(cluster, pick.dims)

    def algorithm(n: int) -> tuple[str, float]:
        if takes(n):  # the latency path, inside the per-call agreement's messages
            form = "halving" if halves(n, halving) else "whole payload"
            return f"latency path ({form})", latency_seconds(cluster, n, halving)
        choice = choose_algorithm(cluster, pick.dims, n)
        return str(choice), predict_call(cluster, choice.dims, n, 0, choice.direct)  # the agreement, then it

    by_size = [(n, *algorithm(n)) for n in sorted({*SHOWN_SIZES, int(nbytes)})]
    return {
        "cluster": {
            "hosts": cluster.hosts, "ranks_per_host": cluster.ranks_per_host, "ranks": cluster.ranks,
            "hosts_per_group": cluster.hosts_per_group, "intra": str(cluster.intra), "inter": str(cluster.inter),
            "group": str(cluster.group) if cluster.group else None, "reduce_rate": format_rate(1 / cluster.gamma),
        },
        "bytes": nbytes,
        "candidates": [
            {"dims": p.name, "seconds": p.seconds, "per_dim_seconds": list(p.per_dim),
             "busbw_GBps": _busbw(cluster.ranks, nbytes, p.seconds) / 1e9}
            for p in everything
        ],
        "pick": pick.name,
        "pick_seconds": pick.seconds,
        "flat_seconds": flat.seconds,
        "speedup_vs_flat": flat.seconds / pick.seconds if pick.seconds else 1.0,
        "link_bound_seconds": link_bound(cluster, nbytes) if cluster.hosts > 1 else None,
        "compute_seconds": compute_s,
        "overlap": overlap,
        "scaling_efficiency": step_efficiency(compute_s, pick.seconds, overlap) if compute_s > 0 else None,
        # DDLFAST_ALGORITHM=auto per call size on the pick's dims (uncompressed): the latency path within its
        # reach where it wins (cost_model.auto_latency_takes), else the cost model's algorithm
        "algorithms": [{"bytes": n, "algorithm": name, "seconds": seconds} for n, name, seconds in by_size],
    }


def _busbw(ranks: int, nbytes: float, seconds: float) -> float:
    return nbytes / seconds * 2 * (ranks - 1) / ranks if seconds > 0 else 0.0


def format_report(data: dict, top: int) -> str:
    c = data["cluster"]
    lines = [
        f"cluster: {c['hosts']} hosts x {c['ranks_per_host']} ranks = {c['ranks']} ranks"
        + (f", {c['hosts_per_group']} hosts per group (uplink {c['group']})" if c["hosts_per_group"] > 1 else ""),
        f"links:   intra {c['intra'] if c['ranks_per_host'] > 1 else 'n/a'} | "
        f"inter {c['inter'] if c['hosts'] > 1 else 'n/a (one host)'} | reduce {c['reduce_rate']}",
        f"size:    {data['bytes'] / 1e6:.1f} MB",
        "",
        f"{'dims':>14} {'predicted ms':>13} {'busbw GB/s':>11}  note",
    ]
    rows = data["candidates"]
    shown = [r for i, r in enumerate(rows) if i < top or r["dims"] in (data["pick"], str(c["ranks"]))]
    for row in shown:
        notes = []
        if row["dims"] == data["pick"]:
            notes.append("<- pick (auto)")
        if row["dims"] == str(c["ranks"]):
            notes.append("flat")
        lines.append(f"{row['dims']:>14} {row['seconds'] * 1e3:13.3f} {row['busbw_GBps']:11.2f}  {' '.join(notes)}")
    if len(rows) > len(shown):
        lines.append(f"{'':>14} ... {len(rows) - len(shown)} more (--top)")
    lines += ["", f"pick: {data['pick']}  {data['pick_seconds'] * 1e3:.3f} ms, "
                  f"{data['speedup_vs_flat']:.2f}x the flat ring ({data['flat_seconds'] * 1e3:.3f} ms)"]
    if data["link_bound_seconds"]:
        lines.append(f"host-link bound 2(h-1)/h*S/rate: {data['link_bound_seconds'] * 1e3:.3f} ms "
                     f"(pick = {data['pick_seconds'] / data['link_bound_seconds']:.2f}x the bound)")
    lines += ["", f"algorithm per call size (DDLFAST_ALGORITHM=auto on {data['pick']}; ms of the whole call, its "
                  "per-call agreement included, which the latency path carries in its own messages; "
                  "DDLFAST_ALGORITHM=mpi: MPI's allreduce at every size):"]
    for row in data["algorithms"]:
        lines.append(f"{format_size(row['bytes']):>14} {row['seconds'] * 1e3:13.3f}  {row['algorithm']}")
    if data["scaling_efficiency"] is not None:
        lines.append(f"scaling efficiency with {data['compute_seconds'] * 1e3:.0f} ms compute per step, "
                     f"{data['overlap']:.0%} overlap: {data['scaling_efficiency']:.1%}")
    return "\n".join(lines)


def measured_cluster() -> tuple[Cluster | None, object]:
    """This MPI job's placement and probed links (collective: run on every rank)."""
    info = topology(probe_every_tier=True)
    return info.cluster, info


def check_arguments(args: argparse.Namespace) -> None:
    """Every number within what the planner predicts in seconds, before any prediction. Raises PlanError."""
    if args.hosts is not None:
        ranks_per_host = max(args.ranks_per_host, 1)  # below 1: Cluster names it
        if args.hosts > MAX_PLAN_RANKS // ranks_per_host:
            raise PlanError(f"--hosts {args.hosts} x --ranks-per-host {args.ranks_per_host}: the planner describes "
                            f"at most {MAX_PLAN_RANKS} ranks")
    if not 1 <= args.max_dims <= MAX_RING_DIMS:
        raise PlanError(f"--max-dims {args.max_dims}: give 1 to {MAX_RING_DIMS} (the engine's most dimensions)")
    if not 0 <= args.compute_ms <= MAX_COMPUTE_MS:
        raise PlanError(f"--compute-ms {args.compute_ms}: give 0 to {MAX_COMPUTE_MS:g} ms")
    if not 0 <= args.overlap <= 1:
        raise PlanError(f"--overlap {args.overlap}: give a fraction from 0 to 1")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        check_arguments(args)
        nbytes = parse_bytes(args.bytes)
        if args.hosts is not None:
            cluster, info, is_root = described_cluster(args), None, True
        else:
            cluster, info = measured_cluster()
            is_root = info.rank == 0
    except PlanError as error:
        print(f"ddlfast.plan: {error}", file=sys.stderr)
        return 2
    if not is_root:
        return 0
    if cluster is None:
        print(f"placement is irregular ({info.describe()}): auto uses a flat ring; nothing to plan")
        return 0
    data = report(cluster, nbytes, args.compute_ms / 1e3, args.overlap, args.max_dims)
    if info is not None:
        data["measured"] = info.as_dict()
    print(json.dumps(data, indent=1, allow_nan=False) if args.json else format_report(data, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
