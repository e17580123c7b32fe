"""Runs on every rank: reproducible=True (and DDLFAST_REPRODUCIBLE=1) gives the bits of one canonical order
whatever the ring dims, DDLFAST_ALGORITHM, chunk, bucket and small-message sizes, and fused vs separate calls;
and the errors (a rank passing another reproducible=, a bad value, a user codec).

The reference is computed here, independently, in NumPy: every element summed in rank order 0..P-1, each
addition rounded to the type (float32 in float32, float64 in float64; float16/bfloat16 accumulated in float32
and rounded once to the type), average multiplying the last sum by 1/P; on the fp16/bf16 wire every input
rounded once to the wire type, summed in float32 in rank order, and the sum rounded once (allreduce;
reduce_scatter keeps the float32 sum). Every result must equal it bit for bit and be the same on every rank.
Also: the GPU executor on emulated lanes, and ddlfast.torch.GradientReducer. Exits non-zero on any failure."""

from __future__ import annotations

import hashlib
import os
import sys
from functools import reduce
from itertools import product

import ml_dtypes
import numpy as np
from mpi4py import MPI
from shard_cases import factorizations  # a sibling program: every ring shape of P

import ddlfast
from ddlfast import _core, _testing, config
from ddlfast.buffers.dtypes import DTYPE_CODES
from ddlfast.compression import TopKCodec
from ddlfast.errors import DdlfastError
from ddlfast.ops import OPS

comm = MPI.COMM_WORLD
RANK, WORLD = comm.Get_rank(), comm.Get_size()
config.MIN_CHUNK_BYTES = 64  # tiny chunks cut every block into many messages
WIRE = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}
HALVES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
# Below and above DDLFAST_SMALL_BYTES (8 KiB): float32 elements.
SIZES = (1, 5, 300, 9000)
SHORT = "short" in sys.argv[1:]
# DDLFAST_EMULATED_HOSTS=H (the test sets it): every context sees H hosts of WORLD/H consecutive ranks, so
# reproducible=True's allreduce runs the canonical chain host by host (src/engine/chain_phase.h).
HOSTS = int(os.environ.get("DDLFAST_EMULATED_HOSTS", "0") or 0)
PER_HOST = WORLD // HOSTS if HOSTS else WORLD
failures: list[str] = []
cases = 0


def fail(name: str, problem: str) -> None:
    failures.append(f"rank {RANK} {name}: {problem}")


def inputs_of(rank: int, n: int, case: int, dtype: type) -> np.ndarray:
    """Values of very different magnitudes, so that the order of additions shows in the bits."""
    rng = np.random.default_rng([rank, n, case])
    values = rng.standard_normal(n) * np.exp(rng.uniform(-6, 6, n))
    if dtype in (np.float16, ml_dtypes.bfloat16):
        values = np.clip(values, -60.0, 60.0)  # no float16 overflow at P = 8
    return values.astype(dtype)


def canonical(arrays: list[np.ndarray], op: str, wire: object = None, round_result: bool = True) -> np.ndarray:
    """The canonical order, computed without ddlfast."""
    p = len(arrays)
    dtype = arrays[0].dtype
    if op in ("min", "max"):
        combine = np.minimum if op == "min" else np.maximum
        result = reduce(combine, arrays)
        return result if wire is None else result.astype(wire).astype(np.float32)
    if dtype in (np.float16, ml_dtypes.bfloat16):
        accumulate = np.float32
        terms = arrays
        if op == "average":  # exact_arithmetic: pre-scaled in float32, rounded to the type
            scale = np.float32(1) / np.float32(p)
            terms = [(x.astype(np.float32) * scale).astype(dtype) for x in arrays]
        total = terms[0].astype(accumulate)
        for x in terms[1:]:
            total = (total + x.astype(accumulate)).astype(accumulate)
        return total.astype(dtype)  # one rounding to the type
    kind = dtype.type
    scale = kind(1) / kind(p)
    terms = list(arrays)
    if wire is not None:
        if op == "average":  # a compressed average pre-scales every input in float32
            terms = [(x * scale).astype(np.float32) for x in terms]
        terms = [x.astype(wire).astype(np.float32) for x in terms]
    total = terms[0]
    for index, x in enumerate(terms[1:], start=1):
        total = (total + x).astype(kind)
        if op == "average" and wire is None and index == p - 1:
            total = (total * scale).astype(kind)
    if wire is not None and round_result:
        total = total.astype(wire).astype(np.float32)
    return total


def same_on_every_rank(name: str, array: np.ndarray) -> None:
    digest = hashlib.sha256(np.ascontiguousarray(array).view(np.uint8).tobytes()).hexdigest()
    if len(set(comm.allgather(digest))) != 1:
        fail(name, "results differ between ranks")


def bits_equal(name: str, got: np.ndarray, want: np.ndarray, everywhere: bool = True) -> None:
    global cases
    cases += 1
    got = np.asarray(got)
    if got.shape != want.shape or got.dtype != want.dtype:
        fail(name, f"got {got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}")
    elif not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
        differ = np.flatnonzero(got.reshape(-1).view(np.uint8).reshape(got.size, -1).any(axis=1)
                                != want.reshape(-1).view(np.uint8).reshape(want.size, -1).any(axis=1))
        wrong = np.flatnonzero(got.reshape(-1).astype(np.float64) != want.reshape(-1).astype(np.float64))[:4]
        fail(name, f"bits differ at {wrong.tolist() or differ[:4].tolist()}: got {got.reshape(-1)[wrong].tolist()} "
                   f"expected {want.reshape(-1)[wrong].tolist()}")
    if everywhere:
        same_on_every_rank(name, got)


# The settings swept: each runs the same calls, which must all give the canonical bits.
def settings_list() -> list[dict[str, str]]:
    # Under emulated hosts, the shapes whose first dimension the placement allows (a divisor of the ranks per
    # host, or whole hosts).
    shapes = ["x".join(map(str, dims)) for dims in factorizations(WORLD)
              if not HOSTS or PER_HOST % dims[0] == 0 or dims[0] % PER_HOST == 0]
    sweep = [{"DDLFAST_RING_DIMS": shape} for shape in shapes]
    sweep += [{"DDLFAST_ALGORITHM": algorithm} for algorithm in ("ring", "direct", "mpi", "latency")]
    sweep += [{"DDLFAST_CHUNK_BYTES": "4096", "DDLFAST_RECEIVES_IN_FLIGHT": "2", "DDLFAST_RING_DIMS": shapes[-1]},
              {"DDLFAST_BUCKET_BYTES": "2048", "DDLFAST_FIRST_BUCKET_BYTES": "512"},
              {"DDLFAST_SMALL_BYTES": "0"}, {"DDLFAST_SMALL_BYTES": "1M", "DDLFAST_RING_DIMS": shapes[0]}]
    return sweep


def with_environment(values: dict[str, str]) -> dict[str, str | None]:
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    return before


def restore(before: dict[str, str | None]) -> None:
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def reproducible_cases(flag: dict[str, object], label: str) -> None:
    """The same calls under every setting of the sweep, against the canonical bits."""
    float_cases = [("float32", op) for op in ("sum", "average", "min", "max")]
    float_cases += [("float64", "sum"), ("float64", "average"), ("float16", "sum"), ("bfloat16", "average")]
    if SHORT:  # the larger rank counts: fewer dtypes and ops, the same settings
        float_cases = [("float32", "sum"), ("float32", "average"), ("float16", "sum")]
    for setting in settings_list():
        before = with_environment(setting)
        where = f"{label} {setting}"
        try:
            for case, (dtype_name, op) in enumerate(float_cases):
                dtype = HALVES.get(dtype_name, np.dtype(dtype_name).type)
                mine = [inputs_of(RANK, n, case, dtype) for n in SIZES]
                everyone = [[inputs_of(r, n, case, dtype) for r in range(WORLD)] for n in SIZES]
                wants = [canonical(arrays, op) for arrays in everyone]
                for n, x, want in zip(SIZES, mine, wants, strict=True):
                    bits_equal(f"allreduce {where} {dtype_name} {op} n={n}",
                               ddlfast.allreduce(x.copy(), op=op, **flag), want)
                fused = ddlfast.fused_allreduce([x.copy() for x in mine], op=op, **flag)
                for n, got, want in zip(SIZES, fused, wants, strict=True):
                    bits_equal(f"fused_allreduce {where} {dtype_name} {op} n={n}", got, want)
                handle = ddlfast.fused_allreduce_async([x.copy() for x in mine], op=op, **flag)
                for n, got, want in zip(SIZES, handle.wait(), wants, strict=True):
                    bits_equal(f"fused_allreduce_async {where} {dtype_name} {op} n={n}", got, want)
                # reduce_scatter: rank r's block of the canonical sum, blocks of 1 and of 2250 elements.
                for per_rank in (1, 2250):
                    full = [np.concatenate([inputs_of(r, per_rank, case * 10 + q, dtype) for q in range(WORLD)])
                            for r in range(WORLD)]
                    want = canonical([f[RANK * per_rank:(RANK + 1) * per_rank] for f in full], op)
                    bits_equal(f"reduce_scatter {where} {dtype_name} {op} block={per_rank}",
                               ddlfast.reduce_scatter(full[RANK], op=op, **flag), want, everywhere=False)
            for compression, wire in WIRE.items():  # float32 on the 16-bit wire
                for op in ("sum", "average"):
                    for n in (5, 9000):
                        everyone = [inputs_of(r, n, 99, np.float32) for r in range(WORLD)]
                        want = canonical(everyone, op, wire)
                        got = ddlfast.allreduce(everyone[RANK].copy(), op=op, compression=compression, **flag)
                        bits_equal(f"allreduce {where} {compression} {op} n={n}", got, want)
                    full = [inputs_of(r, WORLD * 2250, 98, np.float32) for r in range(WORLD)]
                    want = canonical([f[RANK * 2250:(RANK + 1) * 2250] for f in full], op, wire, round_result=False)
                    got = ddlfast.reduce_scatter(full[RANK], op=op, compression=compression, **flag)
                    bits_equal(f"reduce_scatter {where} {compression} {op}", got, want, everywhere=False)
        finally:
            restore(before)


def expect_error_everywhere(name: str, call: object, words: str) -> None:
    global cases
    cases += 1
    try:
        call()
    except DdlfastError as error:
        if words not in str(error):
            fail(name, f"raised, but without {words!r}: {error}")
    else:
        fail(name, "did not raise")
    check = ddlfast.allreduce(np.full(4, RANK + 1.0, np.float32))  # the context stays usable
    if not np.array_equal(check, np.full(4, WORLD * (WORLD + 1) / 2, np.float32)):
        fail(name, f"the next allreduce gave {check}")


def error_cases() -> None:
    for n in (5, 9000):
        x = np.ones(n, np.float32)
        expect_error_everywhere(f"allreduce n={n}, reproducible only on rank 0",
                                lambda x=x: ddlfast.allreduce(x.copy(), reproducible=RANK == 0), "reproducible")
        expect_error_everywhere(f"fused_allreduce n={n}, reproducible only on the last rank",
                                lambda x=x: ddlfast.fused_allreduce([x.copy(), x.copy()],
                                                                    reproducible=RANK == WORLD - 1),
                                "reproducible")
        expect_error_everywhere(f"reduce_scatter n={n}, reproducible only on rank 0",
                                lambda n=n: ddlfast.reduce_scatter(np.ones(n * WORLD, np.float32),
                                                                   reproducible=RANK == 0), "reproducible")
        expect_error_everywhere(f"allreduce n={n}, reproducible='yes' on rank 0",
                                lambda x=x: ddlfast.allreduce(x.copy(), reproducible="yes" if RANK == 0 else True),
                                "reproducible='yes'")
    expect_error_everywhere("TopKCodec with reproducible",
                            lambda: ddlfast.fused_allreduce([np.ones(9000, np.float32)], reproducible=True,
                                                            compression=TopKCodec(0.1)), "user codec")


def device_executor_cases() -> None:
    """The GPU executor (DeviceRingAllreduce on emulated lanes: every device operation deferred and interleaved
    at random) with the options reproducible=True runs on (EngineState.reproducible_options): the canonical bits,
    whatever the chunk size and transfer mode. What it cannot check: the CUDA kernels themselves."""
    engine = _core.Core(comm, 60.0)
    shapes = [((WORLD,), (1,), False)]
    if HOSTS > 1 and PER_HOST > 1:  # the canonical chain across the emulated hosts
        shapes.append(((PER_HOST, HOSTS), (1, 1), True))
    try:
        for case, (dtype_name, op) in enumerate([("float32", "sum"), ("float32", "average"), ("float64", "sum")]):
            dtype = np.dtype(dtype_name).type
            for n in (5, 2000):
                everyone = [inputs_of(r, n, 50 + case, dtype) for r in range(WORLD)]
                want = canonical(everyone, op)
                for (dims, direct, chain), (chunk_bytes, transfer) in product(shapes, ((64, False), (4096, True))):
                    options = _core.CallOptions(dims, chunk_bytes, 2, 0, (), (), direct, False, chain)
                    got = everyone[RANK].copy()
                    _testing.emulated_allreduce(engine, [got.ctypes.data], [n], DTYPE_CODES[dtype_name], OPS[op],
                                                options, transfer, 7 + RANK)
                    bits_equal(f"GPU executor (emulated lanes) dims={dims} chain={chain} {dtype_name} {op} n={n} "
                               f"chunk={chunk_bytes} transfer={transfer}", got, want)
    finally:
        engine.close()


def torch_cases() -> None:
    """ddlfast.torch.GradientReducer(reproducible=True): the canonical average of every gradient, whatever its
    buckets and dims."""
    import torch

    import ddlfast.torch as dt

    torch.set_num_threads(1)
    for bucket_bytes, dims in ((None, None), (256, "x".join(map(str, factorizations(WORLD)[-1])))):
        model = torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.Linear(40, 50))
        with torch.no_grad():
            for index, parameter in enumerate(model.parameters()):
                parameter.copy_(torch.from_numpy(inputs_of(0, parameter.numel(), 70 + index, np.float32))
                                .reshape(parameter.shape))
        reducer = dt.GradientReducer(model, reproducible=True, bucket_bytes=bucket_bytes, dims=dims)
        batches = [torch.from_numpy(inputs_of(r, 8 * 30, 80, np.float32).reshape(8, 30)) for r in range(WORLD)]
        everyone = []
        for batch in batches:  # every rank's local gradients, computed here without communication
            model.zero_grad(set_to_none=False)
            with reducer.no_sync():
                model(batch).pow(2).sum().backward()
            everyone.append([p.grad.numpy().copy() for p in model.parameters()])
        model.zero_grad(set_to_none=False)
        model(batches[RANK]).pow(2).sum().backward()
        reducer.synchronize()
        for index, parameter in enumerate(model.parameters()):
            want = canonical([grads[index] for grads in everyone], "average")
            bits_equal(f"GradientReducer bucket_bytes={bucket_bytes} dims={dims} parameter {index}",
                       parameter.grad.numpy(), want)
        reducer.remove()


def main() -> None:
    torch_cases()
    device_executor_cases()
    reproducible_cases({"reproducible": True}, "reproducible=True")
    if not SHORT:
        before = with_environment({"DDLFAST_REPRODUCIBLE": "1"})
        try:
            reproducible_cases({}, "DDLFAST_REPRODUCIBLE=1")
        finally:
            restore(before)
    if WORLD > 1:
        error_cases()
    everyone = [f for per_rank in comm.allgather(failures) for f in per_rank]
    if RANK == 0:
        print(f"{cases} cases, {len(everyone)} failures")
        print("\n".join(everyone[:40]))
    ddlfast.barrier()
    sys.exit(1 if everyone else 0)


if __name__ == "__main__":
    main()
