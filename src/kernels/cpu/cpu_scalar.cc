// Portable kernels: plain C++ the compiler may vectorise with the baseline ISA.
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

}  // namespace ddlfast
