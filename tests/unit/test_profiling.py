"""profiling.py: the one label per collective, when NVTX ranges are opened, and that they nest around the call.

No GPU here: NVTX's own output (Nsight Systems) is unverified; the choice and the push/pop order are tested with
a recorder in torch.cuda.nvtx's place."""

from __future__ import annotations

import threading

import pytest

from ddlfast import config, profiling
from ddlfast.errors import DdlfastError


def test_label_is_the_collective_under_ddlfast() -> None:
    assert profiling.range_label("allreduce") == "ddlfast:allreduce"
    assert profiling.range_label("fused_reduce_scatter_async") == "ddlfast:fused_reduce_scatter_async"


class _Cuda:
    def __init__(self, available: bool | Exception) -> None:
        self.available = available

    def is_available(self) -> bool:
        if isinstance(self.available, Exception):
            raise self.available
        return self.available


@pytest.mark.parametrize(("cuda_build", "torch_cuda", "wanted"), [
    (False, _Cuda(True), False),  # no CUDA kernels in this build: never
    (True, None, None),  # torch.cuda not imported: not known yet
    (True, _Cuda(False), False),  # no device
    (True, _Cuda(RuntimeError("driver")), False),
    (True, _Cuda(True), True),
])
def test_nvtx_wanted_only_with_cuda_kernels_and_a_device(cuda_build: bool, torch_cuda: object,
                                                         wanted: bool | None) -> None:
    assert profiling.nvtx_wanted(cuda_build, torch_cuda) is wanted


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None]] = []

    def range_push(self, label: str) -> None:
        self.calls.append(("push", label))

    def range_pop(self) -> None:
        self.calls.append(("pop", None))


def test_traced_opens_an_nvtx_range_around_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = _Recorder()
    monkeypatch.setattr(profiling, "_nvtx", recorder)

    @profiling.traced("allreduce")
    def collective(fail: bool) -> str:
        recorder.calls.append(("call", None))
        if fail:
            raise DdlfastError("bad input")
        return "done"

    assert collective(False) == "done"
    with pytest.raises(DdlfastError):
        collective(True)  # the range is closed on the way out of an error too
    assert recorder.calls == [("push", "ddlfast:allreduce"), ("call", None), ("pop", None)] * 2
    with profiling.recording_range("ddlfast:allreduce"):  # the latency path's range
        pass
    assert recorder.calls[-2:] == [("push", "ddlfast:allreduce"), ("pop", None)]


def test_no_nvtx_without_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine: decided from the real build and torch.cuda (no GPU): no ranges, decided once."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    monkeypatch.setattr(profiling, "_nvtx", None)
    assert profiling._decide_nvtx() is False
    assert profiling._nvtx is False
    assert profiling.recording_range("ddlfast:allreduce") is None  # and no profiler recording


def test_stall_limit_replaces_the_timeout_on_this_thread_only() -> None:
    base = config.load_settings().timeout_s
    seen: list[float] = []
    with config.stall_limit(1.5):
        assert config.load_settings().timeout_s == 1.5 == config.current_stall_limit()
        with config.stall_limit(2.5):
            assert config.load_settings().timeout_s == 2.5
        assert config.load_settings().timeout_s == 1.5
        other = threading.Thread(target=lambda: seen.append(config.load_settings().timeout_s))
        other.start()
        other.join()
    assert seen == [base]
    assert config.load_settings().timeout_s == base and config.current_stall_limit() is None
    assert not config.STALL_LIMITS


@pytest.mark.parametrize("seconds", [0.0, 0.01, 8 * 24 * 3600.0])
def test_stall_limit_out_of_range(seconds: float) -> None:
    with pytest.raises(DdlfastError, match="out of range"), config.stall_limit(seconds):
        pass


def test_undecided_without_torch_cuda_costs_one_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    """While torch.cuda is not imported, a collective neither decides NVTX nor asks the core (build_facts built
    a dict on every fused_allreduce of a CUDA build: +40 % at 4 KiB, P=2)."""
    monkeypatch.setattr(profiling, "_nvtx", None)
    monkeypatch.setattr(profiling, "_modules_get", lambda name: None)  # nothing imported: torch, torch.cuda

    def must_not_run() -> None:
        raise AssertionError("NVTX decided without torch.cuda")

    monkeypatch.setattr(profiling, "_decide_nvtx", must_not_run)

    @profiling.traced("allreduce")
    def collective() -> str:
        return "ran"

    assert collective() == "ran" and profiling.recording_range("ddlfast:allreduce") is None
