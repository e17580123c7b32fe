# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: language = c++
"""Bindings over the CUDA side of the core (built only where nvcc was found):
device facts, fences, pinned memory, and DeviceCore, which runs collectives on
device memory. Pointers and streams arrive as integers; ddlfast/buffers/device.py adapts
user arrays to them. Every call into CUDA returns a Status, raised here as
DdlfastError. The test-only entries (kernels one by one, device memory, the
host twins, the kernel bench) are in ddlfast._testing_cuda."""

from cpython.buffer cimport PyBuffer_FillInfo
from libc.stdint cimport uintptr_t
from libc.stddef cimport size_t
from libcpp cimport bool
from libcpp.memory cimport unique_ptr
from libcpp.string cimport string
from libcpp.vector cimport vector
from mpi4py cimport MPI

from ddlfast._core cimport (
    CallOptions, DType, Core, EngineOptions, PhaseEvent, ReduceOp, SegmentedBuffer, Status, cuda_version_string,
    dtype_valid,
    element_size,
)
from ddlfast._cuda cimport (
    CopySpec, DeviceRuntime, DeviceTransfer, Fence, MemoryKind, PinnedBuffer, cuda_device_count, cudaStream_t,
    mpi_cuda_aware, pointer_location, stream_device,
)

include "_common.pxi"
include "_cuda_common.pxi"

_MEMORY_KINDS = ("host (unregistered)", "host (pinned)", "device", "managed")


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


# ---------------------------------------------------------------- memory

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

cdef class DeviceCore:
    """The GPU side of a ddlfast Core: per-device streams, staging slots and fused buckets; its collectives
    run on the Core's one transport with the Core's GPU ring executors. Not collective to create."""

    cdef unique_ptr[DeviceRuntime] runtime
    cdef Core engine  # the runtime borrows its C++ context: keep it alive
    cdef vector[PhaseEvent] events
    cdef public bint record_events

    def __cinit__(self, Core engine not None):
        self.runtime.reset(new DeviceRuntime(engine.get()[0]))
        self.engine = engine

    cdef DeviceRuntime* get(self) except NULL:
        if not self.runtime:
            raise DdlfastError("this ddlfast context is closed")
        engine = self.engine
        engine.get()  # raises when the Core was closed
        return self.runtime.get()

    def set_timeout(self, double seconds) -> None:
        self.engine.set_timeout(seconds)

    def wait_for(self, int device, StreamFence fence not None) -> None:
        """ddlfast's work on `device` enqueued from now on waits for `fence`."""
        cdef DeviceRuntime* context = self.get()
        cdef Status status
        with nogil:
            status = context.wait_for(device, fence.fence.get()[0])
        raise_on_error(status)

    def bucket(self, int device, int dtype, size_t nbytes) -> int:
        """Address of the persistent fused bucket for `dtype` on `device` (at least nbytes)."""
        dtype_size(dtype)
        cdef DeviceRuntime* context = self.get()
        cdef char* data = NULL
        cdef Status status
        with nogil:
            status = context.bucket(device, <DType>dtype, nbytes, &data)
        raise_on_error(status)
        return <uintptr_t>data

    def copy_batch(self, int device, list dsts, list srcs, list sizes) -> None:
        """Fused pack/unpack on ddlfast's stream."""
        cdef vector[CopySpec] specs = copy_specs(dsts, srcs, sizes)
        cdef DeviceRuntime* context = self.get()
        cdef Status status
        with nogil:
            status = context.copy_batch(device, specs)
        raise_on_error(status)

    def copy(self, int device, uintptr_t dst, uintptr_t src, size_t nbytes) -> None:
        """One asynchronous copy (any direction) on ddlfast's stream."""
        cdef DeviceRuntime* context = self.get()
        cdef Status status
        with nogil:
            status = context.copy(device, <void*>dst, <const void*>src, nbytes)
        raise_on_error(status)

    def allreduce_segments(self, int device, list pointers, list counts, int dtype, int op,
                           CallOptions options not None, bint direct=False) -> None:
        """In-place allreduce of device buffers on `device`, treated as one logical buffer. direct: CUDA-aware
        transfers (MPI reads and writes device memory)."""
        cdef unique_ptr[SegmentedBuffer] data
        to_segments(pointers, counts, dtype_size(dtype), &data)
        check_op(op)
        cdef EngineOptions engine_options = options.options
        engine_options.events = &self.events if self.record_events else NULL
        cdef DeviceTransfer transfer = <DeviceTransfer>(1 if direct else 0)
        cdef DeviceRuntime* context = self.get()
        cdef Status status
        with nogil:
            status = context.allreduce(device, data.get()[0], <DType>dtype, <ReduceOp>op, options.dims, options.order,
                                       engine_options, transfer)
        raise_on_error(status)

    def record(self, int device) -> StreamFence:
        """A fence after all work ddlfast has enqueued on `device` so far."""
        cdef StreamFence done = StreamFence()
        cdef DeviceRuntime* context = self.get()
        cdef Status status
        with nogil:
            status = context.record(device, done.fence.get())
        raise_on_error(status)
        return done

    def synchronize(self, int device) -> None:
        """The host waits for ddlfast's streams on `device` (not for the whole device)."""
        cdef DeviceRuntime* context = self.get()
        cdef Status status
        with nogil:
            status = context.synchronize(device)
        raise_on_error(status)

    def stream(self, int device) -> int:
        """ddlfast's stream on `device` (its cudaStream_t as an integer)."""
        cdef DeviceRuntime* context = self.get()
        cdef cudaStream_t handle = NULL
        cdef Status status
        with nogil:
            status = context.stream(device, &handle)
        raise_on_error(status)
        return <uintptr_t>handle

    def take_events(self):
        """Phase events recorded since the last call: [(kind, dim, start_s, end_s, bytes)]."""
        return take_events(&self.events)

    def close(self) -> None:
        self.runtime.reset()
