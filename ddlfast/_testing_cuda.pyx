# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: language = c++
"""Test-only entry points of the CUDA side, built only where nvcc was found and kept out of the library
modules: the CUDA kernels one by one, their element functions run on the host (the host twins), device
memory, blocking copies and the kernel bench (src/testing/kernel_bench.h)."""

from libc.stdint cimport uintptr_t
from libc.stddef cimport size_t
from libcpp.string cimport string
from libcpp.vector cimport vector

from ddlfast._core cimport DType, Status, dtype_valid, element_size
from ddlfast._cuda cimport (
    CopySpec, DeviceAllocation, DeviceGuard, NanRule, WireType, copy_blocking, cuda_accumulate, cuda_copy_batch,
    cuda_decode, cuda_encode, cuda_reduce, cudaStream_t, host_nan_rule, host_twin_accumulate, host_twin_decode,
    host_twin_encode, host_twin_reduce,
)
from ddlfast._testing_cuda cimport KernelTiming, bench_kernel

include "_common.pxi"
include "_cuda_common.pxi"


# ---------------------------------------------------------------- memory and copies

cdef class DeviceMemory:
    """A cudaMalloc'd block on `device`, freed with the object (tests and tools)."""

    cdef DeviceAllocation buffer
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
    dtype_size(dtype)
    check_divisor(divisor)
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
    check_divisor(divisor)
    cdef Status status
    with nogil:
        status = cuda_accumulate(<WireType>wire, <float*>dst, <const void*>src, count, divisor,
                                 <cudaStream_t>stream)
    raise_on_error(status)


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
    dtype_size(dtype)
    check_divisor(divisor)
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
    check_divisor(divisor)
    cdef NanRule rule = nan_rule_of(nan_rule)
    cdef Status status
    with nogil:
        status = host_twin_accumulate(<WireType>wire, <float*>dst, <const void*>src, count, divisor, rule)
    raise_on_error(status)


def time_kernel(int device, str kernel, int dtype, size_t elements, int repeats=20):
    """(seconds per run, bytes moved per run) of one kernel on `device`; see kernel_bench.h."""
    dtype_size(dtype)
    cdef KernelTiming timing
    cdef string name = kernel.encode()
    cdef Status status
    with nogil:
        status = bench_kernel(device, name, <DType>dtype, elements, repeats, &timing)
    raise_on_error(status)
    return timing.seconds, timing.bytes_moved
