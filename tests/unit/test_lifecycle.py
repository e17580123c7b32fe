"""The lifecycle defects of issue 22 where no second rank is needed: every DDLFAST_* variable checked at context
creation, files written never through a link, close() racing a submit, stale compiled modules, and the
one-issuing-thread rule on a one-rank context (the multi-rank cases: tests/mpi/test_trust_lifecycle.py)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import ddlfast
from ddlfast import config, mpi_check
from ddlfast.engine.timeline import Timeline
from ddlfast.engine.worker import CommThread
from ddlfast.files import create_file, replace_file

# A value each runtime variable must refuse. Free-form paths have none (a missing timeline directory is refused
# when the context creates its timeline).
BAD_VALUES = {
    "DDLFAST_COMPRESSION": "zip", "DDLFAST_BUCKET_BYTES": "0", "DDLFAST_FIRST_BUCKET_BYTES": "lots",
    "DDLFAST_CHUNK_BYTES": "8", "DDLFAST_SMALL_BYTES": "-1", "DDLFAST_RECEIVES_IN_FLIGHT": "1",
    "DDLFAST_RING_DIMS": "2y2", "DDLFAST_TIMEOUT_S": "nan", "DDLFAST_ABORT_ON_STALL": "maybe",
    "DDLFAST_TIMELINE_MAX_EVENTS": "0", "DDLFAST_PROBE": "2", "DDLFAST_PROBE_TIMEOUT_S": "inf",
    "DDLFAST_HOSTS_PER_GROUP": "0", "DDLFAST_EMULATED_HOSTS": "-1", "DDLFAST_CUDA_AWARE_MPI": "yes",
    "DDLFAST_SPIN_US": "100001", "DDLFAST_GPU_RING_MIN_BYTES": "-1",
    "DDLFAST_HALVING_BYTES": "1MiB",
    "DDLFAST_ALGORITHM": "fastest",
    "DDLFAST_ALLOW_SINGLE": "2", "DDLFAST_SHARED_MEMORY": "auto",
    "DDLFAST_STRAGGLER_WARN_S": "0.0000001", "DDLFAST_FLIGHT_RECORDS": "-1", "DDLFAST_DEBUG": "verbose",
    "DDLFAST_REPRODUCIBLE": "maybe",
}
FREE_FORM = {"DDLFAST_TIMELINE", "DDLFAST_CACHE_DIR", "DDLFAST_FLIGHT_DIR"}


def test_every_runtime_variable_has_a_bad_value_here() -> None:
    assert set(BAD_VALUES) | FREE_FORM == config.RUNTIME_VARIABLES


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_check_environment_refuses_every_variable(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv(name, BAD_VALUES[name])
    with pytest.raises(ddlfast.DdlfastError, match=name):
        config.check_environment()


@pytest.mark.parametrize(("name", "value"), [
    *(("DDLFAST_PROBE_TIMEOUT_S", v) for v in ("0", "3601", "nan", "inf", "-1")),
    *(("DDLFAST_TIMELINE_MAX_EVENTS", v) for v in ("0", "-5", "10000001")),
])
def test_context_creation_refuses_the_audited_values(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ddlfast.DdlfastError, match=name):
        ddlfast.Context(MPI.COMM_SELF)


def test_check_environment_passes_the_defaults() -> None:
    config.check_environment()


# -- files written never through a link ------------------------------------------------------------------------------


def _planted(tmp_path: Path, name: str) -> Path:
    target = tmp_path / "precious"
    target.write_text("keep me")
    (tmp_path / name).symlink_to(target)
    return target


def test_replace_file_and_create_file_replace_a_planted_link(tmp_path: Path) -> None:
    target = _planted(tmp_path, "a.json")
    replace_file(tmp_path / "a.json", "{}")
    assert target.read_text() == "keep me"
    assert not (tmp_path / "a.json").is_symlink() and (tmp_path / "a.json").read_text() == "{}"
    target = _planted(tmp_path, "b.json")
    with create_file(tmp_path / "b.json", "[]") as file:
        file.write(b"x")
    assert target.read_text() == "keep me"
    assert (tmp_path / "b.json").read_bytes() == b"[]x"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_the_timeline_does_not_follow_a_planted_link(tmp_path: Path) -> None:
    target = _planted(tmp_path, "trace.rank0.json")
    import itertools

    from ddlfast.engine import timeline

    timeline._context_numbers = itertools.count()  # this process's first timeline: trace.rank0.json
    trace = Timeline(str(tmp_path / "trace"), 0)
    trace.add("pack", 0.0, 1.0)
    trace.flush()
    assert target.read_text() == "keep me"
    assert '"pack"' in (tmp_path / "trace.rank0.json").read_text()


# -- close() racing a submit -----------------------------------------------------------------------------------------


def test_a_submit_racing_close_raises_or_completes() -> None:
    """Each submit either raises DdlfastError ('closed') or returns a handle that completes; none is left behind
    the stop marker (the race left 1 in 40 rounds with a handle that never completed)."""
    for _ in range(200):
        worker = CommThread("race")
        handles, refused = [], []
        started = threading.Event()

        def submitter(worker: CommThread = worker, handles: list = handles, refused: list = refused,
                      started: threading.Event = started) -> None:
            started.set()
            while True:
                try:
                    handles.append(worker.submit(lambda: 1, "work"))
                except ddlfast.DdlfastError as error:
                    refused.append(str(error))
                    return

        thread = threading.Thread(target=submitter)
        thread.start()
        started.wait(10)
        worker.close(10)
        thread.join(10)
        assert refused and "closed" in refused[0]
        assert all(handle.wait(timeout=10) == 1 for handle in handles)


# -- one issuing thread, one process ---------------------------------------------------------------------------------


def _in_thread(action, name: str = "other") -> BaseException | None:
    outcome: list = [None]

    def run() -> None:
        try:
            action()
        except BaseException as error:  # noqa: BLE001
            outcome[0] = error

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join(60)
    return outcome[0]


def test_a_second_thread_is_refused_naming_both() -> None:
    context = ddlfast.Context(MPI.COMM_SELF)
    x = np.ones(16, np.float32)
    context.allreduce(x)  # this thread issues
    for call in (lambda: context.allreduce(x), lambda: context.allreduce_async(x), context.barrier,
                 lambda: context.submit(lambda: None, "work")):
        error = _in_thread(call)
        assert isinstance(error, ddlfast.DdlfastError)
        assert "'other'" in str(error) and repr(threading.current_thread().name) in str(error)
        assert "one Context per thread" in str(error)
    with context.delegated():  # explicit: this thread waits while another issues for it
        pass
    assert _in_thread(lambda: context.allreduce(x)) is not None  # the delegation is the calling thread's only
    context.allreduce_async(x).wait()  # the communication thread's own work is not refused
    context.close()


def test_the_first_issuing_thread_binds_and_hand_over_moves_it() -> None:
    context = ddlfast.Context(MPI.COMM_SELF)  # created here, used only by another thread
    x = np.ones(4, np.float32)
    assert _in_thread(lambda: context.allreduce(x), "trainer") is None
    assert "'trainer'" in str(_catch(lambda: context.allreduce(x)))
    context.hand_over()
    context.allreduce(x)
    assert "'trainer'" in str(_in_thread(lambda: context.allreduce(x), "trainer"))
    context.close()


def _catch(action) -> BaseException | None:
    try:
        action()
    except BaseException as error:  # noqa: BLE001
        return error
    return None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork()")
def test_a_fork_child_is_refused_and_its_close_does_nothing() -> None:
    context = ddlfast.Context(MPI.COMM_SELF)
    x = np.ones(4, np.float32)
    context.allreduce(x)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        error = _catch(lambda: context.allreduce(x))
        closed = _catch(context.close)
        ok = isinstance(error, ddlfast.DdlfastError) and "fork() child" in str(error) and closed is None
        os.write(write, b"ok" if ok else repr(error).encode())
        os._exit(0)
    os.close(write)
    report = os.read(read, 4096)
    os.waitpid(pid, 0)
    assert report == b"ok"
    context.allreduce(x)  # the parent's context is untouched
    context.close()


# -- stale compiled modules ------------------------------------------------------------------------------------------


def test_stale_compiled_modules_are_named_and_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "_core.cpython-311-x.so").write_bytes(b"core")
    (tmp_path / "_cuda.cpython-311-x.so").write_bytes(b"left over")
    (tmp_path / "_testing.cpython-311-x.so").write_bytes(b"resized")
    record = tmp_path / "_mpi_build.py"
    record.write_text("MODULES = {'_core.cpython-311-x.so': 4, '_testing.cpython-311-x.so': 3}\n")
    assert mpi_check.stale_modules(tmp_path, record) == ["_cuda.cpython-311-x.so", "_testing.cpython-311-x.so"]
    monkeypatch.setattr("sys.meta_path", list(__import__("sys").meta_path))
    with pytest.warns(mpi_check.StaleModuleWarning, match="ddlfast._cuda"):
        mpi_check.refuse_stale_modules(tmp_path, record)
    finder = __import__("sys").meta_path[0]
    with pytest.raises(ImportError, match="left over from an earlier build"):
        finder.find_spec("ddlfast._cuda")
    assert finder.find_spec("ddlfast._core") is None
    record.write_text("MODULES = {'_cuda.cpython-311-x.so': 9}\n")
    with pytest.raises(ddlfast.DdlfastError, match="ddlfast._core"):
        mpi_check.refuse_stale_modules(tmp_path, record)


def test_this_build_has_no_stale_module() -> None:
    assert mpi_check.stale_modules() == []
