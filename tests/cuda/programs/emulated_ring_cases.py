"""Runs on every rank: the GPU ring executor on emulated lanes (host memory, every device operation
deferred and interleaved at random) against the host engine, bit for bit, over dims, dtypes, segment
layouts, chunk sizes, slot counts, rank orders, both transfer modes, and ring or direct reduce-scatter per
dimension. Also checks that every rank
ends with identical bits. Needs the CUDA build (not a GPU)."""

from __future__ import annotations

import faulthandler
import hashlib
import sys

import numpy as np

from ddlfast import _core, _testing
from ddlfast.buffers.dtypes import DTYPE_CODES
from tests.mpi.programs.harness import comm, failures, rank, report_and_exit, world

checked = 0


def factorizations(n: int) -> list[tuple[int, ...]]:
    shapes = [(n,)]
    for a in range(2, n):
        if n % a == 0:
            shapes.append((a, n // a))
    shapes.append((1, n))
    if n == 4:
        shapes.append((2, 1, 2))
    return shapes


def values(dtype: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if dtype in ("int32", "int64"):
        return rng.integers(-1000, 1000, n).astype(dtype)
    if dtype == "bfloat16":
        return (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return (rng.standard_normal(n) * 10).astype(dtype)


def storage(dtype: str) -> np.dtype:
    return np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(dtype)


def compare(label: str, got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    """The GPU executor's segments against the host engine's, bit for bit, and the same on every rank."""
    global checked
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        if g.tobytes() != e.tobytes():
            bad = np.flatnonzero(g.view(np.uint8) != e.view(np.uint8))
            failures.append(f"rank {rank} {label}: segment {i} differs from the host engine at bytes {bad[:8]}")
    digest = hashlib.sha256(b"".join(g.tobytes() for g in got)).hexdigest()
    if len(set(comm.allgather(digest))) != 1:
        failures.append(f"rank {rank} {label}: ranks hold different bits")
    checked += 1


# A hang anywhere (not only in the executor, which has its own stall limit) prints every thread's stack and
# ends this rank, so the test fails with a trace instead of running into pytest's timeout.
faulthandler.dump_traceback_later(120, exit=True)
host = _core.Core(comm, 60.0)
host.set_timeout(60.0)
case_rng = np.random.default_rng(1234)  # the same cases on every rank
mask_rng = np.random.default_rng(4321)  # which dimensions reduce-scatter directly (engine/direct_phase.h)
shapes = factorizations(world)
dtypes = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
for case in range(64):
    # Independent draws, so every shape meets every dtype and both transfer modes.
    dims = shapes[int(case_rng.integers(0, len(shapes)))]
    dtype = dtypes[int(case_rng.integers(0, len(dtypes)))]
    sizes = [0, 1, 3, world - 1, 17, 100, 1000, 4099, 300_001]  # the largest: rendezvous-sized messages
    segments = [int(case_rng.choice(sizes)) for _ in range(int(case_rng.integers(1, 5)))]
    chunk_bytes = int(case_rng.choice([8, 24, 64, 1000, 4096, 65536, 1 << 20]))
    slots = int(case_rng.choice([2, 3, 4]))
    small_bytes = int(case_rng.choice([0, 0, 0, 64]))
    # The GPU ring runs sum, and float32/float64 average; integer average and the half types' checked
    # arithmetic run on the host engine (see Context._execute_gpu), so they are not compared here.
    op = int(case_rng.integers(0, 2)) if dtype in ("float32", "float64") else 0
    order = tuple(case_rng.permutation(world).tolist()) if case_rng.random() < 0.3 else ()
    direct = bool(case_rng.random() < 0.5)
    seed = int(case_rng.integers(0, 1 << 30))
    direct_by_dim = tuple(int(d) for d in mask_rng.integers(0, 2, len(dims))) if mask_rng.random() < 0.5 else ()
    # Tiny chunks over the largest segments mean ~10^6 messages and emulated operations per rank: minutes
    # on the 2-core CI machine (and the emulated lanes' queues grow to hundreds of MB). Keep tiny chunks
    # for the smaller layouts, where they already cover every boundary case.
    if sum(segments) * np.dtype(storage(dtype)).itemsize // chunk_bytes > 20_000:
        chunk_bytes = 65536
    data_rng = np.random.default_rng([case, rank])
    inputs = [values(dtype, n, data_rng) for n in segments]
    expected = [a.copy() for a in inputs]
    got = [a.copy() for a in inputs]
    code = DTYPE_CODES[dtype]
    options = _core.CallOptions(dims, chunk_bytes, slots, small_bytes, order, (), direct_by_dim)
    host.allreduce_segments([a.ctypes.data for a in expected], [a.size for a in expected], code, op, options)
    _testing.emulated_allreduce(host, [a.ctypes.data for a in got], [a.size for a in got], code, op, options,
                                direct, seed + rank)  # stalls fail at 60 s
    label = (f"case {case}: dims={dims} {dtype} segments={segments} chunk={chunk_bytes} slots={slots} "
             f"small={small_bytes} op={op} order={order} direct={direct} direct_by_dim={direct_by_dim}")
    compare(label, got, expected)
    print(f"rank {rank} finished case {case}", file=sys.stderr, flush=True)

# reproducible=True's canonical chain across hosts (src/engine/chain_phase.h) on dims (per host, hosts): the
# GPU executor's bits equal the host engine's, for the data it sums in its own type (16-bit data takes the flat
# order on the GPU executor).
chain_rng = np.random.default_rng(999)
chain_shapes = [dims for dims in shapes if len(dims) == 2 and min(dims) >= 2]
for case in range(16 if chain_shapes else 0):
    dims = chain_shapes[int(chain_rng.integers(0, len(chain_shapes)))]
    dtype = ("float32", "float64", "int32", "int64")[int(chain_rng.integers(0, 4))]
    segments = [int(chain_rng.choice([1, 3, 17, 1000, 4099, 300_001])) for _ in range(int(chain_rng.integers(1, 4)))]
    chunk_bytes = int(chain_rng.choice([24, 1000, 4096, 65536]))
    if sum(segments) * np.dtype(storage(dtype)).itemsize // chunk_bytes > 20_000:
        chunk_bytes = 65536
    slots = int(chain_rng.choice([2, 3, 4]))
    op = int(chain_rng.integers(0, 2)) if dtype in ("float32", "float64") else 0
    direct = bool(chain_rng.random() < 0.5)
    seed = int(chain_rng.integers(0, 1 << 30))
    data_rng = np.random.default_rng([1000 + case, rank])
    inputs = [values(dtype, n, data_rng) for n in segments]
    expected = [a.copy() for a in inputs]
    got = [a.copy() for a in inputs]
    code = DTYPE_CODES[dtype]
    options = _core.CallOptions(dims, chunk_bytes, slots, 0, (), (), (1, 1), False, True)
    host.allreduce_segments([a.ctypes.data for a in expected], [a.size for a in expected], code, op, options)
    _testing.emulated_allreduce(host, [a.ctypes.data for a in got], [a.size for a in got], code, op, options,
                                direct, seed + rank)
    label = (f"chain case {case}: dims={dims} {dtype} segments={segments} chunk={chunk_bytes} slots={slots} "
             f"op={op} direct={direct}")
    compare(label, got, expected)

host.close()
report_and_exit(f"{checked} cases, ")
