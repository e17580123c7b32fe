"""Runs on every rank (ranks may share one GPU): the GPU ring on device memory against the host engine
on host copies, bit for bit, over dims, dtypes, segments (with misaligned starts), chunk sizes, slot
counts and rank orders; staged transfers always, direct (device pointers to MPI) when MPI reports CUDA
support. Every rank must end with identical bits. `--cases N` runs the first N cases (40 by default; fewer under
compute-sanitizer, scripts/gpu_check.sh)."""

from __future__ import annotations

import faulthandler
import hashlib
import sys

import numpy as np
from mpi4py import MPI

from ddlfast import _core, _cuda, _testing_cuda
from ddlfast.buffers.dtypes import DTYPE_CODES

# A hang prints every thread's stack and ends this rank, so the test fails with a trace, not pytest's timeout.
faulthandler.dump_traceback_later(150, exit=True)

comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
device = rank % _cuda.device_count()
failures: list[str] = []
SIZES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8}


def shapes_for(n: int) -> list[tuple[int, ...]]:
    shapes = [(n,), (1, n)] + [(a, n // a) for a in range(2, n) if n % a == 0]
    return shapes + ([(2, 1, 2)] if n == 4 else [])


def values(dtype: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if dtype in ("int32", "int64"):
        return rng.integers(-1000, 1000, n).astype(dtype)
    if dtype == "bfloat16":
        return (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return (rng.standard_normal(n) * 10).astype(dtype)


host = _core.Core(comm, 120.0)
gpu = _cuda.DeviceCore(host)
modes = [False] + ([True] if _cuda.mpi_cuda_support()[0] else [])
case_rng = np.random.default_rng(99)
shapes, dtypes = shapes_for(world), tuple(SIZES)
cases = 0
CASES = int(sys.argv[sys.argv.index("--cases") + 1]) if "--cases" in sys.argv else 40
for case in range(CASES):
    dims = shapes[int(case_rng.integers(0, len(shapes)))]
    dtype = dtypes[int(case_rng.integers(0, len(dtypes)))]
    sizes = [0, 1, 3, world - 1, 17, 1000, 4099, 300_001]
    segments = [int(case_rng.choice(sizes)) for _ in range(int(case_rng.integers(1, 5)))]
    chunk_bytes = int(case_rng.choice([8, 64, 1000, 65536, 1 << 20]))
    slots = int(case_rng.choice([2, 3, 4]))
    small_bytes = int(case_rng.choice([0, 0, 64]))
    # The GPU ring runs sum, and float32/float64 average; the integer and 16-bit averages run on the host engine
    # (engine/device.py, _HOST_ARITHMETIC) and the GPU ring refuses them. The op is drawn for every case, so the
    # cases stay the same ones.
    drawn_op = int(case_rng.integers(0, 2))
    op = drawn_op if dtype in ("float32", "float64") else 0
    order = tuple(case_rng.permutation(world).tolist()) if case_rng.random() < 0.3 else ()
    offsets = [int(case_rng.integers(0, 4)) for _ in segments]  # elements into each allocation
    # Tiny chunks over the largest segments are ~10^5 chunks of device work per phase: with 4 ranks time-sliced on
    # one GPU that ran past 150 s on an H100. Tiny chunks stay for the smaller layouts (as emulated_ring_cases.py).
    if sum(segments) * SIZES[dtype] // chunk_bytes > 20_000:
        chunk_bytes = 65536
    data_rng = np.random.default_rng([case, rank])
    inputs = [values(dtype, n, data_rng) for n in segments]
    expected = [a.copy() for a in inputs]
    code = DTYPE_CODES[dtype]
    options = _core.CallOptions(dims, chunk_bytes, slots, small_bytes, order)
    host.allreduce_segments([a.ctypes.data for a in expected], [a.size for a in expected], code, op, options)
    for direct in modes:
        memories, pointers = [], []
        for a, offset in zip(inputs, offsets, strict=True):
            memory = _testing_cuda.DeviceMemory(a.nbytes + (offset + 4) * SIZES[dtype], device)
            pointer = memory.pointer + offset * SIZES[dtype]
            _testing_cuda.copy(pointer, a.ctypes.data, a.nbytes)
            memories.append(memory)
            pointers.append(pointer)
        gpu.allreduce_segments(device, pointers, [a.size for a in inputs], code, op, options, direct)
        gpu.synchronize(device)
        got = []
        for a, pointer in zip(inputs, pointers, strict=True):
            out = np.empty_like(a)
            _testing_cuda.copy(out.ctypes.data, pointer, out.nbytes)
            got.append(out)
        label = (f"case {case}: dims={dims} {dtype} segments={segments} chunk={chunk_bytes} slots={slots} "
                 f"small={small_bytes} op={op} order={order} direct={direct}")
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            if g.tobytes() != e.tobytes():
                bad = np.flatnonzero(g.view(np.uint8) != e.view(np.uint8))
                failures.append(f"rank {rank} {label}: segment {i} differs from the host engine at bytes {bad[:8]}")
        digest = hashlib.sha256(b"".join(g.tobytes() for g in got)).hexdigest()
        if len(set(comm.allgather(digest))) != 1:
            failures.append(f"rank {rank} {label}: ranks hold different bits")
        cases += 1

gpu.close()
host.close()
total = comm.allreduce(len(failures))
for failure in failures[:20]:
    print(failure, flush=True)
if rank == 0:
    print(f"{cases} cases (modes {modes}), {total} failures", flush=True)
sys.exit(1 if total else 0)
