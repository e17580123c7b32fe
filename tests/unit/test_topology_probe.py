"""The probe's bounded waiting, settings and cache (one process; multi-rank cases are in tests/mpi)."""

from __future__ import annotations

import os
import stat
import time
import warnings

import numpy as np
import pytest
from mpi4py import MPI

from ddlfast.errors import DdlfastError, DdlfastTimeoutError
from ddlfast.topology import probe
from ddlfast.topology.cost_model import Link


def test_wait_all_gives_up_at_the_deadline() -> None:
    buffer = np.zeros(8, np.uint8)
    request = MPI.COMM_SELF.Irecv(buffer, 0, tag=4242)  # nobody sends: never completes
    start = time.monotonic()
    with pytest.raises(DdlfastTimeoutError, match="never-sent message did not complete"):
        probe.wait_all([request], start + 0.3, "never-sent message", idle=True)
    assert time.monotonic() - start < 5


def test_probe_mode_and_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DDLFAST_PROBE", raising=False)
    assert probe.probe_mode() == "1"
    monkeypatch.setenv("DDLFAST_PROBE", "FORCE")
    assert probe.probe_mode() == "force"
    monkeypatch.setenv("DDLFAST_PROBE", "maybe")
    with pytest.raises(DdlfastError, match="DDLFAST_PROBE='maybe'"):
        probe.probe_mode()
    monkeypatch.setenv("DDLFAST_PROBE_TIMEOUT_S", "2.5")
    assert probe.probe_timeout() == 2.5
    for bad in ("0", "-1", "soon", "inf"):
        monkeypatch.setenv("DDLFAST_PROBE_TIMEOUT_S", bad)
        with pytest.raises(DdlfastError, match="DDLFAST_PROBE_TIMEOUT_S"):
            probe.probe_timeout()


def test_skip_uses_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDLFAST_PROBE", "0")
    links = probe.links_for(MPI.COMM_SELF, {"intra": (0, 0)}, {"x": 1})
    assert links.source == "defaults (DDLFAST_PROBE=0)" and links.intra is not None and links.inter is None


def test_measure_alone_times_the_reduction() -> None:
    links = probe.measure(MPI.COMM_SELF, {}, timeout_s=10)
    assert links.source == "probe" and links.intra is None and 0 < links.gamma < 1e-8


def test_cache_round_trip(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("DDLFAST_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DDLFAST_PROBE", "1")
    links = probe.Links(Link(2e-6, 1e-10), Link(3e-5, 8e-9), None, 2e-10, "probe")
    key = probe.fingerprint({"hosts": 2})
    assert key != probe.fingerprint({"hosts": 3})
    probe._write_cache(key, links)
    cached = probe._read_cache(key)
    assert cached is not None and cached.source == "cache"
    assert (cached.intra, cached.inter, cached.group, cached.gamma) == (links.intra, links.inter, None, 2e-10)
    (tmp_path / f"probe-{key}.json").write_text("{not json")
    with pytest.warns(probe.CacheWarning):
        assert probe._read_cache(key) is None  # a damaged cache is a miss, not an error


def test_unwritable_cache_is_not_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("DDLFAST_CACHE_DIR", str(blocker / "sub"))
    probe._write_cache("k", probe.Links(None, None, None, 1e-10, "probe"))


# -- the cache is untrusted input -----------------------------------------------------------------------------------

GOOD = probe.Links(Link(2e-6, 1e-10), Link(3e-5, 8e-9), None, 2e-10, "probe")


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path):
    directory = tmp_path / "cache"
    monkeypatch.setenv("DDLFAST_CACHE_DIR", str(directory))
    monkeypatch.setenv("DDLFAST_PROBE", "1")
    return directory


def test_cache_is_private(cache) -> None:
    probe._write_cache("k", GOOD)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    files = list(cache.iterdir())
    assert [f.name for f in files] == ["probe-k.json"]  # no temporary left behind
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600


def test_cache_write_does_not_follow_a_planted_link(cache, tmp_path) -> None:
    cache.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (cache / "probe-k.json").symlink_to(victim)
    for pid in range(os.getpid() - 2, os.getpid() + 3):  # the temporary's old, predictable names
        (cache / f".probe-k.{pid}.tmp").symlink_to(victim)
    with pytest.warns(probe.CacheWarning, match="symbolic link"):
        assert probe._read_cache("k") is None  # nor read through it
    probe._write_cache("k", GOOD)
    assert victim.read_text() == "precious"
    assert not (cache / "probe-k.json").is_symlink()
    assert probe._read_cache("k") is not None


@pytest.mark.parametrize(("text", "why"), [
    ('{"intra": [NaN, 1e-10], "inter": null, "group": null, "gamma": 2e-10}', "NaN"),
    ('{"intra": [2e-6, Infinity], "inter": null, "group": null, "gamma": 2e-10}', "Infinity"),
    ('{"intra": [2e-6, 1e-10], "inter": null, "group": null, "gamma": 1e300}', "gamma"),
    ('{"intra": [2e-6, 1e-10], "inter": null, "group": null, "gamma": 1' + "0" * 400 + '}', "gamma"),
    ('{"intra": [-2e-6, 1e-10], "inter": null, "group": null, "gamma": 2e-10}', "intra alpha"),
    ('{"intra": [0, 1e-10], "inter": null, "group": null, "gamma": 2e-10}', "intra alpha"),
    ('{"intra": [2e-6, "fast"], "inter": null, "group": null, "gamma": 2e-10}', "not a number"),
    ('{"intra": [2e-6, true], "inter": null, "group": null, "gamma": 2e-10}', "not a number"),
    ('{"intra": [2e-6], "inter": null, "group": null, "gamma": 2e-10}', "alpha, beta"),
    ('{"intra": [2e-6, 1e-10], "inter": null, "gamma": 2e-10}', "group"),
    ("[" * 100_000 + "]" * 100_000, "larger than"),
    ("[" * 5000 + "]" * 5000, "nests deeper"),
    ('{"a": ' * 5000 + "1" + "}" * 5000, "nests deeper"),
    ('{"intra": [[[[[1]]]]], "inter": null, "group": null, "gamma": 2e-10}', "nests deeper"),
    ('{"intra": [2e-6, 1e-10], "inter": null, "gr', "Unterminated string"),
    ('{"intra": [2e-6, 1e-10], "inter": null, "group": null, "gamma": 2e', "Expecting"),
    ("", "Expecting value"),
    ("[1, 2]", "not a JSON object"),
    ("\xff\xfe", "utf-8"),
])
def test_bad_cache_is_ignored_with_a_warning(cache, text: str, why: str) -> None:
    cache.mkdir(mode=0o700)
    (cache / "probe-k.json").write_bytes(text.encode("latin-1") if text == "\xff\xfe" else text.encode())
    with pytest.warns(probe.CacheWarning, match=why):
        assert probe._read_cache("k") is None


def test_cache_with_other_tiers_than_the_job_is_ignored(cache) -> None:
    probe._write_cache("k", GOOD)
    assert probe._read_cache("k", ("intra", "inter")) is not None
    with pytest.warns(probe.CacheWarning, match="tiers"):
        assert probe._read_cache("k", ("intra",)) is None


def test_cache_that_is_not_a_regular_file_is_ignored(cache) -> None:
    (cache / "probe-k.json").mkdir(parents=True)
    with pytest.warns(probe.CacheWarning):
        assert probe._read_cache("k") is None
    os.mkfifo(cache / "probe-f.json")  # must not block opening it
    with pytest.warns(probe.CacheWarning, match="not a regular file"):
        assert probe._read_cache("f") is None


def test_missing_cache_is_a_silent_miss(cache) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert probe._read_cache("k") is None


def test_links_for_probes_again_after_a_bad_cache(cache, monkeypatch: pytest.MonkeyPatch) -> None:
    pairs, description = {"intra": (0, 0), "inter": (0, 0)}, {"hosts": 2}
    key = probe.fingerprint(description)
    probe._write_cache(key, GOOD)
    measured = []
    monkeypatch.setattr(probe, "measure", lambda *args: measured.append(args) or GOOD)
    links = probe.links_for(MPI.COMM_SELF, pairs, description)
    assert links.source == "cache" and links.intra == GOOD.intra and links.gamma == GOOD.gamma and not measured
    (cache / f"probe-{key}.json").write_text('{"intra": [NaN, 1], "inter": null, "group": null, "gamma": 1}')
    with pytest.warns(probe.CacheWarning, match="NaN"):
        assert probe.links_for(MPI.COMM_SELF, pairs, description) is GOOD
    assert len(measured) == 1
    assert probe._read_cache(key) is not None  # and the fresh result replaced the bad file
