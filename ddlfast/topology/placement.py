"""Where the ranks are, and the ring shape `DDLFAST_RING_DIMS=auto` picks for them.

Placement comes from MPI's shared-memory split (`MPI_Comm_split_type(COMM_TYPE_SHARED)`): ranks that share a
node form a host; hosts are numbered by their lowest rank. Torus positions are the ranks sorted by host, so
each host owns consecutive positions even when the launcher placed ranks round-robin (`order[v]` is the rank
that plays position v; the engine renumbers its rings with it). Optionally DDLFAST_HOSTS_PER_GROUP groups
consecutive hosts into racks, a third tier.

`auto` then asks the cost model (ddlfast/topology/cost_model.py) for the fastest shape of a bucket
(DDLFAST_BUCKET_BYTES) with each tier's link measured by ddlfast/topology/probe.py. Placements with different rank
counts per host fall back to a flat ring (in host order) with a TopologyWarning. Everything is decided once per
Context, when it is created.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from dataclasses import dataclass, field

from mpi4py import MPI

from ddlfast import config
from ddlfast.errors import DdlfastError
from ddlfast.topology import probe
from ddlfast.topology.cost_model import (
    DEFAULT_INTER,
    DEFAULT_INTRA,
    Algorithm,
    Cluster,
    Link,
    Prediction,
    agreement_capacity,
    choose_algorithm,
    halves,
    latency_plan,
    latency_takes,
    plan,
    predict_call,
)

# The call sizes ddlfast.topology() and `python -m ddlfast.plan` show the algorithm of.
SHOWN_SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
# Calls of ever new sizes must not grow memory (Topology.latency_takes).
MAX_LATENCY_TAKES = 4096
# Environment that changes which transport MPI uses between hosts, so a cached probe would not apply.
_TRANSPORT_VARIABLES = ("MPIR_CVAR_CH4_NETMOD", "FI_PROVIDER", "FI_TCP_IFACE", "UCX_TLS", "UCX_NET_DEVICES")


class TopologyWarning(UserWarning):
    """auto could not use the detected topology and chose something safe instead."""


@dataclass(frozen=True)
class Placement:
    host_of_rank: tuple[int, ...]  # host index of each communicator rank
    host_names: tuple[str, ...]  # MPI processor name of each host's first rank
    # Whether some rank of each host shares its cores with more ranks than it has (crowded_ranks); empty: not known
    crowded_hosts: tuple[bool, ...] = ()

    @property
    def oversubscribed(self) -> bool:
        """Whether ranks outnumber the cores they run on somewhere: each step of a collective then waits for its
        partner to be scheduled, and the algorithm with the fewest steps wins (EngineState.latency_reach)."""
        return any(self.crowded_hosts)

    @property
    def size(self) -> int:
        return len(self.host_of_rank)

    @property
    def hosts(self) -> int:
        return len(self.host_names)

    @property
    def ranks_per_host(self) -> tuple[int, ...]:
        counts = [0] * self.hosts
        for host in self.host_of_rank:
            counts[host] += 1
        return tuple(counts)

    def local_rank(self, rank: int) -> int:
        """`rank`'s index among the ranks on its host, in rank order."""
        host = self.host_of_rank[rank]
        return sum(1 for other in range(rank) if self.host_of_rank[other] == host)

    def local_size(self, rank: int) -> int:
        """How many ranks `rank`'s host runs."""
        return self.ranks_per_host[self.host_of_rank[rank]]

    @property
    def regular(self) -> bool:
        return len(set(self.ranks_per_host)) == 1

    @property
    def order(self) -> tuple[int, ...]:
        """Torus position -> rank: ranks grouped by host, hosts and ranks in rank order."""
        return tuple(sorted(range(self.size), key=lambda r: (self.host_of_rank[r], r)))

    @property
    def contiguous(self) -> bool:
        return self.order == tuple(range(self.size))

    def ring_straddles_hosts(self, d1: int) -> bool:
        """Would dimension-1 rings of d1 positions split a host without covering whole hosts?"""
        order = self.order
        for start in range(0, self.size, d1):
            hosts = {self.host_of_rank[r] for r in order[start:start + d1]}
            whole = sum(self.ranks_per_host[h] for h in hosts) == d1
            if len(hosts) > 1 and not whole:
                return True
        return False


def detect_placement(comm: MPI.Intracomm) -> Placement:
    """Collective over `comm`. DDLFAST_EMULATED_HOSTS=H (tests): H hosts of consecutive ranks instead, refused on
    every rank where the ranks' values differ or H does not divide the rank count."""
    emulated = config.emulated_hosts()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    try:
        leader = local.allreduce(comm.rank, op=MPI.MIN)
    finally:
        local.Free()
    entries = comm.allgather((leader, MPI.Get_processor_name(), emulated, cores_here()))
    if len({entry[2] for entry in entries}) > 1:
        values = ", ".join(f"rank {r}: {entry[2]}" for r, entry in enumerate(entries))
        raise DdlfastError(f"DDLFAST_EMULATED_HOSTS differs between the ranks ({values}); set it alike everywhere")
    if emulated:
        if comm.size % emulated:
            raise DdlfastError(f"DDLFAST_EMULATED_HOSTS={emulated} on rank {comm.rank} must divide the "
                               f"{comm.size} ranks")
        per_host = comm.size // emulated
        # Cores unknown (not split between emulated hosts): auto does not treat them as oversubscribed.
        return Placement(tuple(r // per_host for r in range(comm.size)),
                         tuple(f"emulated-host-{h}" for h in range(emulated)))
    leaders = sorted({entry[0] for entry in entries})
    index = {leader: i for i, leader in enumerate(leaders)}
    crowded_hosts = [False] * len(leaders)
    for entry, crowded in zip(entries, crowded_ranks([entry[3] for entry in entries]), strict=True):
        crowded_hosts[index[entry[0]]] |= crowded
    return Placement(tuple(index[entry[0]] for entry in entries), tuple(entries[r][1] for r in leaders),
                     tuple(crowded_hosts))


def cores_here() -> tuple[str, str, int]:
    """(this machine, a digest of the cores this process may run on, how many). The machine is the kernel's boot
    id, which every process of one kernel shares whatever hostname, container or network namespace it runs in
    (where MPI may see a host of its own); the processor name where it cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            machine = file.read().strip()
    except OSError:
        machine = ""
    try:
        cores = tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cores = tuple(range(os.cpu_count() or 1))
    mask = hashlib.blake2b(",".join(map(str, cores)).encode(), digest_size=8).hexdigest()  # a few bytes per rank
    return machine or MPI.Get_processor_name(), mask, len(cores)


def crowded_ranks(cores: list[tuple[str, str, int]]) -> list[bool]:
    """Per rank, from every rank's cores_here(): whether more ranks share its cores than it has. Ranks share
    cores where they run on one machine with the same affinity mask; ranks pinned to cores of their own (Open
    MPI binds 2 ranks to a core each) do not. The transport's spin follows the same rule (MpiTransport::
    choose_spin)."""
    sharing: dict[tuple[str, str], int] = {}
    for machine, mask, _ in cores:
        sharing[machine, mask] = sharing.get((machine, mask), 0) + 1
    return [sharing[machine, mask] > count for machine, mask, count in cores]


def hosts_per_group(hosts: int) -> tuple[int, str | None]:
    """DDLFAST_HOSTS_PER_GROUP (default 1: no racks) and a warning when it cannot be used as given."""
    value = config.hosts_per_group()
    if value == 1:
        return 1, None
    if hosts % value:
        return 1, f"DDLFAST_HOSTS_PER_GROUP={value} does not divide the {hosts} hosts; ignoring it"
    return value, None


def probe_pairs(placement: Placement, group: int, every_tier: bool) -> dict[str, tuple[int, int]]:
    """The (leader, follower) ranks that measure each tier; empty when auto has nothing to choose between."""
    if not every_tier and (placement.hosts == 1 or not placement.regular):
        return {}
    order, rph = placement.order, placement.ranks_per_host
    first = [order[sum(rph[:h])] for h in range(placement.hosts)]
    pairs = {}
    if rph[0] > 1:
        pairs["intra"] = (order[0], order[1])
    if placement.hosts > 1:
        pairs["inter"] = (first[0], first[1])
    if group > 1 and placement.hosts > group:
        pairs["group"] = (first[0], first[group])
    return pairs


@dataclass(frozen=True)
class Topology:
    """What was detected, measured and chosen (ddlfast.topology() returns this)."""

    rank: int
    placement: Placement
    hosts_per_group: int
    links: probe.Links
    cluster: Cluster | None  # None: irregular placement, auto is flat
    plan_bytes: int
    auto_dims: tuple[int, ...]
    candidates: tuple[Prediction, ...]  # fastest first
    warnings: tuple[str, ...]
    # latency_plan's answers by (small_bytes, halving setting): the model runs once per kind of setting
    _latency_plans: dict[tuple[int, int | None], tuple[int, int]] = field(default_factory=dict, compare=False,
                                                                           repr=False)
    # latency_takes' answers by its arguments, at most MAX_LATENCY_TAKES of them
    _latency_takes: dict[tuple[int, int, str, int], bool] = field(default_factory=dict, compare=False, repr=False)
    # Whether the context's agreement runs in memory its ranks share (Core.shared_memory; all on one host): the
    # latency path then reaches farther there (cost_model.latency_plan).
    shared_memory: bool = False

    @property
    def order(self) -> tuple[int, ...]:
        """Torus position -> rank for the engine; () when that is the identity."""
        return () if self.placement.contiguous else self.placement.order

    def resolve(self, chosen: str | tuple[int, ...]) -> tuple[int, ...]:
        """'flat' | 'auto' | explicit dims -> the dims to run, with the checks docs/topology.md describes."""
        size = self.placement.size
        if chosen == "flat":
            return (size,)
        if chosen == "auto":
            if self.rank == 0:
                for message in self.warnings:
                    warnings.warn(f"ddlfast: {message}", TopologyWarning, stacklevel=4)
            return self.auto_dims
        product = 1
        for d in chosen:
            product *= d
        shape = "x".join(map(str, chosen))
        if product != size:
            raise DdlfastError(f"ring dims {shape} multiply to {product} but the communicator has {size} ranks")
        d1 = next((d for d in chosen if d > 1), 1)
        if self.placement.ring_straddles_hosts(d1):
            raise DdlfastError(
                f"ring dims {shape}: dimension-1 rings of {d1} ranks would split hosts (ranks per host: "
                f"{_counts(self.placement)}); use a first dimension that divides the ranks of a host or covers "
                f"whole hosts, or auto (here {'x'.join(map(str, self.auto_dims))})"
            )
        return tuple(chosen)

    def algorithm(self, nbytes: int, dims: tuple[int, ...] | None = None, algorithm: str = "auto",
                  small_bytes: int = config.DEFAULT_SMALL_BYTES, ring_dims: object = "auto",
                  compressed: tuple[bool, ...] = ()) -> Algorithm:
        """The algorithm one call of `nbytes` on `dims` (default: auto's) runs with, for DDLFAST_ALGORITHM
        `algorithm`: the plain ring at or below `small_bytes` (the core's small-message path runs there), else
        the cost model's choice (cost_model.choose_algorithm), which may change auto's dims only where
        DDLFAST_RING_DIMS (`ring_dims`) is auto and the wire is not compressed. Raises PlanError."""
        dims = self.auto_dims if dims is None else dims
        if nbytes <= small_bytes:
            return Algorithm("ring", dims)
        reshape = ring_dims == "auto" and dims == self.auto_dims
        return choose_algorithm(self.cluster, dims, nbytes, algorithm, reshape, compressed)

    def latency_plan(self, small_bytes: int = config.DEFAULT_SMALL_BYTES,
                     halving_setting: int | None = None) -> tuple[int, int]:
        """(halving_bytes, reach) of the latency path under auto (cost_model.latency_plan), with
        DDLFAST_HALVING_BYTES `halving_setting` (None: auto)."""
        key = (small_bytes, halving_setting)
        if key not in self._latency_plans:
            placement = self.placement
            self._latency_plans[key] = latency_plan(self.cluster, placement.size, placement.hosts == 1,
                                                    small_bytes, self._agreed_call, halving_setting,
                                                    placement.oversubscribed, self.shared_memory)
        return self._latency_plans[key]

    def _agreed_call(self, nbytes: int) -> float:
        """Predicted seconds of the agreement and auto's algorithm for an allreduce of `nbytes` (latency_plan)."""
        choice = self.algorithm(nbytes, small_bytes=0)
        return predict_call(self.cluster, choice.dims, nbytes, 0, choice.direct)

    def halving_bytes(self, setting: int | None = None) -> int:
        """From what payload the latency path halves (DDLFAST_HALVING_BYTES `setting`; None: auto,
        latency_plan): on one host with a core per rank from 8 KiB, across hosts where the cost model says,
        never where ranks outnumber cores."""
        return setting if setting is not None else self.latency_plan()[0]

    def latency_reach(self, small_bytes: int = config.DEFAULT_SMALL_BYTES, algorithm: str = "auto",
                      halving_bytes: int = 0) -> int:
        """The largest uncompressed allreduce the latency path takes: DDLFAST_SMALL_BYTES; under auto, as far as
        latency_plan says for a latency path that halves from `halving_bytes` up (0: never)."""
        if algorithm != "auto":
            return small_bytes
        return self.latency_plan(small_bytes, halving_bytes)[1]

    def latency_takes(self, nbytes: int, small_bytes: int = config.DEFAULT_SMALL_BYTES, algorithm: str = "auto",
                      halving_bytes: int = 0) -> bool:
        """Whether the latency path takes an uncompressed allreduce of `nbytes`: at or below DDLFAST_SMALL_BYTES;
        under auto up to latency_reach, across hosts only the sizes where the cost model predicts it faster than
        the agreement and auto's algorithm (cost_model.latency_wins). A pure function of agreed values: every
        rank of a call decides alike."""
        if nbytes <= small_bytes:
            return True
        key = (nbytes, small_bytes, algorithm, halving_bytes)
        if key not in self._latency_takes:
            if len(self._latency_takes) >= MAX_LATENCY_TAKES:
                self._latency_takes.clear()
            placement = self.placement
            self._latency_takes[key] = latency_takes(
                self.cluster, placement.hosts == 1, placement.oversubscribed, nbytes, small_bytes, halving_bytes,
                self.latency_reach(small_bytes, algorithm, halving_bytes), self._agreed_call)
        return self._latency_takes[key]

    def agreement_capacity(self, halving_setting: int | None = None) -> int:
        """The bytes each agreement message of a context on this topology carries at most
        (cost_model.agreement_capacity of auto's reach with DDLFAST_HALVING_BYTES `halving_setting`)."""
        return agreement_capacity(self.latency_plan(config.DEFAULT_SMALL_BYTES, halving_setting)[1])

    def algorithms(self, small_bytes: int = config.DEFAULT_SMALL_BYTES) -> dict[int, str]:
        """auto's algorithm per shown size (uncompressed, on auto's dims), as text."""
        halving = self.halving_bytes(config.halving_bytes())
        return {n: ("latency path, halving" if halves(n, halving) else "latency path")
                if self.latency_takes(n, small_bytes, halving_bytes=halving)
                else str(self.algorithm(n, small_bytes=small_bytes)) for n in SHOWN_SIZES}

    def describe(self) -> str:
        p = self.placement
        text = f"{p.hosts} host{'s' if p.hosts > 1 else ''} x {_counts(p)} ranks"
        if self.hosts_per_group > 1:
            text += f" in groups of {self.hosts_per_group} hosts"
        text += ", host-contiguous" if p.contiguous else ", renumbered host-contiguous"
        if self.shared_memory:
            text += ", agreement in shared memory"
        if p.oversubscribed:
            text += ", ranks outnumber their cores"
        text += f"; auto {'x'.join(map(str, self.auto_dims))} for {self.plan_bytes / 2**20:.3g} MiB buckets"
        text += "; per call size: " + ", ".join(f"{config.format_size(n)} {name}"
                                                for n, name in self.algorithms().items())
        tiers = [f"{t} {getattr(self.links, t)}" for t in probe.TIERS if getattr(self.links, t) is not None]
        return text + f" (links from {self.links.source}{': ' if tiers else ''}{', '.join(tiers)})"

    def as_dict(self) -> dict:
        p = self.placement
        return {
            "size": p.size, "hosts": p.hosts, "ranks_per_host": list(p.ranks_per_host),
            "host_names": list(p.host_names), "host_of_rank": list(p.host_of_rank), "regular": p.regular,
            "contiguous": p.contiguous, "order": list(self.order), "hosts_per_group": self.hosts_per_group,
            "shared_memory": self.shared_memory, "oversubscribed": p.oversubscribed,
            "links": self.links.as_dict(), "plan_bytes": self.plan_bytes,
            "auto_dims": "x".join(map(str, self.auto_dims)),
            "candidates": [{"dims": c.name, "seconds": c.seconds} for c in self.candidates[:8]],
            "algorithms": {str(n): name for n, name in self.algorithms().items()},
            "warnings": list(self.warnings),
        }


def _counts(placement: Placement) -> str:
    counts = placement.ranks_per_host
    return str(counts[0]) if placement.regular else ",".join(map(str, counts))


def build(comm: MPI.Intracomm, plan_bytes: int, every_tier: bool = False) -> Topology:
    """Collective over `comm`: detect, probe (or read the cache), plan. Uses its own duplicate of `comm`."""
    work = comm.Dup()
    try:
        placement = detect_placement(work)
        group, group_warning = hosts_per_group(placement.hosts)
        pairs = probe_pairs(placement, group, every_tier)
        description = {
            "host_of_rank": placement.host_of_rank, "host_names": placement.host_names, "group": group,
            "pairs": pairs, "mpi": MPI.Get_library_version().splitlines()[0],
            "env": {k: os.environ.get(k) for k in _TRANSPORT_VARIABLES},
        }
        links = probe.links_for(work, pairs, description)
    finally:
        work.Free()
    return decide(comm.rank, placement, group, links, plan_bytes, [group_warning] if group_warning else [])


def decide(rank: int, placement: Placement, group: int, links: probe.Links, plan_bytes: int,
           notes: list[str] | None = None) -> Topology:
    """The pure part of build(): the shape auto runs, from what was detected and measured."""
    notes = list(notes or [])
    if not placement.regular:
        notes.append(f"ranks per host differ ({_counts(placement)} on hosts {', '.join(placement.host_names)}); "
                     f"auto uses a flat ring in host order")
        return Topology(rank, placement, group, links, None, plan_bytes, (placement.size,), (), tuple(notes))
    cluster = Cluster(
        hosts=placement.hosts, ranks_per_host=placement.ranks_per_host[0],
        intra=links.intra or Link(*DEFAULT_INTRA), inter=links.inter or Link(*DEFAULT_INTER),
        gamma=links.gamma, hosts_per_group=group, group=links.group,
    )
    pick, candidates = plan(cluster, plan_bytes)
    return Topology(rank, placement, group, links, cluster, plan_bytes, pick.dims, tuple(candidates), tuple(notes))
