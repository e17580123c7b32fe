"""The overlap bench (bench/overlap_torch.py) across emulated hosts with a shaped link (root).

On one 2-core machine, communication is CPU work (shared-memory copies and reductions) competing with the
compute threads, so nothing can be hidden. Across hosts the wire is a separate resource: this shows how much
of it ddlfast's gradient hooks hide behind backward.

    .venv/bin/python -m bench.emulation.overlap --hosts 2 --rate 1gbit --batch 512 --steps 7
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.emulation.netns import INTERFACE, EmulatedCluster, available

OVERLAP = Path(__file__).resolve().parents[1] / "overlap_torch.py"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--rate", default="1gbit", help="each host's link, tc syntax")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--bucket-mib", type=float, default=8)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    reason = available()
    if reason:
        print(f"bench.emulation.overlap: {reason}", file=sys.stderr)
        return 2
    program = [sys.executable, str(OVERLAP), "--batch", str(args.batch), "--steps", str(args.steps),
               "--bucket-mib", str(args.bucket_mib)]
    with EmulatedCluster(args.hosts, args.rate) as cluster:
        # gloo (DDP's set-up) needs rank 0's address and its interface: host names there do not resolve.
        result = cluster.run([1] * args.hosts, program, timeout=args.timeout,
                             env={"MASTER_ADDR": cluster.host_address(0), "GLOO_SOCKET_IFNAME": INTERFACE})
    print(f"{args.hosts} hosts x 1 rank, links {args.rate}:")
    print(result.stdout, end="")
    if result.returncode != 0:
        print(result.stderr[-4000:], file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
