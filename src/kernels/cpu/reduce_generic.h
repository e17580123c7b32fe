// Element-wise reduce loops written once; included by each instruction-set
// translation unit so the compiler vectorises them for that target.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "common/half.h"
#include "kernels/cpu/cpu_kernels.h"

namespace ddlfast {
// Internal linkage on purpose: each ISA translation unit gets its own copies,
// so the linker can never merge an AVX2 instantiation into the scalar table.
namespace {
namespace generic {

template <typename T>
inline void reduce_float(void* dst_v, const void* src_v, std::size_t n, int divisor) {
  T* __restrict dst = static_cast<T*>(dst_v);
  const T* __restrict src = static_cast<const T*>(src_v);
  if (divisor == 1) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = dst[i] + src[i];
  } else {
    const T scale = T(1) / static_cast<T>(divisor);
    for (std::size_t i = 0; i < n; ++i) dst[i] = (dst[i] + src[i]) * scale;
  }
}

template <typename T>
inline void reduce_int(void* dst_v, const void* src_v, std::size_t n, int divisor) {
  T* __restrict dst = static_cast<T*>(dst_v);
  const T* __restrict src = static_cast<const T*>(src_v);
  // Wrap-around on overflow like NumPy, without signed-overflow UB.
  using U = typename std::make_unsigned<T>::type;
  if (divisor == 1) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<T>(static_cast<U>(dst[i]) + static_cast<U>(src[i]));
  } else {
    const T d = static_cast<T>(divisor);
    for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<T>(static_cast<U>(dst[i]) + static_cast<U>(src[i])) / d;
  }
}

template <float (*ToFloat)(std::uint16_t), std::uint16_t (*FromFloat)(float)>
inline void reduce_half_scalar(void* dst_v, const void* src_v, std::size_t n, int divisor) {
  std::uint16_t* dst = static_cast<std::uint16_t*>(dst_v);
  const std::uint16_t* src = static_cast<const std::uint16_t*>(src_v);
  const float scale = divisor == 1 ? 1.0f : 1.0f / static_cast<float>(divisor);
  for (std::size_t i = 0; i < n; ++i) dst[i] = FromFloat((ToFloat(dst[i]) + ToFloat(src[i])) * scale);
}

template <std::uint16_t (*FromFloat)(float), int Wire>
inline std::size_t encode_scalar(void* dst_v, const float* src, std::size_t n) {
  auto* dst = static_cast<std::uint16_t*>(dst_v);
  std::size_t overflows = 0;
  for (std::size_t i = 0; i < n; ++i) {
    dst[i] = FromFloat(src[i]);
    const float magnitude = src[i] < 0 ? -src[i] : src[i];
    overflows += magnitude >= kOverflowFrom[Wire] && magnitude <= 3.4028235e38f;
  }
  return overflows;
}

template <float (*ToFloat)(std::uint16_t)>
inline void decode_scalar(float* dst, const void* src_v, std::size_t n) {
  const auto* src = static_cast<const std::uint16_t*>(src_v);
  for (std::size_t i = 0; i < n; ++i) dst[i] = ToFloat(src[i]);
}

template <float (*ToFloat)(std::uint16_t)>
inline void accumulate_scalar(float* dst, const void* src_v, std::size_t n, int divisor) {
  const auto* src = static_cast<const std::uint16_t*>(src_v);
  if (divisor == 1) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = dst[i] + ToFloat(src[i]);
  } else {
    const float scale = 1.0f / static_cast<float>(divisor);
    for (std::size_t i = 0; i < n; ++i) dst[i] = (dst[i] + ToFloat(src[i])) * scale;
  }
}

}  // namespace generic
}  // namespace
}  // namespace ddlfast
