# C++ declarations of the CUDA-only test code (src/testing/kernel_bench.h), linked into ddlfast._testing_cuda only.
from libc.stddef cimport size_t
from libcpp.string cimport string

from ddlfast._core cimport DType, Status


cdef extern from "testing/kernel_bench.h" namespace "ddlfast" nogil:
    cdef struct KernelTiming:
        double seconds
        size_t bytes_moved
    Status bench_kernel(int device, const string& kernel, DType dtype, size_t elements, int repeats,
                        KernelTiming* out)
