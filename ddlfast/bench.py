"""Benchmark ddlfast's collectives beside MPI's own (nccl-tests conventions).

    mpiexec -n 4 python -m ddlfast.bench --sizes 4KiB,1MiB,64MiB --dims flat,2x2 --check
    mpiexec -n 4 python -m ddlfast.bench --collective reduce_scatter --sizes 4KiB,1MiB --check
    mpiexec -n 4 python -m ddlfast.bench -b 8 -e 64MiB -f 2      # nccl-tests' begin/end/factor sweep
    mpiexec -n 4 python -m ddlfast.bench --dtype bfloat16 --op max --check --json out.json

Rows are printed as they are measured (with --check, each row's #wrong: elements out of tolerance over every
rank, as nccl-tests counts them); the table closes with the wrong-element count and the average busbw;
`--json FILE` writes the rows as one JSON document beside the table (`--json` alone prints it instead).
--dtype: float32, float64, float16, bfloat16 (ml_dtypes; MPI has none, so its baseline reduces in a
user-defined op), int32, int64; --op: sum, average, min, max, product.
Unlike nccl-tests (a loop of back-to-back calls, divided by its length) every call is timed alone (below).

--collective picks the pair: allreduce (comm.Allreduce), reduce_scatter (comm.Reduce_scatter_block), allgather
(comm.Allgather) or broadcast (comm.Bcast from rank 0). A size is the full buffer: the reduce-scatter's input,
the allgather's output (each rank contributes size/p), as nccl-tests counts them.

For every size (and every ring shape in --dims) the two allreduces alternate, iteration by iteration, so both see
the same machine conditions: ddlfast.allreduce, then mpi4py's comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM), then
ddlfast again, and so on. Before each timed call the buffer is reset from a pristine copy and the ranks meet at a
Barrier (neither is timed); MPI.Wtime times the call alone. An iteration's time is the slowest rank's time (an
allreduce MAX over the ranks) and a row reports the median over iterations.

    algbw = bytes / time          busbw = algbw * factor          ratio = busbw_ddlfast / busbw_mpi

with factor 2(p-1)/p for allreduce, (p-1)/p for reduce-scatter and allgather, 1 for broadcast.

ratio > 1 means ddlfast is faster. With one rank nothing moves (2(p-1)/p = 0): busbw and ratio print "n/a".
run_bench() and format_table() are the same machinery for other code (the demo, tests).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from statistics import median
from typing import Any

import ml_dtypes
import numpy as np
from mpi4py import MPI

import ddlfast
from ddlfast import config, files
from ddlfast.errors import DdlfastError, ranks_text
from ddlfast.topology.cost_model import halves

DEFAULT_SIZES = "4KiB,64KiB,1MiB,16MiB,64MiB"
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
# MPI has no bfloat16: its baseline reduces the 2-byte elements in a user-defined MPI op (NumPy over ml_dtypes,
# each pairwise step in float32 rounded to bfloat16), which MPI runs in Python: slower than a built-in op.
_BFLOAT16_REDUCTIONS = {"sum": np.add, "average": np.add, "min": np.minimum, "max": np.maximum,
                        "product": np.multiply}
_bfloat16_ops: dict[str, MPI.Op] = {}
BENCHED_OPS = ("sum", "average", "min", "max", "product")  # MPI's baseline: the same op (SUM for average)
_MPI_OPS = {"sum": "SUM", "average": "SUM", "min": "MIN", "max": "MAX", "product": "PROD"}
# Auto iteration count: about this many bytes reduced per row and per library, clamped to [MIN, MAX] iterations.
AUTO_BYTES_PER_ROW = 512 << 20
AUTO_MIN_ITERS = 5
AUTO_MAX_ITERS = 200
BASELINE = "mpi4py comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)"
# collective -> (MPI's name, the baseline call, busbw factor as text)
COLLECTIVES = {
    "allreduce": ("MPI_Allreduce", BASELINE, "2(p-1)/p"),
    "reduce_scatter": ("MPI_Reduce_scatter_block", "mpi4py comm.Reduce_scatter_block(send, recv, op=MPI.SUM)",
                       "(p-1)/p"),
    "allgather": ("MPI_Allgather", "mpi4py comm.Allgather(send, recv)", "(p-1)/p"),
    "broadcast": ("MPI_Bcast", "mpi4py comm.Bcast(buf, root=0)", "1"),
}
_SEED = 20240917


# -- sizes, shapes, iteration counts --------------------------------------------------------------------------------


def max_bench_bytes() -> int:
    """The largest size a row may have: the input, the shared work buffer and --check's two copies fit in this
    machine's memory (a larger one ended in numpy's MemoryError after the header was printed)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (AttributeError, ValueError, OSError):  # no sysconf: a bound that only stops the absurd
        return 1 << 40


def parse_sizes(text: str, name: str = "--sizes") -> list[int]:
    """'4KiB,1MiB,64M' -> [4096, 1048576, 67108864] (bytes); `name` is the option errors name."""
    sizes = []
    for part in text.split(","):
        if not part.strip():
            continue
        value = config.parse_size(part, name)
        if value <= 0:
            raise DdlfastError(f"{name}: {part.strip()!r} must be more than 0 bytes")
        largest = max_bench_bytes()
        if value > largest:
            raise DdlfastError(f"{name}: {part.strip()!r:.40} is above {config.format_size(largest)}, a quarter of "
                               "this machine's memory (each size holds up to 4 buffers of it)")
        sizes.append(value)
    if not sizes:
        raise DdlfastError(f"{name} is empty; use e.g. 4KiB,1MiB,64MiB")
    return sizes


def parse_dims_list(text: str | Sequence[object], world: int) -> list[str]:
    """'flat,2x2' -> ['flat', '2x2'], each checked against the world size."""
    items = text.split(",") if isinstance(text, str) else list(text)
    names = []
    for item in items:
        if isinstance(item, str) and not item.strip():
            continue
        dims = config.parse_dims(item.strip() if isinstance(item, str) else item, "--dims")
        if isinstance(dims, tuple):
            product = int(np.prod(dims))
            if product != world:
                shape = "x".join(map(str, dims))
                raise DdlfastError(f"--dims {shape} multiplies to {product} but there are {world} ranks")
            names.append("x".join(map(str, dims)))
        else:
            names.append(dims)
    if not names:
        raise DdlfastError("--dims is empty; use e.g. flat or flat,2x2")
    return names


def _algorithm(comm: MPI.Comm, dims: str, nbytes: int, settings: config.Settings, compression: str) -> Any:
    """What DDLFAST_ALGORITHM gives one call of `nbytes` on `dims` (ddlfast.topology(): the engine's rule)."""
    topology = ddlfast.topology(comm)
    ring_dims = topology.resolve(config.parse_dims(dims))
    compressed = () if compression == "none" else (True,) * len(ring_dims)  # keeps the dims, as the engine does
    return topology.algorithm(nbytes, ring_dims, settings.algorithm, settings.small_bytes, settings.ring_dims,
                              compressed)


def _broadcast_path(comm: MPI.Comm, nbytes: int, settings: config.Settings) -> str:
    """The route of a host broadcast of `nbytes` (engine/small.py's rule): in the agreement's messages, along the
    ring, or MPI's broadcast."""
    from ddlfast.api import _context_for
    from ddlfast.engine.small import broadcast_route

    route = broadcast_route(_context_for(comm)._state, nbytes, settings)
    return "mpi-bcast" if route is None else "latency" if route[1] else "ring"


def _carried(comm: MPI.Comm, collective: str, nbytes: int, dims: str, settings: config.Settings,
             compression: str, dtype: np.dtype, op: str) -> bool:
    """Whether ddlfast carries a reduce-scatter or allgather of `nbytes` in the agreement's messages (the engine's
    own rule: engine/shards.carried_options)."""
    if collective not in ("reduce_scatter", "allgather") or compression != "none":
        return False
    from ddlfast.api import _context_for
    from ddlfast.engine.shards import carried_options
    from ddlfast.engine.state import is_half_sum

    state = _context_for(comm)._state
    half_sum = collective == "reduce_scatter" and is_half_sum(dtype, op)
    return carried_options(state, collective, nbytes, state.resolve_dims(dims, settings), settings, (),
                           half_sum) is not None


def sweep_sizes(begin: str | None, end: str | None, factor: int | None) -> list[int]:
    """nccl-tests' -b/-e/-f: begin, begin*factor, ... up to end (bytes; either bound alone is one size)."""
    first = parse_sizes(begin, "-b")[0] if begin else parse_sizes(end, "-e")[0] if end else None
    last = parse_sizes(end, "-e")[0] if end else first
    step = 2 if factor is None else factor
    if first is None or last is None:
        raise DdlfastError("-f needs -b and/or -e (e.g. -b 8 -e 64MiB -f 2)")
    if step < 2:
        raise DdlfastError(f"-f {step}: the step factor must be an integer >= 2")
    if last < first:
        raise DdlfastError(f"-e {format_bytes(last)} is below -b {format_bytes(first)}")
    sizes = [first]
    while sizes[-1] * step <= last:
        sizes.append(sizes[-1] * step)
    return sizes


def auto_iters(nbytes: int) -> int:
    """Many iterations for small sizes (cheap, noisy), at least AUTO_MIN_ITERS for the big ones."""
    return max(AUTO_MIN_ITERS, min(AUTO_MAX_ITERS, AUTO_BYTES_PER_ROW // max(nbytes, 1)))


def auto_warmup(iters: int) -> int:
    return max(2, min(10, iters // 10))


def format_bytes(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return f"{nbytes}B"


def busbw_factor(world: int, collective: str = "allreduce") -> float:
    """nccl-tests' factors: what each rank's link carries relative to the buffer size."""
    if collective == "broadcast":
        return 1.0
    passes = 2.0 if collective == "allreduce" else 1.0
    return passes * (world - 1) / world


# -- inputs and the correctness check -------------------------------------------------------------------------------


def numpy_dtype(name: str) -> np.dtype:
    """A DTYPES name as a NumPy dtype (bfloat16: ml_dtypes')."""
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def _is_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype == BFLOAT16


def _finfo(dtype: np.dtype) -> Any:
    return ml_dtypes.finfo(dtype) if dtype == BFLOAT16 else np.finfo(dtype)


def _mpi_buffer(array: np.ndarray) -> Any:
    """What mpi4py is given: the array, or a bfloat16 array's bits as MPI_UINT16_T (for _bfloat16_op)."""
    return [array.view(np.uint16), MPI.UINT16_T] if array.dtype == BFLOAT16 else array


def _mpi_op(op: str, dtype: np.dtype) -> MPI.Op:
    """MPI's op for the baseline (_MPI_OPS); for bfloat16 a user-defined one."""
    if dtype != BFLOAT16:
        return getattr(MPI, _MPI_OPS[op])
    if op not in _bfloat16_ops:
        reduction = _BFLOAT16_REDUCTIONS[op]

        def reduce(inbuf: Any, inoutbuf: Any, _datatype: Any) -> None:
            incoming = np.frombuffer(inbuf, BFLOAT16)
            result = np.frombuffer(inoutbuf, BFLOAT16)
            result[...] = reduction(incoming.astype(np.float32), result.astype(np.float32)).astype(BFLOAT16)

        _bfloat16_ops[op] = MPI.Op.Create(reduce, commute=True)
    return _bfloat16_ops[op]


def _pristine(count: int, dtype: np.dtype, rank: int, world: int) -> np.ndarray:
    """Deterministic per-rank input: floats in [-1, 1), ints in [-1000, 1000] (no overflow, exact sums)."""
    rng = np.random.default_rng([_SEED, world, rank, count])
    if _is_float(dtype):
        return (rng.random(count, dtype=np.float32) * 2.0 - 1.0).astype(dtype)
    return rng.integers(-1000, 1001, size=count, dtype=dtype)


def _expected_from_mpi(mpi_sum: np.ndarray, op: str, world: int) -> np.ndarray:
    """What ddlfast must hold given MPI's result of the baseline op (_MPI_OPS): the same, but for average."""
    if op != "average":
        return mpi_sum
    if _is_float(mpi_sum.dtype):
        return (mpi_sum.astype(np.float64) / world).astype(mpi_sum.dtype)
    # Integer average is the floor of the exact sum / p (NumPy's //); these small inputs cannot wrap.
    return (mpi_sum // world).astype(mpi_sum.dtype)


WIRE_UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}


def _check_row(ours: np.ndarray, mpi_sum: np.ndarray, pristine: np.ndarray, op: str, comm: MPI.Intracomm,
               what: str, compression: str = "none", mpi_name: str = "MPI_Allreduce",
               block: slice | None = None, wrong: list[int] | None = None) -> list[str]:
    """Compare ddlfast's result with MPI's on every rank; [] when they agree. Collective: every rank calls it.

    block: the part of the reduced buffer this rank holds (reduce-scatter: each rank holds its own, so bits
    are compared with MPI's, not across ranks). wrong: this rank's count of elements out of tolerance is appended."""
    world, rank = comm.Get_size(), comm.Get_rank()
    expected = _expected_from_mpi(mpi_sum, op, world)
    problem = None
    if _is_float(ours.dtype):
        # Per element: two summation orders of p terms each differ by at most ~2(p+1) eps * sum_r |x_r|.
        abs_sum = np.abs(pristine.astype(np.float64))
        comm.Allreduce(MPI.IN_PLACE, abs_sum, op=MPI.SUM)
        abs_sum = abs_sum if block is None else abs_sum[block]
        eps = float(_finfo(ours.dtype).eps)
        scale = 1.0 / world if op == "average" else 1.0
        tolerance = 2.0 * (world + 1) * eps * abs_sum * scale + float(_finfo(ours.dtype).tiny)
        if compression in WIRE_UNIT_ROUNDOFF:  # one rounding to the wire type per ring hop, plus subnormals
            tolerance = world * (WIRE_UNIT_ROUNDOFF[compression] * abs_sum * scale + 2.0**-24)
        if op in ("min", "max"):  # exact (docs/numerics.md): MPI's bits, or their one rounding to the wire type
            magnitude = np.abs(expected.astype(np.float64))
            tolerance = (WIRE_UNIT_ROUNDOFF[compression] * magnitude + 2.0**-24 if compression in WIRE_UNIT_ROUNDOFF
                         else np.zeros_like(magnitude))
        elif op == "product":  # p-1 roundings in either order, relative to the product itself
            tolerance = 2.0 * (world + 1) * eps * np.abs(expected.astype(np.float64)) + float(_finfo(ours.dtype).tiny)
        diff = np.abs(ours.astype(np.float64) - expected.astype(np.float64))
        bad = ~(diff <= tolerance)  # NaN counts as a mismatch
        if wrong is not None:
            wrong.append(int(bad.sum()))
        if bad.any():
            index = int(np.flatnonzero(bad)[0])
            problem = (
                f"{what}: rank {rank}: {int(bad.sum())} of {ours.size} elements differ from {mpi_name} beyond "
                f"tolerance; first at index {index}: ddlfast={float(ours[index])!r}, MPI={float(expected[index])!r}, "
                f"|diff|={diff[index]:.3g} > tolerance {tolerance[index]:.3g} (max |diff| {np.nanmax(diff):.3g})"
            )
    else:
        bad = ours != expected
        if wrong is not None:
            wrong.append(int(bad.sum()))
        if bad.any():
            index = int(np.flatnonzero(bad)[0])
            problem = (
                f"{what}: rank {rank}: {int(bad.sum())} of {ours.size} elements differ from {mpi_name} "
                f"(integers must match exactly); first at index {index}: ddlfast={int(ours[index])}, "
                f"MPI={int(expected[index])}"
            )
    problems = [p for p in comm.allgather(problem) if p is not None]
    if block is None:
        problems += _same_bits(ours, comm, what)
    return problems


def _check_copy(ours: np.ndarray, theirs: np.ndarray, comm: MPI.Intracomm, what: str, mpi_name: str,
                compression: str = "none", wrong: list[int] | None = None) -> list[str]:
    """allgather / broadcast: MPI's bits exactly (through the wire type when compressed, one rounding)."""
    rank = comm.Get_rank()
    if compression in WIRE_UNIT_ROUNDOFF:
        tolerance = WIRE_UNIT_ROUNDOFF[compression] * np.abs(theirs.astype(np.float64)) + 2.0**-24
        bad = ~(np.abs(ours.astype(np.float64) - theirs.astype(np.float64)) <= tolerance)
    else:
        bad = (ours.view(np.uint8).reshape(ours.size, -1) != theirs.view(np.uint8).reshape(theirs.size, -1)).any(1)
    if wrong is not None:
        wrong.append(int(bad.sum()))
    problem = None
    if bad.any():
        index = int(np.flatnonzero(bad)[0])
        problem = (f"{what}: rank {rank}: {int(bad.sum())} of {ours.size} elements differ from {mpi_name}; first "
                   f"at index {index}: ddlfast={ours.flat[index]!r}, MPI={theirs.flat[index]!r}")
    return [p for p in comm.allgather(problem) if p is not None] + _same_bits(ours, comm, what)


def _same_bits(ours: np.ndarray, comm: MPI.Intracomm, what: str) -> list[str]:
    """ddlfast promises identical bits on every rank."""
    problems = []
    digest = hashlib.blake2b(ours.view(np.uint8), digest_size=16).hexdigest()
    digests = comm.allgather(digest)
    if len(set(digests)) > 1:
        groups: dict[str, list[int]] = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        described = "; ".join(
            f"{ranks_text(r)}: {d[:12]}" for d, r in groups.items()
        )
        problems.append(f"{what}: ddlfast results are not bitwise identical on every rank ({described})")
    return problems


# -- the measurement ------------------------------------------------------------------------------------------------


def _summary(samples_s: np.ndarray, nbytes: int, world: int, collective: str = "allreduce") -> dict[str, Any]:
    time_s = float(median(samples_s.tolist()))
    algbw = nbytes / time_s / 1e9 if time_s > 0 else None
    busbw = algbw * busbw_factor(world, collective) if algbw is not None and world > 1 else None
    return {
        "median_us": time_s * 1e6,
        "algbw_GBps": algbw,
        "busbw_GBps": busbw,
        "samples_us": [t * 1e6 for t in samples_s.tolist()],
    }


def run_bench(
    sizes: Sequence[int],
    dtype: str = "float32",
    dims_list: Sequence[object] = ("flat",),
    iters: int | None = None,
    warmup: int | None = None,
    op: str = "sum",
    check: bool = False,
    *,
    comm: MPI.Intracomm | None = None,
    compression: str = "none",
    collective: str = "allreduce",
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Measure a ddlfast collective beside MPI's (COLLECTIVES) for every size (bytes) and ring shape; collective.

    iters/warmup None = automatic (see auto_iters). Returns the same rows on every rank: one dict per
    (dims, size) with both libraries' per-iteration samples (max over ranks), medians and bandwidths, and,
    with check=True, "check" ("ok"/"FAIL") and "check_errors" (messages naming rank, index and values).
    on_row(row) is called with each row as soon as it is measured (the command line streams the table so).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    if op not in BENCHED_OPS:
        raise DdlfastError(f"op={op!r} is not one of {', '.join(BENCHED_OPS)}")
    if dtype not in DTYPES:
        raise DdlfastError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    if collective not in COLLECTIVES:
        raise DdlfastError(f"collective={collective!r} is not one of {', '.join(COLLECTIVES)}")
    if collective == "broadcast" and compression != "none":
        raise DdlfastError("broadcast sends the data as it is: --compression applies to the other collectives")
    world, rank = comm.Get_size(), comm.Get_rank()
    mpi_name = COLLECTIVES[collective][0]
    np_dtype = numpy_dtype(dtype)
    dims_names = parse_dims_list(dims_list, world)
    settings = config.load_settings()
    rows = []
    for dims in dims_names:
        for size in sizes:
            count = size // np_dtype.itemsize
            if collective in ("reduce_scatter", "allgather"):
                count -= count % world  # p equal blocks
            if count < 1:
                raise DdlfastError(f"size {size} B is smaller than one {dtype} element"
                                   + (" per rank" if collective in ("reduce_scatter", "allgather") else ""))
            nbytes = count * np_dtype.itemsize
            n_iters = auto_iters(nbytes) if iters is None else int(iters)
            n_warmup = auto_warmup(n_iters) if warmup is None else int(warmup)
            if n_iters < 1 or n_warmup < 0:
                raise DdlfastError(f"iters must be >= 1 and warmup >= 0 (got {n_iters}, {n_warmup})")
            pristine = _pristine(count // world if collective == "allgather" else count, np_dtype, rank, world)
            out_count = count // world if collective == "reduce_scatter" else count
            # Both libraries run on one buffer, so neither gets the better placement: with a buffer each, where
            # the two sat in memory moved the 4-16 MiB rows by up to 30 % on a 2-core VM (bench/README.md).
            work = np.empty(out_count, np_dtype)
            # The last call of each library copied aside, only for check: (ddlfast's, MPI's).
            results = [np.empty(out_count, np_dtype) for _ in range(2)] if check else []
            run_ours, run_theirs = _calls(collective, pristine, op, dims, comm, compression)
            algorithm = _algorithm(comm, dims, nbytes, settings, compression)
            topology = ddlfast.topology(comm)
            halving = topology.halving_bytes(config.halving_bytes())
            takes = not settings.reproducible and topology.latency_takes(nbytes, settings.small_bytes,
                                                                         settings.algorithm, halving)
            latency = "halving" if halves(nbytes, halving) else "latency"
            # A reduce-scatter the latency path's allreduce takes, an allgather whose result it reaches: carried in
            # the agreement's messages too.
            carried = _carried(comm, collective, nbytes, dims, settings, compression, np_dtype, op)
            resets = collective in ("allreduce", "broadcast")  # in place: each call starts from the input

            samples = np.zeros((n_iters, 2), dtype=np.float64)
            for i in range(n_warmup + n_iters):
                for column, call in enumerate((run_ours, run_theirs)):
                    if resets:
                        np.copyto(work, pristine)
                    comm.Barrier()
                    start = MPI.Wtime()
                    call(work)
                    elapsed = MPI.Wtime() - start
                    if results and i == n_warmup + n_iters - 1:
                        np.copyto(results[column], work)
                    if i >= n_warmup:
                        samples[i - n_warmup, column] = elapsed
            comm.Allreduce(MPI.IN_PLACE, samples, op=MPI.MAX)  # each iteration: the slowest rank's time

            row: dict[str, Any] = {
                "collective": collective,
                "size_bytes": nbytes,
                "count": count,
                "dtype": dtype,
                "dims": dims,
                "op": op,
                "compression": compression,
                "world": world,
                "iters": n_iters,
                "warmup": n_warmup,
                "chunk_bytes": settings.chunk_bytes,
                "small_bytes": settings.small_bytes,
                # Buffers <= DDLFAST_SMALL_BYTES: an allreduce rides in the agreement's butterfly (the latency
                # path, "halving" where it halves; MPI's allreduce with DDLFAST_ALGORITHM=mpi), uncompressed
                # passes too (`carried`), compressed ones go to MPI's own collective; above, DDLFAST_ALGORITHM
                # chooses (the name here, the shape in "algorithm").
                "path": ("local" if world == 1 else _broadcast_path(comm, nbytes, settings) if collective == "broadcast"
                         else (latency if collective == "reduce_scatter" else "latency") if carried
                         else latency if collective == "allreduce" and compression == "none"
                         and settings.small_bytes < nbytes and takes
                         else algorithm.name if nbytes > settings.small_bytes
                         else latency if collective == "allreduce" and settings.algorithm != "mpi"
                         else "mpi-handoff"),
                "algorithm": None if collective == "broadcast" else str(algorithm),
                "ddlfast": _summary(samples[:, 0], nbytes, world, collective),
                "mpi": _summary(samples[:, 1], nbytes, world, collective),
            }
            ours_bw, theirs_bw = row["ddlfast"]["busbw_GBps"], row["mpi"]["busbw_GBps"]
            row["ratio"] = ours_bw / theirs_bw if ours_bw is not None and theirs_bw else None
            if check:
                ours, theirs = results
                what = f"{collective} {format_bytes(nbytes)} {dtype} dims {dims} op {op}"
                wrong: list[int] = []
                if collective in ("allgather", "broadcast"):
                    errors = _check_copy(ours, theirs, comm, what, mpi_name, compression, wrong)
                else:
                    block = slice(rank * out_count, (rank + 1) * out_count) if collective == "reduce_scatter" else None
                    errors = _check_row(ours, theirs, pristine, op, comm, what, compression, mpi_name, block, wrong)
                row["wrong"] = comm.allreduce(sum(wrong))  # nccl-tests' #wrong: elements, over every rank
                row["check"] = "FAIL" if errors else "ok"
                row["check_errors"] = errors
                del ours, theirs
            rows.append(row)
            if on_row is not None:
                on_row(row)
            del pristine, work, results
    return rows


def _calls(collective: str, pristine: np.ndarray, op: str, dims: str, comm: MPI.Intracomm,
           compression: str) -> tuple[Any, Any]:
    """ddlfast's call and MPI's, each writing its result into the buffer it is given."""
    mpi_op, send = _mpi_op(op, pristine.dtype), _mpi_buffer(pristine)
    if collective == "reduce_scatter":
        return (lambda out: ddlfast.reduce_scatter(pristine, op=op, dims=dims, comm=comm, out=out,
                                                   compression=compression),
                lambda out: comm.Reduce_scatter_block(send, _mpi_buffer(out), op=mpi_op))
    if collective == "allgather":
        return (lambda out: ddlfast.allgather(pristine, dims=dims, comm=comm, out=out, compression=compression),
                lambda out: comm.Allgather(send, _mpi_buffer(out)))
    if collective == "broadcast":
        return (lambda buf: ddlfast.broadcast(buf, root=0, comm=comm),
                lambda buf: comm.Bcast(_mpi_buffer(buf), root=0))
    return (lambda buf: ddlfast.allreduce(buf, op=op, dims=dims, comm=comm, compression=compression),
            lambda buf: comm.Allreduce(MPI.IN_PLACE, _mpi_buffer(buf), op=mpi_op))


# -- output ---------------------------------------------------------------------------------------------------------


def _num(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def header_lines(rows: Sequence[dict[str, Any]], world: int) -> list[str]:
    info = ddlfast.build_info()
    first = rows[0] if rows else {}
    chunk = first.get("chunk_bytes", config.load_settings().chunk_bytes)
    small = first.get("small_bytes", config.load_settings().small_bytes)
    op = first.get("op", "sum")
    collective = first.get("collective", "allreduce")
    mpi_name, baseline, factor_text = COLLECTIVES[collective]
    baseline = baseline.replace("MPI.SUM", f"MPI.{_MPI_OPS.get(op, 'SUM')}")
    factor = f"{busbw_factor(world, collective):.3f}" if world > 1 else "0 -> busbw n/a"
    lines = [
        f"# ddlfast bench: {collective} op={op}, world size {world} (busbw factor {factor_text} = {factor})",
        f"# build: kernel {info.get('kernel_selected', '?')} (available: {', '.join(info.get('kernel_paths', []))}), "
        f"MPI library: {' '.join(str(info.get('mpi_library', '?')).split())}, "
        f"mpi4py on {info.get('mpi4py_vendor', '?')}, compiler {info.get('compiler', '?')}",
        f"# ddlfast wire compression: {first.get('compression', 'none')}",
        f"# settings: chunk bytes {chunk} ({format_bytes(chunk)}, DDLFAST_CHUNK_BYTES), small bytes {small} "
        f"(DDLFAST_SMALL_BYTES: an allreduce, a reduce-scatter or an allgather (its result) of at most this rides "
        f"in the agreement's messages, path 'latency', in shared memory as far as the latency path reaches; a "
        f"compressed reduce-scatter or allgather takes MPI's own collective, path 'mpi-handoff')",
        f"# baseline: {baseline}, alternated with ddlfast every iteration, both on one buffer",
        "# time: median over iterations of the slowest rank's time; GB/s = 1e9 B/s; "
        "ratio = busbw_ddlfast / busbw_mpi (>1: ddlfast faster)",
        "# vs nccl-tests: they time a loop of back-to-back calls and divide by its length; here every call is "
        "timed alone, after a Barrier, so no call overlaps the next",
    ]
    if op == "average" and collective in ("allreduce", "reduce_scatter"):
        lines.append(f"# note: op=average; the MPI baseline is {mpi_name} SUM (MPI has no average op)")
    if first.get("dtype") == "bfloat16" and collective in ("allreduce", "reduce_scatter"):
        lines.append(f"# note: MPI has no bfloat16; the baseline is {mpi_name} with a user-defined op in Python "
                     "(NumPy over ml_dtypes, float32 per pairwise step): slower than a built-in op")
    return lines


def column_titles(collective: str, checked: bool) -> list[str]:
    """The table's column title lines (below header_lines)."""
    mpi_name = COLLECTIVES[collective][0]
    left = f"{'size(B)':>12} {'count':>11} {'type':>8} {'dims':>6} {'path':>12}"
    lib = f"{'time(us)':>10} {'algbw':>7} {'busbw':>7}"
    units = f"{'':>10} {'(GB/s)':>7} {'(GB/s)':>7}"
    span = len(lib)
    return [
        "#",
        f"# {'':{len(left)}} | {'ddlfast':^{span}} | {mpi_name:^{span}} |",
        f"# {left} | {lib} | {lib} | {'ratio':>6}" + (f" {'#wrong':>7} {'check':>6}" if checked else ""),
        f"# {'':{len(left)}} | {units} | {units} |",
    ]


def format_row(row: dict[str, Any], checked: bool) -> str:
    """One run_bench row as a table line."""
    cells = [f"{row['size_bytes']:>12} {row['count']:>11} {row['dtype']:>8} {row['dims']:>6} {row['path']:>12}"]
    for lib_name in ("ddlfast", "mpi"):
        r = row[lib_name]
        cells.append(f"{r['median_us']:>10.1f} {_num(r['algbw_GBps']):>7} {_num(r['busbw_GBps']):>7}")
    cells.append(f"{_num(row['ratio']):>6}" + (f" {row.get('wrong', '-'):>7} {row.get('check', '-'):>6}"
                                               if checked else ""))
    return "  " + " | ".join(cells)


def footer_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """nccl-tests' closing lines: the number of rows whose check failed, and each library's busbw averaged over
    the rows (n/a with one rank)."""
    lines = []
    if any("check" in row for row in rows):
        lines.append(f"# out of bounds values : {sum(row.get('wrong', 0) for row in rows)} wrong elements in "
                     f"{sum(row.get('check') == 'FAIL' for row in rows)} rows "
                     f"({'FAILED' if any(row.get('check') == 'FAIL' for row in rows) else 'OK'})")
    for lib_name in ("ddlfast", "mpi"):
        values = [row[lib_name]["busbw_GBps"] for row in rows if row[lib_name]["busbw_GBps"] is not None]
        average = sum(values) / len(values) if values else None
        label = "ddlfast" if lib_name == "ddlfast" else COLLECTIVES[rows[0].get("collective", "allreduce")][0]
        lines.append(f"# avg bus bandwidth {label:>24} : {_num(average, 3)} GB/s")
    return lines


def format_table(rows: Sequence[dict[str, Any]], world: int) -> str:
    """nccl-tests style table (header lines included) of run_bench rows."""
    checked = any("check" in row for row in rows)
    collective = rows[0].get("collective", "allreduce") if rows else "allreduce"
    lines = header_lines(rows, world) + column_titles(collective, checked)
    return "\n".join(lines + [format_row(row, checked) for row in rows])


def json_document(rows: Sequence[dict[str, Any]], world: int) -> dict[str, Any]:
    collective = rows[0].get("collective", "allreduce") if rows else "allreduce"
    mpi_name, baseline, factor_text = COLLECTIVES[collective]
    return {
        "benchmark": f"ddlfast.{collective} vs {mpi_name}",
        "world": world,
        "baseline": baseline,
        "time": "per iteration the max over ranks (us); median_us is the median over iterations",
        "bandwidth": f"algbw = bytes/time, busbw = algbw*{factor_text}, GB/s = 1e9 B/s; null when p = 1",
        "build_info": ddlfast.build_info(),
        "rows": list(rows),
    }


# -- command line ---------------------------------------------------------------------------------------------------


class _RankZeroParser(argparse.ArgumentParser):
    """Help and usage errors printed once (by rank 0), not once per rank."""

    def _print_message(self, message: str, file: Any = None) -> None:
        if MPI.COMM_WORLD.Get_rank() == 0:
            super()._print_message(message, file)


def _parser() -> argparse.ArgumentParser:
    parser = _RankZeroParser(
        prog="python -m ddlfast.bench",
        description="ddlfast's collectives beside MPI's own, alternating per iteration (nccl-tests conventions). "
        "Run under mpiexec -n P.",
    )
    parser.add_argument("--collective", default="allreduce", choices=COLLECTIVES,
                        help="which collective, beside its MPI counterpart (default allreduce)")
    parser.add_argument("--sizes", default=None, help=f"comma list of byte sizes (default {DEFAULT_SIZES})")
    parser.add_argument("-b", "--minbytes", default=None, help="first size of a sweep, as nccl-tests' -b (e.g. 8)")
    parser.add_argument("-e", "--maxbytes", default=None, help="last size of a sweep, as nccl-tests' -e (e.g. 64MiB)")
    parser.add_argument("-f", "--stepfactor", type=int, default=None,
                        help="multiply the size by this from -b to -e, as nccl-tests' -f (default 2)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--dims", default="flat", help="ring shape(s), comma list: flat, auto, 2x2, ... (default flat)")
    parser.add_argument("--iters", type=int, default=None,
                        help=f"timed iterations per size (default auto: {AUTO_MIN_ITERS}..{AUTO_MAX_ITERS}, "
                        f"about {format_bytes(AUTO_BYTES_PER_ROW)} per size)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed iterations first (default auto: 2..10)")
    parser.add_argument("--op", default="sum", choices=BENCHED_OPS,
                        help="the op; MPI's baseline runs the same one (SUM for average)")
    parser.add_argument("--compression", default="none",
                        help="ddlfast wire codec: none, fp16, bf16, or per dimension e.g. none,fp16 (float32 only)")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                        help="write the JSON document to FILE beside the streamed table; without FILE, print it "
                             "(rank 0) instead of the table")
    parser.add_argument("--json-file", default=None, metavar="FILE", help="the same as --json FILE")
    parser.add_argument("--check", action="store_true",
                        help="verify ddlfast's result against MPI's (ints exactly, floats within tolerance)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        swept = args.minbytes is not None or args.maxbytes is not None or args.stepfactor is not None
        if swept and args.sizes is not None:
            raise DdlfastError("give --sizes or -b/-e/-f, not both")
        sizes = (sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor) if swept
                 else parse_sizes(DEFAULT_SIZES if args.sizes is None else args.sizes))
        dims_list = parse_dims_list(args.dims, world)
        if args.iters is not None and args.iters < 1:
            raise DdlfastError("--iters must be >= 1")
        if args.warmup is not None and args.warmup < 0:
            raise DdlfastError("--warmup must be >= 0")
    except DdlfastError as error:
        parser.error(str(error))  # exits 2 on every rank, message printed once
    json_only = args.json == "-"  # --json alone: the document instead of the table
    json_file = args.json if args.json not in (None, "-") else args.json_file
    streaming = rank == 0 and not json_only
    checked = args.check

    def print_row(row: dict[str, Any]) -> None:
        print(format_row(row, checked), flush=True)

    if streaming:  # the header now, each row as it is measured (as nccl-tests does)
        first = {"collective": args.collective, "op": args.op, "compression": args.compression,
                 "dtype": args.dtype}
        print("\n".join(header_lines([first], world) + column_titles(args.collective, checked)), flush=True)
    try:
        rows = run_bench(sizes, args.dtype, dims_list, args.iters, args.warmup, args.op, args.check, comm=comm,
                         compression=args.compression, collective=args.collective,
                         on_row=print_row if streaming else None)
    except DdlfastError as error:
        if rank == 0:
            print(f"ddlfast bench: error: {error}", file=sys.stderr)
        return 1
    failures = [message for row in rows for message in row.get("check_errors", [])]
    if rank == 0:
        if json_file:
            files.replace_file(json_file, json.dumps(json_document(rows, world)) + "\n")
        if json_only:
            print(json.dumps(json_document(rows, world)))
        else:
            print("\n".join(footer_lines(rows)))
            if args.check and not failures:
                exactly = numpy_dtype(args.dtype).kind == "i" or (
                    args.collective in ("allgather", "broadcast") and args.compression == "none")
                where = ("on each rank's block" if args.collective == "reduce_scatter"
                         else "identical bits on every rank")
                print(f"# check: ddlfast matches {COLLECTIVES[args.collective][0]} on every rank in all {len(rows)} "
                      f"rows ({'exactly' if exactly else 'within floating-point tolerance'}), {where}")
        sys.stdout.flush()
        if failures:
            print(f"ddlfast bench: CHECK FAILED in {sum(r.get('check') == 'FAIL' for r in rows)} of {len(rows)} "
                  "rows:", file=sys.stderr)
            for message in failures:
                print(f"  {message}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
