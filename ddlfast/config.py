"""DDLFAST_* environment parameters: parsed and validated in one place.

API arguments override the environment; a malformed value raises DdlfastError
naming the variable, the value and what would be accepted.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ddlfast.errors import DdlfastError

_SIZE_PATTERN = re.compile(r"^\s*(\d+)\s*([kmg]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}

# Defaults chosen from measurements on the 2-core development machine (see README).
DEFAULT_BUCKET_BYTES = 64 << 20
DEFAULT_FIRST_BUCKET_BYTES = 1 << 20
DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_SMALL_BYTES = 8 << 10
DEFAULT_RECEIVES_IN_FLIGHT = 4
# Generous for one message on a slow link, short enough that a missing rank is named promptly.
DEFAULT_TIMEOUT_S = 120.0
MAX_CHUNK_BYTES = 1 << 30


def parse_size(text: str, name: str) -> int:
    """'4096', '512KiB', '64M', '1g' -> bytes."""
    match = _SIZE_PATTERN.match(str(text))
    if not match:
        raise DdlfastError(f"{name}={text!r} is not a byte size; use e.g. 1048576, 512KiB or 64MiB")
    unit = (match.group(2) or "").lower()[:1]
    return int(match.group(1)) * _SIZE_UNITS[unit]


def parse_dims(value: object, name: str = "dims") -> str | tuple[int, ...]:
    """'flat' | 'auto' | '4x2' | (4, 2) -> 'flat' or a tuple of ints (validated >= 1)."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("flat", "auto"):
            return text
        parts = text.split("x")
        if not all(part.strip().isdecimal() for part in parts):
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
    return dims


WIRE_CODECS = ("none", "fp16", "bf16", "auto")


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
    if "auto" in names and len(names) > 1:
        raise DdlfastError(f"{name}={value!r}: 'auto' stands alone")
    return names


def _env_size(name: str, default: int, minimum: int, maximum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = parse_size(raw, name)
    if value < minimum or (maximum is not None and value > maximum):
        upper = f" and <= {maximum}" if maximum is not None else ""
        raise DdlfastError(f"{name}={raw!r} must be >= {minimum}{upper} bytes")
    return value


def _env_int(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    if not raw.strip().isdecimal() or int(raw) < minimum:
        raise DdlfastError(f"{name}={raw!r} must be an integer >= {minimum}")
    return int(raw)


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise DdlfastError(f"{name}={raw!r} is not a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise DdlfastError(f"{name}={raw!r} must be a finite number of seconds >= 0 (0 disables the limit)")
    return value


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


_VARIABLES = (
    "DDLFAST_COMPRESSION", "DDLFAST_BUCKET_BYTES", "DDLFAST_FIRST_BUCKET_BYTES", "DDLFAST_CHUNK_BYTES",
    "DDLFAST_SMALL_BYTES", "DDLFAST_RECEIVES_IN_FLIGHT", "DDLFAST_RING_DIMS", "DDLFAST_TIMEOUT_S",
)
# Every DDLFAST_* name ddlfast, its build and its test tools read; any other is
# most likely a typo that would otherwise be ignored silently.
KNOWN_VARIABLES = frozenset(_VARIABLES + (
    "DDLFAST_ABORT_ON_STALL", "DDLFAST_TIMELINE", "DDLFAST_TIMELINE_MAX_EVENTS", "DDLFAST_PROBE",
    "DDLFAST_PROBE_TIMEOUT_S", "DDLFAST_CACHE_DIR", "DDLFAST_HOSTS_PER_GROUP", "DDLFAST_CUDA_AWARE_MPI",
    # build and test tooling
    "DDLFAST_CUDA", "DDLFAST_MPICC", "DDLFAST_SANITIZE", "DDLFAST_SANITIZE_DIR", "DDLFAST_FUZZ_SEED",
    "DDLFAST_FUZZ_SCALE", "DDLFAST_BENCH_LARGE", "DDLFAST_BENCH_ALL_RANKS",
))
_cache: tuple[tuple, Settings] | None = None
# os.environ.get encodes and checks every key on every call (~1 us each); the
# plain dict of bytes behind it (CPython's os.environ._data) changes with it
# and is read in nanoseconds. Falls back to os.environ where it is absent.
_RAW_ENVIRON = getattr(os.environ, "_data", None)
_RAW_KEYS = tuple(name.encode() for name in _VARIABLES)


def load_settings() -> Settings:
    """The current settings; parsed again only when a DDLFAST_* variable changed."""
    global _cache
    if isinstance(_RAW_ENVIRON, dict):
        raw = tuple(map(_RAW_ENVIRON.get, _RAW_KEYS))
    else:
        raw = tuple(map(os.environ.get, _VARIABLES))
    if _cache is not None and _cache[0] == raw:
        return _cache[1]
    settings = _parse_settings()
    _cache = (raw, settings)
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


def _parse_settings() -> Settings:
    compression = parse_compression(os.environ.get("DDLFAST_COMPRESSION", "none"), "DDLFAST_COMPRESSION")
    return Settings(
        bucket_bytes=_env_size("DDLFAST_BUCKET_BYTES", DEFAULT_BUCKET_BYTES, minimum=1),
        first_bucket_bytes=_env_size("DDLFAST_FIRST_BUCKET_BYTES", DEFAULT_FIRST_BUCKET_BYTES, minimum=1),
        chunk_bytes=_env_size("DDLFAST_CHUNK_BYTES", DEFAULT_CHUNK_BYTES, minimum=8, maximum=MAX_CHUNK_BYTES),
        small_bytes=_env_size("DDLFAST_SMALL_BYTES", DEFAULT_SMALL_BYTES, minimum=0),
        receives_in_flight=_env_int("DDLFAST_RECEIVES_IN_FLIGHT", DEFAULT_RECEIVES_IN_FLIGHT, minimum=2),
        ring_dims=parse_dims(os.environ.get("DDLFAST_RING_DIMS", "").strip() or "auto", "DDLFAST_RING_DIMS"),
        timeout_s=_env_seconds("DDLFAST_TIMEOUT_S", DEFAULT_TIMEOUT_S),
        compression=compression,
    )
