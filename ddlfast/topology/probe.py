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

The cache is untrusted input (a shared or planted directory, a truncated write, a hand edit): rank 0 reads it
without following links, only from a regular file of its own user, at most CACHE_MAX_BYTES, checks the nesting
before parsing and every value after, and on any doubt warns and probes again. It then sends the others a fixed
array of floats, never an object, so nothing in the file can make rank 0 fail alone while the others wait. The
file is written to a fresh temporary file (0600, in a 0700 directory when ddlfast creates it) that is then
renamed over the old one: a planted link at either name is replaced, never followed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ddlfast import _core, config
from ddlfast.buffers.dtypes import DTYPE_CODES
from ddlfast.errors import DdlfastTimeoutError
from ddlfast.files import replace_file
from ddlfast.topology.cost_model import DEFAULT_GAMMA, DEFAULT_INTER, DEFAULT_INTRA, Link

SMALL_BYTES = 8
LARGE_BYTES = (1 << 20, 4 << 20)
ROUND_TRIPS_SMALL = 20
ROUND_TRIPS_LARGE = 4
DEFAULT_TIMEOUT_S = config.DEFAULT_PROBE_TIMEOUT_S
CACHE_VERSION = 1
CACHE_MAX_BYTES = 64 << 10  # a valid file is ~200 bytes
CACHE_MAX_DEPTH = 4  # a valid file nests 2 deep; deeper JSON would only exercise json's recursion
# What a measured value may be, in seconds: latency per message, per byte sent (>= 1 kB/s), per byte reduced.
ALPHA_RANGE = (1e-9, 1.0)
BETA_RANGE = (1e-30, 1e-3)  # a fast link measured under load can come out tiny; still positive
GAMMA_RANGE = (1e-30, 1e-3)
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
    return config.probe_mode()


def probe_timeout() -> float:
    return config.probe_timeout_s()


def cache_dir() -> Path:
    return config.cache_dir()


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


class CacheWarning(UserWarning):
    """The probe cache could not be used; ddlfast probes again."""


class _BadCache(ValueError):
    pass


def _cache_path(key: str) -> Path:
    return cache_dir() / f"probe-{key}.json"


def _read_cache(key: str, tiers: tuple[str, ...] | None = None) -> Links | None:
    """The cached links, or None: missing (silently) or unusable (with a CacheWarning). Never raises.

    tiers: the tiers this job probes; a file whose tiers differ is unusable."""
    path = _cache_path(key)
    try:
        text = _read_small_file(path)
        if text is None:
            return None
        return _links_from_json(text, tiers)
    except Exception as error:  # anything in the file, or the file system, only costs a probe
        warnings.warn(f"ddlfast: ignoring the probe cache {path}: {error}; measuring again", CacheWarning,
                      stacklevel=2)
        return None


def _read_small_file(path: Path) -> str | None:
    """The file's text; None when it does not exist. Refuses links, non-regular files, other users' files and
    files over CACHE_MAX_BYTES (raises _BadCache or OSError)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as error:
        if os.path.islink(path):
            raise _BadCache("it is a symbolic link") from None
        raise error
    with os.fdopen(descriptor, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise _BadCache("it is not a regular file")
        if hasattr(os, "getuid") and info.st_uid != os.getuid():
            raise _BadCache(f"it belongs to user id {info.st_uid}, not to this user")
        data = file.read(CACHE_MAX_BYTES + 1)
    if len(data) > CACHE_MAX_BYTES:
        raise _BadCache(f"it is larger than {CACHE_MAX_BYTES} bytes")
    return data.decode("utf-8")


def _nesting_depth(text: str) -> int:
    """How deep JSON arrays and objects nest in `text` (brackets inside strings ignored)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > CACHE_MAX_DEPTH:
                return deepest
        elif char in "]}":
            depth -= 1
    return deepest


def _number(value: object, what: str, bounds: tuple[float, float]) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _BadCache(f"{what} is {value!r}, not a number")
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range
        number = math.inf
    if not (math.isfinite(number) and bounds[0] <= number <= bounds[1]):
        raise _BadCache(f"{what}={value!r} is outside {bounds[0]:g}..{bounds[1]:g}")
    return number


def _links_from_json(text: str, tiers: tuple[str, ...] | None) -> Links:
    """Parse and validate a cache file's text (raises _BadCache or ValueError)."""
    if _nesting_depth(text) > CACHE_MAX_DEPTH:
        raise _BadCache(f"its JSON nests deeper than {CACHE_MAX_DEPTH} levels")
    # NaN and Infinity are JSON extensions Python accepts; a cache never holds them.
    data = json.loads(text, parse_constant=lambda name: _reject_constant(name))
    if not isinstance(data, dict):
        raise _BadCache("it is not a JSON object")
    links = []
    for tier in TIERS:
        if tier not in data:
            raise _BadCache(f"it has no {tier!r} entry")
        entry = data[tier]
        if entry is None:
            links.append(None)
            continue
        if not isinstance(entry, list) or len(entry) != 2:
            raise _BadCache(f"{tier} is {entry!r}, not [alpha, beta]")
        links.append(Link(_number(entry[0], f"{tier} alpha", ALPHA_RANGE),
                          _number(entry[1], f"{tier} beta", BETA_RANGE)))
    gamma = _number(data.get("gamma"), "gamma", GAMMA_RANGE)
    if tiers is not None:
        present = tuple(t for t, link in zip(TIERS, links, strict=True) if link is not None)
        if present != tuple(t for t in TIERS if t in tiers):
            raise _BadCache(f"it holds the tiers {present or '()'} but this job has {tuple(tiers) or '()'}")
    return Links(*links, gamma=gamma, source="cache")


def _reject_constant(name: str) -> float:
    raise _BadCache(f"it holds {name}")


def _write_cache(key: str, links: Links) -> None:
    """Atomically replace the cache file; never follows a link, never raises for file-system trouble."""
    directory = cache_dir()
    try:
        if not directory.exists():
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        replace_file(directory / f"probe-{key}.json",
                     json.dumps({**links.as_dict(), "written": time.time()}, allow_nan=False))
    except (OSError, ValueError):
        pass  # a read-only home only costs a probe next time


# What rank 0 sends the others: [hit, intra alpha, intra beta, inter alpha, inter beta, group alpha, group beta,
# gamma]; -1 for a tier that is absent. Plain floats, so the broadcast cannot fail on one rank alone.
_WIRE_SIZE = 2 + 2 * len(TIERS)


def _to_wire(links: Links | None) -> np.ndarray:
    values = np.full(_WIRE_SIZE, -1.0)
    if links is not None:
        values[0] = 1.0
        for i, tier in enumerate(TIERS):
            link = getattr(links, tier)
            if link is not None:
                values[1 + 2 * i: 3 + 2 * i] = link.alpha, link.beta
        values[-1] = links.gamma
    return values


def _from_wire(values: np.ndarray) -> Links | None:
    if values[0] != 1.0:
        return None
    tiers = [Link(float(values[1 + 2 * i]), float(values[2 + 2 * i])) if values[2 + 2 * i] > 0 else None
             for i in range(len(TIERS))]
    return Links(*tiers, gamma=float(values[-1]), source="cache")


def links_for(comm: MPI.Intracomm, pairs: dict[str, tuple[int, int]], description: dict,
              force: bool = False) -> Links:
    """Collective: the cached links for this topology, else a fresh probe (DDLFAST_PROBE decides)."""
    mode = "force" if force else probe_mode()
    if mode == "0":
        return default_links(pairs, "defaults (DDLFAST_PROBE=0)")
    if not pairs:
        return default_links(pairs, "defaults (nothing to probe)")
    timeout_s = probe_timeout()
    key = fingerprint(description)
    values = _to_wire(_read_cache(key, tuple(pairs)) if comm.rank == 0 and mode == "1" else None)
    wait_all([comm.Ibcast(values, root=0)], time.monotonic() + timeout_s, "sharing the probe cache", idle=True)
    cached = _from_wire(values)
    if cached is not None:
        return cached
    links = measure(comm, pairs, timeout_s)
    if comm.rank == 0:
        _write_cache(key, links)
    return links
