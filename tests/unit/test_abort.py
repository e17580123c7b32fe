"""DDLFAST_ABORT_ON_STALL parsing and the excepthook ddlfast installs at import."""

from __future__ import annotations

import sys

import pytest

import ddlfast
from ddlfast import abort
from ddlfast.errors import DdlfastError


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("", True), ("on", True), ("0", False),
                                                 ("off", False), ("False", False)])
def test_abort_on_stall_values(monkeypatch: pytest.MonkeyPatch, value: str, expected: bool) -> None:
    monkeypatch.setenv("DDLFAST_ABORT_ON_STALL", value)
    assert abort.abort_on_stall_enabled() is expected


def test_abort_on_stall_malformed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDLFAST_ABORT_ON_STALL", "maybe")
    with pytest.raises(DdlfastError, match="DDLFAST_ABORT_ON_STALL='maybe'"):
        abort.abort_on_stall_enabled()


def test_importing_ddlfast_chains_the_excepthook() -> None:
    assert ddlfast is not None
    assert sys.excepthook is not sys.__excepthook__
    assert sys.excepthook.__qualname__.startswith("install.")
