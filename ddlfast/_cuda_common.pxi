# Shared by the two CUDA modules (_cuda.pyx, _testing_cuda.pyx); the helpers of every module are in _common.pxi.
from libc.stdint cimport uintptr_t
from libc.stddef cimport size_t
from libcpp.vector cimport vector

from ddlfast._cuda cimport CopySpec

from ddlfast.errors import DdlfastError


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
