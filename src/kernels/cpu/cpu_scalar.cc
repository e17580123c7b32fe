// Portable kernels: plain C++ the compiler may vectorise with the baseline ISA.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <type_traits>

#include "kernels/cpu/combine_generic.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/exact_generic.h"
#include "kernels/cpu/reduce_generic.h"

namespace ddlfast {

const KernelTable& scalar_kernels() {
  static const KernelTable table = {
      "scalar",
      {
          &generic::reduce_float<float>,
          &generic::reduce_float<double>,
          &generic::reduce_half_scalar<half_to_float, float_to_half>,
          &generic::reduce_half_scalar<bfloat16_to_float, float_to_bfloat16>,
          &generic::reduce_int<std::int32_t>,
          &generic::reduce_int<std::int64_t>,
      },
      {&generic::encode_scalar<float_to_half, 0>, &generic::encode_scalar<float_to_bfloat16, 1>},
      {&generic::decode_scalar<half_to_float>, &generic::decode_scalar<bfloat16_to_float>},
      {&generic::accumulate_scalar<half_to_float>, &generic::accumulate_scalar<bfloat16_to_float>},
      {&exact::split_int<std::int32_t>, &exact::split_int<std::int64_t>},
      {&exact::join_int<std::int32_t>, &exact::join_int<std::int64_t>},
      {&exact::any_nonfinite<exact::kFp16Exponent>, &exact::any_nonfinite<exact::kBf16Exponent>},
      combine::table<&combine::product_half_scalar<half_to_float, float_to_half>,
                      &combine::product_half_scalar<bfloat16_to_float, float_to_bfloat16>>(),
  };
  return table;
}

const KernelTable& best_kernels() {
  static const KernelTable* chosen = [] {
    const KernelTable* avx2 = avx2_kernels();
    return avx2 != nullptr ? avx2 : &scalar_kernels();
  }();
  return *chosen;
}

void divide_in_place(DType dtype, void* values, std::size_t n, int divisor) {
  if (divisor == 1 || n == 0) return;
  constexpr std::size_t kBlockBytes = 1 << 14;
  // The sign bit alone in each element: -0.0 for the floating types; integers add 0.
  alignas(64) static const auto negative_zeros = [] {
    struct Blocks {
      std::uint32_t f32[kBlockBytes / 4];
      std::uint64_t f64[kBlockBytes / 8];
      std::uint16_t half[kBlockBytes / 2];  // the same bits in fp16 and bf16
      std::uint64_t zero[kBlockBytes / 8];
    } blocks{};
    std::fill(std::begin(blocks.f32), std::end(blocks.f32), 0x80000000u);
    std::fill(std::begin(blocks.f64), std::end(blocks.f64), 0x8000000000000000ull);
    std::fill(std::begin(blocks.half), std::end(blocks.half), std::uint16_t{0x8000});
    return blocks;
  }();
  const void* identity = negative_zeros.zero;
  switch (dtype) {
    case DType::kFloat32: identity = negative_zeros.f32; break;
    case DType::kFloat64: identity = negative_zeros.f64; break;
    case DType::kFloat16:
    case DType::kBFloat16: identity = negative_zeros.half; break;
    default: break;
  }
  const std::size_t esize = dtype_size(dtype);
  const std::size_t block = kBlockBytes / esize;
  char* bytes = static_cast<char*>(values);
  for (std::size_t done = 0; done < n;) {
    const std::size_t count = std::min(n - done, block);
    reduce_into(dtype, bytes + done * esize, identity, count, divisor);
    done += count;
  }
}

}  // namespace ddlfast
