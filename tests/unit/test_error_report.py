"""The short report of an uncaught DdlfastError (ddlfast/error_report.py, called by ddlfast's excepthook)."""

from __future__ import annotations

import sys

import pytest

import ddlfast
from ddlfast import error_report
from ddlfast.errors import DdlfastConsistentError, DdlfastError


def _raised(error: BaseException):
    def user_step() -> None:
        raise error

    try:
        user_step()
    except BaseException:  # noqa: BLE001
        return sys.exc_info()
    raise AssertionError("not raised")


def test_a_rank_error_names_rank_site_and_message() -> None:
    kind, error, trace = _raised(DdlfastError("array 0 on rank 1 is not C-contiguous"))
    text = error_report.report(kind, error, trace)
    assert text.startswith("ddlfast: ")
    assert f"DdlfastError at {__file__}:" in text and "(user_step): array 0 on rank 1 is not C-contiguous" in text
    assert "DDLFAST_DEBUG=1" in text and "Traceback" not in text


def test_an_error_every_rank_raised_is_printed_once() -> None:
    error = DdlfastConsistentError("ranks disagree on array 0")
    error.rank, error.size = 0, 4
    text = error_report.report(*_raised(error)[:1], error, _raised(error)[2])
    assert "ddlfast: ranks 0-3: DdlfastConsistentError at" in text and "ranks disagree on array 0" in text
    error.rank = 2
    other = error_report.report(DdlfastConsistentError, error, None)
    assert other.startswith("ddlfast: rank 2: the same DdlfastConsistentError") and "disagree" not in other


def test_present_leaves_other_exceptions_and_debug_to_python(monkeypatch, capsys) -> None:
    assert error_report.present(*_raised(ValueError("not ddlfast's"))) is False
    monkeypatch.setenv("DDLFAST_DEBUG", "1")
    assert error_report.present(*_raised(DdlfastError("x"))) is False
    monkeypatch.setenv("DDLFAST_DEBUG", "0")
    assert error_report.present(*_raised(DdlfastError("x"))) is True
    assert "ddlfast:" in capsys.readouterr().err


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("on", True), ("0", False), ("", False)])
def test_debug_values(monkeypatch, value: str, expected: bool) -> None:
    monkeypatch.setenv("DDLFAST_DEBUG", value)
    assert ddlfast.config.debug() is expected
