"""The fingerprint sync() compares the ranks' snapshots by (ddlfast/elastic.py, fingerprint_of): the same in every
process for the same state, different for different state, and a clear refusal, naming where and what, for a
value with no canonical encoding. The multi-rank recovery itself is tests/mpi/test_elastic.py (needs ULFM)."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import ddlfast
import ddlfast.elastic
from ddlfast.elastic import fingerprint_of

# A state as a training loop keeps it: sets of strings, objects with the default repr (an address), dicts built
# by iterating a set (their insertion order follows the hash seed), floats whose bits matter.
STATE_PROGRAM = textwrap.dedent("""
    import collections, dataclasses, enum, json, sys
    import numpy as np
    import ddlfast.elastic

    class Config:  # the default repr: <Config object at 0x...>
        def __init__(self):
            self.lr = 0.1
            self.tags = {"warmup", "cosine", "ema"}

    @dataclasses.dataclass
    class Schedule:
        milestones: list
        seen: set

    class Phase(enum.Enum):
        TRAIN = "train"

    words = {"alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"}
    values = {
        "params": np.arange(12, dtype=np.float32).reshape(3, 4),
        "vocabulary": words, "frozen": frozenset(words), "config": Config(), "schedule": Schedule([3, 7], words),
        "counts": {word: len(word) for word in words}, "by_length": collections.defaultdict(list),
        "nested": {"b": {"y": 1, "x": [None, True, -0.0, float("nan"), 3 + 4j, b"raw"]}, "a": (1, "one")},
        "array_of_objects": np.array([{"q", "r"}, Config()], dtype=object), "phase": Phase.TRAIN,
        "step": np.int64(12), "big": 2 ** 100,
    }
    for word in sorted(words):  # lists keep their order: sorted, the same state everywhere
        values["by_length"][len(word)].append(word)
    if sys.argv[1] == "torch":
        import torch
        values["weights"] = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t()
        values["dtype"] = torch.float16
    ddlfast.elastic.ulfm.require = lambda what: None  # the fingerprint needs no ULFM; State's constructor asks
    state = ddlfast.elastic.NumpyState(**values)
    print(json.dumps([state.fingerprint(state.save()), ddlfast.elastic.fingerprint_of(values)]))
""")


def _fingerprints_with_hash_seed(seed: int, *extra: str) -> list[str]:
    result = subprocess.run([sys.executable, "-c", STATE_PROGRAM, *(extra or ("numpy",))], capture_output=True,
                            text=True, timeout=300, env=dict(os.environ, PYTHONHASHSEED=str(seed)))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_two_processes_fingerprint_the_same_state_alike() -> None:
    """What two survivors compute: string hashes seeded differently, objects at other addresses."""
    assert _fingerprints_with_hash_seed(1) == _fingerprints_with_hash_seed(2)


def test_two_processes_fingerprint_the_same_tensors_alike() -> None:
    pytest.importorskip("torch")
    assert _fingerprints_with_hash_seed(3, "torch") == _fingerprints_with_hash_seed(4, "torch")


def test_dicts_equal_whatever_their_order_fingerprint_alike() -> None:
    one, other = {"a": 1, "b": {"c": 2, "d": 3}}, {"b": {"d": 3, "c": 2}, "a": 1}
    assert fingerprint_of({"x": one}) == fingerprint_of({"x": other})
    # An OrderedDict's order is part of its equality, and so of its fingerprint.
    assert (fingerprint_of({"x": collections.OrderedDict(a=1, b=2)})
            != fingerprint_of({"x": collections.OrderedDict(b=2, a=1)}))


@pytest.mark.parametrize("one, other", [
    (0.0, -0.0), (float("nan"), float("-nan")), (1, 1.0), (True, 1), ([1, 2], (1, 2)), ({"a"}, frozenset({"a"})),
    ("a", b"a"), ({"a": 1}, {"a": 2}), (np.float32(1), np.float64(1)), (np.zeros(4), np.zeros((4, 1))),
    (np.zeros(2, np.float32), np.zeros(2, np.int32)), (np.array([1.0, 2.0]), np.array([1.0, 2.0000001])),
    (collections.OrderedDict(a=1), {"a": 1}), ([[1], 2], [[1, 2]]), (("ab", "c"), ("a", "bc")),
])
def test_different_state_fingerprints_differently(one: object, other: object) -> None:
    assert fingerprint_of({"x": one}) != fingerprint_of({"x": other})


@dataclasses.dataclass
class _Point:
    x: float


class _Bare:
    pass


def test_objects_by_their_class_and_content() -> None:
    assert fingerprint_of({"p": _Point(1.0)}) == fingerprint_of({"p": _Point(1.0)})
    assert fingerprint_of({"p": _Point(1.0)}) != fingerprint_of({"p": _Point(2.0)})
    assert fingerprint_of({"p": _Point(1.0)}) != fingerprint_of({"p": {"x": 1.0}})
    with_attribute = _Bare()
    with_attribute.x = 1.0  # type: ignore[attr-defined]
    assert fingerprint_of({"p": with_attribute}) != fingerprint_of({"p": _Point(1.0)})


def test_tensors_by_their_bytes_not_their_repr() -> None:
    """The optimizer's state used to be fingerprinted by repr(), which prints 4 decimals and elides long tensors:
    momentum buffers that differ past them must not read as the same commit."""
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(2000, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2000)).sum().backward()
    optimizer.step()
    first = optimizer.state_dict()
    other = {"state": {k: {"momentum_buffer": v["momentum_buffer"].clone()} for k, v in first["state"].items()},
             "param_groups": first["param_groups"]}
    other["state"][0]["momentum_buffer"][0, 1000] += 1e-6
    assert fingerprint_of({"optimizer": first}) != fingerprint_of({"optimizer": other})
    assert fingerprint_of({"w": torch.zeros(3)}) == fingerprint_of({"w": torch.zeros(3)})


def _self_holding() -> list:
    loop: list = [1]
    loop.append(loop)
    return loop


@pytest.mark.parametrize("value, where, kind", [
    ({"a": [1, {"b": lambda: 0}]}, "state.config['a'][1]['b']", "builtins.function"),
    ({"a": object()}, "state.config['a']", "builtins.object"),
    (_Bare(), "state.config", "_Bare"),
    ({"lock": threading.Lock()}, "state.config['lock']", "_thread.lock"),
    ({"held": {threading.Lock()}}, "state.config['held'] (an element)", "_thread.lock"),
    (_self_holding(), "state.config[1]", "builtins.list"),
    (np.array([object()], dtype=object), "state.config (element 0)", "builtins.object"),
])
def test_a_value_without_canonical_content_is_refused_naming_where(value: object, where: str, kind: str) -> None:
    with pytest.raises(ddlfast.DdlfastError) as caught:
        fingerprint_of({"config": value})
    message = str(caught.value)
    assert f"cannot fingerprint {where} (" in message and kind in message, message


def test_an_open_file_is_refused(tmp_path) -> None:
    with open(tmp_path / "log", "w") as log:
        with pytest.raises(ddlfast.DdlfastError, match=r"state\.log \(_io\.TextIOWrapper\).*cannot be pickled"):
            fingerprint_of({"log": log})


def test_sync_refuses_on_every_rank_what_one_cannot_fingerprint(monkeypatch) -> None:
    """sync() gathers the refusal with the fingerprints, so every rank raises it (here the one rank there is)
    instead of the others waiting for it; a state it can fingerprint syncs."""
    monkeypatch.setattr(ddlfast.elastic.ulfm, "require", lambda what: None)
    state = ddlfast.elastic.NumpyState(params=np.zeros(3), step=0, tags={"a", "b"}, config=_Point(0.5))
    state.sync()
    state.commit()
    state.sync()  # a set and an object with the default repr: fingerprinted
    state.config = {"on_step": lambda: None}  # copied by commit() (as itself), but no content to compare
    state.commit()
    with pytest.raises(ddlfast.DdlfastError, match=r"cannot fingerprint state\.config\['on_step'\].*\(on rank 0\)"):
        state.sync()
