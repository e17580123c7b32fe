# C++ declarations of the test-only code (src/testing), linked into ddlfast._testing only.
from libc.stddef cimport size_t
from libc.stdint cimport uint64_t
from libcpp cimport bool
from libcpp.vector cimport vector
from ddlfast._core cimport CoreCpp, DType, EngineOptions, ReduceOp, Status


cdef extern from "testing/emulated_lanes.h" namespace "ddlfast" nogil:
    Status emulated_device_allreduce(CoreCpp& context, const vector[char*]& bases, const vector[size_t]& counts,
                                     DType dtype, ReduceOp op, const vector[int]& dims, const vector[int]& order,
                                     const EngineOptions& options, bool direct, uint64_t seed)


cdef extern from "testing/in_process_ranks.h" namespace "ddlfast" nogil:
    cdef enum class InProcessExecutor(int):
        kHost
        kDeviceStaged
        kDeviceDirect
        kLatency
    cdef struct InProcessRun:
        int size
        double timeout_s
        size_t agreement_capacity
        vector[int] dims
        vector[int] order
        DType dtype
        ReduceOp op
        EngineOptions options
        InProcessExecutor executor
        uint64_t seed
        int stopped_rank
    void in_process_allreduce(const InProcessRun& run, const vector[vector[char*]]& bases,
                              const vector[vector[size_t]]& counts, const vector[uint64_t]& digests,
                              vector[Status]* results)
