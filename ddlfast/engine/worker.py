"""The communication thread a Context owns, and the handles it completes.

Work runs strictly in submission order, so every rank completes its
collectives in the order it submitted them (the order all ranks agree on).
The compiled core releases the GIL, so the caller's compute (backward) runs
while a bucket is on the wire.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ddlfast.errors import DdlfastError

_STOP = object()


class Handle:
    """The pending result of an asynchronous collective.

    wait() blocks until it completes and returns its result (the list of
    reduced arrays), raising DdlfastError if it failed; waiting again returns
    the same result (or raises the same error). done() never blocks. The
    arrays must not be read or written until wait() has returned.
    """

    def __init__(self, description: str) -> None:
        self.description = description
        self._finished = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Handle], None]] = []
        self._callbacks_lock = threading.Lock()
        self.duration_s = 0.0  # time the communication thread spent executing it

    def done(self) -> bool:
        return self._finished.is_set()

    def add_done_callback(self, callback: Callable[[Handle], None]) -> None:
        """Call `callback(handle)` once the handle completes (at once if it has): on the communication thread,
        so it must be short and must not wait for another collective. What it raises is ignored."""
        with self._callbacks_lock:
            if not self._finished.is_set():
                self._callbacks.append(callback)
                return
        _call_quietly(callback, self)

    def exception(self) -> BaseException | None:
        """What the collective raised, once it is done (None while pending or after success)."""
        return self._error if self._finished.is_set() else None

    def wait(self, timeout: float | None = None) -> Any:
        if not self._finished.wait(timeout):
            raise DdlfastError(f"{self.description} did not complete within {timeout} s")
        if self._error is not None:
            if isinstance(self._error, DdlfastError):
                error = type(self._error)(str(self._error))
                error.__dict__.update(self._error.__dict__)  # e.g. RanksLostError's lost ranks and new size
                raise error from self._error
            raise DdlfastError(f"{self.description} failed: {self._error!r}") from self._error
        return self._result

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        with self._callbacks_lock:
            self._finished.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            _call_quietly(callback, self)


def _call_quietly(callback: Callable[[Handle], None], handle: Handle) -> None:
    try:
        callback(handle)
    except Exception:  # noqa: BLE001 - a callback's failure must not stop the communication thread
        pass


class CommThread:
    """One thread executing submitted work items in order."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # Held while any work runs, here or inline; `_outstanding` counts submitted work not yet finished.
        self._running = threading.Lock()
        self._count_lock = threading.Lock()
        self._outstanding = 0
        # Makes "not closed, then queued" one step against close()'s "closed, then the stop marker": without it a
        # submit racing close() could queue work behind the marker, and its handle would never complete.
        self._submit_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._closed = False
        self._thread.start()

    def submit(self, work: Callable[[], Any], description: str) -> Handle:
        """Queue `work`; raises DdlfastError once close() has begun (never a handle that cannot complete)."""
        handle = Handle(description)
        with self._submit_lock:
            if self._closed:
                raise DdlfastError(f"cannot submit {description}: the context is closed")
            with self._count_lock:
                self._outstanding += 1
            self._queue.put((work, handle))
        return handle

    def run_if_idle(self, work: Callable[[], Any]) -> tuple[bool, Any]:
        """Run `work` on the calling thread if nothing submitted is queued or running (so the order of
        collectives stays the order of submission); (False, None) otherwise. Saves a thread hand-off per
        blocking call once asynchronous calls have created this thread."""
        with self._running:
            with self._count_lock:
                idle = self._outstanding == 0
            if not idle:
                return False, None
            return True, work()

    def close(self, timeout: float | None = None) -> bool:
        """Finish what was submitted, then stop; False if the thread is still busy after `timeout`."""
        with self._submit_lock:
            if not self._closed:
                self._closed = True
                self._queue.put(_STOP)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            work, handle = item
            with self._running:
                start = time.perf_counter()
                try:
                    result = work()
                except BaseException as error:  # noqa: BLE001 - delivered to the waiter instead
                    handle.duration_s = time.perf_counter() - start
                    error_or_result = (error, None)
                else:
                    handle.duration_s = time.perf_counter() - start
                    error_or_result = (None, result)
                with self._count_lock:
                    self._outstanding -= 1
            handle._finish(result=error_or_result[1], error=error_or_result[0])
