// min, max and product loops written once; included by each instruction-set
// translation unit so the compiler vectorises them for that target.
//
// Floating min/max (float32, float64, float16, bfloat16) work on the bits:
// x ^ (sign ? all ones : sign bit) orders every non-nan value as an unsigned
// integer, with -0 below +0. So min/max are exact in any type, commutative and
// associative, and give the same bits whatever the order of reduction (MPI's
// own algorithms on the small-message path may differ per rank): max(-0, +0)
// is +0, min is -0, and a nan on either side gives the one canonical quiet nan
// (positive, zero payload), as np.minimum/np.maximum propagate nan.
// Floating product rounds once per pair (halves: their fp32 product is exact,
// then rounded to the type, as NumPy does) and gives the canonical nan for any
// nan result. Integer product wraps like NumPy (unsigned multiplication).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/half.h"
#include "kernels/cpu/cpu_kernels.h"

namespace ddlfast {
// Internal linkage on purpose, as in reduce_generic.h.
namespace {
namespace combine {

// Bit layout of one floating type: U is its width as an unsigned integer.
template <typename U, U Exponent, U Nan>
struct FloatBits {
  using Bits = U;
  static constexpr U kSign = static_cast<U>(U{1} << (8 * sizeof(U) - 1));
  static constexpr U kExponent = Exponent;  // all exponent bits: inf; above it (magnitude): nan
  static constexpr U kNan = Nan;  // the canonical quiet nan every nan result becomes
};
using Float32Bits = FloatBits<std::uint32_t, 0x7f800000u, 0x7fc00000u>;
using Float64Bits = FloatBits<std::uint64_t, 0x7ff0000000000000ull, 0x7ff8000000000000ull>;
using Float16Bits = FloatBits<std::uint16_t, 0x7c00u, 0x7e00u>;
using BFloat16Bits = FloatBits<std::uint16_t, 0x7f80u, 0x7fc0u>;

// Unsigned key in the order of the values (non-nan), -0 just below +0.
template <typename B>
inline typename B::Bits order_key(typename B::Bits x) {
  using U = typename B::Bits;
  using S = typename std::make_signed<U>::type;
  const U negative = static_cast<U>(static_cast<S>(x) >> (8 * sizeof(U) - 1));  // all ones when the sign is set
  return static_cast<U>(x ^ (negative | B::kSign));
}

template <typename B>
inline bool is_nan_bits(typename B::Bits x) {
  return static_cast<typename B::Bits>(x & ~B::kSign) > B::kExponent;
}

template <typename B, bool Max>
void minmax_float(void* dst_v, const void* src_v, std::size_t n) {
  using U = typename B::Bits;
  U* __restrict dst = static_cast<U*>(dst_v);
  const U* __restrict src = static_cast<const U*>(src_v);
  for (std::size_t i = 0; i < n; ++i) {
    const U a = dst[i];
    const U b = src[i];
    const U ka = order_key<B>(a);
    const U kb = order_key<B>(b);
    const U chosen = (Max ? kb > ka : kb < ka) ? b : a;
    dst[i] = (is_nan_bits<B>(a) | is_nan_bits<B>(b)) ? B::kNan : chosen;
  }
}

template <typename T, bool Max>
void minmax_int(void* dst_v, const void* src_v, std::size_t n) {
  T* __restrict dst = static_cast<T*>(dst_v);
  const T* __restrict src = static_cast<const T*>(src_v);
  for (std::size_t i = 0; i < n; ++i) {
    const T a = dst[i];
    const T b = src[i];
    dst[i] = (Max ? b > a : b < a) ? b : a;
  }
}

template <typename T, typename B>
void product_float(void* dst_v, const void* src_v, std::size_t n) {
  static_assert(sizeof(T) == sizeof(typename B::Bits), "bit layout of another type");
  using U = typename B::Bits;
  T* __restrict dst = static_cast<T*>(dst_v);
  const T* __restrict src = static_cast<const T*>(src_v);
  for (std::size_t i = 0; i < n; ++i) {
    const T p = dst[i] * src[i];
    U bits;
    std::memcpy(&bits, &p, sizeof bits);
    bits = is_nan_bits<B>(bits) ? B::kNan : bits;
    std::memcpy(&dst[i], &bits, sizeof bits);
  }
}

template <typename T>
void product_int(void* dst_v, const void* src_v, std::size_t n) {
  using U = typename std::make_unsigned<T>::type;
  T* __restrict dst = static_cast<T*>(dst_v);
  const T* __restrict src = static_cast<const T*>(src_v);
  for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<T>(static_cast<U>(dst[i]) * static_cast<U>(src[i]));
}

// A nan product becomes float32's canonical nan first, which both half
// conversions turn into their own canonical nan.
template <float (*ToFloat)(std::uint16_t), std::uint16_t (*FromFloat)(float)>
void product_half_scalar(void* dst_v, const void* src_v, std::size_t n) {
  std::uint16_t* dst = static_cast<std::uint16_t*>(dst_v);
  const std::uint16_t* src = static_cast<const std::uint16_t*>(src_v);
  for (std::size_t i = 0; i < n; ++i) {
    const float p = ToFloat(dst[i]) * ToFloat(src[i]);
    dst[i] = FromFloat(p != p ? bits_to_float(Float32Bits::kNan) : p);
  }
}

// Every row but the halves' product, which instruction sets may do their own way.
template <CombineFn ProductFloat16, CombineFn ProductBFloat16>
constexpr CombineTable table() {
  return {{
      {&minmax_float<Float32Bits, false>, &minmax_float<Float64Bits, false>, &minmax_float<Float16Bits, false>,
       &minmax_float<BFloat16Bits, false>, &minmax_int<std::int32_t, false>, &minmax_int<std::int64_t, false>},
      {&minmax_float<Float32Bits, true>, &minmax_float<Float64Bits, true>, &minmax_float<Float16Bits, true>,
       &minmax_float<BFloat16Bits, true>, &minmax_int<std::int32_t, true>, &minmax_int<std::int64_t, true>},
      {&product_float<float, Float32Bits>, &product_float<double, Float64Bits>, ProductFloat16, ProductBFloat16,
       &product_int<std::int32_t>, &product_int<std::int64_t>},
  }};
}

}  // namespace combine
}  // namespace
}  // namespace ddlfast
