// The kernels behind exact integer average and the half-precision range check
// (engine/exact_arithmetic.h), written once; included by each instruction-set
// translation unit so the compiler vectorises them for that target.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kernels/cpu/cpu_kernels.h"

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

// int64 / divisor by multiplying with a precomputed reciprocal (Granlund and
// Montgomery 1994, Thm 4.2), a few cycles instead of a 64-bit idiv: with
// l = ceil(log2 d) and m = ceil(2^(63+l) / d), floor(u*m / 2^(63+l)) == u / d
// for every magnitude u <= 2^63, because m*d - 2^(63+l) < d <= 2^l. For
// 2 <= d < 2^31, m < 2^64 and the shift is the high word's, by l - 1.
class Reciprocal64 {
 public:
  explicit Reciprocal64(int divisor) : divisor_(static_cast<std::uint64_t>(divisor)) {
    int l = 0;
    while ((std::uint64_t{1} << l) < divisor_) ++l;
    const unsigned __int128 power = static_cast<unsigned __int128>(1) << (63 + l);
    multiplier_ = static_cast<std::uint64_t>((power + divisor_ - 1) / divisor_);
    shift_ = l - 1;
  }
  // C's v / d (truncating toward zero), INT64_MIN included.
  // Branch-free: signs are random in real data, and a mispredicted branch
  // costs more than the whole division.
  std::int64_t trunc_div(std::int64_t v) const {
    const std::uint64_t sign = static_cast<std::uint64_t>(v >> 63);  // all ones when negative
    const std::uint64_t magnitude = (static_cast<std::uint64_t>(v) ^ sign) - sign;
    const auto high = static_cast<std::uint64_t>((static_cast<unsigned __int128>(magnitude) * multiplier_) >> 64);
    const std::uint64_t q = high >> shift_;
    return static_cast<std::int64_t>((q ^ sign) - sign);
  }

 private:
  std::uint64_t divisor_;
  std::uint64_t multiplier_ = 0;
  int shift_ = 0;
};

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
  if (std::is_same<T, std::int64_t>::value && divisor >= 2) {
    const Reciprocal64 reciprocal(divisor);
    for (std::size_t i = 0; i < n; ++i) {
      const T v = values[i];
      const T q = static_cast<T>(reciprocal.trunc_div(v));
      remainders[i] = v - q * d;  // |q * d| <= |v|
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
  if (std::is_same<T, std::int64_t>::value && divisor >= 2) {
    const Reciprocal64 reciprocal(divisor);
    for (std::size_t i = 0; i < n; ++i) {
      const T s = remainders[i];
      T q = static_cast<T>(reciprocal.trunc_div(s));
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
