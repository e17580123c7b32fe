# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: language = c++
"""Bindings over the C++ core. Python objects are unpacked to raw pointers
here; every loop that touches data runs in C++ with the GIL released."""

from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport uint64_t, uintptr_t
from libc.stddef cimport size_t
from libcpp cimport bool
from libcpp.memory cimport unique_ptr
from libcpp.string cimport string
from libcpp.vector cimport vector
from mpi4py cimport MPI
from mpi4py.libmpi cimport MPI_COMM_NULL, MPI_Comm

from ddlfast._core cimport (
    Context, DType, ElementRange, EngineOptions, KernelTable, PhaseEvent, PhaseKind, ReduceOp, RingPhase,
    RingSchedule, RingStep, SegmentedBuffer, Status, Torus, avx2_kernels, best_kernels, build_ring_schedule,
    cuda_compiled, cuda_version_string, mpi_library_version, pack, positions_in_block_order, scalar_kernels, unpack,
)

import operator

from ddlfast import config
from ddlfast.errors import DdlfastBrokenError, DdlfastConsistentError, DdlfastError, DdlfastTimeoutError

_STATUS_TIMEOUT = 3
_STATUS_BROKEN = 5
_STATUS_CONSISTENT = 6


cdef int raise_on_error(const Status& status) except -1:
    if status.is_ok():
        return 0
    message = status.message().decode("utf-8", "replace")
    if status.code_int() == _STATUS_TIMEOUT:
        raise DdlfastTimeoutError(message)
    if status.code_int() == _STATUS_BROKEN:
        raise DdlfastBrokenError(message)
    if status.code_int() == _STATUS_CONSISTENT:
        raise DdlfastConsistentError(message)
    raise DdlfastError(message)


cdef vector[int] to_dims(dims) except *:
    cdef vector[int] result
    for d in dims:
        if type(d) is int and -(1 << 30) <= d < (1 << 30):  # the common case, without the lookups below
            result.push_back(d)
            continue
        try:
            value = operator.index(d)  # ints and NumPy integers, not floats
        except TypeError:
            value = None
        if value is None or d is True or d is False or not -(1 << 30) <= value < (1 << 30):
            raise DdlfastError(f"{d!r} in {tuple(dims)!r} is not a small integer")
        result.push_back(value)
    return result


def kernel_paths():
    """Names of the CPU kernel variants this build and CPU can run, best first."""
    cdef const KernelTable* avx2 = avx2_kernels()
    paths = []
    if avx2 != NULL:
        paths.append(avx2.name.decode())
    paths.append(scalar_kernels().name.decode())
    return paths


def selected_kernel_path():
    return best_kernels().name.decode()


cdef const KernelTable* _table(path) except NULL:
    if path is None:
        return &best_kernels()
    if path == scalar_kernels().name.decode():
        return &scalar_kernels()
    if avx2_kernels() != NULL and path == avx2_kernels().name.decode():
        return avx2_kernels()
    raise DdlfastError(f"kernel path {path!r} is not available; have {kernel_paths()}")


def reduce_into(uintptr_t dst, uintptr_t src, size_t count, int dtype, int divisor=1, path=None):
    """dst = (dst + src) / divisor over raw buffers (the unit-test entry to the kernels)."""
    cdef const KernelTable* table = _table(path)
    if dtype < 0 or dtype >= 6:
        raise DdlfastError(f"unknown dtype code {dtype}")
    if divisor < 1:
        raise DdlfastError(f"divisor must be >= 1, got {divisor}")
    with nogil:
        table.reduce[dtype](<void*>dst, <const void*>src, count, divisor)


def combine_into(uintptr_t dst, uintptr_t src, size_t count, int dtype, int op, path=None):
    """dst = op(dst, src) for op min (2), max (3) or product (4) over raw buffers (the kernels' test entry)."""
    cdef const KernelTable* table = _table(path)
    if dtype < 0 or dtype >= 6:
        raise DdlfastError(f"unknown dtype code {dtype}")
    if op < 2 or op > 4:
        raise DdlfastError(f"combine_into takes op code 2 (min), 3 (max) or 4 (product), got {op}")
    with nogil:
        table.combine.fn[op - 2][dtype](<void*>dst, <const void*>src, count)


def encode_wire(uintptr_t dst, uintptr_t src, size_t count, int wire, path=None):
    """dst (fp16/bf16 bits) = wire(src float32): the compression kernels' test entry.

    Returns how many finite inputs overflowed to inf.
    """
    cdef const KernelTable* table = _table(path)
    cdef size_t overflows
    if wire < 0 or wire > 1:
        raise DdlfastError(f"unknown wire type {wire}")
    with nogil:
        overflows = table.encode[wire](<void*>dst, <const float*>src, count)
    return overflows


def decode_wire(uintptr_t dst, uintptr_t src, size_t count, int wire, path=None):
    cdef const KernelTable* table = _table(path)
    if wire < 0 or wire > 1:
        raise DdlfastError(f"unknown wire type {wire}")
    with nogil:
        table.decode[wire](<float*>dst, <const void*>src, count)


def accumulate_wire(uintptr_t dst, uintptr_t src, size_t count, int wire, int divisor=1, path=None):
    cdef const KernelTable* table = _table(path)
    if wire < 0 or wire > 1:
        raise DdlfastError(f"unknown wire type {wire}")
    if divisor < 1:
        raise DdlfastError(f"divisor must be >= 1, got {divisor}")
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
    cdef const KernelTable* table = _table(path)
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
    cdef const KernelTable* table = _table(path)
    if dtype not in _HALF_INDEX:
        raise DdlfastError(f"any_nonfinite takes a float16/bfloat16 dtype code, got {dtype}")
    cdef int index = _HALF_INDEX[dtype]
    cdef bint found
    with nogil:
        found = table.any_nonfinite[index](<const void*>values, count)
    return found


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


def ring_schedule(dims, int rank, size_t count, block_counts=None):
    """The schedule of one rank as plain Python data (for tests and tools).

    Returns (phases, owned) with phases a list of dicts: kind ("reduce_scatter"
    or "allgather"), dim, successor, predecessor, steps [((send_off, send_n),
    (recv_off, recv_n)), ...]; owned is (offset, count). block_counts: the
    size of each torus position's owned block (summing to count); default
    the near-equal split.
    """
    cdef Torus torus = _torus(dims, rank)
    cdef vector[size_t] sizes
    cdef RingSchedule schedule
    if block_counts is None:
        schedule = build_ring_schedule(torus, rank, count)
    else:
        for n in block_counts:
            if n < 0:
                raise DdlfastError(f"block_counts {list(block_counts)!r} holds a negative count")
            sizes.push_back(n)
        if <int>sizes.size() != torus.world_size() or sum(block_counts) != count:
            raise DdlfastError(f"block_counts {list(block_counts)!r} must give one count per position, summing "
                               f"to {count}")
        schedule = build_ring_schedule(torus, rank, sizes)
    phases = []
    for phase in schedule.phases:
        phases.append({
            "kind": "reduce_scatter" if <int>phase.kind == 0 else "allgather",
            "dim": phase.dim,
            "successor": phase.successor,
            "predecessor": phase.predecessor,
            "steps": [((s.send.offset, s.send.count), (s.recv.offset, s.recv.count)) for s in phase.steps],
        })
    return phases, (schedule.owned.offset, schedule.owned.count)


def block_order(dims):
    """The torus positions in the order their owned blocks lie in the buffer."""
    return list(positions_in_block_order(_torus(dims, 0)))


def pack_arrays(uintptr_t bucket, list pointers, list nbytes):
    """Copy many buffers back to back into `bucket` (one call per bucket)."""
    cdef vector[const void*] sources
    cdef vector[size_t] sizes
    if len(pointers) != len(nbytes):
        raise DdlfastError(f"{len(pointers)} pointers but {len(nbytes)} sizes")
    for pointer, size in zip(pointers, nbytes):
        sources.push_back(<const void*><uintptr_t>pointer)
        sizes.push_back(<size_t>size)
    with nogil:
        pack(<void*>bucket, sources.data(), sizes.data(), sizes.size())


def unpack_arrays(uintptr_t bucket, list pointers, list nbytes):
    """Copy a bucket's contents back out to many buffers."""
    cdef vector[void*] targets
    cdef vector[size_t] sizes
    if len(pointers) != len(nbytes):
        raise DdlfastError(f"{len(pointers)} pointers but {len(nbytes)} sizes")
    for pointer, size in zip(pointers, nbytes):
        targets.push_back(<void*><uintptr_t>pointer)
        sizes.push_back(<size_t>size)
    with nogil:
        unpack(<const void*>bucket, targets.data(), sizes.data(), sizes.size())


cdef vector[size_t] _sizes(values) except *:
    cdef vector[size_t] result
    for value in values:
        if value < 0:
            raise DdlfastError(f"negative count {value}")
        result.push_back(<size_t>value)
    return result


cdef int _segments(list pointers, list counts, size_t element_size, unique_ptr[SegmentedBuffer]* out) except -1:
    """Raw (pointer, element count) pieces as one logical buffer."""
    cdef vector[char*] bases
    cdef vector[size_t] sizes = _sizes(counts)
    if len(pointers) != len(counts):
        raise DdlfastError(f"{len(pointers)} pointers but {len(counts)} counts")
    for pointer in pointers:
        bases.push_back(<char*><uintptr_t>pointer)
    out[0].reset(new SegmentedBuffer(bases, sizes, element_size))
    return 0


def build_facts():
    return {
        "cuda": True if cuda_compiled() else False,
        "cuda_version": cuda_version_string().decode(),
        "mpi_library": mpi_library_version().decode(),
        "kernel_paths": kernel_paths(),
        "kernel_selected": selected_kernel_path(),
    }


cdef class CoreContext:
    """Owns the C++ Context: a private duplicate of `comm` and its engines."""

    cdef unique_ptr[Context] context
    cdef vector[PhaseEvent] events
    cdef public bint record_events

    def __cinit__(self, MPI.Comm comm not None, double timeout_s=0):
        if comm.ob_mpi == MPI_COMM_NULL:
            raise DdlfastError("the communicator is MPI.COMM_NULL")
        if comm.Is_inter():
            raise DdlfastError("ddlfast needs an intracommunicator, got an intercommunicator")
        spin_us = config.spin_us()  # rank-local; read first so that a bad value fails before any collective
        cdef Status status
        cdef MPI_Comm handle = comm.ob_mpi
        with nogil:
            status = Context.create(handle, timeout_s, &self.context)
        raise_on_error(status)
        if spin_us is not None:  # else the transport's automatic choice
            self.context.get().transport().set_spin_us(spin_us)

    cdef Context* get(self) except NULL:
        if not self.context:
            raise DdlfastError("this ddlfast context is closed")
        return self.context.get()

    @property
    def rank(self) -> int:
        return self.get().rank()

    @property
    def size(self) -> int:
        return self.get().size()

    def set_timeout(self, double seconds):
        self.get().transport().set_timeout(seconds)

    @property
    def spin_us(self) -> float:
        """How long a wait for a message spins before it yields (DDLFAST_SPIN_US, or the automatic choice)."""
        return self.get().transport().spin_us()

    def agree(self, uint64_t digest) -> bool:
        """The per-call agreement (MpiTransport::agree): True when every rank passed the same digest in the
        same collective. Stall-limited; raises when the context is broken."""
        cdef bool agreed = False
        cdef Status status
        cdef Context* context = self.get()
        with nogil:
            status = context.transport().agree(digest, &agreed)
        raise_on_error(status)
        return agreed

    @property
    def sequence(self) -> int:
        """The number of the collective in progress (of the latest agreement) on this context."""
        return self.get().transport().sequence()

    def wait_requests(self, requests, what: str) -> None:
        """Complete mpi4py requests (any communicator) through the core's one stall-limited poll loop."""
        cdef MPI.Request request
        cdef Status status
        cdef Context* context = self.get()
        cdef bytes what_bytes = what.encode()
        cdef const char* what_text = what_bytes
        for item in requests:
            request = <MPI.Request?>item
            with nogil:
                status = context.transport().wait_request(&request.ob_mpi, what_text, -1)
            raise_on_error(status)

    def abandon(self, reason: str) -> None:
        """A collective failed here after it had started: refuse all later work and tell the other ranks
        (they fail at once instead of at their stall limit)."""
        cdef string text = reason.encode()
        cdef Context* context = self.get()
        with nogil:
            context.transport().abandon_and_tell(text)

    @property
    def broken(self) -> bool:
        """Whether the context refuses work (thread-safe, cheap: the latency path asks on every call)."""
        return self.get().transport().broken()

    @property
    def broken_reason(self) -> str:
        """Why the context refuses work ('' while it is healthy)."""
        return self.get().transport().broken_reason().decode("utf-8", "replace")

    def request_stop(self) -> None:
        """Thread-safe: a wait in progress on another thread gives up within a poll."""
        if self.context:
            self.context.get().transport().request_stop()

    def allreduce(self, uintptr_t data, size_t count, int dtype, int op, dims, size_t chunk_bytes,
                  int receives_in_flight, size_t small_bytes, order=(), wire=()):
        """In-place allreduce of a raw buffer; the caller validated everything.

        order: communicator rank of each torus position (empty: identity).
        wire: per ring dimension, -1 float32, 0 fp16, 1 bf16 (empty: no compression).
        """
        cdef vector[char*] bases
        cdef vector[size_t] sizes
        bases.push_back(<char*>data)
        sizes.push_back(count)
        self._run(bases, sizes, dtype, op, dims, chunk_bytes, receives_in_flight, small_bytes, order, wire)

    def allreduce_segments(self, list pointers, list counts, int dtype, int op, dims, size_t chunk_bytes,
                           int receives_in_flight, size_t small_bytes, order=(), wire=()):
        """Allreduce several same-dtype buffers as one logical buffer, each in place (no packing)."""
        cdef vector[char*] bases
        cdef vector[size_t] sizes
        if len(pointers) != len(counts):
            raise DdlfastError(f"{len(pointers)} pointers but {len(counts)} counts")
        for pointer, count in zip(pointers, counts):
            bases.push_back(<char*><uintptr_t>pointer)
            sizes.push_back(<size_t>count)
        self._run(bases, sizes, dtype, op, dims, chunk_bytes, receives_in_flight, small_bytes, order, wire)

    cdef int _options(self, dims, order, size_t chunk_bytes, int receives_in_flight, size_t small_bytes, wire,
                      vector[int]* dims_vector, vector[int]* order_vector, EngineOptions* options) except -1:
        dims_vector[0] = to_dims(dims)
        order_vector[0] = to_dims(order)
        options.chunk_bytes = chunk_bytes
        options.receives_in_flight = receives_in_flight
        options.small_bytes = small_bytes
        options.events = &self.events if self.record_events else NULL
        options.wire_by_dim = to_dims(wire)
        return 0

    cdef int _run(self, const vector[char*]& bases, const vector[size_t]& sizes, int dtype, int op, dims,
                  size_t chunk_bytes, int receives_in_flight, size_t small_bytes, order, wire) except -1:
        if dtype < 0 or dtype >= 6:
            raise DdlfastError(f"unknown dtype code {dtype}")
        if op < 0 or op >= 5:
            raise DdlfastError(f"unknown op code {op} (ddlfast/ops.py)")
        cdef size_t element_size = (4, 8, 2, 2, 4, 8)[dtype]
        cdef unique_ptr[SegmentedBuffer] data
        data.reset(new SegmentedBuffer(bases, sizes, element_size))
        cdef vector[int] dims_vector
        cdef vector[int] order_vector
        cdef EngineOptions options
        self._options(dims, order, chunk_bytes, receives_in_flight, small_bytes, wire, &dims_vector, &order_vector,
                      &options)
        cdef Status status
        cdef Context* context = self.get()
        with nogil:
            status = context.allreduce(data.get()[0], <DType>dtype, <ReduceOp>op, dims_vector, order_vector,
                                       options)
        raise_on_error(status)
        return 0

    def reduce_scatter_segments(self, list in_pointers, list in_counts, list out_pointers, list out_counts,
                                counts, int dtype, int op, dims, size_t chunk_bytes, int receives_in_flight,
                                size_t small_bytes, order=(), wire=()):
        """Reduce-scatter (RingAllreduce::reduce_scatter): the input segments hold every rank's block in rank
        order (counts[q] elements for rank q) and stay unchanged; this rank's block lands in the output
        segments. The caller validated everything."""
        if dtype < 0 or dtype >= 6:
            raise DdlfastError(f"unknown dtype code {dtype}")
        if op < 0 or op >= 5:
            raise DdlfastError(f"unknown op code {op}")
        self._half(True, in_pointers, in_counts, out_pointers, out_counts, counts, (4, 8, 2, 2, 4, 8)[dtype],
                   dtype, op, dims, chunk_bytes, receives_in_flight, small_bytes, order, wire)

    def allgather_segments(self, list in_pointers, list in_counts, list out_pointers, list out_counts, counts,
                           size_t element_size, bint float32, dims, size_t chunk_bytes, int receives_in_flight,
                           size_t small_bytes, order=(), wire=()):
        """Allgather (RingAllreduce::allgather) of elements of element_size bytes: this rank's block from the
        input segments, every rank's block (counts[q] elements) in rank order into the output segments.
        wire compresses only float32 elements."""
        if element_size == 0:
            raise DdlfastError("element_size must be at least 1")
        self._half(False, in_pointers, in_counts, out_pointers, out_counts, counts, element_size,
                   0 if float32 else -1, 0, dims, chunk_bytes, receives_in_flight, small_bytes, order, wire)

    cdef int _half(self, bint reduce, list in_pointers, list in_counts, list out_pointers, list out_counts, counts,
                   size_t element_size, int dtype, int op, dims, size_t chunk_bytes, int receives_in_flight,
                   size_t small_bytes, order, wire) except -1:
        """dtype: allgather passes 0 for float32 (the wire may compress it), -1 for opaque elements."""
        cdef unique_ptr[SegmentedBuffer] source
        cdef unique_ptr[SegmentedBuffer] target
        _segments(in_pointers, in_counts, element_size, &source)
        _segments(out_pointers, out_counts, element_size, &target)
        cdef vector[size_t] blocks = _sizes(counts)
        cdef vector[int] dims_vector
        cdef vector[int] order_vector
        cdef EngineOptions options
        self._options(dims, order, chunk_bytes, receives_in_flight, small_bytes, wire, &dims_vector, &order_vector,
                      &options)
        cdef Status status
        cdef Context* context = self.get()
        with nogil:
            if reduce:
                status = context.reduce_scatter(source.get()[0], target.get()[0], blocks, <DType>dtype,
                                                <ReduceOp>op, dims_vector, order_vector, options)
            else:
                status = context.allgather(source.get()[0], target.get()[0], blocks, dtype == 0, dims_vector,
                                           order_vector, options)
        raise_on_error(status)
        return 0

    def allreduce_array(self, array, size_t count, int dtype, int op, dims, size_t chunk_bytes,
                        int receives_in_flight, size_t small_bytes, order, uint64_t digest):
        """allreduce() for one array, with the per-call agreement on `digest` in the same call (one crossing
        into the core): the latency path.

        Returns 1 when done; 0, having sent nothing, when the ranks disagree; -1, having done nothing (not
        even the agreement), when the array does not export a writable C-contiguous buffer of whole aligned
        elements: the caller then takes the general path, which says what is wrong on every rank.
        """
        cdef Py_buffer view
        cdef vector[char*] bases
        cdef vector[size_t] sizes
        cdef bool agreed = False
        cdef Status status
        cdef Context* context = self.get()
        try:
            PyObject_GetBuffer(array, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
        except (BufferError, ValueError):  # read-only or not C-contiguous
            return -1
        try:
            if (<size_t>view.len != count * <size_t>view.itemsize
                    or (<uintptr_t>view.buf) % <uintptr_t>view.itemsize != 0):
                return -1
            with nogil:
                status = context.transport().agree(digest, &agreed)
            raise_on_error(status)
            if not agreed:
                return 0
            bases.push_back(<char*>view.buf)
            sizes.push_back(count)
            self._run(bases, sizes, dtype, op, dims, chunk_bytes, receives_in_flight, small_bytes, order, ())
        finally:
            PyBuffer_Release(&view)
        return 1

    def take_overflows(self) -> int:
        """Finite values this rank's wire encoders turned into inf since the last call."""
        return self.get().take_overflows()

    def take_events(self):
        """Phase events recorded since the last call: [(kind, dim, start_s, end_s, bytes)]."""
        names = ("reduce_scatter", "allgather", "mpi_allreduce")
        taken = [(names[e.kind], e.dim, e.start_s, e.end_s, e.bytes) for e in self.events]
        self.events.clear()
        return taken

    def close(self):
        self.context.reset()


cdef extern from *:
    """
    #ifndef DDLFAST_COMPILER
    #define DDLFAST_COMPILER "unknown"
    #endif
    static const char* ddlfast_compiler(void) { return DDLFAST_COMPILER; }
    """
    const char* ddlfast_compiler()


def compiler():
    return ddlfast_compiler().decode()
