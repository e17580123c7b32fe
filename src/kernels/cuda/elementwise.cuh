// Per-element arithmetic of the CUDA kernels, written once for device and
// host. The host instantiation (cuda_reduce.cu, host_* entry points) lets
// CPU-only machines check these functions bit for bit against the CPU
// kernels (kernels/cpu/cpu_kernels.h); on the device the same code runs with
// IEEE round-to-nearest intrinsics that the compiler may not contract.
//
// Semantics, identical to the CPU kernels:
//   floats  dst = (dst + src) * (1/divisor), 1/divisor computed in the element
//           type on the host; divisor 1 is a plain add.
//   fp16/bf16  converted to fp32, the float rule above, rounded once to
//           nearest-even.
//   ints    two's-complement wrap-around add, then division truncating
//           toward zero.
// NaNs: GPUs return one canonical NaN from arithmetic, x86 and Arm return the
// NaN operand (quieted), or their "default NaN" for invalid operations such as
// inf - inf. To give the CPU's bits we redo that choice explicitly; the host's
// default NaN is measured at run time (NanRule) and passed to the kernels.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/nan_rule.h"

#define DDLFAST_HD __host__ __device__ __forceinline__

namespace ddlfast {
namespace elementwise {

DDLFAST_HD std::uint32_t bits_of(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  std::uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
#endif
}

DDLFAST_HD std::uint64_t bits_of(double f) {
#ifdef __CUDA_ARCH__
  return static_cast<std::uint64_t>(__double_as_longlong(f));
#else
  std::uint64_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
#endif
}

DDLFAST_HD float float_from(std::uint32_t b) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
#endif
}

DDLFAST_HD double double_from(std::uint64_t b) {
#ifdef __CUDA_ARCH__
  return __longlong_as_double(static_cast<long long>(b));
#else
  double f;
  std::memcpy(&f, &b, sizeof f);
  return f;
#endif
}

// Bit tests, not isnan(): immune to fast-math flags.
DDLFAST_HD bool is_nan(float f) { return (bits_of(f) & 0x7fffffffu) > 0x7f800000u; }
DDLFAST_HD bool is_nan(double f) { return (bits_of(f) & 0x7fffffffffffffffull) > 0x7ff0000000000000ull; }

DDLFAST_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
DDLFAST_HD double add_rn(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
DDLFAST_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
DDLFAST_HD double mul_rn(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

// What a CPU returns when a + b (or its scaling) is NaN: a NaN operand,
// quieted (the first one when both are), else the default NaN.
DDLFAST_HD float nan_result(float a, float b, const NanRule& rule) {
  if (is_nan(a)) return float_from(bits_of(a) | 0x00400000u);
  if (is_nan(b)) return float_from(bits_of(b) | 0x00400000u);
  return float_from(rule.default_nan32);
}
DDLFAST_HD double nan_result(double a, double b, const NanRule& rule) {
  if (is_nan(a)) return double_from(bits_of(a) | 0x0008000000000000ull);
  if (is_nan(b)) return double_from(bits_of(b) | 0x0008000000000000ull);
  return double_from(rule.default_nan64);
}

// (a + b) * scale, or a + b when !scaled, with the CPU's NaN bits.
template <typename F>
DDLFAST_HD F add_scaled(F a, F b, F scale, bool scaled, const NanRule& rule) {
  F r = add_rn(a, b);
  if (scaled) r = mul_rn(r, scale);
  return is_nan(r) ? nan_result(a, b, rule) : r;
}

// fp16 <-> fp32. Finite values and infinities use CUDA's conversions (exact
// one way, round-to-nearest-even the other, subnormals kept); NaNs keep their
// payload like common/half.h (CUDA would return its canonical NaN).
struct Fp16 {
  DDLFAST_HD static float to_float(std::uint16_t h) {
    if ((h & 0x7fffu) > 0x7c00u) {
      return float_from((static_cast<std::uint32_t>(h & 0x8000u) << 16) | 0x7f800000u |
                        (static_cast<std::uint32_t>(h & 0x3ffu) << 13));
    }
    __half_raw raw;
    raw.x = h;
    return __half2float(__half(raw));
  }
  DDLFAST_HD static std::uint16_t from_float(float f) {
    const std::uint32_t b = bits_of(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
      return static_cast<std::uint16_t>(((b >> 16) & 0x8000u) | 0x7e00u | ((b & 0x7fffffu) >> 13));
    }
    const __half_raw raw = static_cast<__half_raw>(__float2half_rn(f));
    return raw.x;
  }
};

// bf16 <-> fp32: plain integer arithmetic, the same formula as the CPU.
struct Bf16 {
  DDLFAST_HD static float to_float(std::uint16_t b) { return float_from(static_cast<std::uint32_t>(b) << 16); }
  DDLFAST_HD static std::uint16_t from_float(float f) {
    const std::uint32_t b = bits_of(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((b >> 16) | 0x40u);
    return static_cast<std::uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
  }
};

// ---- the element operations the kernels apply ------------------------------
// Each is a small value type passed to the kernel by value; operator() maps
// (dst element, src element) to the new dst element.

template <typename F>
struct FloatReduce {
  static constexpr bool kReadsDst = true;
  F scale;
  bool scaled;
  NanRule rule;
  DDLFAST_HD F operator()(F d, F s) const { return add_scaled(d, s, scale, scaled, rule); }
};

template <typename Codec>
struct HalfReduce {
  static constexpr bool kReadsDst = true;
  float scale;
  bool scaled;
  NanRule rule;
  DDLFAST_HD std::uint16_t operator()(std::uint16_t d, std::uint16_t s) const {
    return Codec::from_float(add_scaled(Codec::to_float(d), Codec::to_float(s), scale, scaled, rule));
  }
};

template <typename T>
struct IntReduce {
  static constexpr bool kReadsDst = true;
  T divisor;
  DDLFAST_HD T operator()(T d, T s) const {
    using U = typename std::make_unsigned<T>::type;
    const T sum = static_cast<T>(static_cast<U>(d) + static_cast<U>(s));
    return divisor == 1 ? sum : static_cast<T>(sum / divisor);
  }
};

// Wire codecs for float32 data (dst, src types differ).
template <typename Codec>
struct Encode {  // dst_wire = wire(src_f32); dst is not read
  static constexpr bool kReadsDst = false;
  DDLFAST_HD std::uint16_t operator()(std::uint16_t, float s) const { return Codec::from_float(s); }
};

template <typename Codec>
struct Decode {  // dst_f32 = float(src_wire); dst is not read
  static constexpr bool kReadsDst = false;
  DDLFAST_HD float operator()(float, std::uint16_t s) const { return Codec::to_float(s); }
};

template <typename Codec>
struct Accumulate {  // dst_f32 = (dst_f32 + float(src_wire)) / divisor, in fp32
  static constexpr bool kReadsDst = true;
  float scale;
  bool scaled;
  NanRule rule;
  DDLFAST_HD float operator()(float d, std::uint16_t s) const {
    return add_scaled(d, Codec::to_float(s), scale, scaled, rule);
  }
};

}  // namespace elementwise
}  // namespace ddlfast
