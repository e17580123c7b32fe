# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: language = c++
"""Bindings over the CUDA side of the core (built only where nvcc was found):
device facts, the CUDA kernels and their host twins, fences, pinned and
device memory, and CudaContext, which runs collectives on device memory.
Pointers and streams arrive as integers; ddlfast/cuda.py adapts user arrays
to them. Every call into CUDA returns a Status, raised here as DdlfastError."""

from cpython.buffer cimport PyBuffer_FillInfo
from libc.stdint cimport uint64_t, uintptr_t
from libc.stddef cimport size_t
from libcpp cimport bool
from libcpp.memory cimport unique_ptr
from libcpp.string cimport string
from libcpp.vector cimport vector
from mpi4py cimport MPI
from mpi4py.libmpi cimport MPI_COMM_NULL

from ddlfast._core cimport (
    DType, EngineOptions, PhaseEvent, ReduceOp, SegmentedBuffer, Status, cuda_version_string,
)
from ddlfast._cuda cimport (
    CopySpec, CudaContext, DeviceBuffer, DeviceGuard, DeviceTransfer, Fence, KernelTiming, MemoryKind, NanRule,
    PinnedBuffer, WireType, bench_kernel, copy_blocking, cuda_accumulate, cuda_copy_batch, cuda_decode,
    cuda_device_count, cuda_encode, cuda_reduce, cudaStream_t, emulated_device_allreduce, host_nan_rule,
    host_twin_accumulate, host_twin_decode, host_twin_encode, host_twin_reduce, mpi_cuda_aware, pointer_location,
    stream_device,
)

import operator

from ddlfast.errors import DdlfastError, DdlfastTimeoutError

_STATUS_TIMEOUT = 3
_MEMORY_KINDS = ("host (unregistered)", "host (pinned)", "device", "managed")
_ELEMENT_SIZES = (4, 8, 2, 2, 4, 8)


cdef int raise_on_error(const Status& status) except -1:
    if status.is_ok():
        return 0
    message = status.message().decode("utf-8", "replace")
    if status.code_int() == _STATUS_TIMEOUT:
        raise DdlfastTimeoutError(message)
    raise DdlfastError(message)


cdef vector[int] int_vector(values) except *:
    cdef vector[int] result
    for value in values:
        result.push_back(operator.index(value))
    return result


cdef int check_dtype(int dtype) except -1:
    if dtype < 0 or dtype >= 6:
        raise DdlfastError(f"unknown dtype code {dtype}")
    return 0


cdef int check_wire(int wire) except -1:
    if wire < 0 or wire > 1:
        raise DdlfastError(f"unknown wire type {wire} (0: fp16, 1: bf16)")
    return 0


# ---------------------------------------------------------------- device facts

def device_count() -> int:
    """CUDA devices visible to this process; 0 (never an error) when there are none."""
    return cuda_device_count(NULL)


def no_device_reason() -> str:
    """Why device_count() is 0 ("" when there are devices)."""
    cdef string why
    if cuda_device_count(&why) > 0:
        return ""
    return why.decode("utf-8", "replace")


def runtime_version() -> str:
    return cuda_version_string().decode()


def mpi_cuda_support():
    """(supported, how): whether MPI reports CUDA-aware transfers at run time, and the query used."""
    cdef string how
    cdef bool supported = mpi_cuda_aware(&how)
    return True if supported else False, how.decode()


def locate_pointer(uintptr_t pointer):
    """(kind, device) of an address: kind is "device", "managed", "host (pinned)" or "host (unregistered)"."""
    cdef MemoryKind kind
    cdef int device = -1
    cdef Status status
    with nogil:
        status = pointer_location(<const void*>pointer, &kind, &device)
    raise_on_error(status)
    return _MEMORY_KINDS[<int>kind], device


def device_of_stream(uintptr_t stream) -> int:
    """The device a stream belongs to; -1 for the default streams (0, 1 legacy, 2 per-thread)."""
    cdef int device = -1
    cdef Status status
    with nogil:
        status = stream_device(<cudaStream_t>stream, &device)
    raise_on_error(status)
    return device


def nan_rule():
    """(float32 bits, float64 bits) of this CPU's NaN for an invalid operation, as the kernels reproduce it."""
    cdef NanRule rule = host_nan_rule()
    return rule.default_nan32, rule.default_nan64


def copy(uintptr_t dst, uintptr_t src, size_t nbytes):
    """Blocking copy between any two of host and device memory (tests and tools)."""
    cdef Status status
    with nogil:
        status = copy_blocking(<void*>dst, <const void*>src, nbytes)
    raise_on_error(status)


# ---------------------------------------------------------------- kernels

def reduce(uintptr_t dst, uintptr_t src, size_t count, int dtype, int divisor=1, uintptr_t stream=0):
    """dst = (dst + src) / divisor on device memory, enqueued on `stream` of the current device."""
    check_dtype(dtype)
    if divisor < 1:
        raise DdlfastError(f"divisor must be >= 1, got {divisor}")
    cdef Status status
    with nogil:
        status = cuda_reduce(<DType>dtype, <void*>dst, <const void*>src, count, divisor, <cudaStream_t>stream)
    raise_on_error(status)


def encode(uintptr_t dst, uintptr_t src, size_t count, int wire, uintptr_t stream=0):
    """dst (fp16/bf16 bits) = wire(src float32) on the device."""
    check_wire(wire)
    cdef Status status
    with nogil:
        status = cuda_encode(<WireType>wire, <void*>dst, <const float*>src, count, <cudaStream_t>stream)
    raise_on_error(status)


def decode(uintptr_t dst, uintptr_t src, size_t count, int wire, uintptr_t stream=0):
    check_wire(wire)
    cdef Status status
    with nogil:
        status = cuda_decode(<WireType>wire, <float*>dst, <const void*>src, count, <cudaStream_t>stream)
    raise_on_error(status)


def accumulate(uintptr_t dst, uintptr_t src, size_t count, int wire, int divisor=1, uintptr_t stream=0):
    """dst_f32 = (dst_f32 + float(src_wire)) / divisor on the device."""
    check_wire(wire)
    if divisor < 1:
        raise DdlfastError(f"divisor must be >= 1, got {divisor}")
    cdef Status status
    with nogil:
        status = cuda_accumulate(<WireType>wire, <float*>dst, <const void*>src, count, divisor,
                                 <cudaStream_t>stream)
    raise_on_error(status)


cdef vector[CopySpec] copy_specs(list dsts, list srcs, list sizes) except *:
    cdef vector[CopySpec] specs
    cdef CopySpec spec
    if not len(dsts) == len(srcs) == len(sizes):
        raise DdlfastError(f"{len(dsts)} destinations, {len(srcs)} sources and {len(sizes)} sizes")
    for dst, src, size in zip(dsts, srcs, sizes):
        spec.dst = <void*><uintptr_t>dst
        spec.src = <const void*><uintptr_t>src
        spec.bytes = <size_t>size
        specs.push_back(spec)
    return specs


def copy_batch(list dsts, list srcs, list sizes, uintptr_t stream=0):
    """Many device copies in one launch (the fused pack/unpack kernel)."""
    cdef vector[CopySpec] specs = copy_specs(dsts, srcs, sizes)
    cdef Status status
    with nogil:
        status = cuda_copy_batch(specs.data(), specs.size(), <cudaStream_t>stream)
    raise_on_error(status)


cdef NanRule nan_rule_of(nan_rule) except *:
    cdef NanRule rule = host_nan_rule()
    if nan_rule is not None:
        rule.default_nan32, rule.default_nan64 = nan_rule
    return rule


def host_reduce(uintptr_t dst, uintptr_t src, size_t count, int dtype, int divisor=1, nan_rule=None):
    """The reduce kernel's element function run on the host, over host memory.

    nan_rule: (float32 bits, float64 bits) for invalid operations; default this CPU's.
    """
    check_dtype(dtype)
    if divisor < 1:
        raise DdlfastError(f"divisor must be >= 1, got {divisor}")
    cdef NanRule rule = nan_rule_of(nan_rule)
    cdef Status status
    with nogil:
        status = host_twin_reduce(<DType>dtype, <void*>dst, <const void*>src, count, divisor, rule)
    raise_on_error(status)


def host_encode(uintptr_t dst, uintptr_t src, size_t count, int wire):
    check_wire(wire)
    cdef Status status
    with nogil:
        status = host_twin_encode(<WireType>wire, <void*>dst, <const float*>src, count)
    raise_on_error(status)


def host_decode(uintptr_t dst, uintptr_t src, size_t count, int wire):
    check_wire(wire)
    cdef Status status
    with nogil:
        status = host_twin_decode(<WireType>wire, <float*>dst, <const void*>src, count)
    raise_on_error(status)


def host_accumulate(uintptr_t dst, uintptr_t src, size_t count, int wire, int divisor=1, nan_rule=None):
    check_wire(wire)
    if divisor < 1:
        raise DdlfastError(f"divisor must be >= 1, got {divisor}")
    cdef NanRule rule = nan_rule_of(nan_rule)
    cdef Status status
    with nogil:
        status = host_twin_accumulate(<WireType>wire, <float*>dst, <const void*>src, count, divisor, rule)
    raise_on_error(status)


def time_kernel(int device, str kernel, int dtype, size_t elements, int repeats=20):
    """(seconds per run, bytes moved per run) of one kernel on `device`; see kernel_bench.h."""
    check_dtype(dtype)
    cdef KernelTiming timing
    cdef string name = kernel.encode()
    cdef Status status
    with nogil:
        status = bench_kernel(device, name, <DType>dtype, elements, repeats, &timing)
    raise_on_error(status)
    return timing.seconds, timing.bytes_moved


# ---------------------------------------------------------------- memory

cdef class DeviceMemory:
    """A cudaMalloc'd block on `device`, freed with the object (tests and tools)."""

    cdef DeviceBuffer buffer
    cdef readonly int device

    def __cinit__(self, size_t nbytes, int device=0):
        cdef DeviceGuard guard
        cdef Status status
        self.device = device
        with nogil:
            status = guard.set(device)
            if status.is_ok():
                status = self.buffer.allocate(nbytes, NULL, False)
        raise_on_error(status)

    @property
    def pointer(self) -> int:
        return <uintptr_t>self.buffer.data()

    @property
    def nbytes(self) -> int:
        return self.buffer.bytes()


cdef class PinnedMemory:
    """Page-locked host memory exporting the buffer protocol (np.frombuffer works on it)."""

    cdef PinnedBuffer buffer

    def __cinit__(self, size_t nbytes):
        cdef Status status
        with nogil:
            status = self.buffer.allocate(nbytes)
        raise_on_error(status)

    @property
    def pointer(self) -> int:
        return <uintptr_t>self.buffer.data()

    @property
    def nbytes(self) -> int:
        return self.buffer.bytes()

    def __getbuffer__(self, Py_buffer* view, int flags):
        PyBuffer_FillInfo(view, self, <void*>self.buffer.data(), self.buffer.bytes(), 0, flags)

    def __releasebuffer__(self, Py_buffer* view):
        pass


# ---------------------------------------------------------------- fences

cdef class StreamFence:
    """A point in a CUDA stream (an event), recorded by `StreamFence.record(device, stream)`."""

    cdef unique_ptr[Fence] fence

    def __cinit__(self):
        self.fence.reset(new Fence())

    @staticmethod
    def record(int device, uintptr_t stream) -> StreamFence:
        """Record now on `stream` (0/1: legacy default, 2: per-thread default) of `device`."""
        cdef StreamFence result = StreamFence()
        cdef Status status
        with nogil:
            status = result.fence.get().record(device, <cudaStream_t>stream)
        raise_on_error(status)
        return result

    @property
    def device(self) -> int:
        return self.fence.get().device()

    def make_wait(self, uintptr_t stream) -> None:
        """Later work on `stream` waits for this fence; the host does not."""
        cdef Status status
        with nogil:
            status = self.fence.get().make_wait(<cudaStream_t>stream)
        raise_on_error(status)

    def synchronize(self) -> None:
        """The host waits for this fence (that point of that stream only)."""
        cdef Status status
        with nogil:
            status = self.fence.get().synchronize()
        raise_on_error(status)

    def done(self) -> bool:
        cdef bool finished = True
        cdef Status status = self.fence.get().query(&finished)
        raise_on_error(status)
        return True if finished else False


# ---------------------------------------------------------------- the context

cdef class GpuContext:
    """The GPU side of a ddlfast context: a private duplicate of `comm` and per-device streams, staging
    slots, fused buckets and ring executors. Creating it is collective over `comm`."""

    cdef unique_ptr[CudaContext] context
    cdef vector[PhaseEvent] events
    cdef public bint record_events

    def __cinit__(self, MPI.Comm comm not None, double timeout_s=0.0):
        if comm.ob_mpi == MPI_COMM_NULL:
            raise DdlfastError("the communicator is MPI.COMM_NULL")
        if comm.Is_inter():
            raise DdlfastError("ddlfast needs an intracommunicator, got an intercommunicator")
        cdef Status status
        with nogil:
            status = CudaContext.create(comm.ob_mpi, timeout_s, &self.context)
        raise_on_error(status)

    cdef CudaContext* get(self) except NULL:
        if not self.context:
            raise DdlfastError("this ddlfast context is closed")
        return self.context.get()

    @property
    def rank(self) -> int:
        return self.get().rank()

    @property
    def size(self) -> int:
        return self.get().size()

    def set_timeout(self, double seconds) -> None:
        self.get().set_timeout(seconds)

    def wait_for(self, int device, StreamFence fence not None) -> None:
        """ddlfast's work on `device` enqueued from now on waits for `fence`."""
        cdef CudaContext* context = self.get()
        cdef Status status
        with nogil:
            status = context.wait_for(device, fence.fence.get()[0])
        raise_on_error(status)

    def bucket(self, int device, int dtype, size_t nbytes) -> int:
        """Address of the persistent fused bucket for `dtype` on `device` (at least nbytes)."""
        check_dtype(dtype)
        cdef CudaContext* context = self.get()
        cdef char* data = NULL
        cdef Status status
        with nogil:
            status = context.bucket(device, <DType>dtype, nbytes, &data)
        raise_on_error(status)
        return <uintptr_t>data

    def copy_batch(self, int device, list dsts, list srcs, list sizes) -> None:
        """Fused pack/unpack on ddlfast's stream."""
        cdef vector[CopySpec] specs = copy_specs(dsts, srcs, sizes)
        cdef CudaContext* context = self.get()
        cdef Status status
        with nogil:
            status = context.copy_batch(device, specs)
        raise_on_error(status)

    def copy(self, int device, uintptr_t dst, uintptr_t src, size_t nbytes) -> None:
        """One asynchronous copy (any direction) on ddlfast's stream."""
        cdef CudaContext* context = self.get()
        cdef Status status
        with nogil:
            status = context.copy(device, <void*>dst, <const void*>src, nbytes)
        raise_on_error(status)

    def allreduce_segments(self, int device, list pointers, list counts, int dtype, int op, dims, size_t chunk_bytes,
                           int receives_in_flight, size_t small_bytes, order=(), bint direct=False) -> None:
        """In-place allreduce of device buffers on `device`, treated as one logical buffer."""
        cdef vector[char*] bases
        cdef vector[size_t] sizes
        if len(pointers) != len(counts):
            raise DdlfastError(f"{len(pointers)} pointers but {len(counts)} counts")
        check_dtype(dtype)
        for pointer, count in zip(pointers, counts):
            bases.push_back(<char*><uintptr_t>pointer)
            sizes.push_back(<size_t>count)
        cdef unique_ptr[SegmentedBuffer] data
        data.reset(new SegmentedBuffer(bases, sizes, _ELEMENT_SIZES[dtype]))
        cdef vector[int] dims_vector = int_vector(dims)
        cdef vector[int] order_vector = int_vector(order)
        cdef EngineOptions options
        options.chunk_bytes = chunk_bytes
        options.receives_in_flight = receives_in_flight
        options.small_bytes = small_bytes
        options.events = &self.events if self.record_events else NULL
        cdef DeviceTransfer transfer = <DeviceTransfer>(1 if direct else 0)
        cdef CudaContext* context = self.get()
        cdef Status status
        with nogil:
            status = context.allreduce(device, data.get()[0], <DType>dtype, <ReduceOp>op, dims_vector, order_vector,
                                       options, transfer)
        raise_on_error(status)

    def record(self, int device) -> StreamFence:
        """A fence after all work ddlfast has enqueued on `device` so far."""
        cdef StreamFence done = StreamFence()
        cdef CudaContext* context = self.get()
        cdef Status status
        with nogil:
            status = context.record(device, done.fence.get())
        raise_on_error(status)
        return done

    def synchronize(self, int device) -> None:
        """The host waits for ddlfast's streams on `device` (not for the whole device)."""
        cdef CudaContext* context = self.get()
        cdef Status status
        with nogil:
            status = context.synchronize(device)
        raise_on_error(status)

    def stream(self, int device) -> int:
        """ddlfast's stream on `device` (its cudaStream_t as an integer)."""
        cdef CudaContext* context = self.get()
        cdef cudaStream_t handle = NULL
        cdef Status status
        with nogil:
            status = context.stream(device, &handle)
        raise_on_error(status)
        return <uintptr_t>handle

    def take_events(self):
        """Phase events recorded since the last call: [(kind, dim, start_s, end_s, bytes)]."""
        names = ("reduce_scatter", "allgather", "mpi_allreduce")
        taken = [(names[e.kind], e.dim, e.start_s, e.end_s, e.bytes) for e in self.events]
        self.events.clear()
        return taken

    def close(self) -> None:
        self.context.reset()


def emulated_allreduce(MPI.Comm comm not None, list pointers, list counts, int dtype, int op, dims,
                       size_t chunk_bytes, int receives_in_flight, size_t small_bytes, order=(), bint direct=False,
                       uint64_t seed=0, double timeout_s=0.0) -> None:
    """The GPU ring executor over host memory on emulated lanes (work deferred and interleaved at random):
    checks the executor's ordering on machines without a GPU. Collective over `comm`."""
    cdef vector[char*] bases
    cdef vector[size_t] sizes
    if len(pointers) != len(counts):
        raise DdlfastError(f"{len(pointers)} pointers but {len(counts)} counts")
    check_dtype(dtype)
    for pointer, count in zip(pointers, counts):
        bases.push_back(<char*><uintptr_t>pointer)
        sizes.push_back(<size_t>count)
    cdef vector[int] dims_vector = int_vector(dims)
    cdef vector[int] order_vector = int_vector(order)
    cdef EngineOptions options
    options.chunk_bytes = chunk_bytes
    options.receives_in_flight = receives_in_flight
    options.small_bytes = small_bytes
    options.events = NULL
    cdef Status status
    with nogil:
        status = emulated_device_allreduce(comm.ob_mpi, bases, sizes, <DType>dtype, <ReduceOp>op, dims_vector,
                                           order_vector, options, direct, seed, timeout_s)
    raise_on_error(status)
