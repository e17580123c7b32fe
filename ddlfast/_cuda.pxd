# C++ declarations of the CUDA side of the core (src/common/cuda, src/kernels/cuda,
# src/engine/cuda), in one place; the shared core types come from _core.pxd.
# Used only by the modules built with CUDA (_cuda, _testing_cuda).
from libc.stddef cimport size_t
from libc.stdint cimport uint32_t, uint64_t
from libcpp cimport bool
from libcpp.string cimport string
from libcpp.vector cimport vector

from ddlfast._core cimport CoreCpp, DType, EngineOptions, ReduceOp, SegmentedBuffer, Status


cdef extern from "cuda_runtime_api.h" nogil:
    # Opaque handles: only ever cast from and to integers here.
    ctypedef void* cudaStream_t


cdef extern from "kernels/cpu/cpu_kernels.h" namespace "ddlfast" nogil:
    cdef enum class WireType(int):
        pass


cdef extern from "common/nan_rule.h" namespace "ddlfast::elementwise" nogil:
    cdef struct NanRule:
        uint32_t default_nan32
        uint64_t default_nan64


cdef extern from "common/cuda/cuda_device.h" namespace "ddlfast" nogil:
    cdef enum class MemoryKind(int):
        pass
    int cuda_device_count(string* why_none)
    Status pointer_location(const void* pointer, MemoryKind* kind, int* device)
    Status stream_device(cudaStream_t stream, int* device)
    Status copy_blocking(void* dst, const void* src, size_t nbytes)
    NanRule host_nan_rule()


cdef extern from "common/cuda/cuda_resources.h" namespace "ddlfast" nogil:
    cdef cppclass DeviceGuard:
        Status set(int device)
    cdef cppclass DeviceAllocation:
        Status allocate(size_t nbytes, cudaStream_t stream, bool pooled)
        char* data()
        size_t bytes()
    cdef cppclass PinnedBuffer:
        Status allocate(size_t nbytes)
        char* data()
        size_t bytes()


cdef extern from "kernels/cuda/cuda_kernels.h" namespace "ddlfast" nogil:
    Status cuda_reduce(DType dtype, void* dst, const void* src, size_t n, int divisor, cudaStream_t stream)
    Status cuda_encode(WireType wire, void* dst_wire, const float* src, size_t n, cudaStream_t stream)
    Status cuda_decode(WireType wire, float* dst, const void* src_wire, size_t n, cudaStream_t stream)
    Status cuda_accumulate(WireType wire, float* dst, const void* src_wire, size_t n, int divisor,
                           cudaStream_t stream)
    Status host_twin_reduce(DType dtype, void* dst, const void* src, size_t n, int divisor, const NanRule& rule)
    Status host_twin_encode(WireType wire, void* dst_wire, const float* src, size_t n)
    Status host_twin_decode(WireType wire, float* dst, const void* src_wire, size_t n)
    Status host_twin_accumulate(WireType wire, float* dst, const void* src_wire, size_t n, int divisor,
                                const NanRule& rule)
    cdef struct CopySpec:
        void* dst
        const void* src
        size_t bytes
    Status cuda_copy_batch(const CopySpec* specs, size_t count, cudaStream_t stream)


cdef extern from "engine/cuda/fence.h" namespace "ddlfast" nogil:
    cdef cppclass Fence:
        Status record(int device, cudaStream_t stream)
        Status make_wait(cudaStream_t stream)
        Status synchronize()
        Status query(bool* done)
        int device()


cdef extern from "engine/device_ring_allreduce.h" namespace "ddlfast" nogil:
    cdef enum class DeviceTransfer(int):
        pass


cdef extern from "engine/cuda/device_runtime.h" namespace "ddlfast" nogil:
    bool mpi_cuda_aware(string* how)
    cdef cppclass DeviceRuntime:
        DeviceRuntime(CoreCpp& context)
        Status wait_for(int device, const Fence& fence)
        Status bucket(int device, DType dtype, size_t nbytes, char** out)
        Status copy_batch(int device, const vector[CopySpec]& specs)
        Status copy(int device, void* dst, const void* src, size_t nbytes)
        Status allreduce(int device, const SegmentedBuffer& data, DType dtype, ReduceOp op, const vector[int]& dims,
                         const vector[int]& order, const EngineOptions& options, DeviceTransfer transfer)
        Status record(int device, Fence* done)
        Status synchronize(int device)
        Status stream(int device, cudaStream_t* out)
