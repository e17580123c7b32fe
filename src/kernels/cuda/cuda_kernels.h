// CUDA kernels: the GPU twins of kernels/cpu/cpu_kernels.h, with the same
// semantics and the same bits (see elementwise.cuh), plus the fused copy that
// packs many arrays into a bucket in one launch.
//
// Every function enqueues work on `stream` and returns at once; the pointers
// must be device (or managed) memory of the calling thread's current device,
// aligned to their element size. 16-byte vector loads and stores are used
// wherever dst and src allow them at the same element; grids are sized from
// the device's SM count (grid-stride loops).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "common/dtype.h"
#include "common/status.h"
#include "kernels/cpu/cpu_kernels.h"
#include "common/nan_rule.h"

namespace ddlfast {

// dst[i] = (dst[i] + src[i]) / divisor.
Status cuda_reduce(DType dtype, void* dst, const void* src, std::size_t n, int divisor, cudaStream_t stream);
// dst_wire[i] = wire(src[i]), round to nearest even (compression: fp32 -> wire).
Status cuda_encode(WireType wire, void* dst_wire, const float* src, std::size_t n, cudaStream_t stream);
// dst[i] = float(src_wire[i]).
Status cuda_decode(WireType wire, float* dst, const void* src_wire, std::size_t n, cudaStream_t stream);
// dst[i] = (dst[i] + float(src_wire[i])) / divisor, accumulating in fp32.
Status cuda_accumulate(WireType wire, float* dst, const void* src_wire, std::size_t n, int divisor,
                       cudaStream_t stream);

// The same element functions run on the host, over host memory: lets
// CPU-only machines compare the kernels' arithmetic with the CPU kernels.
Status host_twin_reduce(DType dtype, void* dst, const void* src, std::size_t n, int divisor,
                        const elementwise::NanRule& rule);
Status host_twin_encode(WireType wire, void* dst_wire, const float* src, std::size_t n);
Status host_twin_decode(WireType wire, float* dst, const void* src_wire, std::size_t n);
Status host_twin_accumulate(WireType wire, float* dst, const void* src_wire, std::size_t n, int divisor,
                            const elementwise::NanRule& rule);

// One copy of a fused pack or unpack.
struct CopySpec {
  void* dst;
  const void* src;
  std::size_t bytes;
};

// All copies in one launch per kCopyBatch specs (the pointer table travels
// as the kernel's parameter, so no table upload is needed): pack is
// {bucket + offset_i <- array_i}, unpack the reverse.
constexpr std::size_t kCopyBatch = 128;
Status cuda_copy_batch(const CopySpec* specs, std::size_t count, cudaStream_t stream);

}  // namespace ddlfast
