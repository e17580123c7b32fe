"""DDLFAST_* environment parsing: values, bounds, defaults, and errors that name the variable."""

from __future__ import annotations

import pytest

from ddlfast import config
from ddlfast.errors import DdlfastError

VARIABLES = (
    "DDLFAST_BUCKET_BYTES",
    "DDLFAST_FIRST_BUCKET_BYTES",
    "DDLFAST_CHUNK_BYTES",
    "DDLFAST_SMALL_BYTES",
    "DDLFAST_RECEIVES_IN_FLIGHT",
    "DDLFAST_RING_DIMS",
    "DDLFAST_TIMEOUT_S",
    "DDLFAST_COMPRESSION",
    "DDLFAST_ALGORITHM",
)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No DDLFAST_* setting of the developer's shell leaks into these tests."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


def codec_names(compression: object) -> tuple[str, ...]:
    """Settings.compression as a tuple of codec names (one name, or one per ring dimension)."""
    return (compression,) if isinstance(compression, str) else tuple(compression)


# ---------------------------------------------------------------- parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("4096", 4096),
        (" 4096 ", 4096),
        ("8b", 8),
        ("8B", 8),
        ("1k", 1024),
        ("1K", 1024),
        ("512KiB", 512 << 10),
        ("512kib", 512 << 10),
        ("512KB", 512_000),  # decimal: KB/MB/GB are SI units
        ("512kb", 512_000),
        ("64MB", 64_000_000),
        ("1GB", 10**9),
        ("64Mi", 64 << 20),
        ("64M", 64 << 20),
        ("64MiB", 64 << 20),
        ("64 MiB", 64 << 20),
        ("1g", 1 << 30),
        ("2GiB", 2 << 30),
        ("007", 7),
    ],
)
def test_parse_size_accepts(text: str, expected: int) -> None:
    assert config.parse_size(text, "SOME_VAR") == expected


@pytest.mark.parametrize("text", ["", " ", "abc", "-1", "+1", "1.5M", "1e3", "1T", "1 TiB", "1KiBB", "KiB", "1 2",
                                  "0x10", "1MiB!"])
def test_parse_size_rejects_naming_the_variable(text: str) -> None:
    with pytest.raises(DdlfastError) as error:
        config.parse_size(text, "SOME_VAR")
    assert "SOME_VAR" in str(error.value)
    assert repr(text) in str(error.value)


# ---------------------------------------------------------------- parse_dims


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("flat", "flat"),
        ("auto", "auto"),
        (" FLAT ", "flat"),
        ("Auto", "auto"),
        ("8", (8,)),
        ("4x2", (4, 2)),
        ("4X2", (4, 2)),
        (" 4 x 2 ", (4, 2)),
        ("3x5x2", (3, 5, 2)),
        ("1x8", (1, 8)),
        ((4, 2), (4, 2)),
        ([4, 2], (4, 2)),
        ((1,), (1,)),
    ],
)
def test_parse_dims_accepts(value: object, expected: object) -> None:
    assert config.parse_dims(value, "DIMS_VAR") == expected


@pytest.mark.parametrize(
    "value",
    ["", "x", "4x", "x4", "4x0", "0", "4*2", "4,2", "-4x2", "4x-2", "2.0x2", "four", "flatx2", (), [], (4, 0),
     (-1, 2), (4, 2.0), [4, "2"], (True, 2), 8, 4.0, None, {"a": 1}],
)
def test_parse_dims_rejects_naming_the_variable(value: object) -> None:
    with pytest.raises(DdlfastError, match="DIMS_VAR"):
        config.parse_dims(value, "DIMS_VAR")


def test_parse_dims_unicode_digits_are_a_clear_error() -> None:
    with pytest.raises(DdlfastError, match="DIMS_VAR"):
        config.parse_dims("4x\u00b2", "DIMS_VAR")


# ---------------------------------------------------------------- load_settings


def test_defaults_when_nothing_is_set() -> None:
    settings = config.load_settings()
    assert settings.bucket_bytes == config.DEFAULT_BUCKET_BYTES
    assert settings.first_bucket_bytes == config.DEFAULT_FIRST_BUCKET_BYTES
    assert settings.chunk_bytes == config.DEFAULT_CHUNK_BYTES
    assert settings.small_bytes == config.DEFAULT_SMALL_BYTES
    assert settings.receives_in_flight == config.DEFAULT_RECEIVES_IN_FLIGHT
    assert settings.ring_dims in ("flat", "auto")
    assert settings.timeout_s > 0
    assert codec_names(settings.compression) == ("none",)
    assert config.MIN_CHUNK_BYTES <= settings.chunk_bytes <= config.MAX_CHUNK_BYTES
    assert settings.receives_in_flight >= 2


@pytest.mark.parametrize("name", VARIABLES)
def test_empty_or_blank_means_default(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    defaults = config.load_settings()
    for blank in ("", "  "):
        monkeypatch.setenv(name, blank)
        assert config.load_settings() == defaults


@pytest.mark.parametrize(
    ("name", "value", "field", "expected"),
    [
        ("DDLFAST_BUCKET_BYTES", "25MiB", "bucket_bytes", 25 << 20),
        ("DDLFAST_BUCKET_BYTES", "1", "bucket_bytes", 1),
        ("DDLFAST_FIRST_BUCKET_BYTES", "1", "first_bucket_bytes", 1),
        ("DDLFAST_FIRST_BUCKET_BYTES", "256k", "first_bucket_bytes", 256 << 10),
        ("DDLFAST_CHUNK_BYTES", "4KiB", "chunk_bytes", 4 << 10),
        ("DDLFAST_CHUNK_BYTES", "1GiB", "chunk_bytes", 1 << 30),
        ("DDLFAST_CHUNK_BYTES", "64KiB", "chunk_bytes", 64 << 10),
        ("DDLFAST_SMALL_BYTES", "0", "small_bytes", 0),
        ("DDLFAST_SMALL_BYTES", "1m", "small_bytes", 1 << 20),
        ("DDLFAST_RECEIVES_IN_FLIGHT", "2", "receives_in_flight", 2),
        ("DDLFAST_RECEIVES_IN_FLIGHT", " 16 ", "receives_in_flight", 16),
        ("DDLFAST_RING_DIMS", "4x2", "ring_dims", (4, 2)),
        ("DDLFAST_RING_DIMS", "auto", "ring_dims", "auto"),
        ("DDLFAST_RING_DIMS", "flat", "ring_dims", "flat"),
        ("DDLFAST_TIMEOUT_S", "0", "timeout_s", 0.0),
        ("DDLFAST_TIMEOUT_S", "2.5", "timeout_s", 2.5),
        ("DDLFAST_TIMEOUT_S", "1e3", "timeout_s", 1000.0),
    ],
)
def test_each_variable_is_read(monkeypatch: pytest.MonkeyPatch, name: str, value: str, field: str,
                               expected: object) -> None:
    defaults = config.load_settings()
    monkeypatch.setenv(name, value)
    settings = config.load_settings()
    assert getattr(settings, field) == expected
    others = {f: getattr(settings, f) for f in settings.__dataclass_fields__ if f != field}
    assert others == {f: getattr(defaults, f) for f in others}, f"{name} changed other settings"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("DDLFAST_BUCKET_BYTES", "0"),
        ("DDLFAST_BUCKET_BYTES", "-5"),
        ("DDLFAST_BUCKET_BYTES", "lots"),
        ("DDLFAST_FIRST_BUCKET_BYTES", "0"),
        ("DDLFAST_FIRST_BUCKET_BYTES", "1.5MiB"),
        ("DDLFAST_CHUNK_BYTES", "7"),
        ("DDLFAST_CHUNK_BYTES", "8"),
        ("DDLFAST_CHUNK_BYTES", "4095"),
        ("DDLFAST_CHUNK_BYTES", "0"),
        ("DDLFAST_CHUNK_BYTES", str((1 << 30) + 1)),
        ("DDLFAST_CHUNK_BYTES", "2GiB"),
        ("DDLFAST_CHUNK_BYTES", "lots"),
        ("DDLFAST_SMALL_BYTES", "-1"),
        ("DDLFAST_SMALL_BYTES", "small"),
        ("DDLFAST_RECEIVES_IN_FLIGHT", "1"),
        ("DDLFAST_RECEIVES_IN_FLIGHT", "0"),
        ("DDLFAST_RECEIVES_IN_FLIGHT", "-3"),
        ("DDLFAST_RECEIVES_IN_FLIGHT", "2.0"),
        ("DDLFAST_RECEIVES_IN_FLIGHT", "many"),
        ("DDLFAST_RING_DIMS", "4x0"),
        ("DDLFAST_RING_DIMS", "4,2"),
        ("DDLFAST_RING_DIMS", "square"),
        ("DDLFAST_TIMEOUT_S", "-1"),
        ("DDLFAST_TIMEOUT_S", "inf"),
        ("DDLFAST_TIMEOUT_S", "nan"),
        ("DDLFAST_TIMEOUT_S", "soon"),
        ("DDLFAST_TIMEOUT_S", "10s"),
        ("DDLFAST_COMPRESSION", "zip"),
        ("DDLFAST_COMPRESSION", "fp16x"),
    ],
)
def test_malformed_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    defaults = config.load_settings()
    monkeypatch.setenv(name, value)
    with pytest.raises(DdlfastError, match=name) as error:
        config.load_settings()
    assert value.strip().lower() in str(error.value).lower(), "the message should quote the bad value"
    # The error is not cached as a result: it raises again, and a fixed value is picked up.
    with pytest.raises(DdlfastError, match=name):
        config.load_settings()
    monkeypatch.delenv(name)
    assert config.load_settings() == defaults


@pytest.mark.parametrize("value", ["none", " NONE ", "None"])
def test_compression_none(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("DDLFAST_COMPRESSION", value)
    assert codec_names(config.load_settings().compression) == ("none",)


@pytest.mark.skipif(not hasattr(config, "parse_compression"), reason="this build has no wire compression")
@pytest.mark.parametrize(
    ("value", "expected"),
    [("fp16", ("fp16",)), ("BF16", ("bf16",)), ("none,fp16", ("none", "fp16")), (" none , bf16 ", ("none", "bf16"))],
)
def test_compression_codecs(monkeypatch: pytest.MonkeyPatch, value: str, expected: tuple[str, ...]) -> None:
    monkeypatch.setenv("DDLFAST_COMPRESSION", value)
    assert codec_names(config.load_settings().compression) == expected


@pytest.mark.skipif(not hasattr(config, "parse_compression"), reason="this build has no wire compression")
@pytest.mark.parametrize("value", ["fp8", "none,", ",fp16", "fp16;bf16", "auto,fp16"])
def test_compression_malformed(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("DDLFAST_COMPRESSION", value)
    with pytest.raises(DdlfastError, match="DDLFAST_COMPRESSION"):
        config.load_settings()


def test_receives_in_flight_unicode_digit_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDLFAST_RECEIVES_IN_FLIGHT", "\u00b2")
    with pytest.raises(DdlfastError, match="DDLFAST_RECEIVES_IN_FLIGHT"):
        config.load_settings()


def test_settings_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache must notice every change, including a return to a value seen before and an unset."""
    monkeypatch.setenv("DDLFAST_CHUNK_BYTES", "64KiB")
    assert config.load_settings().chunk_bytes == 64 << 10
    monkeypatch.setenv("DDLFAST_CHUNK_BYTES", "128KiB")
    assert config.load_settings().chunk_bytes == 128 << 10
    monkeypatch.setenv("DDLFAST_CHUNK_BYTES", "64KiB")
    assert config.load_settings().chunk_bytes == 64 << 10
    monkeypatch.setenv("DDLFAST_RING_DIMS", "2x4")
    assert config.load_settings().ring_dims == (2, 4)
    assert config.load_settings().chunk_bytes == 64 << 10
    monkeypatch.delenv("DDLFAST_CHUNK_BYTES")
    assert config.load_settings().chunk_bytes == config.DEFAULT_CHUNK_BYTES
    monkeypatch.setenv("DDLFAST_CHUNK_BYTES", "lots")
    with pytest.raises(DdlfastError, match="DDLFAST_CHUNK_BYTES"):
        config.load_settings()
    monkeypatch.setenv("DDLFAST_CHUNK_BYTES", "64KiB")
    assert config.load_settings().chunk_bytes == 64 << 10


def test_settings_are_immutable() -> None:
    settings = config.load_settings()
    with pytest.raises(AttributeError):
        settings.chunk_bytes = 1  # type: ignore[misc]


def test_unknown_variable_name_is_an_error_with_a_suggestion() -> None:
    with pytest.raises(DdlfastError, match=r"DDLFAST_BUKET_BYTES \(did you mean DDLFAST_BUCKET_BYTES\?\)"):
        config.check_variable_names({"DDLFAST_BUKET_BYTES": "1MiB", "PATH": "/bin"})


def test_known_variable_names_pass() -> None:
    config.check_variable_names({name: "1" for name in config.KNOWN_VARIABLES} | {"OTHER_VAR": "x"})


def test_every_variable_the_package_reads_is_known() -> None:
    import pathlib
    import re

    package = pathlib.Path(config.__file__).parent
    read = set()
    for source in package.glob("*.py"):
        read |= set(re.findall(r"\"(DDLFAST_[A-Z0-9_]+)\"", source.read_text()))
    assert read - config.KNOWN_VARIABLES == set()


# ---------------------------------------------------------------- bounds (docs/configuration.md)

# (variable, lowest accepted, highest accepted, just below, just above); None: no such value.
BOUNDS = [
    ("DDLFAST_BUCKET_BYTES", "1", "16GiB", "0", str((16 << 30) + 1)),
    ("DDLFAST_FIRST_BUCKET_BYTES", "1", "16GiB", "0", "17GiB"),
    ("DDLFAST_CHUNK_BYTES", "4KiB", "1GiB", "4095", str((1 << 30) + 1)),
    ("DDLFAST_SMALL_BYTES", "0", "1GiB", None, str((1 << 30) + 1)),
    ("DDLFAST_RECEIVES_IN_FLIGHT", "2", "1024", "1", "1025"),
    ("DDLFAST_TIMEOUT_S", "0.1", "604800", "0.09", "604800.5"),
]


@pytest.mark.parametrize(("name", "lowest", "highest", "below", "above"), BOUNDS, ids=[b[0] for b in BOUNDS])
def test_each_engine_variable_has_both_bounds(monkeypatch: pytest.MonkeyPatch, name: str, lowest: str,
                                              highest: str, below: str | None, above: str) -> None:
    for ok in (lowest, highest):
        monkeypatch.setenv(name, ok)
        config.load_settings()
    for bad in (below, above):
        if bad is None:
            continue
        monkeypatch.setenv(name, bad)
        with pytest.raises(DdlfastError) as error:
            config.load_settings()
        message = str(error.value)
        assert name in message and repr(bad) in message and "accepted" in message, message


@pytest.mark.parametrize(("name", "value"), [
    ("DDLFAST_RECEIVES_IN_FLIGHT", "100000000"),  # was std::bad_alloc -> SIGABRT in the core
    ("DDLFAST_RECEIVES_IN_FLIGHT", str(2**31)),  # was OverflowError converting to int
    ("DDLFAST_RECEIVES_IN_FLIGHT", str(2**64)),
    ("DDLFAST_RECEIVES_IN_FLIGHT", "9" * 5000),  # int() of > 4300 digits is a ValueError
    ("DDLFAST_CHUNK_BYTES", str(2**64)),
    ("DDLFAST_CHUNK_BYTES", "9" * 5000),
    ("DDLFAST_SMALL_BYTES", "16GiB"),
    ("DDLFAST_BUCKET_BYTES", str(2**63) + "GiB"),
    ("DDLFAST_TIMEOUT_S", "1e400"),
    ("DDLFAST_TIMEOUT_S", "-0.5"),
    ("DDLFAST_TIMEOUT_S", "1" * 5000),
    ("DDLFAST_RING_DIMS", "2x" + "9" * 40),
    ("DDLFAST_RING_DIMS", "x".join(["1"] * 33)),
    ("DDLFAST_COMPRESSION", ",".join(["none"] * 33)),
])
def test_values_beyond_what_the_core_takes_are_clear_errors(monkeypatch: pytest.MonkeyPatch, name: str,
                                                             value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(DdlfastError, match=name):
        config.load_settings()


def test_receive_scratch_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDLFAST_CHUNK_BYTES", "1GiB")
    monkeypatch.setenv("DDLFAST_RECEIVES_IN_FLIGHT", "4")
    assert config.load_settings().chunk_bytes == 1 << 30  # 4 GiB of scratch: the limit
    monkeypatch.setenv("DDLFAST_RECEIVES_IN_FLIGHT", "5")
    with pytest.raises(DdlfastError, match="DDLFAST_RECEIVES_IN_FLIGHT=5 x DDLFAST_CHUNK_BYTES"):
        config.load_settings()
    monkeypatch.setenv("DDLFAST_CHUNK_BYTES", "1MiB")
    monkeypatch.setenv("DDLFAST_RECEIVES_IN_FLIGHT", "1024")
    assert config.load_settings().receives_in_flight == 1024


def test_parse_dims_bounds_api_arguments_too() -> None:
    assert config.parse_dims((1,) * 32) == (1,) * 32
    for bad in ((1,) * 33, (2, 2**31), "1x" * 32 + "1"):
        with pytest.raises(DdlfastError, match="out of range"):
            config.parse_dims(bad)


@pytest.mark.parametrize(("function", "name", "default", "good", "bad"), [
    (config.probe_mode, "DDLFAST_PROBE", "1", {"0": "0", " FORCE ": "force", "1": "1"}, ["2", "yes", "-1"]),
    (config.probe_timeout_s, "DDLFAST_PROBE_TIMEOUT_S", 30.0, {"0.1": 0.1, "3600": 3600.0, "2.5": 2.5},
     ["0", "0.05", "3601", "nan", "inf", "soon"]),
    (config.hosts_per_group, "DDLFAST_HOSTS_PER_GROUP", 1, {"1": 1, "4": 4, str(1 << 20): 1 << 20},
     ["0", str((1 << 20) + 1), "racks", "2.0", "-2", "\u0664"]),
    (config.emulated_hosts, "DDLFAST_EMULATED_HOSTS", 0, {"0": 0, "2": 2, str(1 << 20): 1 << 20},
     ["-1", str((1 << 20) + 1), "two", "2.0"]),
    (config.timeline_max_events, "DDLFAST_TIMELINE_MAX_EVENTS", 100_000, {"1": 1, "10000000": 10_000_000},
     ["0", "10000001", str(2**70), "many"]),
    (config.abort_on_stall, "DDLFAST_ABORT_ON_STALL", True, {"0": False, "off": False, "1": True, "Yes": True},
     ["2", "maybe"]),
    (config.cuda_aware_mpi, "DDLFAST_CUDA_AWARE_MPI", "auto", {"on": "on", "OFF": "off", "auto": "auto"},
     ["yes", "1"]),
    (config.shared_memory, "DDLFAST_SHARED_MEMORY", True, {"0": False, "off": False, "1": True, "ON": True},
     ["2", "auto", "shm"]),
])
def test_variables_read_outside_the_engine_settings(function, name: str, default: object, good: dict,
                                                    bad: list[str]) -> None:
    assert function({}) == default
    assert function({name: "  "}) == default
    for raw, expected in good.items():
        assert function({name: raw}) == expected
    for raw in bad:
        with pytest.raises(DdlfastError) as error:
            function({name: raw})
        assert name in str(error.value) and repr(raw) in str(error.value) and "accepted" in str(error.value)


def test_spin_us_unset_means_the_automatic_rule() -> None:
    assert config.spin_us({}) is None
    assert config.spin_us({"DDLFAST_SPIN_US": " "}) is None


@pytest.mark.parametrize(("raw", "expected"), [("0", 0), ("1000", 1000), (" 200 ", 200), ("100000", 100_000)])
def test_spin_us_accepts(raw: str, expected: int) -> None:
    assert config.spin_us({"DDLFAST_SPIN_US": raw}) == expected


@pytest.mark.parametrize("raw", ["-1", "100001", "1.5", "1e3", "200us", "fast", "\u0664", str(2**64), "9" * 5000])
def test_spin_us_rejects_naming_the_variable_and_value(raw: str) -> None:
    with pytest.raises(DdlfastError) as error:
        config.spin_us({"DDLFAST_SPIN_US": raw})
    message = str(error.value)
    assert "DDLFAST_SPIN_US" in message and repr(raw) in message and "integers 0 to 100000" in message, message


def test_spin_us_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDLFAST_SPIN_US", "750")
    assert config.spin_us() == 750
    config.check_variable_names()  # a known name
    monkeypatch.setenv("DDLFAST_SPIN_USEC", "750")
    with pytest.raises(DdlfastError, match="did you mean DDLFAST_SPIN_US"):
        config.check_variable_names()


def test_cache_dir_and_timeline_path(tmp_path) -> None:
    assert config.cache_dir({}).parts[-2:] == (".cache", "ddlfast")
    assert config.cache_dir({"DDLFAST_CACHE_DIR": f" {tmp_path} "}) == tmp_path
    assert config.timeline_path({}) is None
    assert config.timeline_path({"DDLFAST_TIMELINE": " /tmp/trace "}) == "/tmp/trace"


def test_the_documented_table_lists_every_runtime_variable() -> None:
    import pathlib

    table = (pathlib.Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    for name in config.KNOWN_VARIABLES:
        assert f"`{name}`" in table, f"{name} is missing from docs/configuration.md"
    for expected in ("4 KiB to 1 GiB", "integer 2 to 1024", "0.1 to 604800 seconds", "0 to 1 GiB",
                     "1 byte to 16 GiB", "integer 1 to 10000000", "0.1 to 3600 seconds", "integer 1 to 1048576",
                     "integer 0 to 100000", "0.001 to 604800 seconds"):
        assert expected in table, f"docs/configuration.md should say {expected!r}"


# ---------------------------------------------------------------- DDLFAST_ALGORITHM


@pytest.mark.parametrize("value", ["auto", "latency", "mpi", "ring", "rabenseifner", "direct", " Direct ", "RING"])
def test_algorithm_accepts_each_choice(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("DDLFAST_ALGORITHM", value)
    assert config.load_settings().algorithm == value.strip().lower()


def test_algorithm_defaults_to_auto() -> None:
    assert config.load_settings().algorithm == "auto"


@pytest.mark.parametrize("value", ["fastest", "rings", "direct,ring", "0", "recursive-doubling"])
def test_algorithm_rejects_naming_the_variable_and_the_choices(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("DDLFAST_ALGORITHM", value)
    with pytest.raises(DdlfastError, match="DDLFAST_ALGORITHM") as raised:
        config.load_settings()
    for choice in config.ALGORITHMS:
        assert choice in str(raised.value)


# ---------------------------------------------------------------- observability (docs/observe.md)


@pytest.mark.parametrize("raw, expected", [(None, None), ("off", None), ("0", None), ("0.5", 0.5), ("2", 2.0)])
def test_straggler_warn_s(raw, expected) -> None:
    assert config.straggler_warn_s({} if raw is None else {"DDLFAST_STRAGGLER_WARN_S": raw}) == expected


@pytest.mark.parametrize("raw", ["abc", "-1", "0.0001", "1e30", "nan"])
def test_straggler_warn_s_refuses(raw) -> None:
    with pytest.raises(DdlfastError, match="DDLFAST_STRAGGLER_WARN_S"):
        config.straggler_warn_s({"DDLFAST_STRAGGLER_WARN_S": raw})


@pytest.mark.parametrize("raw, expected", [(None, 2000), ("0", 0), ("1", 1), ("100000", 100_000)])
def test_flight_records(raw, expected) -> None:
    assert config.flight_records({} if raw is None else {"DDLFAST_FLIGHT_RECORDS": raw}) == expected


@pytest.mark.parametrize("raw", ["-1", "100001", "1000000", "many", "2.5"])
def test_flight_records_refuses(raw) -> None:
    with pytest.raises(DdlfastError, match="DDLFAST_FLIGHT_RECORDS"):
        config.flight_records({"DDLFAST_FLIGHT_RECORDS": raw})


def test_flight_dir(tmp_path) -> None:
    assert config.flight_dir({}) is None
    assert config.flight_dir({"DDLFAST_FLIGHT_DIR": f" {tmp_path} "}) == str(tmp_path)
    assert config.flight_dir({"DDLFAST_FLIGHT_DIR": "  "}) is None  # blank is unset, as for every variable


def test_new_variables_are_checked_at_context_creation(monkeypatch) -> None:
    for name, bad in (("DDLFAST_STRAGGLER_WARN_S", "soon"), ("DDLFAST_FLIGHT_RECORDS", "-3")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(DdlfastError, match=name):
            config.check_environment()
        monkeypatch.delenv(name)


# ---------------------------------------------------------------- DDLFAST_REPRODUCIBLE


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("on", True), (" TRUE ", True), ("0", False),
                                                 ("no", False), ("", False)])
def test_reproducible_accepts_on_and_off(monkeypatch: pytest.MonkeyPatch, value: str, expected: bool) -> None:
    monkeypatch.setenv("DDLFAST_REPRODUCIBLE", value)
    assert config.load_settings().reproducible is expected


@pytest.mark.parametrize("value", ["2", "maybe", "reproducible"])
def test_reproducible_rejects_naming_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("DDLFAST_REPRODUCIBLE", value)
    with pytest.raises(DdlfastError, match="DDLFAST_REPRODUCIBLE"):
        config.load_settings()


def test_reproducible_argument_overrides_the_variable() -> None:
    settings = config.load_settings()
    assert settings.reproducible is False
    assert config.with_reproducible(settings, None, 0) is settings
    assert config.with_reproducible(settings, False, 0) is settings
    flipped = config.with_reproducible(settings, True, 0)
    assert flipped.reproducible is True and flipped.chunk_bytes == settings.chunk_bytes
    assert config.with_reproducible(settings, True, 0) is flipped  # one object per setting: plans stay cached
    assert config.with_reproducible(flipped, False, 0) == settings
    for bad in ("yes", 1, None.__class__):
        with pytest.raises(DdlfastError, match="reproducible=.* on rank 3 must be True, False or None"):
            config.with_reproducible(settings, bad, 3)


def test_settings_set_again_to_the_same_value_keep_the_fast_check(monkeypatch) -> None:
    """A DDLFAST_* variable set again to its value (a new object): the same Settings, and the identity check every
    collective makes (config._same_values, in C) holds again afterwards instead of failing on every later call."""
    import ddlfast._core  # noqa: F401 - it hands config its compare

    if config._same_values is None:
        pytest.skip("os.environ has no plain dict here")
    monkeypatch.setenv("DDLFAST_BUCKET_BYTES", "1MiB")
    first = config.load_settings()
    monkeypatch.setenv("DDLFAST_BUCKET_BYTES", "1MiB")
    assert config.load_settings() is first
    assert config._same_values(config._RAW_ENVIRON, config._RAW_KEYS, config._cache[0])
    monkeypatch.setenv("DDLFAST_BUCKET_BYTES", "2MiB")
    assert config.load_settings().bucket_bytes == 2 * config.MIB


def test_a_broadcast_takes_the_ring_from_one_chunk_per_hop(monkeypatch: pytest.MonkeyPatch) -> None:
    """engine/small.ring_broadcasts: the ring's pipeline from (P - 1) chunks up, at P = 2 (one hop) at every size;
    never with DDLFAST_ALGORITHM=mpi or one rank."""
    from ddlfast.engine.small import ring_broadcasts

    settings = config.load_settings()
    chunk = settings.chunk_bytes
    assert ring_broadcasts(2, chunk, settings) and ring_broadcasts(2, 1, settings)
    assert ring_broadcasts(3, 2 * chunk, settings) and not ring_broadcasts(3, 2 * chunk - 1, settings)
    assert ring_broadcasts(8, 7 * chunk, settings) and not ring_broadcasts(8, 7 * chunk - 1, settings)
    assert not ring_broadcasts(1, 100 * chunk, settings)
    monkeypatch.setenv("DDLFAST_ALGORITHM", "mpi")
    assert not ring_broadcasts(4, 100 * chunk, config.load_settings())
