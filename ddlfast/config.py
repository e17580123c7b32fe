"""DDLFAST_* environment parameters: parsed and validated in one place.

API arguments override the environment; a malformed value raises DdlfastError
naming the variable, the value and what would be accepted.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from ddlfast.errors import DdlfastError

_SIZE_PATTERN = re.compile(r"^\s*(\d+)\s*([kmg]i?b?|b)?\s*$", re.IGNORECASE | re.ASCII)
# Binary for KiB/MiB/GiB (and the bare K/M/G that nccl-tests reads as binary), decimal for KB/MB/GB (SI, as the
# issue and every disk vendor spell them); case does not matter.
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
_MAX_DIGITS = 30  # int() of a long digit string is slow, and above 4300 digits a ValueError

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30

# Defaults chosen from measurements on the 2-core development machine (see README).
DEFAULT_BUCKET_BYTES = 64 << 20
DEFAULT_FIRST_BUCKET_BYTES = 1 << 20
DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_SMALL_BYTES = 8 << 10
DEFAULT_RECEIVES_IN_FLIGHT = 4
# Generous for one message on a slow link, short enough that a missing rank is named promptly.
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_PROBE_TIMEOUT_S = 30.0
DEFAULT_TIMELINE_MAX_EVENTS = 100_000
DEFAULT_FLIGHT_RECORDS = 2000
# A collective names a rank as the one the others waited for only when it held them longer than this (the
# spread of waits below it is scheduling noise: docs/observe.md has the measurement).
STRAGGLER_NOISE_S = 0.002

# Accepted ranges, inclusive (docs/configuration.md is the table users read; tests/unit/test_config.py checks
# that both agree). Every upper bound keeps a value inside what the C++ core takes (int, size_t, double) and
# what one rank can afford to allocate; every lower bound excludes settings that only make things pathological
# (DDLFAST_CHUNK_BYTES=8 costs gigabytes of request bookkeeping for a 16 MiB allreduce).
MIN_CHUNK_BYTES = 4 * KIB  # a module attribute so that test programs may lower it (the fuzz cuts tiny chunks)
MAX_CHUNK_BYTES = GIB
MAX_BUCKET_BYTES = 16 * GIB
MAX_SMALL_BYTES = GIB  # MPI_Allreduce's int count stays below INT_MAX for every dtype
# The latency path carries a buffer of at most DDLFAST_SMALL_BYTES inside the agreement's messages
# (src/transport/agreement_exchange.cc) when its bytes on the wire fit twice this (an integer average carries its
# remainders too, twice its bytes); each context keeps two message buffers that size. Larger "small" buffers go to
# MPI_Allreduce after the agreement.
MAX_LATENCY_BYTES = 64 * KIB
# The bytes each context's agreement messages carry from its creation (twice MAX_LATENCY_BYTES, as above).
CREATION_AGREEMENT_BYTES = 2 * MAX_LATENCY_BYTES
# Across hosts the cost model may send auto's allreduces farther to the latency path, up to this
# (cost_model.latency_plan: its halving form is Rabenseifner's with the agreement in the halving steps' headers);
# the context's message buffers then grow to that (cost_model.agreement_capacity).
MAX_LATENCY_REACH_BYTES = 4 * MIB
MIN_RECEIVES_IN_FLIGHT, MAX_RECEIVES_IN_FLIGHT = 2, 1024
MAX_SCRATCH_BYTES = 4 * GIB  # receive scratch per phase = receives in flight x chunk bytes
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 0.1, 7 * 24 * 3600.0  # 0 (wait forever) is accepted too
MIN_PROBE_TIMEOUT_S, MAX_PROBE_TIMEOUT_S = 0.1, 3600.0
MAX_TIMELINE_MAX_EVENTS = 10_000_000  # ~150 bytes each in memory before a flush
MAX_HOSTS_PER_GROUP = 1 << 20
MAX_RING_DIMS = 32  # dimensions in a shape, and codecs in a per-dimension compression list
MAX_RING_DIM = (1 << 31) - 1  # ranks in one dimension: an MPI rank count (int)
# A wait neither answers a stall census nor checks the stall limit while it spins, so a spin stays below the
# smallest accepted DDLFAST_TIMEOUT_S (0.1 s).
MAX_SPIN_US = 100_000
MAX_FLIGHT_RECORDS = 100_000  # ~370 bytes each in the file: 37 MB, well below the merge tool's 512 MiB
MIN_STRAGGLER_WARN_S, MAX_STRAGGLER_WARN_S = 0.001, 7 * 24 * 3600.0


def format_size(value: int) -> str:
    """4096 -> '4 KiB', 1536 -> '1536 bytes' (for messages and reports)."""
    for unit, name in ((GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")):
        if value >= unit and value % unit == 0:
            return f"{value // unit} {name}"
    return f"{value} bytes" if value != 1 else "1 byte"


def parse_size(text: str, name: str, accepted: str = "") -> int:
    """'4096', '512KiB', '64M', '1g' -> bytes: KiB/MiB/GiB (and K/M/G) binary, KB/MB/GB decimal ('64MB' is
    64,000,000). The one size parser: DDLFAST_*_BYTES, bench, plan, simulate and the demo all read sizes here.
    `accepted` (the range) is added to errors."""
    match = _SIZE_PATTERN.match(str(text))
    if not match:
        raise DdlfastError(f"{name}={text!r} is not a byte size; use e.g. 1048576, 512KiB or 64MiB{accepted}")
    digits = match.group(1).lstrip("0") or "0"
    if len(digits) > _MAX_DIGITS:
        raise DdlfastError(f"{name}={text!r} is out of range ({len(digits)} digits){accepted}")
    return int(digits) * _SIZE_UNITS[(match.group(2) or "").lower()]


def parse_dims(value: object, name: str = "dims") -> str | tuple[int, ...]:
    """'flat' | 'auto' | '4x2' | (4, 2) -> 'flat' or a tuple of ints (validated >= 1)."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("flat", "auto"):
            return text
        parts = text.split("x")
        if len(parts) > MAX_RING_DIMS or any(len(part.strip()) > _MAX_DIGITS for part in parts):
            raise DdlfastError(f"{name}={value!r} is out of range: accepted 1 to {MAX_RING_DIMS} dimensions of "
                               f"1 to {MAX_RING_DIM} ranks each")
        if not all(part.strip().isascii() and part.strip().isdecimal() for part in parts):
            raise DdlfastError(f"{name}={value!r} is not 'flat', 'auto' or a shape like '4x2'")
        dims = tuple(int(part) for part in parts)
    elif isinstance(value, (tuple, list)):
        if not value or not all(isinstance(d, int) and not isinstance(d, bool) for d in value):
            raise DdlfastError(f"{name}={value!r} must be a non-empty sequence of ints")
        dims = tuple(value)
    else:
        raise DdlfastError(f"{name}={value!r} must be 'flat', 'auto', '4x2' or a tuple of ints")
    if any(d < 1 for d in dims):
        raise DdlfastError(f"{name}={value!r}: every ring dimension must be >= 1")
    if len(dims) > MAX_RING_DIMS or any(d > MAX_RING_DIM for d in dims):
        raise DdlfastError(f"{name}={value!r} is out of range: accepted 1 to {MAX_RING_DIMS} dimensions of "
                           f"1 to {MAX_RING_DIM} ranks each")
    return dims


WIRE_CODECS = ("none", "fp16", "bf16", "auto")
# DDLFAST_ALGORITHM: auto (the cost model per call size, ddlfast/topology/cost_model.py), latency and mpi (the
# small-message paths), ring, rabenseifner (ring dims all 2) and direct (direct reduce-scatter in every dimension).
ALGORITHMS = ("auto", "latency", "mpi", "ring", "rabenseifner", "direct")


def parse_compression(value: object, name: str = "compression") -> tuple[str, ...]:
    """None | 'none' | 'fp16' | 'bf16' | 'auto' | 'none,fp16' (one per ring dimension) -> names."""
    if value is None:
        return ("none",)
    if isinstance(value, str):
        names = tuple(part.strip().lower() for part in value.split(",")) if value.strip() else ("none",)
    elif isinstance(value, (tuple, list)) and value and all(isinstance(v, str) for v in value):
        names = tuple(v.strip().lower() for v in value)
    else:
        raise DdlfastError(f"{name}={value!r} must be None, a codec name or a codec object")
    for codec in names:
        if codec not in WIRE_CODECS:
            raise DdlfastError(f"{name}={value!r}: unknown codec {codec!r}; use {', '.join(WIRE_CODECS)} "
                               "(comma-separated per ring dimension), or a ddlfast.compression.Codec")
    if len(names) > MAX_RING_DIMS:
        raise DdlfastError(f"{name}={value!r}: at most {MAX_RING_DIMS} codecs (one per ring dimension)")
    if "auto" in names and len(names) > 1:
        raise DdlfastError(f"{name}={value!r}: 'auto' stands alone")
    return names


def _raw(name: str, environ: Mapping[str, str] | None) -> str | None:
    """The variable's text, or None when unset or blank (both mean the default)."""
    raw = (os.environ if environ is None else environ).get(name)
    return None if raw is None or raw.strip() == "" else raw


def _env_size(name: str, default: int, minimum: int, maximum: int,
              environ: Mapping[str, str] | None = None) -> int:
    raw = _raw(name, environ)
    if raw is None:
        return default
    accepted = f"{format_size(minimum)} to {format_size(maximum)} ({maximum} bytes)"
    value = parse_size(raw, name, f"; accepted {accepted}")
    if not minimum <= value <= maximum:
        raise DdlfastError(f"{name}={raw!r} is out of range: accepted {accepted}")
    return value


def _env_int(name: str, default: int, minimum: int, maximum: int, environ: Mapping[str, str] | None = None) -> int:
    raw = _raw(name, environ)
    if raw is None:
        return default
    text = raw.strip()
    if not (text.isascii() and text.isdecimal()):
        raise DdlfastError(f"{name}={raw!r} is not an integer; accepted integers {minimum} to {maximum}")
    if len(text.lstrip("0")) > _MAX_DIGITS or not minimum <= int(text) <= maximum:
        raise DdlfastError(f"{name}={raw!r} is out of range: accepted integers {minimum} to {maximum}")
    return int(text)


def _env_seconds(name: str, default: float, minimum: float, maximum: float, zero_means_forever: bool,
                 environ: Mapping[str, str] | None = None) -> float:
    raw = _raw(name, environ)
    if raw is None:
        return default
    forever = " (or 0: no limit)" if zero_means_forever else ""
    try:
        value = float(raw) if len(raw) <= 64 else float("nan")
    except ValueError:
        raise DdlfastError(f"{name}={raw!r} is not a number of seconds; accepted {minimum:g} to {maximum:g}"
                           f"{forever}") from None
    if zero_means_forever and value == 0:
        return 0.0
    if not minimum <= value <= maximum:  # NaN fails too
        raise DdlfastError(f"{name}={raw!r} is out of range: accepted {minimum:g} to {maximum:g} seconds{forever}")
    return value


def _env_choice(name: str, default: str, choices: dict[str, str], environ: Mapping[str, str] | None = None) -> str:
    """A keyword variable; `choices` maps each accepted spelling (lower case) to its meaning."""
    raw = _raw(name, environ)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise DdlfastError(f"{name}={raw!r}: accepted {', '.join(sorted(set(choices)))}")
    return choices[value]


@dataclass(frozen=True)
class Settings:
    bucket_bytes: int
    first_bucket_bytes: int
    chunk_bytes: int
    small_bytes: int
    receives_in_flight: int
    ring_dims: str | tuple[int, ...]
    timeout_s: float
    compression: tuple[str, ...]  # one codec name, or one per ring dimension
    algorithm: str = "auto"  # DDLFAST_ALGORITHM: one of ALGORITHMS
    # DDLFAST_REPRODUCIBLE / reproducible=: one canonical summation order (rank order at each element's owner),
    # so the bits depend only on the inputs and the rank count (docs/numerics.md)
    reproducible: bool = False


_VARIABLES = (
    "DDLFAST_COMPRESSION", "DDLFAST_BUCKET_BYTES", "DDLFAST_FIRST_BUCKET_BYTES", "DDLFAST_CHUNK_BYTES",
    "DDLFAST_SMALL_BYTES", "DDLFAST_RECEIVES_IN_FLIGHT", "DDLFAST_RING_DIMS", "DDLFAST_TIMEOUT_S",
    "DDLFAST_ALGORITHM", "DDLFAST_REPRODUCIBLE",
)
# Every DDLFAST_* name ddlfast, its build and its test tools read; any other is
# most likely a typo that would otherwise be ignored silently.
# What the library reads (each parsed by check_environment() at context creation).
RUNTIME_VARIABLES = frozenset(_VARIABLES + (
    "DDLFAST_ABORT_ON_STALL", "DDLFAST_TIMELINE", "DDLFAST_TIMELINE_MAX_EVENTS", "DDLFAST_PROBE",
    "DDLFAST_PROBE_TIMEOUT_S", "DDLFAST_CACHE_DIR", "DDLFAST_HOSTS_PER_GROUP", "DDLFAST_EMULATED_HOSTS",
    "DDLFAST_CUDA_AWARE_MPI", "DDLFAST_GPU_RING_MIN_BYTES", "DDLFAST_HALVING_BYTES",
    "DDLFAST_SPIN_US", "DDLFAST_ALLOW_SINGLE", "DDLFAST_STRAGGLER_WARN_S", "DDLFAST_FLIGHT_RECORDS",
    "DDLFAST_FLIGHT_DIR", "DDLFAST_DEBUG", "DDLFAST_SHARED_MEMORY",
))
# Build and test tooling.
TOOLING_VARIABLES = frozenset((
    "DDLFAST_CUDA", "DDLFAST_MPICC", "DDLFAST_MPI", "DDLFAST_VENV", "DDLFAST_MPIEXEC", "DDLFAST_SANITIZE",
    "DDLFAST_SANITIZE_DIR", "DDLFAST_FUZZ_SEED",
    "DDLFAST_FUZZ_SCALE", "DDLFAST_BENCH_LARGE", "DDLFAST_BENCH_ALL_RANKS",
    "DDLFAST_HOROVOD_TESTS", "DDLFAST_HOROVOD_TESTS_ALL",  # tests/mpi/test_horovod.py: a local copy of Horovod's tests
    "DDLFAST_TORCH_DIST_ALL",  # tests/torch_dist/: the whole of PyTorch's distributed test class, not the CI subset
))
KNOWN_VARIABLES = RUNTIME_VARIABLES | TOOLING_VARIABLES
_cache: tuple[tuple, Settings] | None = None
# os.environ.get encodes and checks every key on every call (~1 us each); the
# plain dict of bytes behind it (CPython's os.environ._data) changes with it
# and is read in nanoseconds. Falls back to os.environ where it is absent.
_RAW_ENVIRON: dict = getattr(os.environ, "_data", None)  # type: ignore[assignment]  # checked before use
_RAW_KEYS = tuple(name.encode() for name in _VARIABLES)
# `same_values(environ, keys, values)`: whether environ[keys[i]] is values[i] (the very object; None where
# absent) for every i, without building a tuple per call. ddlfast._core sets it (in C; this module imports no
# compiled one); until then, and where os.environ has no plain dict, the tuples are compared.
_same_values: Callable[[dict, tuple, tuple], bool] | None = None


def use_value_compare(same_values: Callable[[dict, tuple, tuple], bool]) -> None:
    global _same_values
    if isinstance(_RAW_ENVIRON, dict):
        _same_values = same_values


# Stall limits that replace DDLFAST_TIMEOUT_S on one thread while it issues or runs the work of a torch process
# group created with timeout= (integrations/torch_backend.py): thread ident -> seconds. Empty unless such a group
# is at work, so load_settings pays one truthiness test for it.
STALL_LIMITS: dict[int, float] = {}
_limited: tuple[Settings, float, Settings] | None = None  # (settings, limit, settings with that limit)


@contextlib.contextmanager
def stall_limit(seconds: float) -> Iterator[None]:
    """On this thread, load_settings().timeout_s is `seconds` (validated as DDLFAST_TIMEOUT_S is) until exit."""
    if not MIN_TIMEOUT_S <= seconds <= MAX_TIMEOUT_S:
        raise DdlfastError(f"timeout {seconds:g} s is out of range: accepted {MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:g} "
                           "seconds")
    ident = threading.get_ident()
    before = STALL_LIMITS.get(ident)
    STALL_LIMITS[ident] = seconds
    try:
        yield
    finally:
        if before is None:
            del STALL_LIMITS[ident]
        else:
            STALL_LIMITS[ident] = before


def current_stall_limit() -> float | None:
    """The stall_limit() in force on this thread, or None (DDLFAST_TIMEOUT_S)."""
    return STALL_LIMITS.get(threading.get_ident()) if STALL_LIMITS else None


def load_settings() -> Settings:
    """The current settings; parsed again only when a DDLFAST_* variable changed. timeout_s is this thread's
    stall_limit() where one is in force."""
    global _cache, _limited
    cache = _cache
    if cache is not None and _same_values is not None and _same_values(_RAW_ENVIRON, _RAW_KEYS, cache[0]):
        settings = cache[1]  # every collective asks: the common case, in C
    else:
        if isinstance(_RAW_ENVIRON, dict):
            raw = tuple(map(_RAW_ENVIRON.get, _RAW_KEYS))
        else:
            raw = tuple(map(os.environ.get, _VARIABLES))
        # Equal values in new objects (a variable set again to what it was): the same settings, and the values'
        # objects kept, so that the identity check above holds again from the next call on.
        settings = cache[1] if cache is not None and cache[0] == raw else _parse_settings()
        _cache = (raw, settings)
    if STALL_LIMITS:
        limit = STALL_LIMITS.get(threading.get_ident())
        if limit is not None and limit != settings.timeout_s:
            last = _limited
            if last is None or last[0] is not settings or last[1] != limit:
                last = _limited = (settings, limit, replace(settings, timeout_s=limit))
            return last[2]
    return settings


def check_variable_names(environ: dict[str, str] | None = None) -> None:
    """Raises DdlfastError for a DDLFAST_* variable ddlfast does not know (naming the closest known one)."""
    import difflib

    names = os.environ if environ is None else environ
    unknown = sorted(name for name in names if name.startswith("DDLFAST_") and name not in KNOWN_VARIABLES)
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, sorted(KNOWN_VARIABLES), n=1, cutoff=0.6)
            hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
        raise DdlfastError(f"unknown environment variable {', '.join(hints)}; the README's table lists the "
                           "DDLFAST_* variables ddlfast reads (unset the unknown one, or fix its name)")


def check_environment() -> None:
    """Every DDLFAST_* variable ddlfast reads, parsed now (at context creation), so a bad value raises there
    naming the variable, not later when (or if) the setting is first used; and no unknown DDLFAST_* name."""
    check_variable_names()
    load_settings()
    probe_mode()
    probe_timeout_s()
    cache_dir()
    hosts_per_group()
    emulated_hosts()
    timeline_path()
    timeline_max_events()
    abort_on_stall()
    cuda_aware_mpi()
    gpu_ring_min_bytes()
    halving_bytes()
    spin_us()
    shared_memory()
    allow_single()
    straggler_warn_s()
    flight_records()
    flight_dir()
    debug()


def settings_or_problem() -> tuple[Settings, DdlfastError | None]:
    """(settings, None) where every DDLFAST_* variable is valid (check_environment), else (settings good enough to
    take part in a context's creation, the error): a bad value on some ranks must fail creation on every rank
    through the creation agreement, not on those ranks alone (the others would wait out the stall limit, and
    the communicator's collectives would be out of step for every later context)."""
    try:
        check_environment()
        return load_settings(), None
    except DdlfastError as error:
        problem = error
    try:
        timeout_s = _env_seconds("DDLFAST_TIMEOUT_S", DEFAULT_TIMEOUT_S, MIN_TIMEOUT_S, MAX_TIMEOUT_S,
                                 zero_means_forever=True)
    except DdlfastError:
        timeout_s = DEFAULT_TIMEOUT_S
    return Settings(bucket_bytes=DEFAULT_BUCKET_BYTES, first_bucket_bytes=DEFAULT_FIRST_BUCKET_BYTES,
                    chunk_bytes=DEFAULT_CHUNK_BYTES, small_bytes=DEFAULT_SMALL_BYTES,
                    receives_in_flight=DEFAULT_RECEIVES_IN_FLIGHT, ring_dims="auto", timeout_s=timeout_s,
                    compression=("none",)), problem


def _parse_settings() -> Settings:
    compression = parse_compression(os.environ.get("DDLFAST_COMPRESSION", "none"), "DDLFAST_COMPRESSION")
    chunk_bytes = _env_size("DDLFAST_CHUNK_BYTES", DEFAULT_CHUNK_BYTES, MIN_CHUNK_BYTES, MAX_CHUNK_BYTES)
    receives = _env_int("DDLFAST_RECEIVES_IN_FLIGHT", DEFAULT_RECEIVES_IN_FLIGHT, MIN_RECEIVES_IN_FLIGHT,
                        MAX_RECEIVES_IN_FLIGHT)
    if chunk_bytes * receives > MAX_SCRATCH_BYTES:  # the core allocates this much receive scratch up front
        raise DdlfastError(
            f"DDLFAST_RECEIVES_IN_FLIGHT={receives} x DDLFAST_CHUNK_BYTES={chunk_bytes} is "
            f"{format_size(chunk_bytes * receives)} of receive scratch; the product must be at most "
            f"{format_size(MAX_SCRATCH_BYTES)}")
    return Settings(
        bucket_bytes=_env_size("DDLFAST_BUCKET_BYTES", DEFAULT_BUCKET_BYTES, 1, MAX_BUCKET_BYTES),
        first_bucket_bytes=_env_size("DDLFAST_FIRST_BUCKET_BYTES", DEFAULT_FIRST_BUCKET_BYTES, 1, MAX_BUCKET_BYTES),
        chunk_bytes=chunk_bytes,
        small_bytes=_env_size("DDLFAST_SMALL_BYTES", DEFAULT_SMALL_BYTES, 0, MAX_SMALL_BYTES),
        receives_in_flight=receives,
        ring_dims=parse_dims(os.environ.get("DDLFAST_RING_DIMS", "").strip() or "auto", "DDLFAST_RING_DIMS"),
        timeout_s=_env_seconds("DDLFAST_TIMEOUT_S", DEFAULT_TIMEOUT_S, MIN_TIMEOUT_S, MAX_TIMEOUT_S,
                               zero_means_forever=True),
        compression=compression,
        algorithm=_env_choice("DDLFAST_ALGORITHM", "auto", {name: name for name in ALGORITHMS}),
        reproducible=_env_choice("DDLFAST_REPRODUCIBLE", "0", _ON_OFF) == "1",
    )


_reproducible_cache: dict[Settings, Settings] = {}


def with_reproducible(settings: Settings, reproducible: object, rank: int) -> Settings:
    """The settings of one call: `reproducible=` (True/False) overrides DDLFAST_REPRODUCIBLE; None keeps it.
    The same Settings object for the same inputs (the latency path caches its plans per Settings object)."""
    if reproducible is None or reproducible is settings.reproducible:
        return settings
    if not isinstance(reproducible, bool):
        raise DdlfastError(f"reproducible={reproducible!r} on rank {rank} must be True, False or None "
                           "(None: DDLFAST_REPRODUCIBLE)")
    try:
        return _reproducible_cache[settings]
    except KeyError:
        pass
    if len(_reproducible_cache) >= 64:  # settings change rarely; never grow without bound
        _reproducible_cache.clear()
    flipped = _reproducible_cache[settings] = replace(settings, reproducible=reproducible)
    return flipped


# -- variables read outside the engine settings (each by its own module, through these functions) -----------------


def probe_mode(environ: Mapping[str, str] | None = None) -> str:
    """DDLFAST_PROBE: '1' measure unless cached (default), '0' skip and use defaults, 'force' measure again."""
    return _env_choice("DDLFAST_PROBE", "1", {"1": "1", "0": "0", "force": "force"}, environ)


def probe_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """DDLFAST_PROBE_TIMEOUT_S: a probe peer that does not answer is an error after this long."""
    return _env_seconds("DDLFAST_PROBE_TIMEOUT_S", DEFAULT_PROBE_TIMEOUT_S, MIN_PROBE_TIMEOUT_S,
                        MAX_PROBE_TIMEOUT_S, zero_means_forever=False, environ=environ)


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """DDLFAST_CACHE_DIR (default ~/.cache/ddlfast)."""
    raw = _raw("DDLFAST_CACHE_DIR", environ)
    if raw is None:
        return Path.home() / ".cache" / "ddlfast"
    return Path(raw.strip())


def hosts_per_group(environ: Mapping[str, str] | None = None) -> int:
    """DDLFAST_HOSTS_PER_GROUP: hosts per rack (default 1: no racks)."""
    return _env_int("DDLFAST_HOSTS_PER_GROUP", 1, 1, MAX_HOSTS_PER_GROUP, environ)


def emulated_hosts(environ: Mapping[str, str] | None = None) -> int:
    """DDLFAST_EMULATED_HOSTS: for tests on one machine, the placement ddlfast sees is this many hosts of
    consecutive ranks (they must divide the rank count), whatever MPI reports (default 0: what MPI reports)."""
    return _env_int("DDLFAST_EMULATED_HOSTS", 0, 0, MAX_HOSTS_PER_GROUP, environ)


def timeline_path(environ: Mapping[str, str] | None = None) -> str | None:
    """DDLFAST_TIMELINE: the trace path prefix, or None (no trace)."""
    raw = _raw("DDLFAST_TIMELINE", environ)
    return None if raw is None else raw.strip()


def timeline_max_events(environ: Mapping[str, str] | None = None) -> int:
    """DDLFAST_TIMELINE_MAX_EVENTS: the most events a trace file holds."""
    return _env_int("DDLFAST_TIMELINE_MAX_EVENTS", DEFAULT_TIMELINE_MAX_EVENTS, 1, MAX_TIMELINE_MAX_EVENTS, environ)


_ON_OFF = {**dict.fromkeys(("1", "true", "yes", "on"), "1"), **dict.fromkeys(("0", "false", "no", "off"), "0")}


def abort_on_stall(environ: Mapping[str, str] | None = None) -> bool:
    """DDLFAST_ABORT_ON_STALL: whether an uncaught DdlfastTimeoutError calls MPI_Abort (default on)."""
    return _env_choice("DDLFAST_ABORT_ON_STALL", "1", _ON_OFF, environ) == "1"


def shared_memory(environ: Mapping[str, str] | None = None) -> bool:
    """DDLFAST_SHARED_MEMORY: whether the per-call agreement and the latency path run in memory shared by the ranks
    when all run on one host (default on; src/transport/shared_agreement.cc). Off on any rank: off on every rank."""
    return _env_choice("DDLFAST_SHARED_MEMORY", "1", _ON_OFF, environ) == "1"


def allow_single(environ: Mapping[str, str] | None = None) -> bool:
    """DDLFAST_ALLOW_SINGLE: whether a process MPI sees alone may run although its launcher (torchrun, srun, another
    MPI's mpiexec) started several (default off: that is an error saying how to launch; ddlfast/launch.py)."""
    return _env_choice("DDLFAST_ALLOW_SINGLE", "0", _ON_OFF, environ) == "1"


# GPU calls below this size go through pinned host copies and the host engine while MPI is not CUDA-aware: one
# copy each way and the host's latency and direct algorithms beat the staged GPU ring's 2(P-1) steps of copy, MPI,
# copy and kernel there. On an H100 shared by the ranks (bench/gpu_pipeline.py, GPU ring vs host copies): 1 MiB
# 0.75 vs 0.80 ms at P=2 and 2.24 vs 0.99 ms at P=4; 16 MiB 4.05 vs 8.25 and 9.18 vs 11.94 ms.
DEFAULT_GPU_RING_MIN_BYTES = 4 << 20


def gpu_ring_min_bytes(environ: Mapping[str, str] | None = None) -> int:
    """DDLFAST_GPU_RING_MIN_BYTES: the smallest GPU call (bytes of all its arrays) the staged GPU ring runs; 0: all."""
    return _env_size("DDLFAST_GPU_RING_MIN_BYTES", DEFAULT_GPU_RING_MIN_BYTES, 0, MAX_BUCKET_BYTES, environ)


# On one host where every rank has a core of its own (cost_model.latency_plan), the latency path halves payloads
# from DEFAULT_HALVING_BYTES up (recursive halving and doubling inside the agreement's messages,
# src/transport/agreement_exchange.cc) and takes allreduces up to HALVING_REACH_BYTES. Measured on 16 cores
# (MPICH 5.0.2, docs/gpu.md's host section): the whole payload plus its header passes MPICH's shared-memory eager
# size at 8 KiB (0.54-0.60x MPI_Allreduce's busbw at P = 4, 8, 16; halving 0.82-0.94x, 4 KiB whole 0.95-1.06x); at
# 16-32 KiB halving 0.86-0.94x, the agreement plus Rabenseifner's or the direct step 0.71-0.93x; at 64 KiB those
# 0.92-1.10x, halving 0.80-0.88x.
DEFAULT_HALVING_BYTES = 8 << 10
HALVING_REACH_BYTES = 32 << 10
# Where the ranks of one host share the agreement's memory and outnumber its cores (cost_model.latency_plan):
# halving from here, and the latency path up to the reach (each rank's slots grow to it: 2 x P x 4 MiB shared; where
# /dev/shm cannot hold that, the slots stay at their size and larger calls take the ring).
SHARED_OVERSUBSCRIBED_HALVING_BYTES = 16 << 10
SHARED_OVERSUBSCRIBED_REACH_BYTES = MAX_LATENCY_REACH_BYTES
# A reduce-scatter or allgather rides in the agreement's messages (engine/shards.carried_options) up to this, where
# the latency path reaches that far: on 2 cores at P = 4 (busbw / MPI's, carried against the ring, two runs) an
# allgather at 2 MiB was 1.14-1.34 against 0.96-0.99 and at 4 MiB 0.84-0.89 against 0.98-1.05; a reduce-scatter
# at 2 MiB 1.04-1.07 against 1.03-1.10, at 4 MiB 0.74-0.81 against 0.76-0.87.
MAX_CARRIED_SHARD_BYTES = 2 * MIB


def halving_bytes(environ: Mapping[str, str] | None = None) -> int | None:
    """DDLFAST_HALVING_BYTES: the latency path reduces payloads of at least this many bytes by recursive halving
    and doubling; 0: never; auto (None, the default): cost_model.latency_plan decides."""
    raw = _raw("DDLFAST_HALVING_BYTES", environ)
    if raw is None or raw.strip().lower() == "auto":
        return None
    return _env_size("DDLFAST_HALVING_BYTES", 0, 0, 2 * MAX_LATENCY_BYTES, environ)


def cuda_aware_mpi(environ: Mapping[str, str] | None = None) -> str:
    """DDLFAST_CUDA_AWARE_MPI: auto (ask MPI), on (device pointers to MPI), off (stage through host memory)."""
    return _env_choice("DDLFAST_CUDA_AWARE_MPI", "auto", {"auto": "auto", "on": "on", "off": "off"}, environ)


def spin_us(environ: Mapping[str, str] | None = None) -> int | None:
    """DDLFAST_SPIN_US: how long (microseconds) a wait for a message spins before it gives the core away, or
    None (unset): the automatic rule (200 us, none where a host runs more ranks than it has cores; docs/mpi.md).
    Rank-local: ranks may differ."""
    if _raw("DDLFAST_SPIN_US", environ) is None:
        return None
    return _env_int("DDLFAST_SPIN_US", 0, 0, MAX_SPIN_US, environ)


def straggler_warn_s(environ: Mapping[str, str] | None = None) -> float | None:
    """DDLFAST_STRAGGLER_WARN_S: rank 0 logs one warning per rank once that rank has held the others longer than
    this within the last 100 collectives (None, unset or 'off': no warning; docs/observe.md)."""
    raw = _raw("DDLFAST_STRAGGLER_WARN_S", environ)
    if raw is None or raw.strip().lower() in ("off", "0"):
        return None
    return _env_seconds("DDLFAST_STRAGGLER_WARN_S", 0.0, MIN_STRAGGLER_WARN_S, MAX_STRAGGLER_WARN_S,
                        zero_means_forever=False, environ=environ)


def flight_records(environ: Mapping[str, str] | None = None) -> int:
    """DDLFAST_FLIGHT_RECORDS: how many of its latest collectives each rank's flight recorder keeps (0: off)."""
    return _env_int("DDLFAST_FLIGHT_RECORDS", DEFAULT_FLIGHT_RECORDS, 0, MAX_FLIGHT_RECORDS, environ)


def flight_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """DDLFAST_FLIGHT_DIR: where each rank writes its flight record (on a stall, a broken context, SIGUSR1 and
    ddlfast.dump_flight_record()); None: not written on its own (dump_flight_record(directory) still can)."""
    raw = _raw("DDLFAST_FLIGHT_DIR", environ)
    return None if raw is None else raw.strip()


def debug(environ: Mapping[str, str] | None = None) -> bool:
    """DDLFAST_DEBUG: Python's whole traceback for an uncaught DdlfastError (default: a short report per rank,
    ddlfast/error_report.py), and rank 0 prints the plan at context creation (ring dims, algorithm per size,
    probe results, buckets)."""
    return _env_choice("DDLFAST_DEBUG", "0", _ON_OFF, environ) == "1"
