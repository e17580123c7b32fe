"""`python -m ddlfast.simulate`: ddlfast's C++ engine at 16 to 1024 ranks on a simulated cluster (SimGrid SMPI),
beside SMPI's own allreduce algorithms on the same platform (issue 23, docs/scale.md).

    python -m ddlfast.simulate --platform fattree-8gpu --ranks 1024 --sizes 4KiB,1MiB,256MiB
    python -m ddlfast.simulate --platform my_cluster.xml --ranks 64 --sizes 64MiB --dims 8x8 --json

It builds the driver (bench/simulation) with smpicxx when needed, runs one simulation for ddlfast (what ddlfast's
auto runs for each size on the platform's described links: `engine_choice`, the latency path, the ring or
Rabenseifner's all-2 shape, with a direct reduce-scatter in the dims where the model predicts it faster; or
--dims) and one per built-in
MPI_Allreduce algorithm (--cfg=smpi/allreduce:NAME), and prints per size the simulated time and busbw of each, the
best built-in and the ratio best_builtin_s / ddlfast_s (> 1: ddlfast faster).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ddlfast.config import DEFAULT_BUCKET_BYTES, DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_BYTES
from ddlfast.topology.cost_model import (
    SMPI_FACTORS,
    Algorithm,
    Cluster,
    PlanError,
    agreement_capacity,
    auto_latency_plan,
    auto_latency_takes,
    choose_algorithm,
    parse_bytes,
    parse_link,
    plan,
    predict_call,
)

PLATFORMS = Path(__file__).resolve().parent / "platforms"
REPOSITORY = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPOSITORY / "bench" / "simulation" / "build.sh"
DRIVER = REPOSITORY / "build" / "simulation" / "ddlfast_sim_driver"
# SMPI 3.32 names Rabenseifner rab1, rab2 and rab_rdb (the rab_rsag is not among them).
BUILTINS = ("lr", "rab1", "rab2", "rab_rdb", "rdb", "smp_rsag", "mvapich2", "mpich", "ompi")
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather")
# The planner's reduction rate where the simulation charges no reduction time (--compute off: SMPI's built-ins
# never charge theirs, so neither side does).
FREE_REDUCTION = 1e18
# Sizes up to this are checked against the exact reference inside the driver, in private memory, as long as all
# ranks' checked buffers together stay within CHECKED_MEMORY_BYTES (1 MiB at up to 256 ranks, 256 KiB at 1024);
# larger ones use folded buffers (SMPI_SHARED_MALLOC; the driver copies no large payload and the built-ins reduce
# nothing on them: bench/simulation/driver.cc).
CHECK_BYTES = 1 << 20
CHECKED_MEMORY_BYTES = 256 << 20


def check_bytes(ranks: int) -> int:
    """The largest size the driver checks at `ranks` ranks."""
    return min(CHECK_BYTES, CHECKED_MEMORY_BYTES // ranks)


EXIT_BAD_INPUT = 2
# SMPI_SHARED_MALLOC folds a buffer by mapping one file block over it again and again: one mapping per block per
# buffer per rank. With SMPI's default 1 MiB block, 256 ranks x 2 buffers of 256 MiB need 131072 mappings, past
# Linux's default vm.max_map_count (65530), and the simulation aborted ("Could not map folded virtual memory").
# With 256 MiB blocks, 1024 ranks need 2048.
SHARED_BLOCK_BYTES = 256 << 20
MAX_MAP_COUNT = 65530  # Linux's default vm.max_map_count


def shared_mappings(ranks: int, nbytes: int, block: int = SHARED_BLOCK_BYTES) -> int:
    """Memory mappings the driver's two folded buffers of `nbytes` take on `ranks` ranks."""
    return 2 * ranks * -(-nbytes // block)


# SMPI's built-in algorithms allocate temporary buffers of the whole message per rank (SMPI_SHARED_MALLOC does
# not reach inside them): on checked sizes, whose payloads are copied and reduced, about 3 x ranks x size bytes
# of real memory. Checked sizes above this budget run ddlfast only. (Folded sizes never touch those buffers.)
BUILTIN_MEMORY_BYTES = 6 << 30


class SimulationError(Exception):
    """Bad input or a missing tool: one line, exit status 2."""


# Input bounds, checked before SimGrid runs (it aborts, or runs for hours, past them):
# - ranks: the most any shipped platform holds and this tool has simulated (the agreement alone at 1024 ranks
#   takes 16 s of wall time; docs/scale.md);
# - bytes per call: the built-ins pass an int count of float32 elements to MPI_Allreduce (8 GiB at most), and the
#   folded buffers must map within half of vm.max_map_count (`shared_mappings`), the rest left to the process;
# - a platform file's size and hosts: ElementTree reads the whole file, and every host is named in a list.
MAX_SIMULATED_RANKS = 1024
MAX_SIMULATED_BYTES = 4 << 30
MAX_PLATFORM_BYTES = 16 << 20
MAX_PLATFORM_HOSTS = 1 << 16
MAX_ITERATIONS = 1000
MAX_STALL_LIMIT_S = 3600.0
MAX_BUILTIN_MEMORY_GIB = 1 << 20


@dataclass
class Platform:
    name: str
    path: Path
    hosts: list[str]
    ranks_per_host: int
    props: dict[str, str] = field(default_factory=dict)

    def placement(self, ranks: int) -> tuple[int, int]:
        """(hosts, ranks per host) for `ranks`: hosts filled with ranks_per_host ranks each."""
        per_host = min(self.ranks_per_host, ranks)
        if ranks < 1 or ranks % per_host:
            raise SimulationError(f"platform {self.name} places {self.ranks_per_host} ranks per host: {ranks} ranks "
                                  f"do not fill whole hosts (use a multiple of {self.ranks_per_host})")
        hosts = ranks // per_host
        if hosts > len(self.hosts):
            raise SimulationError(f"platform {self.name} has {len(self.hosts)} hosts x {self.ranks_per_host} ranks "
                                  f"= {len(self.hosts) * self.ranks_per_host} ranks at most; {ranks} asked")
        return hosts, per_host

    def cluster(self, ranks: int) -> Cluster:
        """The planner's description of the hosts `ranks` use (ddlfast:* properties; defaults where absent)."""
        hosts, per_host = self.placement(ranks)
        # SMPI scales every message's latency and rate by its size (smpi/lat-factor, smpi/bw-factor): the
        # planner is told so, as it would be told a real network's per-message costs.
        # SimGrid's cluster loopback (the link inside a host) is a fat pipe: flows on it do not share it.
        kwargs = {"hosts": hosts, "ranks_per_host": per_host, "gamma": 1 / FREE_REDUCTION, "factors": SMPI_FACTORS,
                  "chunk_bytes": DEFAULT_CHUNK_BYTES, "intra_fatpipe": True}
        try:
            if "ddlfast:intra" in self.props:
                kwargs["intra"] = parse_link(self.props["ddlfast:intra"])
            if "ddlfast:inter" in self.props:
                kwargs["inter"] = parse_link(self.props["ddlfast:inter"])
            group = int(self.props.get("ddlfast:hosts_per_group", "1"))
            if group > 1 and hosts > group and hosts % group == 0 and "ddlfast:group" in self.props:
                kwargs["hosts_per_group"] = group
                kwargs["group"] = parse_link(self.props["ddlfast:group"])
            return Cluster(**kwargs)
        except (PlanError, ValueError) as error:
            raise SimulationError(f"platform {self.name}: bad ddlfast:* property ({error})") from None


def engine_choice(cluster: Cluster, nbytes: int, dims: tuple[int, ...] | None = None,
                  reach: int | None = None) -> Algorithm:
    """What ddlfast runs for one allreduce of `nbytes` with its defaults: the ring dims auto plans once for the
    job (`plan` at DDLFAST_BUCKET_BYTES, as topology.placement.decide) or `dims`, then the algorithm per call
    size (topology.placement.Topology.algorithm): the latency path up to `reach` (None: where an allreduce's
    takes it, cost_model.auto_latency_takes), else cost_model.choose_algorithm (a direct reduce-scatter per
    dimension, or the all-2 shape where auto's dims may be reshaped)."""
    auto = plan(cluster, DEFAULT_BUCKET_BYTES)[0].dims
    shape = auto if dims is None else dims
    takes = (auto_latency_takes(cluster, shape, reshape=shape == auto)(nbytes) if reach is None
             else nbytes <= reach)
    if takes:
        return Algorithm("latency", shape)
    return choose_algorithm(cluster, shape, nbytes, "auto", reshape=shape == auto)


def latency_forms(cluster: Cluster, dims: tuple[int, ...] | None = None) -> tuple[int, int]:
    """(halving_bytes, reach) of ddlfast's latency path with its defaults on a simulated cluster (every rank a
    core of its own): cost_model.auto_latency_plan, as topology.placement.Topology.latency_plan decides on a job."""
    auto = plan(cluster, DEFAULT_BUCKET_BYTES)[0].dims
    shape = auto if dims is None else dims
    return auto_latency_plan(cluster, shape, reshape=shape == auto)


def case_text(nbytes: int, choice: Algorithm) -> str:
    """The driver's --case for one choice: BYTES:DIMS, and :DIRECT (a digit per dimension) where any is direct, or
    :latency where the latency path takes it."""
    text = f"{nbytes}:{'x'.join(map(str, choice.dims))}"
    if choice.name == "latency":
        text += ":latency"
    elif any(choice.direct):
        text += ":" + "".join(str(flag) for flag in choice.direct)
    return text


_RADICAL_PART = re.compile(r"\s*([0-9]{1,9})\s*(?:-\s*([0-9]{1,9})\s*)?")


def _expand_radical(radical: str) -> list[int]:
    """'0-63' or '0-3,8,10-11' -> the host numbers, at most MAX_PLATFORM_HOSTS of them (counted before any list
    is made). Raises SimulationError."""
    spans = []
    for part in radical.split(","):
        match = _RADICAL_PART.fullmatch(part)
        if not match:
            raise SimulationError(f"cluster radical {radical!r:.60}: give ranges like 0-63 or 0-3,8")
        low = int(match.group(1))
        spans.append(range(low, int(match.group(2) or low) + 1))
    if sum(len(span) for span in spans) > MAX_PLATFORM_HOSTS:
        raise SimulationError(f"cluster radical {radical!r:.60}: more than {MAX_PLATFORM_HOSTS} hosts")
    return [number for span in spans for number in span]


def _count(text: str, what: str) -> int:
    """A platform's count attribute (core, ddlfast:ranks_per_host): 1 to MAX_SIMULATED_RANKS."""
    if not (text.isascii() and text.isdecimal() and len(text) <= 9 and 1 <= int(text) <= MAX_SIMULATED_RANKS):
        raise SimulationError(f"{what} {text!r:.40} is not a count from 1 to {MAX_SIMULATED_RANKS}")
    return int(text)


def load_platform(name_or_path: str) -> Platform:
    """A shipped platform by name (ddlfast/platforms/NAME.xml) or any SimGrid platform XML file."""
    shipped = PLATFORMS / f"{name_or_path}.xml"
    path = shipped if shipped.is_file() else Path(name_or_path)
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in PLATFORMS.glob("*.xml")))
        raise SimulationError(f"unknown platform {name_or_path!r}: give one of {names} or a SimGrid XML file")
    try:
        if path.stat().st_size > MAX_PLATFORM_BYTES:
            raise SimulationError(f"platform {path}: larger than {MAX_PLATFORM_BYTES} bytes")
        root = ElementTree.parse(path).getroot()
    except (ElementTree.ParseError, OSError) as error:
        raise SimulationError(f"platform {path}: not readable XML ({error})") from None
    hosts: list[str] = []
    props: dict[str, str] = {}
    cores = 1
    for element in root.iter():
        if element.tag == "host":
            hosts.append(element.get("id", ""))
            cores = max(cores, _count(element.get("core", "1"), f"platform {path}: host core"))
        elif element.tag == "cluster":
            prefix, suffix = element.get("prefix", ""), element.get("suffix", "")
            hosts.extend(f"{prefix}{n}{suffix}" for n in _expand_radical(element.get("radical", "0")))
            cores = max(cores, _count(element.get("core", "1"), f"platform {path}: cluster core"))
        if len(hosts) > MAX_PLATFORM_HOSTS:
            raise SimulationError(f"platform {path}: more than {MAX_PLATFORM_HOSTS} hosts")
        elif element.tag == "prop" and element.get("id", "").startswith("ddlfast:"):
            props[element.get("id", "")] = element.get("value", "")
    if not hosts:
        raise SimulationError(f"platform {path}: no <host> or <cluster> found")
    ranks_per_host = _count(props.get("ddlfast:ranks_per_host", str(cores)), f"platform {path}: ranks_per_host")
    return Platform(path.stem if path == shipped else str(path), path, hosts, ranks_per_host, props)


def parse_sizes(text: str) -> list[int]:
    sizes = []
    for part in text.split(","):
        try:
            size = parse_bytes(part)
        except PlanError:
            raise SimulationError(f"--sizes: cannot read {part!r:.60}; use e.g. 4KiB,1MiB,256MiB") from None
        if size < 4:
            raise SimulationError(f"--sizes: {part!r} is below one float32 element")
        if size > MAX_SIMULATED_BYTES:
            raise SimulationError(f"--sizes: {part!r} is above the {_size_text(MAX_SIMULATED_BYTES)} per call the "
                                  "simulation holds")
        sizes.append(size)
    return sizes


def parse_dims(text: str, ranks: int) -> tuple[int, ...]:
    if not re.fullmatch(r"[0-9]{1,9}(x[0-9]{1,9}){0,31}", text):  # int() of a long digit string is an error
        raise SimulationError(f"--dims: cannot read {text!r:.60}; use e.g. 4x16")
    dims = tuple(int(d) for d in text.split("x"))
    if min(dims) < 1 or math.prod(dims) != ranks:
        raise SimulationError(f"--dims {text} do not multiply to {ranks} ranks")
    return dims


def require_simgrid() -> None:
    missing = [tool for tool in ("smpicxx", "smpirun") if shutil.which(tool) is None]
    if missing:
        raise SimulationError(f"SimGrid is missing ({' and '.join(missing)} not found): install it with "
                              "`apt-get install libsimgrid-dev` (Debian/Ubuntu)")


def build_driver() -> Path:
    if not BUILD_SCRIPT.is_file():
        raise SimulationError(f"the simulation driver's sources are not here ({BUILD_SCRIPT}): run from a ddlfast "
                              "checkout")
    result = subprocess.run(["bash", str(BUILD_SCRIPT), str(DRIVER)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building the simulation driver failed:\n{result.stdout}{result.stderr}")
    return DRIVER


@dataclass
class Simulation:
    """One smpirun of the driver on a platform."""

    platform: Platform
    ranks: int
    compute: str = "off"
    timeout_s: float = 3600.0

    def run(self, driver_args: Sequence[str], config: Sequence[str] = ()) -> str:
        hosts, per_host = self.platform.placement(self.ranks)
        with tempfile.TemporaryDirectory(prefix="ddlfast-sim-") as scratch:
            hostfile = Path(scratch) / "hostfile"
            hostfile.write_text("".join(f"{host}\n" * per_host for host in self.platform.hosts[:hosts]))
            compute = (["--cfg=smpi/simulate-computation:no"] if self.compute == "off"
                       else ["--cfg=smpi/host-speed:1Gf"])
            command = ["smpirun", "-np", str(self.ranks), "-platform", str(self.platform.path),
                       "-hostfile", str(hostfile), *compute,
                       # A poll costs 0.1 us, every poll: SMPI's growing poll cost is one counter shared by all
                       # ranks and carried from case to case (bench/simulation/smpi_compat.h).
                       "--cfg=smpi/test:1e-7", "--cfg=smpi/grow-injected-times:no",
                       f"--cfg=smpi/shared-malloc-blocksize:{SHARED_BLOCK_BYTES}",
                       "--log=root.thres:warning", "--log=smpi_config.thres:error",
                       *config, str(DRIVER), *driver_args]
            try:
                result = subprocess.run(command, capture_output=True, text=True, timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"simulation ran past {self.timeout_s:.0f} s: {' '.join(command)}") from None
        if result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"simulation failed (exit {result.returncode}): {' '.join(command)}\n{tail}")
        return result.stdout


def _results(output: str) -> dict[int, float]:
    """size -> seconds from the driver's `result` lines."""
    found = {}
    for line in output.splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[0] == "result":
            found[int(parts[2])] = float(parts[4])
    return found


def busbw(collective: str, ranks: int, nbytes: int, seconds: float) -> float:
    """Bus bandwidth in bytes/s (nccl-tests' convention): 2(p-1)/p S/t for allreduce, (p-1)/p S/t otherwise."""
    factor = 2 * (ranks - 1) / ranks if collective == "allreduce" else (ranks - 1) / ranks
    return nbytes / seconds * factor if seconds > 0 else 0.0


def _compare(row: dict, collective: str, ranks: int) -> dict:
    """The row's busbw, best built-in and ratio from its ddlfast_s and builtins_s (either may be missing)."""
    ours = row["ddlfast_s"]
    row["ddlfast_busbw_GBps"] = busbw(collective, ranks, row["size_bytes"], ours) / 1e9 if ours else None
    if row["builtins_s"]:
        best = min(row["builtins_s"], key=row["builtins_s"].get)
        theirs = row["builtins_s"][best]
        row |= {"best_builtin": best, "best_builtin_s": theirs, "ratio": theirs / ours if ours else None}
    else:
        row |= {"best_builtin": None, "best_builtin_s": None, "ratio": None}
    return row


def join_reports(parts: Sequence[dict]) -> dict:
    """One report from runs of the same platform and rank count made side by side (a size, or ddlfast and each
    built-in, per process): per size, ddlfast's time from the run that has it and every built-in's."""
    first = parts[0]
    if any(part["platform"] != first["platform"] or part["ranks"] != first["ranks"]
           or part["collective"] != first["collective"] for part in parts):
        raise SimulationError("join: every report must be of the same platform, rank count and collective")
    by_size: dict[int, dict] = {}
    for part in parts:
        for row in part["rows"]:
            joined = by_size.setdefault(row["size_bytes"], dict(row, builtins_s={}, ddlfast_s=None))
            if row["ddlfast_s"] is not None:
                joined |= {key: row[key] for key in ("dims", "algorithm", "ddlfast_s", "planner_s") if key in row}
            joined["builtins_s"] |= row["builtins_s"]
    rows = [_compare(by_size[size], first["collective"], first["ranks"]) for size in sorted(by_size)]
    agreement = next((part["agreement_s"] for part in parts if part["agreement_s"] is not None), None)
    skipped = [part["builtins_skipped_above_bytes"] for part in parts if part.get("builtins_skipped_above_bytes")]
    return first | {"rows": rows, "agreement_s": agreement, "builtins_skipped_above_bytes": max(skipped, default=None)}


def simulate(platform: Platform, ranks: int, sizes: Sequence[int], dims: tuple[int, ...] | None = None,
             collective: str = "allreduce", builtins: Sequence[str] = BUILTINS, compute: str = "off",
             iters: int = 2, builtin_memory: int = BUILTIN_MEMORY_BYTES, warmup: int = 1,
             run_ddlfast: bool = True) -> dict:
    """Runs ddlfast and every built-in on the platform; the report as data (what --json prints). Without
    `run_ddlfast`, the built-ins alone (runs made side by side, joined by `join_reports`)."""
    build_driver()  # incremental: nothing to do when the driver is newer than every source
    cluster = platform.cluster(ranks)
    halving, reach = latency_forms(cluster, dims)
    capacity = agreement_capacity(reach)  # the context's, whatever the collective
    # The latency path is an allreduce's, size by size: the passes hand off at the limit.
    limit = None if collective == "allreduce" else DEFAULT_SMALL_BYTES
    chosen = {}
    for size in sizes:
        choice = engine_choice(cluster, size, dims, limit)
        latency = size if choice.name == "latency" else 0
        chosen[size] = (choice, predict_call(cluster, choice.dims, size, latency, choice.direct, halving))
    simulation = Simulation(platform, ranks, compute)
    checked = check_bytes(ranks)
    common = ["--iters", str(iters), "--warmup", str(warmup), "--check-bytes", str(checked)]
    cases = [arg for size in sizes for arg in ("--case", case_text(size, chosen[size][0]))]
    # ddlfast's defaults: an allreduce the latency path takes (a case marked :latency) rides inside the agreement's
    # butterfly, halving from `halving` up; at or below the small-message limit reduce-scatter and allgather hand
    # off to MPI's own collective, here MPICH's selection (the MPI ddlfast's wheel runs on).
    engine = ["--small-bytes", str(DEFAULT_SMALL_BYTES), "--chunk-bytes", str(DEFAULT_CHUNK_BYTES),
              "--halving-bytes", str(halving), "--agreement-capacity", str(capacity)]
    ours, agreement = {}, None
    if run_ddlfast:
        ours = _results(simulation.run(["--collective", collective, *common, *engine, *cases],
                                       ["--cfg=smpi/allreduce:mpich", "--cfg=smpi/reduce_scatter:mpich",
                                        "--cfg=smpi/allgather:mpich"]))
        # The per-call agreement alone (a butterfly of 48-byte headers), which every ddlfast call includes.
        agreement = _results(simulation.run(["--collective", "agree", *common, "--case", f"4:{ranks}"]))[4]
    theirs: dict[str, dict[int, float]] = {}
    fitting = [size for size in sizes if size > checked or 3 * ranks * size <= builtin_memory]
    if collective == "allreduce" and fitting:
        flat = [arg for size in fitting for arg in ("--case", f"{size}:{ranks}")]
        for name in builtins:
            theirs[name] = _results(simulation.run(["--collective", "builtin", *common, *flat],
                                                   [f"--cfg=smpi/allreduce:{name}"]))
    rows = []
    for size in sizes:
        row = {"size_bytes": size, "dims": "x".join(map(str, chosen[size][0].dims)),
               "algorithm": str(chosen[size][0]), "ddlfast_s": ours.get(size),
               "planner_s": chosen[size][1] if collective == "allreduce" else None,
               "builtins_s": {name: times[size] for name, times in theirs.items() if size in times}}
        rows.append(_compare(row, collective, ranks))
    hosts, per_host = platform.placement(ranks)
    return {"platform": platform.name, "ranks": ranks, "hosts": hosts, "ranks_per_host": per_host,
            "collective": collective, "compute": compute, "iters": iters, "warmup": warmup, "agreement_s": agreement,
            "rows": rows,
            "builtins_skipped_above_bytes": max(fitting, default=0) if len(fitting) < len(sizes) else None}


def _size_text(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return f"{size}B"


def format_report(data: dict) -> str:
    lines = [f"platform {data['platform']}: {data['ranks']} ranks = {data['hosts']} hosts x "
             f"{data['ranks_per_host']}, {data['collective']}, simulated (SMPI), reduction cost {data['compute']}",
             f"{'size':>8} {'dims':>12} {'ddlfast ms':>11} {'busbw GB/s':>10} {'planner ms':>10} "
             f"{'best built-in':>14} {'its ms':>10} {'ratio':>6}"]
    for row in data["rows"]:
        planner = f"{row['planner_s'] * 1e3:10.3f}" if row["planner_s"] is not None else f"{'-':>10}"
        ratio = f"{row['ratio']:6.2f}" if row["ratio"] else f"{'-':>6}"
        best = (f"{row['best_builtin']:>14} {row['best_builtin_s'] * 1e3:10.3f} {ratio}"
                if row["best_builtin"] else f"{'-':>14} {'-':>10} {'-':>6}")
        ours = (f"{row['ddlfast_s'] * 1e3:11.3f} {row['ddlfast_busbw_GBps']:10.2f}" if row["ddlfast_s"]
                else f"{'not run':>11} {'-':>10}")
        lines.append(f"{_size_text(row['size_bytes']):>8} {row['dims']:>12} {ours} {planner} {best}"
                     + (f"  ({row['algorithm']})" if row.get("algorithm", "").startswith(("direct", "ring "))
                        and "direct" in row.get("algorithm", "") else ""))
    compared = [row for row in data["rows"] if row["builtins_s"]]
    if compared:
        names = list(dict.fromkeys(name for row in compared for name in row["builtins_s"]))
        lines += ["", "built-in MPI_Allreduce algorithms, ms:", f"{'size':>8} " + " ".join(f"{n:>9}" for n in names)]
        for row in compared:
            lines.append(f"{_size_text(row['size_bytes']):>8} "
                         + " ".join(f"{row['builtins_s'][n] * 1e3:9.3f}" if n in row["builtins_s"] else f"{'-':>9}"
                                    for n in names))
    if data.get("builtins_skipped_above_bytes") is not None:
        lines.append("built-ins not run above the memory budget (SMPI's algorithms hold ~3 x ranks x size bytes of "
                     "real memory; --builtin-memory-gib)")
    lines.append("ratio = best built-in time / ddlfast time (> 1: ddlfast faster)"
                 + (f"; ddlfast's times include its per-call agreement, {data['agreement_s'] * 1e3:.3f} ms alone"
                    if data["agreement_s"] is not None else ""))
    return "\n".join(lines)


def check_missing(missing: str, ranks: int) -> None:
    """--missing-rank R or R-S: ranks of the job. Raises SimulationError."""
    match = re.fullmatch(r"([0-9]{1,9})(?:-([0-9]{1,9}))?", missing)
    if not match or not int(match.group(1)) <= int(match.group(2) or match.group(1)) < ranks:
        raise SimulationError(f"--missing-rank {missing!r:.40}: give a rank or a range R-S of the {ranks} ranks")


def check_arguments(args: argparse.Namespace, sizes: Sequence[int]) -> None:
    """The numbers SimGrid would abort on or run for hours with, refused before it starts. Raises
    SimulationError."""
    if not 1 <= args.iters <= MAX_ITERATIONS:
        raise SimulationError(f"--iters {args.iters}: give 1 to {MAX_ITERATIONS}")
    if not 0 <= args.warmup <= MAX_ITERATIONS:
        raise SimulationError(f"--warmup {args.warmup}: give 0 to {MAX_ITERATIONS}")
    if not 0 <= args.builtin_memory_gib <= MAX_BUILTIN_MEMORY_GIB:  # NaN and infinity fail too
        raise SimulationError(f"--builtin-memory-gib {args.builtin_memory_gib}: give 0 to {MAX_BUILTIN_MEMORY_GIB}")
    if not 0 < args.stall_limit <= MAX_STALL_LIMIT_S:
        raise SimulationError(f"--stall-limit {args.stall_limit}: give more than 0 to {MAX_STALL_LIMIT_S:g} s")
    if args.missing_rank is not None:
        check_missing(args.missing_rank, args.ranks)
    for size in sizes:
        if shared_mappings(args.ranks, size) > MAX_MAP_COUNT // 2:
            raise SimulationError(f"--sizes: {_size_text(size)} at {args.ranks} ranks needs "
                                  f"{shared_mappings(args.ranks, size)} memory mappings, above the "
                                  f"{MAX_MAP_COUNT // 2} the simulation may take (smaller sizes or fewer ranks)")


def census(platform: Platform, ranks: int, missing: str, timeout_s: float, size: int = 4096) -> str:
    """Rank R (or ranks R-S, `missing`) never join an allreduce: the driver checks every other rank names them."""
    check_missing(missing, ranks)
    build_driver()
    output = Simulation(platform, ranks).run(["--case", f"{size}:{ranks}", "--missing-rank", missing,
                                              "--timeout", str(timeout_s)])
    return "\n".join(line for line in output.splitlines() if line.startswith("census"))


def _parser() -> argparse.ArgumentParser:
    names = ", ".join(sorted(p.stem for p in PLATFORMS.glob("*.xml")))
    parser = argparse.ArgumentParser(prog="python -m ddlfast.simulate", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--platform", required=True, help=f"a shipped platform ({names}) or a SimGrid XML file")
    parser.add_argument("--ranks", type=int, required=True, help="simulated MPI ranks")
    parser.add_argument("--sizes", default="4KiB,1MiB,64MiB", help="bytes per call, e.g. 4KiB,1MiB,256MiB")
    parser.add_argument("--dims", help="ring shape for every size, e.g. 4x16 (default: ddlfast.plan's pick)")
    parser.add_argument("--collective", choices=COLLECTIVES, default="allreduce",
                        help="ddlfast's collective (built-ins are compared for allreduce only)")
    parser.add_argument("--builtins", default=",".join(BUILTINS), help="SMPI allreduce algorithms to compare")
    parser.add_argument("--compute", choices=("off", "measured"), default="off",
                        help="reduction cost: off (network only, like SMPI's built-ins) or this host's measured "
                             "CPU time (docs/scale.md)")
    parser.add_argument("--builtin-memory-gib", type=float, default=BUILTIN_MEMORY_BYTES / 2**30,
                        help="run the built-ins on checked sizes only where ~3 x ranks x size fits this much memory")
    parser.add_argument("--iters", type=int, default=2, help="timed calls per size")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed calls per size first (0 gives the same simulated times: nothing is created "
                             "lazily, and reduction cost is off by default)")
    parser.add_argument("--missing-rank",
                        help="census check instead: this rank (or range R-S) never joins; every other must name it")
    parser.add_argument("--stall-limit", type=float, default=5.0,
                        help="with --missing-rank: the stall limit in (wall-clock) seconds")
    parser.add_argument("--builtins-only", action="store_true",
                        help="run the built-ins alone (to join with runs made side by side: bench/simulation/study.py "
                             "join)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if not 1 <= args.ranks <= MAX_SIMULATED_RANKS:
            raise SimulationError(f"--ranks {args.ranks}: give 1 to {MAX_SIMULATED_RANKS}")
        platform = load_platform(args.platform)
        platform.placement(args.ranks)
        sizes = parse_sizes(args.sizes)
        dims = parse_dims(args.dims, args.ranks) if args.dims else None
        builtins = [name for name in args.builtins.split(",") if name]
        if not all(re.fullmatch(r"[a-z0-9_]{1,40}", name) for name in builtins):
            raise SimulationError(f"--builtins {args.builtins!r:.60}: give SMPI algorithm names, e.g. rab1,ompi")
        check_arguments(args, sizes)
        require_simgrid()
        build_driver()
        if args.missing_rank is not None:
            print(census(platform, args.ranks, args.missing_rank, args.stall_limit))
            return 0
    except SimulationError as error:
        print(f"ddlfast.simulate: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    data = simulate(platform, args.ranks, sizes, dims, args.collective, builtins, args.compute, args.iters,
                    int(args.builtin_memory_gib * 2**30), args.warmup, not args.builtins_only)
    print(json.dumps(data, indent=1) if args.json else format_report(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
