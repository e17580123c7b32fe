// CPU arithmetic kernels. Each instruction-set variant fills one KernelTable;
// best_kernels() picks the fastest the running CPU supports (chosen once).
#pragma once

#include <cstddef>

#include "common/dtype.h"

namespace ddlfast {

// dst[i] = (dst[i] + src[i]) / divisor, in one pass. divisor == 1 is a plain
// sum; floats multiply by 1/divisor, integers divide (truncating toward zero).
// fp16/bf16 add in fp32 and round once.
using ReduceFn = void (*)(void* dst, const void* src, std::size_t n, int divisor);

// dst[i] = op(dst[i], src[i]) for min, max and product (kernels/cpu/combine_generic.h
// gives their exact rules: nan, signed zeros, wrapping).
using CombineFn = void (*)(void* dst, const void* src, std::size_t n);
constexpr int kNumCombineOps = 3;  // index: op - ReduceOp::kMin
inline int combine_index(ReduceOp op) { return static_cast<int>(op) - static_cast<int>(ReduceOp::kMin); }
struct CombineTable {
  CombineFn fn[kNumCombineOps][kNumDTypes];  // [min, max, product][dtype]
};

// Wire codecs for compressed transfers of float32 data (index: WireType).
enum class WireType : int { kFloat16 = 0, kBFloat16 = 1 };
constexpr int kNumWireTypes = 2;
// The codecs' index of float16/bfloat16 data (its values are what the codecs read and write).
inline WireType half_type(DType dtype) { return dtype == DType::kFloat16 ? WireType::kFloat16 : WireType::kBFloat16; }
// dst_wire[i] = wire(src[i]), rounding to nearest even. Returns how many
// finite inputs overflowed to inf (so overflow is an error, never silent).
using EncodeFn = std::size_t (*)(void* dst_wire, const float* src, std::size_t n);
// dst[i] = float(src_wire[i]).
using DecodeFn = void (*)(float* dst, const void* src_wire, std::size_t n);
// dst[i] = (dst[i] + float(src_wire[i])) / divisor: accumulation stays in fp32.
using AccumulateFn = void (*)(float* dst, const void* src_wire, std::size_t n, int divisor);

// Exact integer average (engine/exact_arithmetic.h), int32 and int64 only.
// split: values[i] = trunc(v / divisor), remainders[i] = v - values[i] * divisor
// (C's / and %, so |values[i]| <= |v| / divisor and sums of them never wrap).
using SplitFn = void (*)(void* values, void* remainders, std::size_t n, int divisor);
// join: values[i] += floor(remainders[i] / divisor), wrapping like the sum.
using JoinFn = void (*)(void* values, const void* remainders, std::size_t n, int divisor);
// Half types (index: WireType): does any of the n values hold inf or nan?
using AnyNonFiniteFn = bool (*)(const void* values, std::size_t n);

struct KernelTable {
  const char* name;
  ReduceFn reduce[kNumDTypes];
  EncodeFn encode[kNumWireTypes];
  DecodeFn decode[kNumWireTypes];
  AccumulateFn accumulate[kNumWireTypes];
  SplitFn split[2];  // int32, int64
  JoinFn join[2];
  AnyNonFiniteFn any_nonfinite[kNumWireTypes];
  CombineTable combine;
};

const KernelTable& scalar_kernels();
// nullptr when the build has no AVX2 variant or the CPU lacks AVX2/F16C.
const KernelTable* avx2_kernels();
const KernelTable& best_kernels();

inline void reduce_into(DType dtype, void* dst, const void* src, std::size_t n, int divisor) {
  best_kernels().reduce[static_cast<int>(dtype)](dst, src, n, divisor);
}

// The one entry the engine reduces through: sum and average take `divisor`
// (1 for sum), min, max and product ignore it.
inline void reduce_into(DType dtype, ReduceOp op, void* dst, const void* src, std::size_t n, int divisor) {
  if (op == ReduceOp::kSum || op == ReduceOp::kAverage) {
    best_kernels().reduce[static_cast<int>(dtype)](dst, src, n, divisor);
  } else {
    best_kernels().combine.fn[combine_index(op)][static_cast<int>(dtype)](dst, src, n);
  }
}

// values[i] /= divisor with the reduce kernel's arithmetic (floats: times 1/divisor, rounded once), keeping
// every sign: the kernel adds the additive identity that changes no bits, -0.0 for the floating types
// (x + -0 == x for every x, -0 and nan included; x + +0 would turn -0 into +0), 0 for integers. So average on
// a path that sums first and divides after (MPI's own collectives) gives the ring's bits.
void divide_in_place(DType dtype, void* values, std::size_t n, int divisor);

inline std::size_t wire_size(WireType) { return 2; }

// Smallest magnitudes that round to inf: 65520 for fp16, bits 0x7f7f8000 for bf16.
constexpr float kFp16OverflowFrom = 65520.0f;
constexpr float kBf16OverflowFrom = 3.3961514e38f;
constexpr float kOverflowFrom[kNumWireTypes] = {kFp16OverflowFrom, kBf16OverflowFrom};

}  // namespace ddlfast
