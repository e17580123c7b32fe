"""Sweep one DDLFAST_* variable inside one MPI job, e.g. to choose DDLFAST_CHUNK_BYTES:

    mpiexec -n 4 python bench/sweep.py DDLFAST_CHUNK_BYTES=64KiB,256KiB,512KiB,1MiB,4MiB --sizes 64MiB
    mpiexec -n 4 python bench/sweep.py DDLFAST_SMALL_BYTES=default,0 --sizes 1KiB,4KiB,16KiB,64KiB

ddlfast reads DDLFAST_* per call, so every value runs in the same processes. The values are visited in
--rounds rounds, in a rotated order each round, so slow drift of the machine is spread over all of them; each
visit is one ddlfast.bench.run_bench call (ddlfast alternating with MPI_Allreduce). Per value and size the table
shows the median over all samples of all rounds (each sample: the slowest rank's time), the spread of the
per-round medians, and MPI's median measured beside it. "default" unsets the variable.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from statistics import median

from mpi4py import MPI

from ddlfast.bench import format_bytes, header_lines, parse_dims_list, parse_sizes, run_bench


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("assignment", help="VARIABLE=value1,value2,... ('default' unsets it)")
    parser.add_argument("--sizes", default="64MiB")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--dims", default="flat")
    parser.add_argument("--iters", type=int, default=None, help="per visit (default: the bench's auto count)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    name, _, values_text = args.assignment.partition("=")
    values = [v.strip() for v in values_text.split(",") if v.strip()]
    if not name.startswith("DDLFAST_") or not values:
        parser.error("give VARIABLE=value1,value2,... with a DDLFAST_* variable")
    sizes = parse_sizes(args.sizes)
    dims = parse_dims_list(args.dims, comm.Get_size())
    saved = os.environ.get(name)
    pooled: dict[tuple[str, str, int], dict[str, list[float]]] = {}
    try:
        for round_index in range(args.rounds):
            shift = round_index % len(values)
            for value in values[shift:] + values[:shift]:
                if value == "default":
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
                rows = run_bench(sizes, args.dtype, dims, args.iters, args.warmup, "sum", False, comm=comm)
                for row in rows:
                    entry = pooled.setdefault((value, row["dims"], row["size_bytes"]),
                                              {"ours": [], "theirs": [], "round_medians": [], "path": []})
                    entry["ours"] += row["ddlfast"]["samples_us"]
                    entry["theirs"] += row["mpi"]["samples_us"]
                    entry["round_medians"].append(row["ddlfast"]["median_us"])
                    entry["path"].append(row["path"])
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved
    if comm.Get_rank() == 0:
        lines = [line for line in header_lines([], comm.Get_size()) if not line.startswith("# settings")]
        lines.append(f"# sweep {name} over {', '.join(values)}: {args.rounds} rounds, rotated order; "
                     "time = median of all samples (us), spread = min..max of per-round medians")
        lines.append(f"# {name:>22} {'size':>7} {'dims':>5} {'path':>11} {'samples':>7} {'ddlfast(us)':>11} "
                     f"{'spread':>17} {'MPI(us)':>10} {'MPI/ddlfast':>11}")
        for (value, dim, nbytes), entry in pooled.items():
            ours, theirs = median(entry["ours"]), median(entry["theirs"])
            spread = f"{min(entry['round_medians']):.1f}..{max(entry['round_medians']):.1f}"
            lines.append(f"  {value:>22} {format_bytes(nbytes):>7} {dim:>5} {entry['path'][0]:>11} "
                         f"{len(entry['ours']):>7} {ours:>11.1f} {spread:>17} {theirs:>10.1f} {theirs / ours:>11.2f}")
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
