"""TorchState's snapshot copy (ddlfast/elastic.py, _copied): a deep copy of a model's and an optimizer's state
dicts that reuses the previous snapshot's tensors where they fit, and never shares memory with the live state."""

from __future__ import annotations

import collections

import pytest

torch = pytest.importorskip("torch")

from ddlfast.elastic import _copied  # noqa: E402


def _state() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_copy_then_a_copy_into_the_same_tensors() -> None:
    model, optimizer = _state()
    first = _copied(model.state_dict(), None)
    assert isinstance(first, collections.OrderedDict) and list(first) == ["weight", "bias"]
    assert all(first[name].data_ptr() != live.data_ptr() for name, live in model.state_dict().items())
    kept = {name: tensor.data_ptr() for name, tensor in first.items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    second = _copied(model.state_dict(), first)
    assert {name: tensor.data_ptr() for name, tensor in second.items()} == kept  # no new tensors
    assert torch.equal(second["weight"], model.weight)
    with torch.no_grad():
        model.weight.add_(1.0)  # the snapshot does not move with the live state
    assert not torch.equal(second["weight"], model.weight)


def test_optimizer_state_and_mismatches() -> None:
    model, optimizer = _state()
    first = _copied(optimizer.state_dict(), None)
    momentum = first["state"][0]["momentum_buffer"]
    assert torch.equal(momentum, optimizer.state_dict()["state"][0]["momentum_buffer"])
    assert first["param_groups"] == optimizer.state_dict()["param_groups"]
    again = _copied(optimizer.state_dict(), first)
    assert again["state"][0]["momentum_buffer"].data_ptr() == momentum.data_ptr()
    # A tensor whose shape or dtype changed gets a new copy; a default dict keeps its factory.
    other = _copied({"a": torch.zeros(5), "b": torch.zeros(3, dtype=torch.float64)}, {"a": torch.zeros(4),
                                                                                       "b": torch.zeros(3)})
    assert other["a"].shape == (5,) and other["b"].dtype == torch.float64
    counts = collections.defaultdict(int, {"x": 1})
    copied = _copied(counts, None)
    assert isinstance(copied, collections.defaultdict) and copied["missing"] == 0 and copied is not counts
