// Scalar fp16/bf16 <-> fp32 conversion (round to nearest even), the portable
// reference that the SIMD and CUDA paths must match bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

namespace ddlfast {

static inline float bits_to_float(std::uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

static inline std::uint32_t float_to_bits(float f) {
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

static inline float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exponent = (h >> 10) & 0x1fu;
  std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) {  // inf / nan
    return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  }
  if (exponent == 0) {
    if (mantissa == 0) return bits_to_float(sign);
    // Subnormal: normalise.
    exponent = 127 - 15 + 1;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    mantissa &= 0x3ffu;
    return bits_to_float(sign | (exponent << 23) | (mantissa << 13));
  }
  return bits_to_float(sign | ((exponent + 127 - 15) << 23) | (mantissa << 13));
}

static inline std::uint16_t float_to_half(float f) {
  const std::uint32_t bits = float_to_bits(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) {  // nan: quiet, top payload bits kept (what F16C does)
    return sign | 0x7e00u | static_cast<std::uint16_t>((abs & 0x7fffffu) >> 13);
  }
  if (abs == 0x7f800000u) return sign | 0x7c00u;
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds past 65504 -> inf
  if (abs < 0x38800000u) {  // result is subnormal or zero
    if (abs < 0x33000000u) return sign;  // below half the smallest subnormal
    const std::uint32_t exponent = abs >> 23;
    const std::uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
    // value = mantissa * 2^(exponent-150) and the fp16 subnormal unit is 2^-24.
    const std::uint32_t total_shift = 126 - exponent;
    std::uint32_t result = mantissa >> total_shift;
    const std::uint32_t remainder = mantissa & ((1u << total_shift) - 1u);
    const std::uint32_t halfway = 1u << (total_shift - 1);
    if (remainder > halfway || (remainder == halfway && (result & 1u))) ++result;
    return sign | static_cast<std::uint16_t>(result);
  }
  // Normal: rebias exponent, round mantissa from 23 to 10 bits.
  std::uint32_t rebased = abs - ((127u - 15u) << 23);
  const std::uint32_t remainder = rebased & 0x1fffu;
  std::uint32_t result = rebased >> 13;
  if (remainder > 0x1000u || (remainder == 0x1000u && (result & 1u))) ++result;
  return sign | static_cast<std::uint16_t>(result);
}

static inline float bfloat16_to_float(std::uint16_t b) {
  return bits_to_float(static_cast<std::uint32_t>(b) << 16);
}

static inline std::uint16_t float_to_bfloat16(float f) {
  const std::uint32_t bits = float_to_bits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // nan: keep it a quiet nan
    return static_cast<std::uint16_t>((bits >> 16) | 0x40u);
  }
  const std::uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>((bits + rounding) >> 16);
}

}  // namespace ddlfast
