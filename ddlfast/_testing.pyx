# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: language = c++
"""Test-only entry points, built in every build and kept out of the library modules: the CPU kernels one
by one (any variant), the ring schedule as Python data, and the GPU ring executor on emulated lanes (host
memory; no GPU and no nvcc needed). The CUDA-only ones are in ddlfast._testing_cuda."""

from libc.stdint cimport uint64_t, uintptr_t
from libc.stddef cimport size_t
from libcpp.vector cimport vector
from mpi4py cimport MPI

from ddlfast._core cimport (
    Butterfly, CallOptions, CoreCpp, DType, Core, ElementRange, EngineOptions, KernelTable, PhaseKind, ReduceOp, RingPhase, RingSchedule, RingStep,
    Status, Torus, build_ring_schedule, butterfly, dtype_valid, element_size, positions_in_block_order,
)
from ddlfast._testing cimport InProcessExecutor, InProcessRun, emulated_device_allreduce, in_process_allreduce as run_in_process

from ddlfast.errors import DdlfastError

include "_common.pxi"
include "_kernel_paths.pxi"


# ---------------------------------------------------------------- butterfly

_BUTTERFLY_ROLES = ("fold_out", "fold_in", "exchange")


def butterfly_plan(int rank, int size):
    """One rank's butterfly (src/algo/butterfly.h) as (role, fold partner, [partner per step])."""
    if size < 1 or not 0 <= rank < size:
        raise DdlfastError(f"rank {rank} of {size} ranks")
    cdef Butterfly plan = butterfly(rank, size)
    return _BUTTERFLY_ROLES[<int>plan.role], plan.fold_partner, list(plan.step_partners)


# ---------------------------------------------------------------- CPU kernels

def combine_into(uintptr_t dst, uintptr_t src, size_t count, int dtype, int op, path=None):
    """dst = op(dst, src) for op min (2), max (3) or product (4) over raw buffers (the kernels' test entry)."""
    cdef const KernelTable* table = kernel_table(path)
    dtype_size(dtype)
    if op < 2 or op > 4:
        raise DdlfastError(f"combine_into takes op code 2 (min), 3 (max) or 4 (product), got {op}")
    with nogil:
        table.combine.fn[op - 2][dtype](<void*>dst, <const void*>src, count)


def encode_wire(uintptr_t dst, uintptr_t src, size_t count, int wire, path=None):
    """dst (fp16/bf16 bits) = wire(src float32): the compression kernels' test entry.

    Returns how many finite inputs overflowed to inf.
    """
    cdef const KernelTable* table = kernel_table(path)
    cdef size_t overflows
    check_wire(wire)
    with nogil:
        overflows = table.encode[wire](<void*>dst, <const float*>src, count)
    return overflows


def decode_wire(uintptr_t dst, uintptr_t src, size_t count, int wire, path=None):
    cdef const KernelTable* table = kernel_table(path)
    check_wire(wire)
    with nogil:
        table.decode[wire](<float*>dst, <const void*>src, count)


def accumulate_wire(uintptr_t dst, uintptr_t src, size_t count, int wire, int divisor=1, path=None):
    cdef const KernelTable* table = kernel_table(path)
    check_wire(wire)
    check_divisor(divisor)
    with nogil:
        table.accumulate[wire](<float*>dst, <const void*>src, count, divisor)


# Exact integer average and the half types' range check (src/engine/exact_arithmetic.h).
_INTEGER_INDEX = {4: 0, 5: 1}  # dtype code -> split/join index
_HALF_INDEX = {2: 0, 3: 1}  # dtype code -> any_nonfinite index


def split_exact(uintptr_t values, uintptr_t remainders, size_t count, int dtype, int divisor, path=None):
    """values = trunc(values / divisor) in place, remainders = what is left (int32/int64)."""
    _exact_integer_kernel(True, values, remainders, count, dtype, divisor, path)


def join_exact(uintptr_t values, uintptr_t remainders, size_t count, int dtype, int divisor, path=None):
    """values += floor(remainders / divisor) in place, wrapping (int32/int64)."""
    _exact_integer_kernel(False, values, remainders, count, dtype, divisor, path)


cdef int _exact_integer_kernel(bint split, uintptr_t values, uintptr_t remainders, size_t count, int dtype,
                               int divisor, path) except -1:
    cdef const KernelTable* table = kernel_table(path)
    if dtype not in _INTEGER_INDEX or divisor < 1:
        raise DdlfastError(f"{'split' if split else 'join'}_exact takes an integer dtype code and divisor >= 1, "
                           f"got {dtype}, {divisor}")
    cdef int index = _INTEGER_INDEX[dtype]
    with nogil:
        if split:
            table.split[index](<void*>values, <void*>remainders, count, divisor)
        else:
            table.join[index](<void*>values, <const void*>remainders, count, divisor)
    return 0


def any_nonfinite(uintptr_t values, size_t count, int dtype, path=None) -> bool:
    """Whether any of `count` float16/bfloat16 values is inf or nan."""
    cdef const KernelTable* table = kernel_table(path)
    if dtype not in _HALF_INDEX:
        raise DdlfastError(f"any_nonfinite takes a float16/bfloat16 dtype code, got {dtype}")
    cdef int index = _HALF_INDEX[dtype]
    cdef bint found
    with nogil:
        found = table.any_nonfinite[index](<const void*>values, count)
    return found


# ---------------------------------------------------------------- the ring schedule

cdef Torus _torus(dims, int rank) except *:
    cdef Torus torus
    cdef vector[int] dims_vector = to_dims(dims)
    world = 1
    for d in dims:
        world *= d
    if world > (1 << 30):
        raise DdlfastError(f"ring dims {tuple(dims)!r} describe {world} ranks, more than ddlfast supports")
    raise_on_error(Torus.make(dims_vector, world, &torus))
    if rank < 0 or rank >= world:
        raise DdlfastError(f"rank {rank} is outside a world of {world}")
    return torus


def ring_schedule(dims, int rank, size_t count, block_counts=None, direct=()):
    """The schedule of one rank as plain Python data (for tests and tools).

    Returns (phases, owned) with phases a list of dicts: kind ("reduce_scatter"
    or "allgather"), dim, successor, predecessor, steps [((send_off, send_n),
    (recv_off, recv_n)), ...], and for a direct reduce-scatter direct=True,
    coordinate, peers [rank at each coordinate] and blocks [(offset, count)
    of each coordinate's block]; owned is (offset, count). block_counts: the
    size of each torus position's owned block (summing to count); default
    the near-equal split. direct: per dimension, 1 for a direct reduce-scatter.
    """
    cdef Torus torus = _torus(dims, rank)
    cdef vector[size_t] sizes
    cdef vector[int] direct_vector = to_dims(direct)
    cdef RingSchedule schedule
    if block_counts is None:
        schedule = build_ring_schedule(torus, rank, count, direct_vector)
    else:
        for n in block_counts:
            if n < 0:
                raise DdlfastError(f"block_counts {list(block_counts)!r} holds a negative count")
            sizes.push_back(n)
        if <int>sizes.size() != torus.world_size() or sum(block_counts) != count:
            raise DdlfastError(f"block_counts {list(block_counts)!r} must give one count per position, summing "
                               f"to {count}")
        schedule = build_ring_schedule(torus, rank, sizes, direct_vector)
    phases = []
    for phase in schedule.phases:
        described = {
            "kind": "reduce_scatter" if <int>phase.kind == 0 else "allgather",
            "dim": phase.dim,
            "successor": phase.successor,
            "predecessor": phase.predecessor,
            "steps": [((s.send.offset, s.send.count), (s.recv.offset, s.recv.count)) for s in phase.steps],
        }
        if phase.direct:
            described.update(direct=True, coordinate=phase.coordinate, peers=list(phase.peers),
                             blocks=[(b.offset, b.count) for b in phase.blocks])
        phases.append(described)
    return phases, (schedule.owned.offset, schedule.owned.count)


def block_order(dims):
    """The torus positions in the order their owned blocks lie in the buffer."""
    return list(positions_in_block_order(_torus(dims, 0)))


# ---------------------------------------------------------------- the GPU executor on emulated lanes

def emulated_allreduce(Core engine not None, list pointers, list counts, int dtype, int op,
                       CallOptions options not None, bint direct=False, uint64_t seed=0) -> None:
    """The Engine's GPU ring executor over host memory on emulated lanes (work deferred and interleaved at
    random): checks the executor's ordering on machines without a GPU. Collective over the Core's ranks.
    direct: CUDA-aware transfers (MPI reads and writes device memory); the options' direct per ring dimension
    runs the direct reduce-scatter (engine/direct_phase.h)."""
    cdef vector[char*] bases
    cdef vector[size_t] sizes = to_sizes(counts)
    if len(pointers) != len(counts):
        raise DdlfastError(f"{len(pointers)} pointers but {len(counts)} counts")
    dtype_size(dtype)
    check_op(op)
    cdef CoreCpp* context = engine.get()
    for pointer in pointers:
        bases.push_back(<char*><uintptr_t>pointer)
    cdef Status status
    with nogil:
        status = emulated_device_allreduce(context[0], bases, sizes, <DType>dtype, <ReduceOp>op, options.dims,
                                           options.order, options.options, direct, seed)
    raise_on_error(status)


# ---------------------------------------------------------------- P ranks as threads of this process

_IN_PROCESS_EXECUTORS = {"host": InProcessExecutor.kHost, "device_staged": InProcessExecutor.kDeviceStaged,
                         "device_direct": InProcessExecutor.kDeviceDirect, "latency": InProcessExecutor.kLatency}


def in_process_allreduce(list arrays, int dtype, int op, CallOptions options not None, str executor="host", *,
                         double timeout_s=30.0, size_t agreement_capacity=0, digests=None, int stopped_rank=-1,
                         uint64_t seed=0) -> list:
    """One allreduce at len(arrays) ranks, each a thread of this process over the in-process transport
    (src/testing/in_process_transport.h): arrays[r] is rank r's list of contiguous arrays, reduced in place.
    executor: "host" (RingAllreduce; the options' direct runs the direct reduce-scatter), "device_staged" or
    "device_direct" (DeviceRingAllreduce on emulated lanes), "latency" (LatencyAllreduce, inside the agreement).
    Every rank first agrees on digests[r] (default: all 0). stopped_rank takes no part. Returns, per rank, None
    or the DdlfastError it raised."""
    cdef InProcessRun run
    cdef vector[vector[char*]] bases
    cdef vector[vector[size_t]] counts
    cdef vector[uint64_t] digest_vector
    cdef vector[Status] results
    cdef vector[char*] rank_bases
    cdef vector[size_t] rank_counts
    if executor not in _IN_PROCESS_EXECUTORS:
        raise DdlfastError(f"executor {executor!r} is not one of {sorted(_IN_PROCESS_EXECUTORS)}")
    run.size = len(arrays)
    if run.size < 1 or (digests is not None and len(digests) != run.size):
        raise DdlfastError(f"{run.size} ranks' arrays, digests {digests!r}")
    run.dtype = <DType>dtype
    check_op(op)
    run.op = <ReduceOp>op
    run.timeout_s = timeout_s
    run.agreement_capacity = agreement_capacity
    run.dims = options.dims
    run.order = options.order
    run.options = options.options
    run.executor = _IN_PROCESS_EXECUTORS[executor]
    run.seed = seed
    run.stopped_rank = stopped_rank
    cdef size_t element_size = dtype_size(dtype)
    for rank_arrays in arrays:
        rank_bases.clear()
        rank_counts.clear()
        for array in rank_arrays:
            if not array.flags.c_contiguous or array.itemsize != element_size:
                raise DdlfastError(f"in_process_allreduce takes contiguous arrays of {element_size}-byte elements")
            rank_bases.push_back(<char*><uintptr_t>array.ctypes.data)
            rank_counts.push_back(array.size)
        bases.push_back(rank_bases)
        counts.push_back(rank_counts)
        digest_vector.push_back(0 if digests is None else digests[len(digest_vector)])
    with nogil:
        run_in_process(run, bases, counts, digest_vector, &results)
    outcomes = []
    for rank in range(run.size):
        try:
            raise_on_error(results[rank])
            outcomes.append(None)
        except DdlfastError as error:
            outcomes.append(error)
    return outcomes
