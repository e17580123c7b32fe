"""Measure each tier's link at first use: a short ping-pong, cached under a topology fingerprint.

Tiers: `intra` (two ranks of host 0), `inter` (first ranks of hosts 0 and 1) and, with racks, `group` (host 0
and the first host of group 1). Latency is half the round trip of 8 bytes; seconds per byte is the slope between
two large sizes (fastest of a few round trips each), which cancels latency and a shaper's burst allowance. One
rank times a reduction for gamma.

Everything here is bounded: requests are polled against one deadline (DDLFAST_PROBE_TIMEOUT_S, default 30 s)
and a rank that does not answer makes every waiting rank raise DdlfastTimeoutError instead of hanging.

DDLFAST_PROBE: `1` (default) measure unless cached, `0` skip and use defaults, `force` measure and re-cache.
The cache lives in $DDLFAST_CACHE_DIR (default ~/.cache/ddlfast); rank 0 alone reads and writes it and tells
the others, so hosts with different home directories still agree.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ddlfast.errors import DdlfastError, DdlfastTimeoutError
from ddlfast.plan import DEFAULT_GAMMA, DEFAULT_INTER, DEFAULT_INTRA, Link

SMALL_BYTES = 8
LARGE_BYTES = (1 << 20, 4 << 20)
ROUND_TRIPS_SMALL = 20
ROUND_TRIPS_LARGE = 4
DEFAULT_TIMEOUT_S = 30.0
CACHE_VERSION = 1
TIERS = ("intra", "inter", "group")
_IDLE_POLL_S = 1e-3  # ranks that only wait leave the CPU to the pair that measures


@dataclass(frozen=True)
class Links:
    """Per-tier links (None: the tier does not exist here) and seconds per byte reduced."""

    intra: Link | None
    inter: Link | None
    group: Link | None
    gamma: float
    source: str  # "probe", "cache", "defaults", "defaults (DDLFAST_PROBE=0)"

    def as_dict(self) -> dict:
        tiers = {t: None if getattr(self, t) is None else [getattr(self, t).alpha, getattr(self, t).beta]
                 for t in TIERS}
        return {**tiers, "gamma": self.gamma, "source": self.source}


def default_links(pairs: dict[str, tuple[int, int]], source: str) -> Links:
    return Links(
        Link(*DEFAULT_INTRA) if "intra" in pairs else None,
        Link(*DEFAULT_INTER) if "inter" in pairs else None,
        Link(*DEFAULT_INTER) if "group" in pairs else None,
        DEFAULT_GAMMA, source,
    )


def probe_mode() -> str:
    raw = os.environ.get("DDLFAST_PROBE", "1").strip().lower() or "1"
    if raw not in ("0", "1", "force"):
        raise DdlfastError(f"DDLFAST_PROBE={raw!r} must be 1 (measure unless cached), 0 (skip) or force")
    return raw


def probe_timeout() -> float:
    raw = os.environ.get("DDLFAST_PROBE_TIMEOUT_S", "").strip()
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise DdlfastError(f"DDLFAST_PROBE_TIMEOUT_S={raw!r} must be a number of seconds > 0")
    return value


def cache_dir() -> Path:
    raw = os.environ.get("DDLFAST_CACHE_DIR", "").strip()
    return Path(raw) if raw else Path.home() / ".cache" / "ddlfast"


# -- bounded waiting ----------------------------------------------------------------------------------------------


def wait_all(requests: list[MPI.Request], deadline: float, what: str, idle: bool = False) -> None:
    """Testall until done or `deadline` (time.monotonic); on timeout cancel what can be and raise."""
    while not MPI.Request.Testall(requests):
        if time.monotonic() > deadline:
            _cancel(requests)
            raise DdlfastTimeoutError(
                f"ddlfast topology probe: {what} did not complete within the probe's time limit "
                f"(DDLFAST_PROBE_TIMEOUT_S); a rank is unreachable or stalled. DDLFAST_PROBE=0 skips the probe."
            )
        if idle:
            time.sleep(_IDLE_POLL_S)


def _cancel(requests: list[MPI.Request]) -> None:
    """Cancel and, where that completes them (receives do at once), free; what cannot be cancelled is left."""
    for request in requests:
        try:
            request.Cancel()
        except MPI.Exception:
            pass
    give_up = time.monotonic() + 0.5
    while not MPI.Request.Testall(requests) and time.monotonic() < give_up:
        time.sleep(_IDLE_POLL_S)


def _ping_pong(comm: MPI.Comm, peer: int, leader: bool, nbytes: int, trips: int, deadline: float, tag: int) -> float:
    """Fastest round trip in seconds (on the leader; the follower returns 0). The minimum, not the median: on a
    busy machine a preempted rank only ever adds time."""
    buffer = np.zeros(max(nbytes, 1), dtype=np.uint8)
    times = []
    for _ in range(trips):
        start = time.perf_counter()
        if leader:
            wait_all([comm.Isend(buffer, peer, tag)], deadline, f"ping to rank {peer}")
            wait_all([comm.Irecv(buffer, peer, tag)], deadline, f"pong from rank {peer}")
        else:
            wait_all([comm.Irecv(buffer, peer, tag)], deadline, f"ping from rank {peer}")
            wait_all([comm.Isend(buffer, peer, tag)], deadline, f"pong to rank {peer}")
        times.append(time.perf_counter() - start)
    return min(times)


def _measure_pair(comm: MPI.Comm, peer: int, leader: bool, deadline: float, tag: int) -> tuple[float, float]:
    """(alpha, beta) on the leader, zeros on the follower."""
    _ping_pong(comm, peer, leader, SMALL_BYTES, 2, deadline, tag)  # warm up the connection
    small = _ping_pong(comm, peer, leader, SMALL_BYTES, ROUND_TRIPS_SMALL, deadline, tag)
    low, high = (_ping_pong(comm, peer, leader, n, ROUND_TRIPS_LARGE, deadline, tag) for n in LARGE_BYTES)
    if not leader:
        return 0.0, 0.0
    alpha = small / 2
    whole = max(high / 2 - alpha, 1e-12) / LARGE_BYTES[1]  # slightly optimistic under a shaper's burst
    slope = (high - low) / 2 / (LARGE_BYTES[1] - LARGE_BYTES[0])
    # On a loaded machine one slow round trip can swamp the difference; then trust the whole transfer.
    return alpha, slope if 0.5 * whole <= slope <= 2 * whole else whole


def _measure_gamma() -> float:
    from ddlfast import _core
    from ddlfast.dtypes import DTYPE_CODES

    count = 1 << 20
    dst, src = np.ones(count, np.float32), np.ones(count, np.float32)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        _core.reduce_into(dst.ctypes.data, src.ctypes.data, count, DTYPE_CODES["float32"])
        best = min(best, time.perf_counter() - start)
    return best / dst.nbytes


def measure(comm: MPI.Intracomm, pairs: dict[str, tuple[int, int]], timeout_s: float) -> Links:
    """Collective over `comm`: ping-pong each tier's pair in turn, then share the results."""
    deadline = time.monotonic() + timeout_s
    values = np.full(2 * len(TIERS) + 1, -1.0)
    for index, tier in enumerate(TIERS):
        if tier not in pairs:
            continue
        leader, follower = pairs[tier]
        # One pair at a time, the others asleep: the tiers must not share links or cores while measured.
        wait_all([comm.Ibarrier()], deadline, f"the start of the {tier} probe", idle=True)
        if comm.rank in (leader, follower):
            is_leader = comm.rank == leader
            alpha, beta = _measure_pair(comm, follower if is_leader else leader, is_leader, deadline, 100 + index)
            if is_leader:
                values[2 * index: 2 * index + 2] = alpha, beta
    if comm.rank == 0:
        values[-1] = _measure_gamma()
    shared = np.empty_like(values)
    wait_all([comm.Iallreduce(values, shared, op=MPI.MAX)], deadline, "sharing the probe's results", idle=True)
    links = [Link(float(shared[2 * i]), float(shared[2 * i + 1])) if tier in pairs and shared[2 * i + 1] > 0
             else None for i, tier in enumerate(TIERS)]
    return Links(*links, gamma=float(shared[-1]) if shared[-1] > 0 else DEFAULT_GAMMA, source="probe")


# -- cache ----------------------------------------------------------------------------------------------------------


def fingerprint(description: dict) -> str:
    text = json.dumps({"version": CACHE_VERSION, **description}, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def _read_cache(key: str) -> Links | None:
    try:
        data = json.loads((cache_dir() / f"probe-{key}.json").read_text())
        tiers = [None if data[t] is None else Link(float(data[t][0]), float(data[t][1])) for t in TIERS]
        return Links(*tiers, gamma=float(data["gamma"]), source="cache")
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def _write_cache(key: str, links: Links) -> None:
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        temporary = directory / f".probe-{key}.{os.getpid()}.tmp"
        temporary.write_text(json.dumps({**links.as_dict(), "written": time.time()}))
        os.replace(temporary, directory / f"probe-{key}.json")
    except OSError:
        pass  # a read-only home only costs a probe next time


def links_for(comm: MPI.Intracomm, pairs: dict[str, tuple[int, int]], description: dict,
              force: bool = False) -> Links:
    """Collective: the cached links for this topology, else a fresh probe (DDLFAST_PROBE decides)."""
    mode = "force" if force else probe_mode()
    if mode == "0":
        return default_links(pairs, "defaults (DDLFAST_PROBE=0)")
    if not pairs:
        return default_links(pairs, "defaults (nothing to probe)")
    key = fingerprint(description)
    cached = _read_cache(key) if comm.rank == 0 and mode == "1" else None
    cached = comm.bcast(cached, root=0)
    if cached is not None:
        return cached
    links = measure(comm, pairs, probe_timeout())
    if comm.rank == 0:
        _write_cache(key, links)
    return links
