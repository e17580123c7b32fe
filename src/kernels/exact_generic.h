// The kernels behind exact integer average and the half-precision range check
// (engine/exact_arithmetic.h), written once; included by each instruction-set
// translation unit so the compiler vectorises them for that target.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kernels/cpu_kernels.h"

namespace ddlfast {
// Internal linkage on purpose, as in reduce_generic.h.
namespace {
namespace exact {

// Below this divisor, int32 / divisor through double is exact: the quotient's
// rounding error is at most 2^31 * 2^-53 = 2^-22, smaller than the 1/divisor
// that separates a non-integer quotient from the integers on either side.
// The loops then vectorise (there is no SIMD integer division on x86).
constexpr int kDoubleExactDivisor = 1 << 21;

// Whether `divisor` may take the vectorisable double route for T.
template <typename T>
constexpr bool via_double(int divisor) {
  return std::is_same<T, std::int32_t>::value && divisor < kDoubleExactDivisor;
}

template <typename T>
void split_int(void* values_v, void* remainders_v, std::size_t n, int divisor) {
  T* __restrict values = static_cast<T*>(values_v);
  T* __restrict remainders = static_cast<T*>(remainders_v);
  const T d = static_cast<T>(divisor);
  if (via_double<T>(divisor)) {
    const double dd = divisor;
    for (std::size_t i = 0; i < n; ++i) {
      const T v = values[i];
      const T q = static_cast<T>(static_cast<double>(v) / dd);  // truncates, like C's /
      remainders[i] = v - q * d;  // |q * d| <= |v|: no overflow
      values[i] = q;
    }
    return;
  }
  for (std::size_t i = 0; i < n; ++i) {
    const T v = values[i];
    values[i] = v / d;
    remainders[i] = v % d;
  }
}

template <typename T>
void join_int(void* values_v, const void* remainders_v, std::size_t n, int divisor) {
  using U = typename std::make_unsigned<T>::type;
  T* __restrict values = static_cast<T*>(values_v);
  const T* __restrict remainders = static_cast<const T*>(remainders_v);
  const T d = static_cast<T>(divisor);
  if (via_double<T>(divisor)) {
    const double dd = divisor;
    for (std::size_t i = 0; i < n; ++i) {
      const T s = remainders[i];
      T q = static_cast<T>(static_cast<double>(s) / dd);
      q -= static_cast<T>(q * d > s);  // truncation -> floor
      values[i] = static_cast<T>(static_cast<U>(values[i]) + static_cast<U>(q));
    }
    return;
  }
  for (std::size_t i = 0; i < n; ++i) {
    const T s = remainders[i];
    const T q = s / d - static_cast<T>(s % d < 0);
    values[i] = static_cast<T>(static_cast<U>(values[i]) + static_cast<U>(q));
  }
}

// fp16 and bf16 are inf or nan exactly when all exponent bits are set. The
// max over (bits & mask) is a 16-bit reduction any SIMD target has; blocks
// end the scan early once one is found.
template <std::uint16_t ExponentMask>
bool any_nonfinite(const void* values_v, std::size_t n) {
  const std::uint16_t* values = static_cast<const std::uint16_t*>(values_v);
  constexpr std::size_t kBlock = 4096;
  for (std::size_t start = 0; start < n; start += kBlock) {
    const std::size_t end = n - start < kBlock ? n : start + kBlock;
    std::int16_t top = 0;
    for (std::size_t i = start; i < end; ++i) {
      const std::int16_t exponent = static_cast<std::int16_t>(values[i] & ExponentMask);
      top = exponent > top ? exponent : top;
    }
    if (top == static_cast<std::int16_t>(ExponentMask)) return true;
  }
  return false;
}

constexpr std::uint16_t kFp16Exponent = 0x7c00;
constexpr std::uint16_t kBf16Exponent = 0x7f80;

}  // namespace exact
}  // namespace
}  // namespace ddlfast
