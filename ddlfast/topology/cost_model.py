"""The cost model: predicted allreduce time of every ring shape (docs/topology.md), and the pick among them.
`python -m ddlfast.plan` (ddlfast/plan.py) prints it for a described cluster or for this job.

The model. Ranks sit at torus positions, host-contiguous (ddlfast renumbers them so), `ranks_per_host` to a
host and optionally `hosts_per_group` hosts to a group (rack). Dimension i (size di, block `S / Di` bytes)
runs `di - 1` reduce-scatter steps and `di - 1` allgather steps; in one step every ring edge carries one block.
A step costs the latency of the slowest tier its edges cross, plus the slowest of:

    an edge inside a host          block * beta_intra             (ranks of a host talk pairwise)
    the busiest host's link        edges leaving it * block * beta_inter   (shared by the host's ranks)
    the busiest group's uplink     edges leaving it * block * beta_group   (when a group link is given)

plus `block * gamma` for the reduction in reduce-scatter steps. With one tier this is exactly the classic
`2(p-1)a + 2(p-1)/p S b + (p-1)/p S g`; with a slow host link shared by a host's ranks it charges a flat ring
`2(p-1)/p * S` per host link crossing and the host-aligned 2D ring `2(h-1)/h * S` per host.

A step costs the slowest tier's latency plus transfer (the edges run at once, each at its own tier's cost). Real
MPI messages cost more than `alpha + bytes * beta` by an amount that depends on their size (the eager/rendezvous
switch, per-message software overhead): `Cluster.factors` scales a tier's latency and rate per message size
(piecewise, as SMPI's `smpi/lat-factor` and `smpi/bw-factor` do; SMPI_FACTORS are SimGrid's defaults, calibrated
on a real cluster). A ring step sends blocks of up to `chunk_bytes`, so a 1 MiB block pays a large message's
latency once per step: a shape with many steps (the flat ring across many hosts) pays it most, which is what
made the flat 64-rank ring simulate at twice the host-aligned 4x16 one (docs/scale.md). Without factors (the
default) every message costs `alpha + bytes * beta`.

A whole call (`predict_call`) adds the per-call agreement (a butterfly of small headers, `butterfly_seconds`)
to the ring, or, at or below the small-message limit, is the latency path (the same butterfly carrying the data).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ddlfast import config
from ddlfast.config import DEFAULT_CHUNK_BYTES, DEFAULT_RECEIVES_IN_FLIGHT
from ddlfast.errors import DdlfastError

# Defaults where nothing was measured or described (DDLFAST_PROBE=0): shared memory and a 10 Gbit/s network.
DEFAULT_INTRA = (1e-6, 1 / 10e9)
DEFAULT_INTER = (20e-6, 8 / 10e9)
DEFAULT_GAMMA = 1 / 4e9
# Shapes predicted within this fraction of the fastest count as equal; the one with fewest dimensions wins.
TIE_FRACTION = 0.02
MAX_DIMS = 4

# Described links: anything outside these is a typo, and keeps every prediction finite (JSON has no Infinity).
MIN_RATE, MAX_RATE = 1.0, 1e18  # bytes per second
MAX_LATENCY_S = 3600.0
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[-+]?\d+)?)\s*([a-zµ]*)\s*(/s|ps)?\s*$", re.IGNORECASE)


class PlanError(ValueError):
    """A described cluster or quantity that the planner cannot use."""


# -- quantities -------------------------------------------------------------------------------------------------


def _split(text: str, what: str) -> tuple[float, str, bool]:
    match = _QUANTITY.match(str(text))
    if not match:
        raise PlanError(f"{what}: cannot read {text!r}")
    return float(match.group(1)), match.group(2), match.group(3) is not None


def parse_bytes(text: str) -> int:
    """A byte size as every ddlfast size reads ('64MiB' and '64M' are 2**26, '64MB' is 64e6; config.parse_size,
    the one size parser, shared with --sizes and the DDLFAST_*_BYTES variables)."""
    try:
        return config.parse_size(text, "bytes")
    except DdlfastError as error:
        raise PlanError(str(error)) from None


def parse_rate(text: str) -> float:
    """'40GB/s' -> 40e9, '100Gbit/s' -> 12.5e9, '1gbit' -> 125e6, '10Gb/s' -> 1.25e9 (bytes per second)."""
    value, unit, _ = _split(text, "rate")
    lower = unit.lower()
    for suffix, scale in (("bit", 1 / 8), ("bps", 1 / 8), ("B", 1.0), ("b", 1 / 8)):
        matches = lower.endswith(suffix) if len(suffix) > 1 else unit.endswith(suffix)
        if matches and lower[: -len(suffix)] in _UNITS:
            rate = value * _UNITS[lower[: -len(suffix)]] * scale
            if not MIN_RATE <= rate <= MAX_RATE:  # its inverse, seconds per byte, multiplies every size
                raise PlanError(f"rate: {text!r} is outside 1 B/s to 1e18 B/s")
            return rate
    raise PlanError(f"rate: cannot read {text!r}; use e.g. 100Gbit/s or 40GB/s")


def parse_time(text: str) -> float:
    """'5us' -> 5e-6, '2ms' -> 2e-3 (seconds)."""
    value, unit, per_second = _split(text, "time")
    if per_second or unit.lower() not in _TIME_UNITS:
        raise PlanError(f"time: cannot read {text!r}; use e.g. 5us or 1.5ms")
    seconds = value * _TIME_UNITS[unit.lower()]
    if not seconds <= MAX_LATENCY_S:  # '1e999s' reads as infinity, and every prediction would be
        raise PlanError(f"time: {text!r} is above {MAX_LATENCY_S:g} s")
    return seconds


@dataclass(frozen=True)
class Link:
    """One tier's link: alpha seconds per message, beta seconds per byte."""

    alpha: float
    beta: float

    @property
    def rate(self) -> float:
        return 1 / self.beta

    def __str__(self) -> str:
        return f"{format_rate(self.rate)}, {self.alpha * 1e6:.1f} us"


def parse_link(text: str) -> Link:
    """'100Gbit/s,5us' (either order) -> Link."""
    parts = [part for part in str(text).split(",") if part.strip()]
    rates = [part for part in parts if not _is_time(part)]
    times = [part for part in parts if _is_time(part)]
    if len(rates) != 1 or len(times) != 1:
        raise PlanError(f"link {text!r}: give a rate and a latency, e.g. 100Gbit/s,5us")
    return Link(parse_time(times[0]), 1 / parse_rate(rates[0]))


def _is_time(part: str) -> bool:
    try:
        parse_time(part)
    except PlanError:
        return False
    return True


def format_rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s * 8 / 1e9:.3g} Gbit/s" if bytes_per_s < 4e9 else f"{bytes_per_s / 1e9:.3g} GB/s"


# -- the model ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MessageFactors:
    """Per-message-size multipliers of a link's latency and rate: (from_bytes, factor) pairs, ascending; a
    message of n bytes takes the factor of the last pair with from_bytes <= n (1 where none)."""

    latency: tuple[tuple[int, float], ...] = ()
    bandwidth: tuple[tuple[int, float], ...] = ()

    @staticmethod
    def _lookup(table: tuple[tuple[int, float], ...], nbytes: float) -> float:
        factor = 1.0
        for start, value in table:
            if nbytes >= start:
                factor = value
        return factor

    def latency_factor(self, nbytes: float) -> float:
        return self._lookup(self.latency, nbytes)

    def bandwidth_factor(self, nbytes: float) -> float:
        return self._lookup(self.bandwidth, nbytes)

    def message(self, link: Link, nbytes: float, load: float = 1.0) -> float:
        """Seconds for `load` messages of `nbytes` sharing `link` (one latency: they travel at once)."""
        return link.alpha * self.latency_factor(nbytes) + load * nbytes * link.beta / self.bandwidth_factor(nbytes)


def parse_factors(text: str) -> tuple[tuple[int, float], ...]:
    """SMPI's syntax, '65472:11.6;15424:3.5;0:2.0' (any order) -> ((0, 2.0), (15424, 3.5), (65472, 11.6))."""
    pairs = []
    for part in str(text).split(";"):
        if not part.strip():
            continue
        start, sep, value = part.partition(":")
        try:
            if not sep:
                raise ValueError
            pairs.append((int(start), float(value)))
        except ValueError:
            raise PlanError(f"factors: cannot read {part!r}; use e.g. 65472:11.6;0:2.0") from None
        if pairs[-1][0] < 0 or pairs[-1][1] <= 0:
            raise PlanError(f"factors: {part!r}: sizes must be >= 0 and factors > 0")
    return tuple(sorted(pairs))


# SimGrid 3.32's default smpi/lat-factor and smpi/bw-factor (SMPI's network model, fitted on a real InfiniBand
# cluster by SimGrid's authors): what `python -m ddlfast.simulate` tells the planner about every platform.
SMPI_FACTORS = MessageFactors(
    latency=parse_factors("65472:11.6436;15424:3.48845;9376:2.59299;5776:2.18796;3484:1.88101;1426:1.61075;"
                          "732:1.9503;257:1.95341;0:2.01467"),
    bandwidth=parse_factors("65472:0.940694;15424:0.697866;9376:0.58729;5776:1.08739;3484:0.77493;1426:0.608902;"
                            "732:0.341987;257:0.338112;0:0.812084"))


@dataclass(frozen=True)
class Cluster:
    """A regular placement: `hosts` hosts of `ranks_per_host` ranks, optionally grouped into racks."""

    hosts: int
    ranks_per_host: int
    intra: Link = Link(*DEFAULT_INTRA)
    inter: Link = Link(*DEFAULT_INTER)
    gamma: float = DEFAULT_GAMMA
    hosts_per_group: int = 1  # 1: no group tier
    group: Link | None = None  # a group's uplink, shared by its hosts; None: no limit beyond the host links
    factors: MessageFactors = MessageFactors()  # per-message-size latency and rate multipliers (none: 1)
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # the largest message a ring step sends (DDLFAST_CHUNK_BYTES)
    # Messages inside a host do not share its link (a crossbar, or SimGrid's cluster loopback, a fat pipe): the
    # chunks of a step in flight at once, up to `window`, each run at the full rate.
    intra_fatpipe: bool = False
    window: int = DEFAULT_RECEIVES_IN_FLIGHT  # chunks a rank receives at once (DDLFAST_RECEIVES_IN_FLIGHT)

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.ranks_per_host < 1:
            raise PlanError("hosts and ranks per host must be >= 1")
        if self.hosts_per_group < 1 or self.hosts % self.hosts_per_group:
            raise PlanError(f"hosts per group {self.hosts_per_group} does not divide {self.hosts} hosts")

    @property
    def ranks(self) -> int:
        return self.hosts * self.ranks_per_host

    @property
    def groups(self) -> int:
        return self.hosts // self.hosts_per_group


@dataclass(frozen=True)
class Prediction:
    dims: tuple[int, ...]
    seconds: float
    per_dim: tuple[float, ...] = field(default=(), compare=False)  # seconds spent in each dimension

    @property
    def name(self) -> str:
        return "x".join(map(str, self.dims))


# Each shape's dimensions repeat across the shapes of one rank count (4x8x2 and 8x4x2 share the rings of 2 over
# 32), and each call is O(ranks) (O(ranks x size) direct): remembered, planning 30240 ranks took 32 s, not 1.
@functools.lru_cache(maxsize=4096)
def _edges_out(dims_before: int, size: int, ranks: int, unit: int) -> tuple[bool, int]:
    """For the rings of one dimension: does any edge stay inside a unit of `unit` consecutive positions, and
    how many edges leave the busiest unit?"""
    v = np.arange(ranks)
    coordinate = (v // dims_before) % size
    successor = np.where(coordinate == size - 1, v - (size - 1) * dims_before, v + dims_before)
    crossing = (v // unit) != (successor // unit)
    inside = bool((~crossing).any())
    if not crossing.any():
        return inside, 0
    return inside, int(np.bincount(v[crossing] // unit).max())


@functools.lru_cache(maxsize=4096)
def _direct_out(dims_before: int, size: int, ranks: int, unit: int) -> tuple[bool, int]:
    """For a direct reduce-scatter of one dimension (every rank sends a block to each of the other size-1 ranks
    of its dimension): does any block stay inside a unit of `unit` consecutive positions, and how many blocks
    leave the busiest unit?"""
    v = np.arange(ranks)
    coordinate = (v // dims_before) % size
    inside, busiest = False, np.zeros(ranks // unit + 1, dtype=np.int64)
    for shift in range(1, size):
        peer = v + (((coordinate + shift) % size) - coordinate) * dims_before
        crossing = (v // unit) != (peer // unit)
        inside = inside or bool((~crossing).any())
        busiest += np.bincount(v[crossing] // unit, minlength=busiest.size)
    return inside, int(busiest.max())


def predict(cluster: Cluster, dims: Sequence[int], nbytes: float, direct: Sequence[int] = ()) -> Prediction:
    """Predicted seconds of one allreduce of `nbytes` on ring shape `dims`; `direct[i]` = 1: dimension i's
    reduce-scatter is direct (one step: every rank sends its d-1 blocks at once, at the latency of the slowest
    tier they cross and the busiest link's bytes; the allgather stays the ring's)."""
    dims = tuple(int(d) for d in dims)
    if int(np.prod(dims)) != cluster.ranks:
        raise PlanError(f"dims {'x'.join(map(str, dims))} do not multiply to {cluster.ranks} ranks")
    rph, group_size = cluster.ranks_per_host, cluster.ranks_per_host * cluster.hosts_per_group
    per_dim, before = [], 1
    for index, size in enumerate(dims):
        if size == 1:
            per_dim.append(0.0)
            continue
        block = nbytes / (before * size)
        alpha, transfer = _step_cost(cluster, block, 1, _edges_out, before, size, rph, group_size)
        ring_half = (size - 1) * (alpha + transfer)
        if index < len(direct) and direct[index]:
            # All d-1 blocks at once: the busiest link carries all of its blocks in one step.
            _, direct_transfer = _step_cost(cluster, block, size - 1, _direct_out, before, size, rph, group_size)
            reduce_scatter = alpha + direct_transfer
        else:
            reduce_scatter = ring_half
        per_dim.append(reduce_scatter + ring_half + (size - 1) * block * cluster.gamma)
        before *= size
    return Prediction(dims, float(sum(per_dim)), tuple(per_dim))


def _step_cost(cluster: Cluster, block: float, sent: int, edges_out: Any, before: int, size: int, rph: int,
               group_size: int) -> tuple[float, float]:
    """(latency, transfer seconds) of one step of a dimension in which each rank sends `sent` blocks and
    `edges_out` counts the blocks that leave each unit of a tier: the slowest tier's latency plus transfer (each
    tier's edges run at once), split as that tier's two parts."""
    message = min(block, cluster.chunk_bytes)
    factors = cluster.factors
    lat_factor, rate_factor = factors.latency_factor(message), factors.bandwidth_factor(message)
    intra_edges, host_out = edges_out(before, size, cluster.ranks, rph)
    tiers = []
    if intra_edges and cluster.intra_fatpipe and sent * block > message:
        # Rounds of up to `window` chunks, each round a message's latency and one chunk's transfer.
        rounds = -(-math.ceil(sent * block / message) // cluster.window)
        latency = cluster.intra.alpha * lat_factor
        tiers.append((latency, rounds * (latency + message * cluster.intra.beta / rate_factor) - latency))
    elif intra_edges:
        tiers.append((cluster.intra.alpha * lat_factor, sent * block * cluster.intra.beta / rate_factor))
    if host_out:
        tiers.append((cluster.inter.alpha * lat_factor, host_out * block * cluster.inter.beta / rate_factor))
    if cluster.group is not None and cluster.groups > 1:
        _, group_out = edges_out(before, size, cluster.ranks, group_size)
        if group_out:
            tiers.append((cluster.group.alpha * lat_factor, group_out * block * cluster.group.beta / rate_factor))
    return max(tiers, key=sum, default=(0.0, 0.0))


def _butterfly_partners(ranks: int) -> list[np.ndarray]:
    """Each rank's partner in every step of src/algo/butterfly.cc's butterfly (-1: idle in that step): the fold of
    the first 2*rest ranks in pairs (r, r^1), log2 of the largest power of two of exchange steps, the fold back."""
    power = 1 << (ranks.bit_length() - 1)
    rest = ranks - power
    v = np.arange(ranks)
    index = np.where(v < 2 * rest, np.where(v % 2 == 1, v // 2, -1), v - rest)
    fold = np.where(v < 2 * rest, v ^ 1, -1)
    steps = [fold] if rest else []
    mask = 1
    while mask < power:
        other = index ^ mask
        steps.append(np.where(index < 0, -1, np.where(other < rest, 2 * other + 1, other + rest)))
        mask *= 2
    return steps + ([fold] if rest else [])


# The agreement's header: 48 bytes of fingerprint, flags and the previous collective's waits per rank's message
# (kHeaderBytes in src/transport/agreement_exchange.cc).
AGREEMENT_BYTES = 48


def _step_seconds(cluster: Cluster, partner: np.ndarray, nbytes: float) -> float:
    """One butterfly step's seconds: its slowest tier, the latency of the link it crosses and the messages sharing
    it (a host's ranks all send off the host at once in the steps that leave it, over its one link)."""
    v = np.arange(cluster.ranks)
    rph, group_ranks = cluster.ranks_per_host, cluster.ranks_per_host * cluster.hosts_per_group
    active = partner >= 0
    senders, receivers = v[active], partner[active]
    costs = []
    off_host = senders // rph != receivers // rph
    if (~off_host).any():
        costs.append(cluster.factors.message(cluster.intra, nbytes))
    if off_host.any():
        load = int(np.bincount(senders[off_host] // rph).max())
        costs.append(cluster.factors.message(cluster.inter, nbytes, load))
        off_group = senders // group_ranks != receivers // group_ranks
        if cluster.group is not None and cluster.groups > 1 and off_group.any():
            load = int(np.bincount(senders[off_group] // group_ranks).max())
            costs.append(cluster.factors.message(cluster.group, nbytes, load))
    return max(costs)


def butterfly_seconds(cluster: Cluster, nbytes: float) -> float:
    """Seconds of a butterfly (recursive doubling, src/algo/butterfly.h) carrying `nbytes` per message: log2(P)
    exchange steps at distance 1, 2, 4, ...; a rank count that is no power of two folds the extra ranks in
    first and hands them the result last (two more steps). A step costs its slowest tier (_step_seconds). The
    per-call agreement is this with a small header; the latency path's whole form is this with the data."""
    ranks = cluster.ranks
    if ranks == 1:
        return 0.0
    total = sum(_step_seconds(cluster, partner, nbytes) for partner in _butterfly_partners(ranks))
    power = 1 << (ranks.bit_length() - 1)
    total += (power.bit_length() - 1) * nbytes * cluster.gamma
    return total


# The latency path copies its data into its message buffer and the result back (the caller's memory is written
# only on agreement), and the halving form each step's sent half too: in payloads, charged at the reduction's rate.
WHOLE_FORM_COPIES = 2
HALVING_FORM_COPIES = 3


def halving_seconds(cluster: Cluster, nbytes: float) -> float:
    """Seconds of the latency path's halving form (src/transport/agreement_exchange.cc) for `nbytes` of data: the
    fold steps with the whole payload, then the butterfly's steps carrying the header and half of what a rank
    still reduces (recursive halving), then the same steps back with the owners' blocks (recursive doubling)."""
    ranks = cluster.ranks
    if ranks == 1:
        return 0.0
    partners = _butterfly_partners(ranks)
    folds = ranks & (ranks - 1) != 0
    total = 0.0
    if folds:
        total += sum(_step_seconds(cluster, fold, AGREEMENT_BYTES + nbytes) for fold in (partners[0], partners[-1]))
        partners = partners[1:-1]
    part = float(nbytes)
    for partner in partners:
        part /= 2
        total += _step_seconds(cluster, partner, AGREEMENT_BYTES + part) + _step_seconds(cluster, partner, part)
        total += part * cluster.gamma
    return total + HALVING_FORM_COPIES * nbytes * cluster.gamma


def halves(nbytes: float, halving_bytes: int) -> bool:
    """Whether the latency path halves a payload of `nbytes`: from `halving_bytes` up, 0 never (the core's rule,
    src/engine/latency_allreduce.cc)."""
    return halving_bytes > 0 and nbytes >= halving_bytes


def latency_seconds(cluster: Cluster, nbytes: float, halving_bytes: int = 0) -> float:
    """Seconds of one latency-path call of `nbytes`: the halving form where it halves, else the whole payload
    behind the agreement's header in every step."""
    if halves(nbytes, halving_bytes):
        return halving_seconds(cluster, nbytes)
    return butterfly_seconds(cluster, AGREEMENT_BYTES + nbytes) + WHOLE_FORM_COPIES * nbytes * cluster.gamma


# Sizes at which the latency path's reach and halving are chosen across hosts (latency_plan): 1 KiB to
# MAX_LATENCY_REACH_BYTES.
LATENCY_SIZES = tuple(1 << k for k in range(10, config.MAX_LATENCY_REACH_BYTES.bit_length()))


def agreement_capacity(reach: int) -> int:
    """The bytes each agreement message may carry (the context's, the same on every rank: receives are posted at
    it) for a latency path that reaches `reach`: twice MAX_LATENCY_BYTES (an integer average carries remainders
    beside its data), more where auto's reach across hosts is farther, up to MAX_LATENCY_REACH_BYTES (a larger
    DDLFAST_SMALL_BYTES does not grow it: those calls go to MPI_Allreduce after the agreement). Each context keeps
    two message buffers of it and one of half."""
    return max(config.CREATION_AGREEMENT_BYTES, min(reach, config.MAX_LATENCY_REACH_BYTES))


def latency_plan(cluster: Cluster | None, ranks: int, one_host: bool, small_bytes: int,
                 agreed_call: Callable[[int], float], halving_setting: int | None = None,
                 oversubscribed: bool = False, shared_memory: bool = False) -> tuple[int, int]:
    """(halving_bytes, reach) of the latency path under DDLFAST_ALGORITHM=auto: it halves payloads from
    halving_bytes up (0: never; `halving_setting`, DDLFAST_HALVING_BYTES, decides where not None) and takes
    allreduces up to reach (at least `small_bytes`). `agreed_call(n)`: the seconds of the agreement and auto's
    algorithm for n bytes (predict_call above the small-message limit).
    - Where ranks outnumber cores (`oversubscribed`): no halving, reach config.MAX_LATENCY_BYTES. A step costs a
      scheduling of its partner there, and the butterfly's log2(P) steps beat the agreement plus a ring's or
      Rabenseifner's 2 log2(P) (2 cores, 16-64 KiB: 1.2-2.2x MPI_Allreduce's busbw at P = 3, 4, 8, the others
      0.7-1.0x).
    - On one host (`one_host`) with a core per rank, measured (config.DEFAULT_HALVING_BYTES):
      halving from 8 KiB, where the whole payload passes MPICH's shared-memory eager size, reach
      config.HALVING_REACH_BYTES for P > 2 (at P = 2 the ring's one step stays ahead).
    - Across hosts, this model: halving from the first of LATENCY_SIZES from which halving_seconds stays below
      butterfly_seconds, and reach the last of LATENCY_SIZES at which the latency path's form is faster than
      `agreed_call` (under SMPI's model, within 5 % of the simulated times at 64 ranks), up to
      config.MAX_LATENCY_REACH_BYTES. Below it the latency path takes only the sizes where it is faster too
      (latency_wins; modeled_reach): the two cross more than once (fattree-8gpu at 64 ranks: the ring with
      direct steps wins at 256 KiB, the latency path's halving at 128 KiB and 512 KiB-4 MiB). With no model (an
      irregular placement, `cluster` None), no halving and no reach beyond the limit.
    - On one host whose ranks share the agreement's memory (`shared_memory`, src/transport/shared_agreement.cc),
      measured on 2 cores against the butterfly and the ring: with a core per rank, reach config.MAX_LATENCY_BYTES
      (P = 2: 16-64 KiB 1.4-2.0x MPI_Allreduce's busbw, where the ring was 1.0x; past that the ring wins; on 16
      cores, P = 2-8, 4-64 KiB 1.2-2.5x), halving from 8 KiB for P > 2 and never at P = 2 (the whole payload is
      one exchange through the segment: 8 KiB 1.24-1.32x MPI's busbw against halving's 1.12-1.16x, 16 KiB
      2.50-2.58x against 2.31-2.38x, 32-64 KiB alike); oversubscribed (P = 4, 8), halving from
      config.SHARED_OVERSUBSCRIBED_HALVING_BYTES and reach config.SHARED_OVERSUBSCRIBED_REACH_BYTES (128 KiB-1 MiB
      1.3-2.2x, 2-4 MiB 1.7-2.0x, where the ring and the butterfly were 0.8-1.1x: one pass over shared memory
      instead of a scheduling of a partner per step; at 16 MiB, in pieces of 1 MiB, it was 0.84x against the
      ring's 0.99x).
      Without halving (a setting of 0) the reach stays config.MAX_LATENCY_BYTES."""
    if not modeled_reach(cluster, one_host, oversubscribed):
        return measured_latency_plan(ranks, one_host, small_bytes, halving_setting, oversubscribed, shared_memory)
    assert cluster is not None  # modeled_reach
    if halving_setting is not None:
        halving = halving_setting
    else:
        halving = 0
        for n in reversed(LATENCY_SIZES):
            if halving_seconds(cluster, n) >= latency_seconds(cluster, n):
                break
            halving = n
    reach = small_bytes
    for n in LATENCY_SIZES:
        if n > small_bytes and latency_wins(cluster, n, halving, agreed_call):
            reach = n
    return halving, reach


def modeled_reach(cluster: Cluster | None, one_host: bool, oversubscribed: bool) -> bool:
    """Whether latency_plan asks the cost model (across hosts, a core per rank, a regular placement): the latency
    path then takes the sizes up to its reach where latency_wins, elsewhere every size up to its reach."""
    return cluster is not None and not one_host and not oversubscribed


def latency_wins(cluster: Cluster, nbytes: int, halving_bytes: int, agreed_call: Callable[[int], float]) -> bool:
    """Whether the model predicts the latency path (halving from `halving_bytes` up) at least as fast as
    `agreed_call(nbytes)`, the agreement and auto's algorithm (latency_plan)."""
    return latency_seconds(cluster, nbytes, halving_bytes) <= agreed_call(nbytes)


def latency_takes(cluster: Cluster | None, one_host: bool, oversubscribed: bool, nbytes: int, small_bytes: int,
                  halving_bytes: int, reach: int, agreed_call: Callable[[int], float]) -> bool:
    """Whether the latency path takes an allreduce of `nbytes` under latency_plan's (halving_bytes, reach): at or
    below the small-message limit; up to the reach, every size where no model decides, else the sizes where
    latency_wins."""
    if nbytes <= small_bytes:
        return True
    if nbytes > reach:
        return False
    if not modeled_reach(cluster, one_host, oversubscribed):
        return True
    assert cluster is not None  # modeled_reach
    return latency_wins(cluster, nbytes, halving_bytes, agreed_call)


def measured_latency_plan(ranks: int, one_host: bool, small_bytes: int, halving_setting: int | None,
                          oversubscribed: bool, shared_memory: bool) -> tuple[int, int]:
    """latency_plan where no model decides: the measured policies (its docstring), and no reach beyond the limit
    without a model."""
    if shared_memory and one_host:
        if oversubscribed:
            halving = config.SHARED_OVERSUBSCRIBED_HALVING_BYTES if halving_setting is None else halving_setting
            reach = config.SHARED_OVERSUBSCRIBED_REACH_BYTES if halving else config.MAX_LATENCY_BYTES
        else:
            # Two ranks: the whole payload is one exchange through the segment, halving two.
            default = 0 if ranks == 2 else config.DEFAULT_HALVING_BYTES
            halving = default if halving_setting is None else halving_setting
            reach = config.MAX_LATENCY_BYTES
        return halving, max(small_bytes, reach)
    if oversubscribed:
        halving = 0 if halving_setting is None else halving_setting
        return halving, max(small_bytes, config.MAX_LATENCY_BYTES)
    if one_host:
        halving = config.DEFAULT_HALVING_BYTES if halving_setting is None else halving_setting
        return halving, max(small_bytes, config.HALVING_REACH_BYTES) if halving and ranks > 2 else small_bytes
    return halving_setting or 0, small_bytes


def auto_latency_plan(cluster: Cluster, dims: Sequence[int], reshape: bool = True,
                      small_bytes: int = config.DEFAULT_SMALL_BYTES) -> tuple[int, int]:
    """latency_plan for a job on `cluster` (a core per rank) whose auto dims are `dims`: what the simulator's
    driver and `python -m ddlfast.plan` show ddlfast running (topology.placement.Topology.latency_plan on a job)."""
    agreed_call = auto_agreed_call(cluster, dims, reshape)
    return latency_plan(cluster, cluster.ranks, cluster.hosts == 1, small_bytes, agreed_call)


def auto_agreed_call(cluster: Cluster, dims: Sequence[int], reshape: bool = True) -> Callable[[int], float]:
    """Predicted seconds of the agreement and auto's algorithm per call size, for a job on `cluster` whose auto dims
    are `dims` (latency_plan's `agreed_call`)."""
    def agreed_call(nbytes: int) -> float:
        choice = choose_algorithm(cluster, dims, nbytes, "auto", reshape)
        return predict_call(cluster, choice.dims, nbytes, 0, choice.direct)

    return agreed_call


def auto_latency_takes(cluster: Cluster, dims: Sequence[int], reshape: bool = True,
                       small_bytes: int = config.DEFAULT_SMALL_BYTES) -> Callable[[int], bool]:
    """Per call size, whether auto's latency path takes an allreduce of that many bytes for a job on `cluster` (a
    core per rank) whose auto dims are `dims` (topology.placement.Topology.latency_takes on a job); the plan is
    worked out once, here."""
    agreed_call = auto_agreed_call(cluster, dims, reshape)
    halving, reach = latency_plan(cluster, cluster.ranks, cluster.hosts == 1, small_bytes, agreed_call)
    return lambda nbytes: latency_takes(cluster, cluster.hosts == 1, False, nbytes, small_bytes, halving, reach,
                                        agreed_call)


def predict_call(cluster: Cluster, dims: Sequence[int], nbytes: float,
                 small_bytes: int = config.DEFAULT_SMALL_BYTES, direct: Sequence[int] = (),
                 halving_bytes: int = 0) -> float:
    """Predicted seconds of one ddlfast allreduce call as ddlfast.allreduce runs it: at or below `small_bytes`
    the latency path (the agreement's butterfly carrying the data; halving from `halving_bytes` up, 0 never),
    above it the agreement and then the ring (`direct` as in `predict`)."""
    if nbytes <= small_bytes:
        return latency_seconds(cluster, nbytes, halving_bytes)
    return butterfly_seconds(cluster, AGREEMENT_BYTES) + predict(cluster, dims, nbytes, direct).seconds


def factorizations(n: int, max_factors: int) -> list[tuple[int, ...]]:
    """Ordered factorizations of n into at most `max_factors` factors >= 2 (n = 1: the empty one)."""
    if n == 1:
        return [()]
    found = []
    if max_factors >= 1:
        found.append((n,))
    if max_factors >= 2:
        for first in range(2, n):
            if n % first == 0:
                found.extend((first, *rest) for rest in factorizations(n // first, max_factors - 1) if rest)
    return found


def all_shapes(ranks: int, max_dims: int = MAX_DIMS) -> list[tuple[int, ...]]:
    """Every ring shape of `ranks` with at most `max_dims` dimensions (unit dimensions dropped)."""
    return sorted((shape or (1,) for shape in factorizations(ranks, max_dims)), key=lambda s: (len(s), s))


def rank(predictions: Iterable[Prediction]) -> list[Prediction]:
    return sorted(predictions, key=lambda p: (p.seconds, len(p.dims), p.dims))


def choose(predictions: Sequence[Prediction], tie: float = TIE_FRACTION) -> Prediction:
    """The fastest shape; among those within `tie` of it, the one with fewest dimensions."""
    best = min(p.seconds for p in predictions)
    near = [p for p in predictions if p.seconds <= best * (1 + tie)]
    return min(near, key=lambda p: (len(p.dims), p.seconds, p.dims))


def plan(cluster: Cluster, nbytes: float, max_dims: int = MAX_DIMS) -> tuple[Prediction, list[Prediction]]:
    """auto's pick for `nbytes`, and the predictions of every shape (fastest first)."""
    predictions = rank(predict(cluster, shape, nbytes) for shape in all_shapes(cluster.ranks, max_dims))
    return choose(predictions), predictions


# -- the algorithm per call size ------------------------------------------------------------------------------------

# A compressed dimension takes the direct reduce-scatter (one rounding per dimension instead of one per hop) unless
# it is predicted slower than the ring by more than this fraction.
DIRECT_COMPRESSED_SLACK = 0.05


@dataclass(frozen=True)
class Algorithm:
    """How one call of a given size runs: the ring dims and, per dimension, a direct (1) or ring (0)
    reduce-scatter; () is the ring everywhere."""

    name: str  # "ring", "direct" (some dimension direct), "rabenseifner" (dims all 2), "latency", "mpi"
    dims: tuple[int, ...]
    direct: tuple[int, ...] = ()
    seconds: float = field(default=0.0, compare=False)  # predicted (0 where nothing was predicted)

    def __str__(self) -> str:
        if self.name in ("latency", "mpi"):
            return self.name
        shape = "x".join(map(str, self.dims))
        if self.name == "direct":
            which = [str(i + 1) for i, d in enumerate(self.direct) if d and self.dims[i] > 1]
            if len(which) < sum(1 for d in self.dims if d > 1):
                return f"ring {shape}, direct reduce-scatter in dim {','.join(which)}"
        return f"{self.name} {shape}"


def power_of_two_dims(ranks: int) -> tuple[int, ...] | None:
    """All-2 dims (the k-dim ring as Rabenseifner's halving/doubling), or None where `ranks` is no power of 2."""
    if ranks < 2 or ranks & (ranks - 1):
        return None
    return (2,) * (ranks.bit_length() - 1)


def choose_algorithm(cluster: Cluster | None, dims: Sequence[int], nbytes: float, algorithm: str = "auto",
                     reshape: bool = True, compressed: Sequence[bool] = ()) -> Algorithm:
    """The algorithm (DDLFAST_ALGORITHM, ddlfast/config.py) a call of `nbytes` runs with on ring `dims`: a pure
    function of values every rank shares (the size, the dims, the settings and the topology), so every rank
    chooses the same.

    auto: per dimension the direct reduce-scatter where it is predicted faster than the ring by more than the
    tie fraction (a `compressed` dimension: unless slower by more than DIRECT_COMPRESSED_SLACK), and, where
    `reshape` allows another shape (dims chosen by auto, an uncompressed wire) and P is a power of two, all-2
    dims where those are faster still. Without a cluster (an irregular placement): the ring. Raises PlanError
    for rabenseifner on a P that is no power of two."""
    dims = tuple(int(d) for d in dims)
    ranks = int(np.prod(dims))
    if algorithm in ("latency", "mpi", "ring"):
        return Algorithm(algorithm, dims)
    if algorithm == "direct":
        return Algorithm("direct", dims, (1,) * len(dims))
    halving = power_of_two_dims(ranks)
    if algorithm == "rabenseifner":
        if ranks == 1:
            return Algorithm("ring", dims)  # nothing moves
        if halving is None:
            raise PlanError(f"rabenseifner needs a power-of-two rank count, not {ranks}")
        return Algorithm("rabenseifner", halving)
    if algorithm != "auto":
        raise PlanError(f"unknown algorithm {algorithm!r}")
    if cluster is None or ranks != cluster.ranks or ranks == 1:
        return Algorithm("ring", dims)
    ring = predict(cluster, dims, nbytes)
    everywhere = predict(cluster, dims, nbytes, (1,) * len(dims))
    direct = []
    for i, size in enumerate(dims):
        slack = DIRECT_COMPRESSED_SLACK if i < len(compressed) and compressed[i] else -TIE_FRACTION
        direct.append(int(size > 2 and everywhere.per_dim[i] <= ring.per_dim[i] * (1 + slack)))
    best = (Algorithm("direct", dims, tuple(direct), float(sum(everywhere.per_dim[i] if d else ring.per_dim[i]
                                                               for i, d in enumerate(direct))))
            if any(direct) else Algorithm("ring", dims, (), ring.seconds))
    if reshape and halving is not None and halving != dims and not any(compressed):
        halved = predict(cluster, halving, nbytes)
        if halved.seconds < best.seconds * (1 - TIE_FRACTION):
            best = Algorithm("rabenseifner", halving, (), halved.seconds)
    return best


def step_efficiency(compute_s: float, allreduce_s: float, overlap: float = 0.0) -> float:
    """Scaling efficiency of a data-parallel step: compute / (compute + allreduce time not hidden behind the
    `overlap` fraction of compute)."""
    if compute_s <= 0:
        return 0.0
    exposed = max(0.0, allreduce_s - overlap * compute_s)
    return compute_s / (compute_s + exposed)


def link_bound(cluster: Cluster, nbytes: float) -> float:
    """Seconds for the bytes each host must send, `2(h-1)/h * S`, at the host link's rate."""
    return 2 * (cluster.hosts - 1) / cluster.hosts * nbytes * cluster.inter.beta


# -- command line -------------------------------------------------------------------------------------------------
