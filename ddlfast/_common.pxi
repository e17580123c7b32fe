# Helpers every Cython module of ddlfast shares (included by _core.pyx, _cuda.pyx, _testing.pyx and
# _testing_cuda.pyx): one error path, one rule for ring dims, one way to fill EngineOptions and take events.
from libc.stddef cimport size_t
from libc.stdint cimport uintptr_t
from libcpp.memory cimport unique_ptr
from libcpp.vector cimport vector
from mpi4py cimport MPI
from mpi4py.libmpi cimport MPI_COMM_NULL

from ddlfast._core cimport EngineOptions, PhaseEvent, SegmentedBuffer, Status

import operator

from ddlfast.errors import DdlfastBrokenError, DdlfastConsistentError, DdlfastError, DdlfastTimeoutError

# StatusCode in src/common/status.h.
_STATUS_TIMEOUT = 3
_STATUS_BROKEN = 5
_STATUS_CONSISTENT = 6
_STATUS_INTERRUPTED = 7
# What a signal handler raised inside a core wait (ddlfast/_core.pyx, check_signals), raised by raise_on_error.
_raised_in_wait = []
_NUM_OPS = 5  # ReduceOp codes (ddlfast/ops.py)
_EVENT_NAMES = ("reduce_scatter", "allgather", "mpi_allreduce", "latency_allreduce")  # by EventKind


cdef int raise_on_error(const Status& status) except -1:
    """The one way a C++ Status becomes a Python exception."""
    if status.is_ok():
        return 0
    message = status.message().decode("utf-8", "replace")
    if status.code_int() == _STATUS_TIMEOUT:
        raise DdlfastTimeoutError(message)
    if status.code_int() == _STATUS_BROKEN:
        raise DdlfastBrokenError(message)
    if status.code_int() == _STATUS_CONSISTENT:
        raise DdlfastConsistentError(message)
    if status.code_int() == _STATUS_INTERRUPTED:  # the core abandoned the collective and told the other ranks
        error = _raised_in_wait.pop() if _raised_in_wait else KeyboardInterrupt()
        note = f"ddlfast: {message}; the other ranks were told, and this context refuses further work"
        if hasattr(error, "add_note"):  # Python 3.11+
            error.add_note(note)
        raise error
    raise DdlfastError(message)


cdef vector[int] to_dims(dims) except *:
    """Ring dims, rank orders and per-dimension wire codes: Python or NumPy integers below 2**30, never
    floats or bools."""
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


cdef size_t dtype_size(int dtype) except 0:
    """Bytes per element of a DType code (src/common/dtype.h); refuses unknown codes."""
    if not dtype_valid(dtype):
        raise DdlfastError(f"unknown dtype code {dtype}")
    return element_size(<DType>dtype)


cdef int check_op(int op) except -1:
    if op < 0 or op >= _NUM_OPS:
        raise DdlfastError(f"unknown op code {op} (ddlfast/ops.py)")
    return 0


cdef int check_wire(int wire) except -1:
    if wire < 0 or wire > 1:
        raise DdlfastError(f"unknown wire type {wire} (0: fp16, 1: bf16)")
    return 0


cdef int check_divisor(int divisor) except -1:
    if divisor < 1:
        raise DdlfastError(f"divisor must be >= 1, got {divisor}")
    return 0


cdef int check_comm(MPI.Comm comm) except -1:
    if comm.ob_mpi == MPI_COMM_NULL:
        raise DdlfastError("the communicator is MPI.COMM_NULL")
    if comm.Is_inter():
        raise DdlfastError("ddlfast needs an intracommunicator, got an intercommunicator")
    return 0


cdef int fill_options(EngineOptions* options, size_t chunk_bytes, int receives_in_flight, size_t small_bytes,
                      vector[PhaseEvent]* events, wire, direct=()) except -1:
    """events: where the engine records its phases (NULL: not recorded); wire: per ring dimension, -1
    float32, 0 fp16, 1 bf16 (empty: no compression); direct: per ring dimension, 1 for the direct
    reduce-scatter, 0 for the ring (empty: the ring everywhere)."""
    options.chunk_bytes = chunk_bytes
    options.receives_in_flight = receives_in_flight
    options.small_bytes = small_bytes
    options.events = events
    options.wire_by_dim = to_dims(wire)
    options.direct_by_dim = to_dims(direct)
    return 0


cdef list take_events(vector[PhaseEvent]* events):
    """The recorded phases as [(kind, dim, start_s, end_s, bytes)], clearing them."""
    taken = [(_EVENT_NAMES[<int>e.kind], e.dim, e.start_s, e.end_s, e.bytes) for e in events[0]]
    events.clear()
    return taken


cdef vector[size_t] to_sizes(values) except *:
    cdef vector[size_t] result
    for value in values:
        if value < 0:
            raise DdlfastError(f"negative count {value}")
        result.push_back(<size_t>value)
    return result


cdef int to_segments(list pointers, list counts, size_t element_size, unique_ptr[SegmentedBuffer]* out) except -1:
    """Raw (pointer, element count) pieces as one logical buffer."""
    cdef vector[char*] bases
    cdef vector[size_t] sizes = to_sizes(counts)
    if len(pointers) != len(counts):
        raise DdlfastError(f"{len(pointers)} pointers but {len(counts)} counts")
    for pointer in pointers:
        bases.push_back(<char*><uintptr_t>pointer)
    out[0].reset(new SegmentedBuffer(bases, sizes, element_size))
    return 0
