"""Multi-host emulation benchmark (root): ddlfast auto vs flat vs comm.Allreduce over shaped links.

    sudo .venv/bin/python -m bench.emulation.run --hosts 2 --ranks-per-host 2 --rate 1gbit --bytes 64MiB --iters 7

Builds the emulated cluster (bench/emulation/netns.py), runs bench/emulation/measure.py across it, prints a
table with the planner's prediction beside each measurement and the host-link bound `2(h-1)/h * S / rate`
(at the nominal tc rate and at the probed rate), then tears everything down.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.emulation.netns import EmulatedCluster, available
from ddlfast.topology.cost_model import parse_rate

MEASURE = Path(__file__).with_name("measure.py")


def format_table(report: dict, nominal_rate: float) -> str:
    topo, nbytes = report["topology"], report["bytes"]
    hosts = topo["hosts"]
    inter = topo["links"]["inter"]
    lines = [f"{hosts} hosts x {topo['ranks_per_host']} ranks, {nbytes / 2**20:.0f} MiB float32; auto picked "
             f"{topo['auto_dims']}; probed links: {json.dumps(topo['links'])}"]
    mpi = report["variants"].get("mpi", {}).get("median_s")
    bound_nominal = 2 * (hosts - 1) / hosts * nbytes / nominal_rate if hosts > 1 else None
    lines.append(f"{'variant':>14} {'dims':>6} {'median s':>9} {'algbw MB/s':>11} {'x mpi':>6} {'predicted s':>12} "
                 f"{'pred/meas':>9} {'x bound':>8} {'rel err':>8}")
    for name, entry in report["variants"].items():
        median_s = entry["median_s"]
        predicted = entry.get("predicted_s")
        error = entry.get("relative_error_vs_mpi")
        lines.append(
            f"{name:>14} {entry.get('dims', '-'):>6} {median_s:9.3f} {nbytes / median_s / 1e6:11.1f} "
            f"{(mpi / median_s if mpi else float('nan')):6.2f} "
            f"{(f'{predicted:.3f}' if predicted else '-'):>12} "
            f"{(f'{predicted / median_s:.2f}' if predicted else '-'):>9} "
            f"{(f'{median_s / bound_nominal:.2f}' if bound_nominal else '-'):>8} "
            f"{(f'{error:.1e}' if error is not None else '-'):>8}"
        )
    if bound_nominal:
        probed = f", {report['link_bound_s']:.3f} s at the probed rate" if report.get("link_bound_s") else ""
        lines.append(f"host-link bound 2(h-1)/h*S/rate: {bound_nominal:.3f} s at {nominal_rate * 8 / 1e9:g} Gbit/s"
                     f"{probed}" + (f" ({1 / inter[1] * 8 / 1e9:.3f} Gbit/s)" if inter else ""))
    if report.get("algorithms"):
        lines.append("algorithms run: " + json.dumps(report["algorithms"]))
    lines.append("per-iteration seconds: " + json.dumps({k: [round(t, 3) for t in v["times_s"]]
                                                          for k, v in report["variants"].items()}))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--ranks-per-host", type=int, default=2)
    parser.add_argument("--placement", choices=("block", "round-robin"), default="block")
    parser.add_argument("--rate", default="1gbit", help="each host's link, tc syntax")
    parser.add_argument("--burst", default="256kb", help="tbf bucket: a few 64 KiB segments")
    parser.add_argument("--queue", default="50ms", help="tbf queue limit, as delay")
    parser.add_argument("--bytes", default="64MiB")
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--variants", default="auto,flat,mpi")
    parser.add_argument("--check", action="store_true", help="also verify every result")
    parser.add_argument("--reduce-scatter", action="store_true", help="time reduce_scatter instead of allreduce")
    parser.add_argument("--data", choices=("integers", "random"), default="integers",
                        help="random: normal floats and each variant's relative error against MPI's fp32 sum")
    parser.add_argument("--json", help="write the raw report here")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    reason = available()
    if reason:
        print(f"bench.emulation.run: {reason}", file=sys.stderr)
        return 2
    program = [sys.executable, str(MEASURE), "--bytes", args.bytes, "--iters", str(args.iters),
               "--variants", args.variants, "--data", args.data, *(["--check"] if args.check else []),
               *(["--reduce-scatter"] if args.reduce_scatter else [])]
    with EmulatedCluster(args.hosts, args.rate, args.burst, args.queue) as cluster:
        if args.placement == "block":
            slots, ranks = [args.ranks_per_host] * args.hosts, None
        else:
            slots, ranks = [1] * args.hosts, args.hosts * args.ranks_per_host
        env = " ".join(f"{k}={v}" for k, v in cluster.environment().items())
        print("$", env, shlex.join(cluster.mpiexec_command(slots, program, ranks)), flush=True)
        result = cluster.run(slots, program, timeout=args.timeout, ranks=ranks)
    if result.returncode != 0:
        print(result.stdout[-4000:], result.stderr[-4000:], sep="\n", file=sys.stderr)
        return result.returncode or 1
    report = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    report["emulation"] = {"rate": args.rate, "burst": args.burst, "queue": args.queue, "placement": args.placement}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(format_table(report, parse_rate(args.rate)))
    return 0 if report["failures"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
