"""The scale study of docs/scale.md: runs ddlfast.simulate over platforms and rank counts and writes the tables
(Markdown), the raw JSON and, where matplotlib is installed, the plots to out/scale/.

    nice -n 10 .venv/bin/python bench/simulation/study.py sweep --platform fattree-8gpu --ranks 16,64,256,1024 --docs
    nice -n 10 .venv/bin/python bench/simulation/study.py resnet50 --ranks 8,16,32,64,128,256
    nice -n 10 .venv/bin/python bench/simulation/study.py planner --platform ddl-64x4,ethernet-10g --ranks 16,32
    # one size per process, side by side, then the rank count's sweep from them:
    python -m ddlfast.simulate --platform fattree-8gpu --ranks 1024 --sizes 4KiB --warmup 0 --iters 1 --json > 4k.json
    .venv/bin/python bench/simulation/study.py join --platform fattree-8gpu --ranks 1024 --builtins ... 4k.json ...

Each simulation is one process on one core; where cores are free, run rank counts (or sizes, then `join`) side by
side.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from resnet50_shapes import resnet50_shapes  # noqa: E402

from ddlfast import simulate  # noqa: E402
from ddlfast.config import DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES  # noqa: E402
from ddlfast.fusion.bucketing import assign_buckets  # noqa: E402
from ddlfast.topology.cost_model import link_bound, step_efficiency  # noqa: E402

OUT = Path("out/scale")
# PowerAI DDL's ResNet-50: 90 epochs of ImageNet-1k (1.28M images) in 50 minutes on 256 P100 = 150 images/s per
# GPU; at 32 images per GPU a step is 0.213 s, of which 95 % (their efficiency) is compute: 0.2 s.
DDL_COMPUTE_S = 0.2
DDL_EFFICIENCY = 0.95


def _write(name: str, text: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / name).write_text(text)
    print(text)


def sweep(platform_name: str, ranks_list: list[int], sizes: list[int], builtins: list[str],
          docs: Path | None = None, kept_only: bool = False) -> None:
    """ddlfast's automatic choice beside every built-in at each rank count. Each rank count's result is kept in
    out/scale/sweep-PLATFORM-RANKS.json and reused when its sizes and built-ins match (a sweep interrupted or
    run one rank count at a time resumes); the table and the plots cover every rank count asked."""
    platform = simulate.load_platform(platform_name)
    results = []
    for ranks in ranks_list:
        path = OUT / f"sweep-{platform_name}-{ranks}.json"
        kept = json.loads(path.read_text()) if path.is_file() else None
        if kept and (kept_only or [r["size_bytes"] for r in kept["rows"]] == sizes
                     and kept.get("builtins") == builtins):
            data = kept  # with --kept-only, whatever sizes it has
        elif kept_only:
            print(f"{path}: not there; --kept-only leaves {ranks} ranks out")
            continue
        else:
            # One timed call, no warm-up: the simulation is deterministic and nothing is created lazily, so
            # both give the same simulated time (docs/scale.md), and this halves the work at 1024 ranks.
            data = simulate.simulate(platform, ranks, sizes, builtins=builtins, iters=1, warmup=0) | {
                "builtins": builtins}
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(data, indent=1))
        results.append(data)
        print(simulate.format_report(data), flush=True)
    lines = ["| ranks | size | auto's algorithm | ddlfast ms | busbw GB/s | planner ms | planner/sim | best built-in "
             "| its ms | ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for data in results:
        for row in data["rows"]:
            ours = row["ddlfast_s"]
            ratio = f"{row['ratio']:.2f}" if row["ratio"] else "-"
            best = (f"{row['best_builtin']} | {row['best_builtin_s'] * 1e3:.3f} | {ratio}"
                    if row["best_builtin"] else "not run | - | -")
            planned = row["planner_s"] * 1e3
            simulated = (f"{ours * 1e3:.3f} | {row['ddlfast_busbw_GBps']:.2f} | {planned:.3f} | "
                         f"{row['planner_s'] / ours:.2f}" if ours else f"not run | - | {planned:.3f} | -")
            lines.append(f"| {data['ranks']} | {simulate._size_text(row['size_bytes'])} | {row['algorithm']} | "
                         f"{simulated} | {best} |")
        if data["agreement_s"] is not None:
            lines.append(f"| {data['ranks']} | agreement alone | | {data['agreement_s'] * 1e3:.3f} | | | | | | |")
    _write(f"sweep-{platform_name}.md", "\n".join(lines) + "\n")
    _plot(platform_name, results, docs or OUT)


def join(platform_name: str, ranks: int, builtins: list[str], files: list[Path]) -> None:
    """One rank count's sweep from `python -m ddlfast.simulate --json` runs of one size each (run side by side,
    one process per size, where a single sweep would take too long): written where `sweep` finds and reuses it."""
    parts = [json.loads(path.read_text()) for path in files]
    if any(part["platform"] != platform_name or part["ranks"] != ranks for part in parts):
        raise SystemExit(f"join: every file must be a {platform_name} run at {ranks} ranks")
    data = simulate.join_reports(parts) | {"builtins": builtins}
    path = OUT / f"sweep-{platform_name}-{ranks}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    print(simulate.format_report(data))
    print(f"{path}: {len(data['rows'])} sizes")


def _plot(platform_name: str, results: list[dict], folder: Path) -> None:
    """FOLDER/scale-PLATFORM.png: busbw against size per rank count (ddlfast solid, the best built-in dashed),
    ddlfast's time against the best built-in's, and the scaling efficiency: busbw at P ranks over busbw at the
    fewest ranks swept, per size."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    figure, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, data in enumerate(results):
        color, rows = colors[index % len(colors)], [r for r in data["rows"] if r["ddlfast_s"]]
        axes[0].plot([r["size_bytes"] for r in rows], [r["ddlfast_busbw_GBps"] for r in rows], marker="o",
                     color=color, label=f"ddlfast, {data['ranks']} ranks")
        compared = [r for r in rows if r["ratio"]]
        if compared:
            axes[0].plot([r["size_bytes"] for r in compared],
                         [simulate.busbw("allreduce", data["ranks"], r["size_bytes"], r["best_builtin_s"]) / 1e9
                          for r in compared], marker="x", linestyle="--", color=color,
                         label=f"best built-in, {data['ranks']} ranks")
            axes[1].plot([r["size_bytes"] for r in compared], [r["ratio"] for r in compared], marker="o",
                         color=color, label=f"{data['ranks']} ranks")
    base = results[0]
    for row in (r for r in base["rows"] if r["ddlfast_s"]):
        points = [(data["ranks"], other["ddlfast_busbw_GBps"] / row["ddlfast_busbw_GBps"])
                  for data in results for other in data["rows"]
                  if other["size_bytes"] == row["size_bytes"] and other["ddlfast_s"]]
        axes[2].plot([p[0] for p in points], [p[1] for p in points], marker="o",
                     label=simulate._size_text(row["size_bytes"]))
    for axis, label in ((axes[0], "busbw (GB/s)"), (axes[1], "best built-in time / ddlfast time")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("bytes per allreduce")
        axis.set_ylabel(label)
        axis.legend(fontsize=7)
    axes[0].set_yscale("log")
    axes[1].axhline(1.0, color="grey", linewidth=0.8)
    axes[1].axhline(0.95, color="red", linewidth=0.8, linestyle=":")
    axes[2].set_xscale("log", base=2)
    axes[2].set_xlabel("ranks")
    axes[2].set_ylabel(f"ddlfast busbw / busbw at {base['ranks']} ranks")
    axes[2].legend(fontsize=7, title="size")
    figure.suptitle(f"{platform_name}, simulated (SimGrid SMPI): ddlfast's automatic choice beside the best of "
                    f"SMPI's built-in allreduce algorithms")
    figure.tight_layout()
    folder.mkdir(parents=True, exist_ok=True)
    figure.savefig(folder / f"scale-{platform_name}.png", dpi=90)


def planner(platform_names: list[str], ranks_list: list[int], sizes: list[int], dims: list[str],
            docs: Path | None = None) -> None:
    """The planner's prediction of a whole call (cost_model.predict_call: the agreement and the ring, or the
    latency path) beside the simulated time, for auto's pick at every size and for any --dims given."""
    lines = ["| platform | ranks | size | algorithm | simulated ms | planner ms | planner/simulated |",
             "|---|---|---|---|---|---|---|"]
    series: dict[str, list[tuple[int, float]]] = {}
    for name in platform_names:
        platform = simulate.load_platform(name)
        for ranks in ranks_list:
            shapes = [None] + [tuple(int(d) for d in text.split("x")) for text in dims
                               if math.prod(int(d) for d in text.split("x")) == ranks]
            for shape in shapes:
                data = simulate.simulate(platform, ranks, sizes, shape, builtins=[], iters=1, warmup=0)
                for row in data["rows"]:
                    lines.append(f"| {name} | {ranks} | {simulate._size_text(row['size_bytes'])} | "
                                 f"{row['algorithm']}{'' if shape else ' (auto)'} | {row['ddlfast_s'] * 1e3:.3f} | "
                                 f"{row['planner_s'] * 1e3:.3f} | {row['planner_s'] / row['ddlfast_s']:.2f} |")
                    print(lines[-1], flush=True)
                    label = f"{name}, {ranks} ranks" + ("" if shape is None else f", {row['dims']}")
                    series.setdefault(label, []).append((row["size_bytes"], row["planner_s"] / row["ddlfast_s"]))
    _write(f"planner-{'-'.join(platform_names)}.md", "\n".join(lines) + "\n")
    _plot_planner(series, (docs / "scale-planner.png") if docs else OUT / f"planner-{'-'.join(platform_names)}.png")


def _plot_planner(series: dict[str, list[tuple[int, float]]], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    figure, axis = plt.subplots(figsize=(7, 4))
    for label, points in series.items():
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    axis.axhspan(0.9, 1.1, color="grey", alpha=0.2, label="within 10 %")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("bytes per allreduce")
    axis.set_ylabel("planner / simulated time")
    axis.legend(fontsize=7)
    figure.suptitle("ddlfast.plan's cost model against SimGrid SMPI")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def resnet50_buckets() -> list[int]:
    """ResNet-50's gradient buckets in bytes as ddlfast fuses them (assign_buckets walks the parameters last to
    first, as backward produces their gradients)."""
    nbytes = [4 * int(__import__("math").prod(shape)) for shape in resnet50_shapes()]
    buckets = assign_buckets(["float32"] * len(nbytes), nbytes, DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES)
    return [sum(nbytes[i] for i in bucket.indices) for bucket in buckets]


def resnet50(ranks_list: list[int], builtins: list[str]) -> None:
    """PowerAI DDL's case: ResNet-50's buckets on ddl-64x4, each allreduced as auto runs it; the step's
    communication is their sum (no overlap with backward), and the efficiency follows with the paper's compute."""
    platform = simulate.load_platform("ddl-64x4")
    buckets = resnet50_buckets()
    distinct = sorted(set(buckets))
    lines = [f"ResNet-50 gradients: {sum(buckets) / 2**20:.1f} MiB in {len(buckets)} buckets "
             f"({', '.join(simulate._size_text(b) if b % 1024 == 0 else f'{b / 2**20:.2f}MiB' for b in buckets)}); "
             f"compute per step {DDL_COMPUTE_S * 1e3:.0f} ms (from the paper), no overlap", "",
             "| ranks | algorithm per bucket | allreduce per step ms | planner ms | host-link bound ms "
             "| best built-in per step ms | efficiency | planner's efficiency | paper |",
             "|---|---|---|---|---|---|---|---|---|"]
    for ranks in ranks_list:
        data = simulate.simulate(platform, ranks, distinct, builtins=builtins, iters=1, warmup=0)
        by_size = {row["size_bytes"]: row for row in data["rows"]}
        ours = sum(by_size[b]["ddlfast_s"] for b in buckets)
        predicted = sum(by_size[b]["planner_s"] for b in buckets)
        compared = all(by_size[b]["best_builtin_s"] for b in buckets)
        theirs = f"{sum(by_size[b]['best_builtin_s'] for b in buckets) * 1e3:.2f}" if compared else "not run"
        algorithms = "; ".join(by_size[b]["algorithm"] for b in buckets)
        bound = link_bound(platform.cluster(ranks), sum(buckets))
        lines.append(f"| {ranks} | {algorithms} | {ours * 1e3:.2f} | {predicted * 1e3:.2f} | {bound * 1e3:.2f} | "
                     f"{theirs} | {step_efficiency(DDL_COMPUTE_S, ours):.1%} | "
                     f"{step_efficiency(DDL_COMPUTE_S, predicted):.1%} | {DDL_EFFICIENCY:.0%} |")
        print(lines[-1], flush=True)
        _write(f"resnet50-ddl-64x4-{ranks}.json", json.dumps(data, indent=1))
    _write(f"resnet50-ddl-64x4-{'-'.join(map(str, ranks_list))}.md", "\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("sweep", "resnet50", "planner", "join"))
    parser.add_argument("files", nargs="*", type=Path, help="join: the per-size --json outputs")
    parser.add_argument("--platform", default="fattree-8gpu")
    parser.add_argument("--ranks", default="16,64")
    parser.add_argument("--sizes", default="4KiB,256KiB,16MiB,256MiB")
    parser.add_argument("--builtins", default=",".join(simulate.BUILTINS))
    parser.add_argument("--dims", default="", help="planner: shapes to simulate beside auto's pick, e.g. 64,4x16")
    parser.add_argument("--docs", action="store_true", help="sweep, planner: write the plot to docs/ (else out/scale/)")
    parser.add_argument("--kept-only", action="store_true",
                        help="sweep: table and plots from the rank counts already simulated, nothing run")
    args = parser.parse_intermixed_args()  # join: the files after the options
    ranks = [int(r) for r in args.ranks.split(",")]
    simulate.require_simgrid()
    simulate.build_driver()
    if args.what == "planner":
        dims = [text for text in args.dims.split(",") if text]
        docs = Path(__file__).resolve().parents[2] / "docs" if args.docs else None
        planner(args.platform.split(","), ranks, simulate.parse_sizes(args.sizes), dims, docs)
    elif args.what == "join":
        join(args.platform, ranks[0], args.builtins.split(","), args.files)
    elif args.what == "sweep":
        docs = Path(__file__).resolve().parents[2] / "docs" if args.docs else None
        sweep(args.platform, ranks, simulate.parse_sizes(args.sizes), args.builtins.split(","), docs, args.kept_only)
    else:
        resnet50(ranks, [name for name in args.builtins.split(",") if name])
    return 0


if __name__ == "__main__":
    sys.exit(main())
