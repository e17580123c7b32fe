"""A longer soak than CI's, by hand: many fused_allreduce calls over bigger arrays
under mpiexec, with a report of resident memory per rank and throughput.

    .venv/bin/python bench/soak.py                                 # 4 ranks, 10,000 calls, ~7.5 MB per call
    .venv/bin/python bench/soak.py --ranks 8 --iterations 50000 --preset ci
    .venv/bin/python bench/soak.py --json soak.json                # also write the figures as JSON

It runs tests/mpi/programs/soak.py (see there: exact results checked on every
call, every 10th call asynchronous, RSS sampled every --sample-every calls from
the end of the warm-up) and prints per rank the RSS at the end of the warm-up,
at the end, its peak and growth, and the RSS curve; plus calls/s and the bytes
reduced per second. Exits non-zero on wrong results or when any rank's RSS grew
by 1% or more (the issue's target) after the warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "tests" / "mpi" / "programs" / "soak.py"
RANK_LINE = re.compile(r"^SOAK rank (\d+) rss_kib warm=(\d+) end=(\d+) max=(\d+) growth_kib=(-?\d+) "
                       r"growth_pct=(-?[\d.]+) objects warm=(\d+) end=(\d+) wrong=(\d+)$", re.MULTILINE)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=10_000)
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--preset", choices=["bench", "ci"], default="bench")
    parser.add_argument("--sample-every", type=int, default=1000)
    parser.add_argument("--async-every", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    beside = Path(sys.executable).parent / "mpiexec"
    command = [str(beside) if beside.exists() else "mpiexec", "-n", str(args.ranks), sys.executable, str(PROGRAM),
               "--iterations", str(args.iterations), "--warmup", str(args.warmup), "--preset", args.preset,
               "--sample-every", str(args.sample_every), "--async-every", str(args.async_every)]
    print("running:", " ".join(command), flush=True)
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    wall = time.perf_counter() - start
    output = result.stdout
    done = re.search(r"^SOAK done: (\d+) iterations in ([\d.]+) s on \d+ ranks, preset \w+, (\d+) bytes in (\d+) "
                     r"arrays per call, (\d+) calls/s after warm-up, (\d+) failures$", output, re.MULTILINE)
    if result.returncode != 0 or not done:
        print(output[-6000:], result.stderr[-6000:], sep="\n")
        print(f"soak FAILED (mpiexec exited {result.returncode})")
        return 1
    bytes_per_call, calls_per_s = int(done.group(3)), int(done.group(5))
    print(f"\n{args.iterations} fused_allreduce calls on {args.ranks} ranks ({done.group(4)} arrays, "
          f"{bytes_per_call / 1e6:.2f} MB per call) in {float(done.group(2)):.1f} s ({wall:.1f} s with start-up)")
    print(f"after warm-up: {calls_per_s} calls/s, {calls_per_s * bytes_per_call / 1e9:.3f} GB/s reduced per rank")
    print(f"\n{'rank':>4} {'RSS warm MiB':>13} {'RSS end MiB':>12} {'peak MiB':>9} {'growth KiB':>11} {'growth':>8} "
          f"{'py objects':>16}")
    ranks = []
    for match in RANK_LINE.finditer(output):
        rank, warm, end, peak, growth, pct, objects_warm, objects_end, wrong = match.groups()
        samples = re.search(rf"^SOAK rank {rank} samples (.*)$", output, re.MULTILINE).group(1).split()
        ranks.append({"rank": int(rank), "rss_warm_kib": int(warm), "rss_end_kib": int(end), "rss_peak_kib": int(peak),
                      "growth_kib": int(growth), "growth_pct": float(pct), "objects_warm": int(objects_warm),
                      "objects_end": int(objects_end), "wrong": int(wrong),
                      "rss_samples_kib": {int(i): int(s) for i, s in (pair.split(":") for pair in samples)}})
        print(f"{rank:>4} {int(warm) / 1024:>13.1f} {int(end) / 1024:>12.1f} {int(peak) / 1024:>9.1f} "
              f"{int(growth):>+11d} {float(pct):>+7.3f}% {objects_warm:>7} -> {objects_end:<6}")
    print("\nRSS curve (KiB), iteration: " + "  ".join(
        f"{i}:{'/'.join(str(r['rss_samples_kib'][i]) for r in ranks)}" for i in ranks[0]["rss_samples_kib"]))
    worst = max(r["growth_pct"] for r in ranks)
    verdict = "PASS" if worst < 1.0 else "FAIL"
    print(f"\n{verdict}: worst RSS growth after warm-up {worst:+.3f}% (target < 1%), wrong results: "
          f"{sum(r['wrong'] for r in ranks)}")
    if args.json:
        args.json.write_text(json.dumps({
            "ranks": args.ranks, "iterations": args.iterations, "warmup": args.warmup, "preset": args.preset,
            "bytes_per_call": bytes_per_call, "calls_per_s": calls_per_s, "seconds": float(done.group(2)),
            "per_rank": ranks}, indent=1))
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
