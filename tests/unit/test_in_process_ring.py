"""The engine at P = 2..16 ranks in one process: ranks are threads over the in-process transport
(src/testing/in_process_transport.h), running the engine's own classes: the host executor (RingAllreduce, the
one phase loop, with the direct reduce-scatter where asked), the GPU executor on emulated lanes
(DeviceRingAllreduce, staged and direct transfers), the latency path (LatencyAllreduce inside the agreement) and
the small-message handoff of both executors to the transport's own collective. Results are compared with a NumPy
reference computed independently and must hold the same bits on every rank; a rank that stops must be named by
every other rank, and a layout one rank disagrees on must be refused by every rank with nothing written. The MPI
tests (tests/mpi) still run all of it over real processes."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from ddlfast import _core, _testing
from ddlfast.buffers.dtypes import DTYPE_CODES
from ddlfast.errors import DdlfastConsistentError, DdlfastTimeoutError
from ddlfast.ops import OPS

CHUNK = 256  # bytes: many chunks per block even for small arrays, so every step of the phase loop runs
COUNTS = (37, 0, 1000, 3)  # several arrays per rank, one empty: segments the ring must cut at


def dims_for(world: int) -> list[tuple[int, ...]]:
    """The 1-d ring and, where world factors, 2-d and 3-d tori."""
    shapes = [(world,)]
    shapes += [(a, world // a) for a in (2, 3, 4) if world % a == 0 and world // a > 1][:1]
    if world == 8:
        shapes.append((2, 2, 2))
    return shapes


def contributions(world: int, dtype: str, seed: int, counts: tuple[int, ...] = COUNTS) -> list[list[np.ndarray]]:
    """Rank r's arrays: small integers (whose float sums are exact) for sums, any values for min and max."""
    rng = np.random.default_rng(seed)
    if dtype.startswith("int"):
        return [[rng.integers(-1000, 1000, n).astype(dtype) for n in counts] for _ in range(world)]
    return [[rng.integers(-64, 64, n).astype(dtype) for n in counts] for _ in range(world)]


def reference(inputs: list[list[np.ndarray]], op: str) -> list[np.ndarray]:
    world = len(inputs)
    stacked = [np.stack([rank[i] for rank in inputs]).astype(np.float64 if inputs[0][i].dtype.kind == "f"
                                                              else np.int64) for i in range(len(inputs[0]))]
    if op == "sum":
        return [s.sum(axis=0) for s in stacked]
    if op == "average":  # integers: the floor of the exact mean; floats: the exact mean of exact sums
        return [s.sum(axis=0) // world if s.dtype.kind == "i" else s.sum(axis=0) / world for s in stacked]
    return [s.min(axis=0) if op == "min" else s.max(axis=0) for s in stacked]


def run(inputs: list[list[np.ndarray]], op: str, dims: tuple[int, ...], executor: str = "host", *,
        small_bytes: int = 0, direct: tuple[int, ...] = (), mpi_small_path: bool = False, **kwargs: object) -> list:
    options = _core.CallOptions(dims, CHUNK, 3, small_bytes, direct=direct, mpi_small_path=mpi_small_path)
    dtype = DTYPE_CODES[inputs[0][0].dtype.name]
    return _testing.in_process_allreduce(inputs, dtype, OPS[op], options, executor, **kwargs)


def check(inputs: list[list[np.ndarray]], outcomes: list, op: str) -> None:
    assert outcomes == [None] * len(inputs), outcomes
    digests = {hashlib.sha256(b"".join(a.tobytes() for a in rank)).hexdigest() for rank in inputs}
    assert len(digests) == 1, "ranks hold different bits"
    for got, want in zip(inputs[0], reference_of[id(inputs)], strict=True):
        if got.dtype.kind == "f" and op == "average":
            np.testing.assert_allclose(got, want, rtol=4e-7 * len(inputs))
        else:
            np.testing.assert_array_equal(got, want.astype(got.dtype))


reference_of: dict[int, list[np.ndarray]] = {}


def fresh(world: int, dtype: str, op: str, seed: int, counts: tuple[int, ...] = COUNTS) -> list[list[np.ndarray]]:
    inputs = contributions(world, dtype, seed, counts)
    reference_of[id(inputs)] = reference(inputs, op)
    return inputs


@pytest.mark.parametrize("world", range(2, 17))
def test_host_ring_at_every_world_size(world: int) -> None:
    for shape_index, dims in enumerate(dims_for(world)):
        for dtype, op in (("float32", "sum"), ("int64", "average"), ("float64", "max"), ("int32", "min")):
            inputs = fresh(world, dtype, op, seed=world * 100 + shape_index)
            check(inputs, run(inputs, op, dims), op)


@pytest.mark.parametrize("world", [2, 3, 5, 8, 16])
@pytest.mark.parametrize("executor", ["device_staged", "device_direct"])
def test_gpu_executor_on_emulated_lanes_gives_the_host_bits(world: int, executor: str) -> None:
    for dims in dims_for(world):
        for op in ("sum", "average"):
            host = contributions(world, "float32", seed=world)
            rng = np.random.default_rng(world)
            for rank in host:  # any floats: the two executors must give the same bits, not just close ones
                for array in rank:
                    array[...] = rng.standard_normal(array.size)
            device = [[a.copy() for a in rank] for rank in host]
            assert run(host, op, dims) == [None] * world
            assert run(device, op, dims, executor, seed=world) == [None] * world
            for got, want in zip(device, host, strict=True):
                assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True)), (dims, op)


@pytest.mark.parametrize("world", [2, 4, 6, 9, 16])
@pytest.mark.parametrize("executor", ["host", "device_staged"])
def test_direct_reduce_scatter(world: int, executor: str) -> None:
    for dims in dims_for(world):
        for direct in ([1] * len(dims), [1] + [0] * (len(dims) - 1)):
            op = "sum"
            inputs = fresh(world, "float32", op, seed=world + len(dims))
            check(inputs, run(inputs, op, dims, executor, direct=tuple(direct)), op)


@pytest.mark.parametrize("world", [2, 3, 7, 16])
def test_latency_path_and_the_small_handoff(world: int) -> None:
    counts = (5, 0, 60)
    for op in ("sum", "average", "max"):
        dtype = "int32" if op == "average" else "float32"
        inputs = fresh(world, dtype, op, seed=world, counts=counts)
        check(inputs, run(inputs, op, (world,), "latency", small_bytes=4096, agreement_capacity=4096), op)
        inputs = fresh(world, dtype, op, seed=world + 1, counts=counts)
        check(inputs, run(inputs, op, (world,), small_bytes=4096, mpi_small_path=True), op)
        if op != "max":  # the GPU executor's handoff: copies in and out on its emulated lanes
            inputs = fresh(world, "float32", op, seed=world + 2, counts=counts)
            check(inputs, run(inputs, op, (world,), "device_staged", small_bytes=4096, seed=world), op)


@pytest.mark.parametrize("executor", ["host", "device_staged", "latency"])
def test_a_rank_that_stops_is_named_by_every_other_rank(executor: str) -> None:
    world, stopped = 6, 4
    inputs = contributions(world, "float32", seed=1)
    outcomes = run(inputs, "sum", (2, 3), executor, small_bytes=8192 if executor == "latency" else 0,
                   agreement_capacity=8192, timeout_s=0.3, stopped_rank=stopped)
    for rank, outcome in enumerate(outcomes):
        if rank == stopped:
            continue
        assert isinstance(outcome, DdlfastTimeoutError), (rank, outcome)
        assert f"rank {stopped} did not join" in str(outcome), (rank, outcome)


@pytest.mark.parametrize("executor", ["host", "device_direct", "latency"])
def test_a_mismatched_layout_is_refused_on_every_rank(executor: str) -> None:
    world = 5
    inputs = contributions(world, "float32", seed=2)
    inputs[3] = [np.ones(n + 8, np.float32) for n in COUNTS]  # another layout, and another digest for it
    before = [[a.copy() for a in rank] for rank in inputs]
    small = 8192 if executor == "latency" else 0
    outcomes = run(inputs, "sum", (world,), executor, small_bytes=small, agreement_capacity=8192,
                   digests=[7, 7, 7, 8, 7])
    assert all(isinstance(o, DdlfastConsistentError) and "disagree" in str(o) for o in outcomes), outcomes
    for got, want in zip(inputs, before, strict=True):
        assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True)), "a refused call wrote data"
    # The next call on the same layout works (a refusal leaves nothing behind).
    inputs = fresh(world, "float32", "sum", seed=3)
    check(inputs, run(inputs, "sum", (world,), executor, small_bytes=small, agreement_capacity=8192), "sum")
