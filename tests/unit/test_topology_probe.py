"""The probe's bounded waiting, settings and cache (one process; multi-rank cases are in tests/mpi)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

from ddlfast import probe
from ddlfast.errors import DdlfastError, DdlfastTimeoutError
from ddlfast.plan import Link


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
    assert probe._read_cache(key) is None  # a damaged cache is a miss, not an error


def test_unwritable_cache_is_not_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("DDLFAST_CACHE_DIR", str(blocker / "sub"))
    probe._write_cache("k", probe.Links(None, None, None, 1e-10, "probe"))
