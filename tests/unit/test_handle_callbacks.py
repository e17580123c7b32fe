"""Handle.add_done_callback: called once, after completion, on the thread that completed the handle (or at once)."""

from __future__ import annotations

import threading

import pytest

from ddlfast.engine.worker import CommThread
from ddlfast.errors import DdlfastError


def test_callbacks_run_after_completion_on_the_communication_thread() -> None:
    worker = CommThread("test-comm")
    release = threading.Event()
    handle = worker.submit(lambda: (release.wait(10), 42)[1], "blocked work")
    seen: list[tuple[object, str]] = []
    handle.add_done_callback(lambda h: seen.append((h.wait(), threading.current_thread().name)))
    assert seen == []
    release.set()
    assert handle.wait(10) == 42
    worker.close(10)
    assert seen == [(42, "test-comm")]


def test_a_callback_added_after_completion_runs_at_once_and_errors_reach_it() -> None:
    worker = CommThread("test-comm")

    def fail() -> None:
        raise DdlfastError("injected")

    handle = worker.submit(fail, "failing work")
    with pytest.raises(DdlfastError, match="injected"):
        handle.wait(10)
    errors: list[str] = []

    def record(h: object) -> None:
        try:
            h.wait()
        except DdlfastError as error:
            errors.append(str(error))

    handle.add_done_callback(record)
    handle.add_done_callback(lambda h: 1 / 0)  # a failing callback is ignored
    assert errors == ["injected"]
    assert worker.submit(lambda: 7, "after").wait(10) == 7  # the thread survived
    worker.close(10)
