// Reduce and cast kernels: one grid-stride kernel template over the element
// operations of elementwise.cuh. Each thread moves one 16-byte vector of the
// wider operand per iteration (8-byte of the narrower one for the casts);
// the few elements before the first aligned vector and after the last are
// done one by one by the same grid.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/cuda/cuda_check.h"
#include "common/cuda/cuda_device.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/elementwise.cuh"

namespace ddlfast {
namespace {

using namespace elementwise;  // NOLINT: this file's vocabulary

constexpr int kThreads = 256;

template <std::size_t Bytes> struct VectorOf;
template <> struct VectorOf<16> { using type = uint4; };
template <> struct VectorOf<8> { using type = uint2; };

// Elements per thread and iteration: one 16-byte vector of the wider type.
template <typename D, typename S>
struct Group {
  static constexpr std::size_t kWide = sizeof(D) > sizeof(S) ? sizeof(D) : sizeof(S);
  static constexpr std::size_t kElements = 16 / kWide;
  using DstVector = typename VectorOf<kElements * sizeof(D)>::type;
  using SrcVector = typename VectorOf<kElements * sizeof(S)>::type;
};

template <typename V, typename T, std::size_t N>
union Lanes {
  V vector;
  T element[N];
};

template <typename D, typename S, typename Op>
__global__ void __launch_bounds__(kThreads)
    elementwise_kernel(D* __restrict__ dst, const S* __restrict__ src, std::size_t n, std::size_t head,
                       std::size_t groups, Op op) {
  using G = Group<D, S>;
  constexpr std::size_t kN = G::kElements;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  auto* dst_vectors = reinterpret_cast<typename G::DstVector*>(dst + head);
  const auto* src_vectors = reinterpret_cast<const typename G::SrcVector*>(src + head);
  for (std::size_t i = first; i < groups; i += stride) {
    Lanes<typename G::DstVector, D, kN> d;
    Lanes<typename G::SrcVector, S, kN> s;
    s.vector = src_vectors[i];
    if (Op::kReadsDst) d.vector = dst_vectors[i];
#pragma unroll
    for (std::size_t k = 0; k < kN; ++k) d.element[k] = op(Op::kReadsDst ? d.element[k] : D(), s.element[k]);
    dst_vectors[i] = d.vector;
  }
  // The unaligned head [0, head) and the tail after the last whole vector.
  const std::size_t tail = head + groups * kN;
  const std::size_t loose = head + (n - tail);
  for (std::size_t i = first; i < loose; i += stride) {
    const std::size_t e = i < head ? i : tail + (i - head);
    dst[e] = op(Op::kReadsDst ? dst[e] : D(), src[e]);
  }
}

template <typename D, typename S, typename Op>
Status launch(D* dst, const S* src, std::size_t n, Op op, cudaStream_t stream, const char* what) {
  if (n == 0) return Status::ok();
  const auto dst_address = reinterpret_cast<std::uintptr_t>(dst);
  const auto src_address = reinterpret_cast<std::uintptr_t>(src);
  if (dst_address % alignof(D) != 0 || src_address % alignof(S) != 0) {
    return Status::invalid(std::string(what) + ": pointers must be aligned to their element size");
  }
  using G = Group<D, S>;
  constexpr std::size_t kDstBytes = G::kElements * sizeof(D);
  constexpr std::size_t kSrcBytes = G::kElements * sizeof(S);
  std::size_t head = ((kDstBytes - dst_address % kDstBytes) % kDstBytes) / sizeof(D);
  std::size_t groups = 0;
  if (head < n && (src_address + head * sizeof(S)) % kSrcBytes == 0) {
    groups = (n - head) / G::kElements;
  } else {
    head = n;  // dst and src cannot be vectorized together: element by element
  }
  LaunchShape shape;
  DDLFAST_RETURN_IF_ERROR(current_launch_shape(&shape));
  const std::size_t work = std::max(groups, n - groups * G::kElements);
  elementwise_kernel<D, S, Op><<<grid_blocks(shape, work, kThreads), kThreads, 0, stream>>>(dst, src, n, head,
                                                                                             groups, op);
  return cuda_status(cudaGetLastError(), what);
}

template <typename D, typename S, typename Op>
void host_loop(D* dst, const S* src, std::size_t n, Op op) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = op(Op::kReadsDst ? dst[i] : D(), src[i]);
}

// Every entry point dispatches the same way; Run decides device or host.
template <typename Run>
Status dispatch_reduce(DType dtype, void* dst, const void* src, std::size_t n, int divisor, const NanRule& rule,
                       Run run) {
  if (divisor < 1) return Status::invalid("divisor must be >= 1");
  const bool scaled = divisor != 1;
  switch (dtype) {
    case DType::kFloat32:
      return run(static_cast<float*>(dst), static_cast<const float*>(src), n,
                 FloatReduce<float>{1.0f / static_cast<float>(divisor), scaled, rule});
    case DType::kFloat64:
      return run(static_cast<double*>(dst), static_cast<const double*>(src), n,
                 FloatReduce<double>{1.0 / static_cast<double>(divisor), scaled, rule});
    case DType::kFloat16:
      return run(static_cast<std::uint16_t*>(dst), static_cast<const std::uint16_t*>(src), n,
                 HalfReduce<Fp16>{1.0f / static_cast<float>(divisor), scaled, rule});
    case DType::kBFloat16:
      return run(static_cast<std::uint16_t*>(dst), static_cast<const std::uint16_t*>(src), n,
                 HalfReduce<Bf16>{1.0f / static_cast<float>(divisor), scaled, rule});
    case DType::kInt32:
      return run(static_cast<std::int32_t*>(dst), static_cast<const std::int32_t*>(src), n,
                 IntReduce<std::int32_t>{divisor});
    case DType::kInt64:
      return run(static_cast<std::int64_t*>(dst), static_cast<const std::int64_t*>(src), n,
                 IntReduce<std::int64_t>{divisor});
  }
  return Status::invalid("unknown dtype code " + std::to_string(static_cast<int>(dtype)));
}

template <typename Run>
Status dispatch_encode(WireType wire, void* dst, const float* src, std::size_t n, Run run) {
  auto* out = static_cast<std::uint16_t*>(dst);
  if (wire == WireType::kFloat16) return run(out, src, n, Encode<Fp16>{});
  if (wire == WireType::kBFloat16) return run(out, src, n, Encode<Bf16>{});
  return Status::invalid("unknown wire type " + std::to_string(static_cast<int>(wire)));
}

template <typename Run>
Status dispatch_decode(WireType wire, float* dst, const void* src, std::size_t n, Run run) {
  const auto* in = static_cast<const std::uint16_t*>(src);
  if (wire == WireType::kFloat16) return run(dst, in, n, Decode<Fp16>{});
  if (wire == WireType::kBFloat16) return run(dst, in, n, Decode<Bf16>{});
  return Status::invalid("unknown wire type " + std::to_string(static_cast<int>(wire)));
}

template <typename Run>
Status dispatch_accumulate(WireType wire, float* dst, const void* src, std::size_t n, int divisor,
                           const NanRule& rule, Run run) {
  if (divisor < 1) return Status::invalid("divisor must be >= 1");
  const auto* in = static_cast<const std::uint16_t*>(src);
  const float scale = 1.0f / static_cast<float>(divisor);
  if (wire == WireType::kFloat16) return run(dst, in, n, Accumulate<Fp16>{scale, divisor != 1, rule});
  if (wire == WireType::kBFloat16) return run(dst, in, n, Accumulate<Bf16>{scale, divisor != 1, rule});
  return Status::invalid("unknown wire type " + std::to_string(static_cast<int>(wire)));
}

// The host's NaN rule, measured once.
const NanRule& rule() {
  static const NanRule measured = host_nan_rule();
  return measured;
}

struct OnDevice {
  cudaStream_t stream;
  const char* what;
  template <typename D, typename S, typename Op>
  Status operator()(D* dst, const S* src, std::size_t n, Op op) const {
    return launch(dst, src, n, op, stream, what);
  }
};

struct OnHost {
  template <typename D, typename S, typename Op>
  Status operator()(D* dst, const S* src, std::size_t n, Op op) const {
    host_loop(dst, src, n, op);
    return Status::ok();
  }
};

}  // namespace

Status cuda_reduce(DType dtype, void* dst, const void* src, std::size_t n, int divisor, cudaStream_t stream) {
  return dispatch_reduce(dtype, dst, src, n, divisor, rule(), OnDevice{stream, "launching the reduce kernel"});
}

Status cuda_encode(WireType wire, void* dst_wire, const float* src, std::size_t n, cudaStream_t stream) {
  return dispatch_encode(wire, dst_wire, src, n, OnDevice{stream, "launching the encode kernel"});
}

Status cuda_decode(WireType wire, float* dst, const void* src_wire, std::size_t n, cudaStream_t stream) {
  return dispatch_decode(wire, dst, src_wire, n, OnDevice{stream, "launching the decode kernel"});
}

Status cuda_accumulate(WireType wire, float* dst, const void* src_wire, std::size_t n, int divisor,
                       cudaStream_t stream) {
  return dispatch_accumulate(wire, dst, src_wire, n, divisor, rule(),
                             OnDevice{stream, "launching the accumulate kernel"});
}

Status host_twin_reduce(DType dtype, void* dst, const void* src, std::size_t n, int divisor,
                        const NanRule& nan_rule) {
  return dispatch_reduce(dtype, dst, src, n, divisor, nan_rule, OnHost{});
}

Status host_twin_encode(WireType wire, void* dst_wire, const float* src, std::size_t n) {
  return dispatch_encode(wire, dst_wire, src, n, OnHost{});
}

Status host_twin_decode(WireType wire, float* dst, const void* src_wire, std::size_t n) {
  return dispatch_decode(wire, dst, src_wire, n, OnHost{});
}

Status host_twin_accumulate(WireType wire, float* dst, const void* src_wire, std::size_t n, int divisor,
                            const NanRule& nan_rule) {
  return dispatch_accumulate(wire, dst, src_wire, n, divisor, nan_rule, OnHost{});
}

}  // namespace ddlfast
