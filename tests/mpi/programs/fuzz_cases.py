"""Runs on every rank: a seeded multi-rank fuzz of allreduce.

Every case is drawn from `numpy.random.default_rng([seed, world, index])`, so
each rank draws the same case without talking, and one case can be re-run on
its own (`--only INDEX`). A case picks:

- the API: allreduce, fused_allreduce (1-6 arrays, mixed dtypes and shapes)
  or fused_allreduce_async(...).wait(); reduce_scatter (even blocks or
  counts=), fused_reduce_scatter and its async form, allgather,
  fused_allgather and its async form, broadcast from a random root;
- ring dims: "flat", a random ordered factorisation of the world size with
  unit dims mixed in (as "2x1x3" or a tuple), or None with DDLFAST_RING_DIMS
  set to one;
- counts: 0, 1, below the world size, the world size +-1, primes, small
  random, and now and then a large-ish one;
- dtype, op (sum / average), wire compression (float32 only, per dimension
  too) and the engine settings DDLFAST_CHUNK_BYTES, DDLFAST_SMALL_BYTES,
  DDLFAST_BUCKET_BYTES, DDLFAST_FIRST_BUCKET_BYTES,
  DDLFAST_RECEIVES_IN_FLIGHT (re-read on every call);
- where each array lives: a view at a random byte offset (sometimes
  misaligned) inside a buffer of guard bytes that must stay untouched.

Checks: the call returns the arrays it was given; identical bits on every
rank (sha256 allgather); the guard bytes; and, on one rank per case (every
rank in turn, which suffices because the bits are identical), the values
against a NumPy reference computed in float64/int64 from every rank's
regenerated input, within a bound derived from the rounding of the element
or wire type per ring hop. Any exception aborts the job with the case and
the command that reproduces it. Prints "N cases on P ranks, F failures".
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import sys
import threading
import time
from dataclasses import dataclass

import harness
import ml_dtypes
import numpy as np
from mpi4py import MPI

import ddlfast
from ddlfast import _core, config

# Tiny chunks (8 bytes and up) cut these small buffers into many chunks; users may not go below 4 KiB.
config.MIN_CHUNK_BYTES = 8

DTYPES = {
    "float32": np.dtype(np.float32), "float64": np.dtype(np.float64), "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16), "int32": np.dtype(np.int32), "int64": np.dtype(np.int64),
}
# Unit roundoff of each float type (half an ulp of 1.0), and its smallest subnormal.
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float64": 2.0**-53, "float16": 2.0**-11, "bfloat16": 2.0**-8}
TINY = {"float32": 2.0**-149, "float64": 0.0, "float16": 2.0**-24, "bfloat16": 2.0**-133}
WIRE_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}
# Largest |input| per dtype (times 10**scale): sums of 8 ranks stay finite in fp16 and exact in the int types.
INT_LIMIT = {"int32": 1 << 20, "int64": 1 << 40}
PRIMES = (2, 3, 5, 7, 11, 13, 17, 31, 97, 101, 127, 257, 1009, 4099, 8191, 65537)
ENGINE_VARIABLES = ("DDLFAST_CHUNK_BYTES", "DDLFAST_SMALL_BYTES", "DDLFAST_BUCKET_BYTES",
                    "DDLFAST_FIRST_BUCKET_BYTES", "DDLFAST_RECEIVES_IN_FLIGHT", "DDLFAST_RING_DIMS",
                    "DDLFAST_COMPRESSION")
GUARD_BYTE = 0xA5
GUARD_BYTES = 24


@dataclass(frozen=True)
class ArraySpec:
    dtype: str
    shape: tuple[int, ...]
    byte_offset: int  # inside its guard buffer; not a multiple of the itemsize when misaligned

    @property
    def count(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


# The collectives a case can call; fused ones take 1-6 arrays.
APIS = ("allreduce", "fused", "async", "reduce_scatter", "fused_reduce_scatter", "reduce_scatter_async",
        "allgather", "fused_allgather", "allgather_async", "broadcast")
API_CHANCES = (0.35, 0.22, 0.1, 0.06, 0.06, 0.04, 0.05, 0.05, 0.04, 0.03)
SINGLE_ARRAY_APIS = ("allreduce", "reduce_scatter", "allgather", "broadcast")
SCATTERING = ("reduce_scatter", "fused_reduce_scatter", "reduce_scatter_async")
GATHERING = ("allgather", "fused_allgather", "allgather_async", "broadcast")


@dataclass(frozen=True)
class Case:
    index: int
    api: str  # one of APIS
    dims: object  # None | "flat" | "2x1x3" | (2, 1, 3)
    arrays: tuple[ArraySpec, ...]
    op: str
    compression: str | None
    env: tuple[tuple[str, str], ...]
    log_scale: float  # float inputs are standard normal times 10**log_scale
    spread: bool  # element magnitudes also spread over three decades
    fault: tuple[str, int] | None = None  # (kind, rank): one rank's arguments differ (see FAULTS)
    counts: tuple[tuple[int, ...] | None, ...] = ()  # reduce-scatter: per array, each rank's block (None: even)
    root: int = 0  # broadcast

    def describe(self) -> str:
        arrays = ", ".join(f"{a.dtype}{list(a.shape)}@{a.byte_offset}" for a in self.arrays)
        env = " ".join(f"{k}={v}" for k, v in self.env) or "-"
        fault = f" fault: {self.fault[0]} on rank {self.fault[1]}" if self.fault else ""
        extra = f", counts={list(self.counts)!r}" if self.api in SCATTERING else ""
        extra += f", root={self.root}" if self.api == "broadcast" else ""
        return (f"case {self.index}: {self.api}([{arrays}], op={self.op!r}, dims={self.dims!r}, "
                f"compression={self.compression!r}{extra}) env: {env} scale=1e{self.log_scale:.2f} "
                f"spread={self.spread}{fault}")


# ------------------------------------------------------------------------------------------------ drawing cases


def factorisation(world: int, rng: np.random.Generator) -> tuple[int, ...]:
    """A random ordered factorisation of `world` into ring dims, with unit dims mixed in (at most 4 dims)."""
    primes, n, f = [], world, 2
    while n > 1:
        while n % f == 0:
            primes.append(f)
            n //= f
        f += 1
    rng.shuffle(primes)
    groups = int(rng.integers(1, len(primes) + 1)) if primes else 0
    dims = [1] * groups
    for i, prime in enumerate(primes):  # every group gets one prime, the rest land anywhere
        dims[i if i < groups else int(rng.integers(0, groups))] *= prime
    for _ in range(int(rng.choice([0, 0, 1, 2]))):
        if len(dims) < 4:
            dims.insert(int(rng.integers(0, len(dims) + 1)), 1)
    return tuple(dims) if dims else (1,)


def draw_count(world: int, rng: np.random.Generator, large: int) -> int:
    kind = rng.choice(["zero", "one", "below_p", "near_p", "prime", "small", "medium", "large"],
                      p=[0.06, 0.06, 0.1, 0.1, 0.2, 0.26, 0.17, 0.05])
    if kind == "zero":
        return 0
    if kind == "one":
        return 1
    if kind == "below_p":
        return int(rng.integers(1, world)) if world > 1 else 1
    if kind == "near_p":
        return max(0, world * int(rng.integers(1, 4)) + int(rng.integers(-1, 2)))
    if kind == "prime":
        return int(rng.choice(PRIMES))
    if kind == "small":
        return int(rng.integers(2, 2000))
    if kind == "medium":
        return int(rng.integers(2000, 60_000))
    return int(rng.integers(large // 2, large + 1))


def draw_shape(count: int, rng: np.random.Generator) -> tuple[int, ...]:
    if count > 1 and rng.random() < 0.3:
        for columns in rng.permutation([2, 3, 4, 7, 16]):
            if count % columns == 0:
                return (count // int(columns), int(columns))
    if count == 0 and rng.random() < 0.3:
        return (0, 3)
    return (count,)


def draw_arrays(api: str, world: int, rng: np.random.Generator, large: int, float32_only: bool,
                misaligned: float) -> list[ArraySpec]:
    how_many = 1 if api in SINGLE_ARRAY_APIS else int(rng.choice([1, 2, 3, 4, 6]))
    one_dtype = str(rng.choice(list(DTYPES)))
    specs = []
    for _ in range(how_many):
        if float32_only:
            dtype = "float32"
        elif rng.random() < 0.6:
            dtype = one_dtype
        else:
            dtype = str(rng.choice(list(DTYPES)))
        count = draw_count(world, rng, large if how_many == 1 else large // how_many)
        itemsize = DTYPES[dtype].itemsize
        if rng.random() < misaligned:
            offset = int(rng.integers(1, 64))  # misaligned for the element type, usually
        else:
            offset = itemsize * int(rng.integers(0, 64 // itemsize + 1))
        specs.append(ArraySpec(dtype, draw_shape(count, rng), offset))
    return specs


def draw_env(specs: list[ArraySpec], rng: np.random.Generator) -> dict[str, str]:
    total = sum(s.count * DTYPES[s.dtype].itemsize for s in specs)
    env: dict[str, str] = {}
    if rng.random() < 0.75:
        chunk = int(rng.choice([8, 12, 20, 64, 100, 1000, 4096, 65536, 1 << 20]))
        while total // chunk > 4096:  # bounded message count: the fuzz is about shapes, not throughput
            chunk *= 8
        env["DDLFAST_CHUNK_BYTES"] = str(chunk) if rng.random() < 0.7 else f"{chunk}b"
    small = rng.choice(["zero", "zero", "default", "random", "everything"])
    if small == "zero":
        env["DDLFAST_SMALL_BYTES"] = "0"
    elif small == "random":
        env["DDLFAST_SMALL_BYTES"] = str(int(rng.integers(0, 2 * max(total, 1) + 1)))
    elif small == "everything":
        env["DDLFAST_SMALL_BYTES"] = "1GiB"
    if len(specs) > 1 and rng.random() < 0.7:
        env["DDLFAST_BUCKET_BYTES"] = str(int(rng.integers(1, max(total, 2) + 1)))
        if rng.random() < 0.5:
            env["DDLFAST_FIRST_BUCKET_BYTES"] = str(int(rng.integers(1, max(total, 2) + 1)))
    if rng.random() < 0.3:
        env["DDLFAST_RECEIVES_IN_FLIGHT"] = str(int(rng.integers(2, 9)))
    return env


# One rank's arguments differ from the others' (drawn with --faults): every rank must raise a DdlfastError that
# names that rank, without a stall, and the next case must run normally on the same context.
# "name": the calls pass name=<the case>, and that rank's names the next case (as a rank that skipped a step
# would). "exception": a RuntimeError (not a DdlfastError) while that rank's arguments are validated.
# "thread" and "fork" are that rank's alone: it first calls the collective from a second thread, or from a fork()
# child, which must be refused there at once without any rank noticing; then the case runs and is checked as usual.
FAULTS = ("dtype", "length", "op", "strided", "extra-array", "name", "exception", "thread", "fork")
LOCAL_FAULTS = ("thread", "fork")


def draw_fault(seed: int, world: int, index: int, chance: float) -> tuple[str, int] | None:
    rng = np.random.default_rng([seed, world, index, 7])  # its own stream: the case itself is drawn as without
    if world < 2 or rng.random() >= chance:
        return None
    return str(rng.choice(FAULTS)), int(rng.integers(0, world))


def make_case(seed: int, world: int, index: int, large: int, misaligned: float = 0.1) -> Case:
    rng = np.random.default_rng([seed, world, index])
    api = str(rng.choice(APIS, p=API_CHANCES))
    factors = factorisation(world, rng)
    dims_kind = rng.choice(["flat", "string", "tuple", "env", "default"], p=[0.2, 0.3, 0.3, 0.12, 0.08])
    env: dict[str, str] = {}
    dims: object
    if dims_kind == "flat":
        dims = "flat"
    elif dims_kind == "string":
        dims = "x".join(map(str, factors))
    elif dims_kind == "tuple":
        dims = factors
    else:
        dims = None
        if dims_kind == "env":
            env["DDLFAST_RING_DIMS"] = "x".join(map(str, factors))
    n_dims = 1 if dims == "flat" else len(factors)  # per-dimension compression needs explicit dims
    compress = api not in GATHERING and rng.random() < 0.3  # gathered values travel as they are
    specs = draw_arrays(api, world, rng, large, float32_only=compress, misaligned=misaligned)
    counts: list[tuple[int, ...] | None] = []
    if api in SCATTERING:
        for spec in specs:
            if spec.count % world == 0 and rng.random() < 0.5:
                counts.append(None)  # even blocks
            else:  # each rank's block: a random split of the array (zero-length blocks too)
                cuts = np.sort(rng.integers(0, spec.count + 1, size=world - 1))
                counts.append(tuple(int(c) for c in np.diff(np.concatenate(([0], cuts, [spec.count])))))
    compression = None
    if compress:
        choice = str(rng.choice(["fp16", "bf16", "none", "per-dim", "auto"], p=[0.35, 0.3, 0.1, 0.2, 0.05]))
        if choice == "per-dim" and dims is not None:
            compression = ",".join(str(rng.choice(["none", "fp16", "bf16"])) for _ in range(n_dims))
        elif choice != "per-dim":
            compression = choice
    env.update(draw_env(specs, rng))
    op = "sum" if api in GATHERING else str(rng.choice(["sum", "average"]))
    return Case(index, api, dims, tuple(specs), op, compression, tuple(sorted(env.items())),
                float(rng.uniform(-2, 2)), bool(rng.random() < 0.3), counts=tuple(counts),
                root=int(rng.integers(0, world)))


# ------------------------------------------------------------------------------------------- inputs and reference


def contribution(seed: int, case: Case, array: int, owner: int) -> np.ndarray:
    """Rank `owner`'s input for one array of one case (any rank can regenerate any rank's)."""
    spec = case.arrays[array]
    rng = np.random.default_rng([seed, case.index, array, owner])
    if spec.dtype.startswith("int"):
        limit = INT_LIMIT[spec.dtype] if rng.random() < 0.5 else 1000
        values = rng.integers(-limit, limit, size=spec.count, endpoint=True)
    else:
        scale = 10.0 ** min(case.log_scale, 1.5 if spec.dtype == "float16" or case.compression else 2.0)
        values = rng.standard_normal(spec.count) * scale
        if case.spread:
            values *= 10.0 ** rng.uniform(-3, 0, spec.count)
        values[rng.random(spec.count) < 0.02] = 0.0
    return values.astype(DTYPES[spec.dtype]).reshape(spec.shape)


def wire_roundoff(compression: str | None) -> float:
    names = [] if compression in (None, "auto") else compression.split(",")
    return max([WIRE_ROUNDOFF[n] for n in names if n in WIRE_ROUNDOFF], default=0.0)


def block_of(case: Case, array: int, rank: int, world: int) -> tuple[int, int]:
    """Where rank's reduce-scatter block starts and ends in the flattened array."""
    counts = case.counts[array]
    if counts is None:
        size = case.arrays[array].count // world
        return rank * size, (rank + 1) * size
    return sum(counts[:rank]), sum(counts[:rank + 1])


def check_gathered(seed: int, case: Case, array: int, got: np.ndarray, world: int) -> str | None:
    """allgather: every rank's input in rank order; broadcast: root's. Exact bits."""
    owners = [case.root] if case.api == "broadcast" else range(world)
    want = np.concatenate([contribution(seed, case, array, r).reshape(-1) for r in owners])
    got = got.reshape(-1)
    if got.dtype != want.dtype or got.tobytes() != want.tobytes():
        bad = np.flatnonzero(got.view(np.uint8) != want.view(np.uint8)) if got.nbytes == want.nbytes else []
        return f"array {array}: gathered bits differ ({len(bad)} bytes, first {list(bad[:5])}; {got.size} elements)"
    return None


def check_values(seed: int, case: Case, array: int, got: np.ndarray, world: int,
                 block: tuple[int, int] | None = None) -> str | None:
    """The reduced values (of the elements in `block` only, for a reduce-scatter) against the reference."""
    spec = case.arrays[array]
    start, stop = block if block is not None else (0, spec.count)
    inputs = [contribution(seed, case, array, r).reshape(-1)[start:stop] for r in range(world)]
    spec = dataclasses.replace(spec, shape=(stop - start,))
    got = got.reshape(-1)
    if spec.dtype.startswith("int"):
        total = np.sum(np.stack(inputs).astype(np.int64), axis=0) if spec.count else np.zeros(0, np.int64)
        if case.op == "average":
            total = total // world  # floor of the exact sum, like NumPy's // (inputs small enough for int64)
        bad = np.flatnonzero(got.astype(np.int64) != total)
        if bad.size:
            return (f"array {array}: {bad.size} int mismatches, first at {bad[:5].tolist()}: "
                    f"got {got[bad[:5]].tolist()} expected {total[bad[:5]].tolist()}")
        return None
    stacked = np.stack(inputs).astype(np.float64) if spec.count else np.zeros((world, 0))
    expected, magnitude = stacked.sum(axis=0), np.abs(stacked).sum(axis=0)
    if case.op == "average":
        expected, magnitude = expected / world, magnitude / world
    # One rounding of the element type per ring hop (at most world - 1 of them), one for the average's scale,
    # and as much again for the order of the float64 reference's own sum.
    tolerance = 2 * (world + 1) * UNIT_ROUNDOFF[spec.dtype] * magnitude + world * TINY[spec.dtype]
    unit = wire_roundoff(case.compression)
    if unit:  # the stated wire bound: one rounding of the wire type per ring hop
        tolerance = tolerance + world * (unit * magnitude + 2.0**-24)
    value = got.astype(np.float64)
    error = np.abs(value - expected)
    bad = np.flatnonzero(~(error <= tolerance))  # NaN counts as bad
    if bad.size:
        worst = bad[int(np.argmax((error - tolerance)[bad]))]
        return (f"array {array}: {bad.size} values off, worst at {worst}: got {float(value[worst])!r} expected "
                f"{float(expected[worst])!r} (error {error[worst]:.3g} > bound {tolerance[worst]:.3g})")
    return None


# ---------------------------------------------------------------------------------------------------- running


def placed(values: np.ndarray, spec: ArraySpec) -> tuple[np.ndarray, np.ndarray]:
    """A guard buffer with `values` copied in at spec.byte_offset, and the array view there."""
    nbytes = values.nbytes
    buffer = np.full(spec.byte_offset + nbytes + GUARD_BYTES, GUARD_BYTE, dtype=np.uint8)
    view = buffer[spec.byte_offset:spec.byte_offset + nbytes].view(values.dtype).reshape(spec.shape)
    view[...] = values
    return buffer, view


def is_misaligned(case: Case) -> bool:
    return any(spec.byte_offset % DTYPES[spec.dtype].itemsize for spec in case.arrays)


def set_environment(case: Case, base: dict[str, str | None]) -> None:
    for name in ENGINE_VARIABLES:
        os.environ.pop(name, None)
        if base.get(name) is not None:
            os.environ[name] = base[name]
    os.environ.update(dict(case.env))


def faulty_arguments(case: Case, arrays: list[np.ndarray]) -> tuple[list[np.ndarray], str]:
    """This rank's arguments under the case's fault."""
    kind = case.fault[0]
    first = arrays[0]
    if kind == "dtype":
        other = np.float64 if first.dtype != np.float64 else np.float32
        return [np.zeros(first.shape, other), *arrays[1:]], case.op
    if kind == "length":
        return [np.zeros(first.size + 1, first.dtype), *arrays[1:]], case.op
    if kind == "op":
        return arrays, "average" if case.op == "sum" else "sum"
    if kind == "strided":
        return [np.zeros(2 * max(first.size, 2), first.dtype)[::2], *arrays[1:]], case.op
    return [*arrays, np.zeros(3, first.dtype)], case.op  # extra-array


class RaisingDims:
    """dims= whose hash raises a RuntimeError: an exception that is not a DdlfastError, while validating."""

    def __hash__(self) -> int:
        raise RuntimeError("fault injected while validating")

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("fault injected while validating")


class RaisingRoot(int):
    def __ge__(self, other: object) -> bool:
        raise RuntimeError("fault injected while validating")

    __le__ = __lt__ = __gt__ = __ge__


CASE_DIMS = object()  # collective()'s default dims: the case's own


def collective(case: Case, arrays: list[np.ndarray], op: str, name: object = None, dims: object = CASE_DIMS,
               root: object = None) -> list:
    """The case's collective; returns its results (the arrays, or the blocks / gathered arrays)."""
    api, compression = case.api, case.compression
    dims = case.dims if dims is CASE_DIMS else dims
    counts = [list(c) if c is not None else None for c in case.counts]
    if api == "allreduce" and len(arrays) == 1:
        return [ddlfast.allreduce(arrays[0], op=op, dims=dims, compression=compression, name=name)]
    if api == "async":
        return ddlfast.fused_allreduce_async(arrays, op=op, dims=dims, compression=compression, name=name).wait()
    if api in ("allreduce", "fused"):
        return ddlfast.fused_allreduce(arrays, op=op, dims=dims, compression=compression, name=name)
    if api == "reduce_scatter" and len(arrays) == 1:
        return [ddlfast.reduce_scatter(arrays[0], op=op, dims=dims, counts=counts[0] if counts else None,
                                       compression=compression, name=name)]
    if api == "reduce_scatter_async":
        return ddlfast.fused_reduce_scatter_async(arrays, op=op, dims=dims, counts=counts or None,
                                                  compression=compression, name=name).wait()
    if api in ("reduce_scatter", "fused_reduce_scatter"):
        return ddlfast.fused_reduce_scatter(arrays, op=op, dims=dims, counts=counts or None, compression=compression,
                                            name=name)
    if api == "allgather" and len(arrays) == 1:
        return [ddlfast.allgather(arrays[0], dims=dims, name=name)]
    if api == "allgather_async":
        return ddlfast.fused_allgather_async(arrays, dims=dims, name=name).wait()
    if api in ("allgather", "fused_allgather"):
        return ddlfast.fused_allgather(arrays, dims=dims, name=name)
    return [ddlfast.broadcast(arrays[0], root=case.root if root is None else root, name=name)]


def run_faulty_case(comm: MPI.Intracomm, case: Case, arrays: list[np.ndarray]) -> list[str]:
    """Every rank must raise a DdlfastError naming the faulty rank; the context must stay usable."""
    rank = comm.Get_rank()
    kind, culprit = case.fault
    name, dims, root = f"case {case.index}", CASE_DIMS, None
    no_op = kind == "op" and case.api in GATHERING
    if kind in ("name", "exception") or no_op or (kind == "extra-array" and case.api == "broadcast"):
        mine, op = arrays, case.op
        if rank == culprit:
            if kind == "name":
                name = f"case {case.index + 1}"
            elif kind in ("op", "extra-array"):  # no op, or one array only: a length instead
                mine = [np.zeros(arrays[0].size + 1, arrays[0].dtype), *arrays[1:]]
            elif case.api == "broadcast":
                root = RaisingRoot(case.root)
            else:
                dims = RaisingDims()
    else:
        mine, op = faulty_arguments(case, arrays) if rank == culprit else (arrays, case.op)
    try:
        collective(case, mine, op, name=name, dims=dims, root=root)
    except ddlfast.DdlfastBrokenError as error:
        return [f"fault {kind} on rank {culprit} broke the context: {error}"]
    except ddlfast.DdlfastError as error:
        if f"rank {culprit}" not in str(error) and f"ranks {culprit}" not in str(error):
            return [f"fault {kind} on rank {culprit}: the error does not name it: {error}"]
        return []
    return [f"fault {kind} on rank {culprit} was not detected"]


def refused_elsewhere(case: Case, arrays: list[np.ndarray]) -> list[str]:
    """The case's collective from a second thread, or in a fork() child: refused there, nothing sent."""
    kind = case.fault[0]
    if kind == "thread":
        outcome: list[BaseException | None] = []

        def call() -> None:
            try:
                collective(case, arrays, case.op)
                outcome.append(None)
            except BaseException as error:  # noqa: BLE001 - checked below
                outcome.append(error)

        thread = threading.Thread(target=call, name="fuzz-second-thread")
        thread.start()
        thread.join()
        error = outcome[0]
        if not isinstance(error, ddlfast.DdlfastError) or "thread" not in str(error):
            return [f"fault thread: a second thread's call was not refused: {error!r}"]
        return []
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: refused, then gone without touching MPI (os._exit runs no exit hooks)
        os.close(read)
        try:
            collective(case, arrays, case.op)
            verdict = b"not refused"
        except ddlfast.DdlfastError as error:
            verdict = b"ok" if b"fork" in str(error).encode() else str(error).encode()
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            verdict = repr(error).encode()
        os.write(write, verdict[:500])
        os._exit(0)
    os.close(write)
    verdict = os.read(read, 600)
    os.close(read)
    os.waitpid(child, 0)
    return [] if verdict == b"ok" else [f"fault fork: the child's call was not refused: {verdict.decode()}"]


def run_case(comm: MPI.Intracomm, seed: int, case: Case) -> list[str]:
    rank, world = comm.Get_rank(), comm.Get_size()
    buffers, arrays = [], []
    for i, spec in enumerate(case.arrays):
        buffer, view = placed(contribution(seed, case, i, rank), spec)
        buffers.append(buffer)
        arrays.append(view)
    problems = []
    if case.fault is not None and case.fault[0] in LOCAL_FAULTS:
        if rank == case.fault[1]:
            problems += refused_elsewhere(case, arrays)
    elif case.fault is not None:
        return run_faulty_case(comm, case, arrays)
    returned = collective(case, arrays, case.op)
    if case.api in SCATTERING or case.api in GATHERING[:3]:  # new arrays: checked on every rank
        if len(returned) != len(arrays):
            return [*problems, f"returned {len(returned)} results for {len(arrays)} arrays"]
        for i, got in enumerate(returned):
            if case.api in SCATTERING:
                problem = check_values(seed, case, i, got, world, block_of(case, i, rank, world))
            else:
                problem = check_gathered(seed, case, i, got, world)
            if problem:
                problems.append(problem)
        if case.api in GATHERING:
            digests = comm.allgather(hashlib.sha256(b"".join(g.tobytes() for g in returned)).hexdigest())
            if len(set(digests)) != 1:
                problems.append("gathered bits differ across ranks")
        return problems
    if len(returned) != len(arrays) or any(r is not a for r, a in zip(returned, arrays, strict=False)):
        problems.append("did not return the arrays it reduced in place")
    for i, (buffer, spec) in enumerate(zip(buffers, case.arrays, strict=True)):
        end = spec.byte_offset + arrays[i].nbytes
        outside = np.concatenate([buffer[:spec.byte_offset], buffer[end:]])
        if np.any(outside != GUARD_BYTE):
            changed = np.flatnonzero(outside != GUARD_BYTE)
            problems.append(f"array {i}: bytes outside the array changed (guard bytes {changed[:8].tolist()})")
    digest = hashlib.sha256(b"".join(a.tobytes() for a in arrays)).hexdigest()
    digests = comm.allgather(digest)
    if len(set(digests)) != 1:
        problems.append("results differ in bits across ranks: "
                        + ", ".join(f"rank {r} {d[:12]}" for r, d in enumerate(digests)))
    if rank == case.index % world:  # bits are identical everywhere, so one rank per case checks the values
        for i, array in enumerate(arrays):
            problem = (check_gathered(seed, case, i, array, world) if case.api == "broadcast"
                       else check_values(seed, case, i, array, world))
            if problem:
                problems.append(problem)
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--cases", type=int, default=100)
    parser.add_argument("--first", type=int, default=0, help="index of the first case")
    parser.add_argument("--only", type=int, default=None, help="run just this case index")
    parser.add_argument("--large", type=int, default=200_003, help="upper end of the rare large counts")
    parser.add_argument("--misaligned", type=float, default=0.1,
                        help="chance that an array sits at a byte offset that is not a multiple of its itemsize")
    parser.add_argument("--faults", type=float, default=0.0,
                        help="chance that a case injects one fault on one rank (FAULTS)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    base = {name: os.environ.get(name) for name in ENGINE_VARIABLES}
    indices = [args.only] if args.only is not None else range(args.first, args.first + args.cases)
    if rank == 0:
        print(f"fuzz seed {args.seed} on {world} ranks: cases {indices[0]}..{indices[-1]} "
              f"(core: {_core.__file__})", flush=True)
    ddlfast.barrier()  # the main thread is the context's issuing thread, whatever case comes first
    start = time.perf_counter()
    failures: list[str] = []
    ran = rejected = injected = 0
    for index in indices:
        case = make_case(args.seed, world, index, args.large, args.misaligned)
        case = dataclasses.replace(case, fault=draw_fault(args.seed, world, index, args.faults))
        injected += case.fault is not None
        set_environment(case, base)
        reproduce = (f"reproduce: mpiexec -n {world} python tests/mpi/programs/fuzz_cases.py --seed {args.seed} "
                     f"--only {index} --large {args.large} --misaligned {args.misaligned} --faults {args.faults}")
        try:
            problems = run_case(comm, args.seed, case)
        except ddlfast.DdlfastError as error:
            if not (is_misaligned(case) and "align" in str(error)):
                print(f"rank {rank} FAILED {case.describe()}\n  raised {type(error).__name__}: {error}\n  {reproduce}",
                      flush=True)
                comm.Abort(3)
            rejected += 1  # refusing a misaligned array (on every rank, before any message) is a valid answer
            problems = []
        except Exception as error:  # a rank alone in an exception would leave the others waiting: abort
            print(f"rank {rank} FAILED {case.describe()}\n  raised {type(error).__name__}: {error}\n  {reproduce}",
                  flush=True)
            comm.Abort(3)
        for problem in problems:
            failures.append(f"rank {rank} {case.describe()}\n  {problem}\n  {reproduce}")
        ran += 1
    set_environment(Case(0, "", None, (), "", None, (), 0.0, False), base)
    elapsed = time.perf_counter() - start
    if rank == 0:
        if rejected:
            print(f"{rejected} cases with misaligned arrays were refused with an alignment error")
        if injected:
            print(f"{injected} cases injected a fault on one rank (every rank had to name it)")
    return harness.report(f"{ran} cases on {world} ranks in {elapsed:.1f} s (seed {args.seed}), ", own=failures,
                          limit=30)


if __name__ == "__main__":
    sys.exit(main())
