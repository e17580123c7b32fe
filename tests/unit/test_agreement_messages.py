"""The per-rank disagreement messages, built without MPI from what each rank would send."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import numpy as np

from ddlfast.engine.agreement import (
    MAX_CACHED_DIGESTS,
    allreduce_layout,
    describe,
    disagreement_message,
    name_digest,
    readable,
)
from ddlfast.engine.control import decode_value, encode_value

SETTINGS = SimpleNamespace(chunk_bytes=1 << 20, small_bytes=8192, bucket_bytes=64 << 20, first_bucket_bytes=1 << 20,
                           algorithm="auto", reproducible=False)


def host_layout(dtype: object, shape: tuple, op: str = "sum", settings: object = SETTINGS) -> tuple:
    return allreduce_layout(op, (4,), ((np.dtype(dtype), shape),), ("none",), False, settings)


def gpu_layout(dtype: str, shape: tuple) -> tuple:
    return allreduce_layout("sum", (4,), ((f"cuda {dtype}", shape),), ("none",), False, SETTINGS)


def message_for(layouts: list[tuple], sequences: list[int] | None = None) -> str:
    sequences = sequences or [7] * len(layouts)
    # As the ranks exchange them: JSON on the wire, each checked by readable().
    received = [decode_value(encode_value(describe(layout, s)), r)
                for r, (layout, s) in enumerate(zip(layouts, sequences, strict=True))]
    return disagreement_message([readable(d, r) for r, d in enumerate(received)])


def test_shape_difference_names_the_odd_rank() -> None:
    layouts = [host_layout(np.float32, (1000,))] * 4
    layouts[1] = host_layout(np.float32, (1007,))
    message = message_for(layouts)
    assert "ranks 0,2,3 passed float32[1000]" in message and "rank 1 passed float32[1007]" in message


def test_gpu_and_host_arrays_mixed_across_ranks_are_described() -> None:
    message = message_for([gpu_layout("float32", (10,)), host_layout(np.float32, (10,))])
    assert "cuda float32" in message and "rank 1 passed float32[10]" in message


def test_dtype_difference_at_the_same_size() -> None:
    message = message_for([host_layout(np.float32, (3000,)), host_layout(np.int32, (3000,))])
    assert "rank 0 passed float32[3000]" in message and "rank 1 passed int32[3000]" in message


def test_a_skipped_call_names_each_ranks_sequence_number() -> None:
    message = message_for([host_layout(np.float32, (8,)), host_layout(np.float32, (8,))], [5, 4])
    assert "different collectives" in message and "rank 0 is at collective #5" in message
    assert "rank 1 is at collective #4" in message


def test_an_engine_setting_that_sizes_messages_is_named() -> None:
    other = SimpleNamespace(**{**vars(SETTINGS), "small_bytes": 65536})
    message = message_for([host_layout(np.float32, (8,)), host_layout(np.float32, (8,), settings=other)])
    assert "DDLFAST_SMALL_BYTES" in message and "rank 1 passed DDLFAST_SMALL_BYTES=65536" in message


def test_a_rank_with_bad_input_is_named_with_its_error() -> None:
    message = message_for([host_layout(np.float32, (8,)), ("error", "array 0 on rank 1 is not C-contiguous")])
    assert message.startswith("collective #7 could not run: rank 1: array 0 on rank 1 is not C-contiguous")


def test_broadcast_roots_and_kinds_are_compared() -> None:
    arrays = ((np.dtype(np.float32), (4,)),)
    assert "ranks disagree on root" in message_for([("broadcast", 0, arrays), ("broadcast", 1, arrays)])
    message = message_for([("broadcast", 0, arrays), host_layout(np.float32, (4,))])
    assert "different collectives" in message and "rank 1 passed allreduce" in message


def test_names_that_differ_are_reported_first() -> None:
    layout = host_layout(np.float32, (100,))
    received = [decode_value(encode_value(describe(layout, 9, name)), r)
                for r, name in enumerate(["step 4", "step 5", "step 4"])]
    message = disagreement_message([readable(d, r) for r, d in enumerate(received)])
    assert "different names" in message and "rank 1 passed name='step 5'" in message, message
    assert "ranks 0,2 passed name='step 4'" in message, message


def test_a_peer_description_is_data_never_code() -> None:
    """What a peer sends is parsed as JSON and checked; nothing it sends can run code here (no pickle)."""
    import pickle

    class Boom:
        def __reduce__(self) -> tuple:
            return (print, ("unpickled!",))

    layout = host_layout(np.float32, (100,))
    good = decode_value(encode_value(describe(layout, 3)), 0)
    for r, payload in enumerate([pickle.dumps(Boom()), b"\xff\xfe", b'{"kind": 3}', b'[1, 2]',
                                 b'{"kind": "allreduce", "sequence": 3, "arrays": [["float32", ["x"]]]}']):
        message = disagreement_message([readable(good, 0), readable(decode_value(payload, r + 1), r + 1)])
        assert f"rank {r + 1} sent a description of its collective that is not ddlfast's" in message, message


def test_numpy_values_and_tuples_survive_the_exchange() -> None:
    value = {"n": np.int64(3), "x": np.float32(0.5), "t": (1, (2, 3)), "d": np.dtype("float32")}
    assert decode_value(encode_value(value), 0) == {"n": 3, "x": 0.5, "t": [1, [2, 3]], "d": "float32"}


def test_ranks_that_would_choose_different_algorithms_are_named() -> None:
    """DDLFAST_ALGORITHM is in every allreduce layout: ranks with different values disagree, by name."""
    other = SimpleNamespace(**{**vars(SETTINGS), "algorithm": "direct"})
    layouts = [allreduce_layout("sum", (4,), ((np.dtype("float32"), (10,)),), ("none",), False, s)
               for s in (SETTINGS, other)]
    assert layouts[0] != layouts[1]
    message = disagreement_message([readable(describe(layout, 3, None), rank)
                                    for rank, layout in enumerate(layouts)])
    assert "DDLFAST_ALGORITHM" in message and "'direct'" in message and "rank 1" in message, message


def test_reproducible_difference_names_the_ranks() -> None:
    """reproducible=True on one rank only: the message says which rank passed which."""
    other = SimpleNamespace(**{**vars(SETTINGS), "reproducible": True})
    message = message_for([host_layout("float32", (10,), settings=s) for s in (SETTINGS, other, SETTINGS)])
    assert message.startswith("ranks disagree on reproducible"), message
    assert "rank 1 passed True" in message and "ranks 0,2 passed False" in message, message


def _splitmix_reference(value: int) -> int:
    """splitmix64's finalizer in Python's arbitrary-size ints (name_digest's rule for an int name)."""
    mask = (1 << 64) - 1
    z = (value * 0x9E3779B97F4A7C15 + 0x5851F42D4C957F2D) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    return z ^ (z >> 27)


def _blake2b_reference(name: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(name).encode(), digest_size=8, person=b"ddlfast-name").digest(),
                          "little")


def test_name_digests_are_the_rule_every_rank_computes() -> None:
    """name_digest: an int in 0..2**64-1 (a NumPy integer alike) through splitmix64 in the core, a str (also when
    kept from before, also past the cache's size) and any other int through blake2b of its repr."""
    for value in (0, 1, 7, 12345, 1 << 20, (1 << 63) + 5, (1 << 64) - 1):
        assert name_digest(value) == _splitmix_reference(value)
        assert name_digest(np.uint64(value)) == _splitmix_reference(value)
    for value in (-1, 1 << 64):
        assert name_digest(value) == _blake2b_reference(value)
    for name in ("layer3.weight", "", "é" * 9):
        assert name_digest(name) == name_digest(name) == _blake2b_reference(name)
    names = [f"bucket {i}" for i in range(MAX_CACHED_DIGESTS + 3)]
    assert [name_digest(name) for name in names] == [_blake2b_reference(name) for name in names]
    assert len({name_digest(name) for name in names}) == len(names)
