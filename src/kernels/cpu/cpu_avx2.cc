// AVX2 + F16C kernels. This file alone is compiled with -mavx2 -mf16c; it is
// only entered after the CPU reported both features.
#include <immintrin.h>

#include <type_traits>

#include "kernels/cpu/combine_generic.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/exact_generic.h"
#include "kernels/cpu/reduce_generic.h"

namespace ddlfast {
namespace {

// fp16: F16C converts 8 lanes at a time; rounding is IEEE nearest-even, the
// same as float_to_half, so both paths give the same bits.
void reduce_fp16(void* dst_v, const void* src_v, std::size_t n, int divisor) {
  auto* dst = static_cast<std::uint16_t*>(dst_v);
  const auto* src = static_cast<const std::uint16_t*>(src_v);
  const float scale_value = divisor == 1 ? 1.0f : 1.0f / static_cast<float>(divisor);
  const __m256 scale = _mm256_set1_ps(scale_value);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dst + i)));
    __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    __m256 sum = _mm256_add_ps(a, b);
    if (divisor != 1) sum = _mm256_mul_ps(sum, scale);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(sum, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) dst[i] = float_to_half((half_to_float(dst[i]) + half_to_float(src[i])) * scale_value);
}

inline __m256 bf16x8_to_ps(const std::uint16_t* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Round to nearest even, quiet nans: the vector form of float_to_bfloat16.
inline __m128i ps_to_bf16x8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                            _mm256_set1_epi32(0x7f800000));
  const __m256i quiet_nan = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
  const __m256i chosen = _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet_nan, is_nan), 16);
  // Pack 8 x u32 (each < 65536) into 8 x u16; packus works per 128-bit lane.
  const __m256i packed = _mm256_packus_epi32(chosen, chosen);
  const __m256i ordered = _mm256_permute4x64_epi64(packed, 0x08);
  return _mm256_castsi256_si128(ordered);
}

void reduce_bf16(void* dst_v, const void* src_v, std::size_t n, int divisor) {
  auto* dst = static_cast<std::uint16_t*>(dst_v);
  const auto* src = static_cast<const std::uint16_t*>(src_v);
  const float scale_value = divisor == 1 ? 1.0f : 1.0f / static_cast<float>(divisor);
  const __m256 scale = _mm256_set1_ps(scale_value);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 sum = _mm256_add_ps(bf16x8_to_ps(dst + i), bf16x8_to_ps(src + i));
    if (divisor != 1) sum = _mm256_mul_ps(sum, scale);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), ps_to_bf16x8(sum));
  }
  for (; i < n; ++i) dst[i] = float_to_bfloat16((bfloat16_to_float(dst[i]) + bfloat16_to_float(src[i])) * scale_value);
}

// A nan lane becomes float32's canonical nan, which both conversions below
// turn into their type's canonical nan (combine_generic.h).
inline __m256 canonical_nan_lanes(__m256 x) {
  const __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_blendv_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), is_nan);
}

inline void store_fp16x8(std::uint16_t* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

inline void store_bf16x8(std::uint16_t* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), ps_to_bf16x8(v));
}

inline __m256 load_fp16x8(const std::uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Halves' product: exact in fp32, rounded once to the type (as NumPy does).
template <__m256 (*Load)(const std::uint16_t*), void (*Store)(std::uint16_t*, __m256), float (*ToFloat)(std::uint16_t),
          std::uint16_t (*FromFloat)(float)>
void product_half(void* dst_v, const void* src_v, std::size_t n) {
  auto* dst = static_cast<std::uint16_t*>(dst_v);
  const auto* src = static_cast<const std::uint16_t*>(src_v);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) Store(dst + i, canonical_nan_lanes(_mm256_mul_ps(Load(dst + i), Load(src + i))));
  combine::product_half_scalar<ToFloat, FromFloat>(dst + i, src + i, n - i);
}

constexpr auto product_fp16 = &product_half<load_fp16x8, store_fp16x8, half_to_float, float_to_half>;
constexpr auto product_bf16 = &product_half<bf16x8_to_ps, store_bf16x8, bfloat16_to_float, float_to_bfloat16>;

// Lanes whose finite input rounds to inf (|x| in [overflow_from, FLT_MAX]).
inline int overflowing_lanes(__m256 x, __m256 overflow_from) {
  const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  const __m256 too_big = _mm256_cmp_ps(magnitude, overflow_from, _CMP_GE_OQ);
  const __m256 finite = _mm256_cmp_ps(magnitude, _mm256_set1_ps(3.4028235e38f), _CMP_LE_OQ);
  return __builtin_popcount(static_cast<unsigned>(_mm256_movemask_ps(_mm256_and_ps(too_big, finite))));
}

std::size_t encode_fp16(void* dst_v, const float* src, std::size_t n) {
  auto* dst = static_cast<std::uint16_t*>(dst_v);
  const __m256 overflow_from = _mm256_set1_ps(kFp16OverflowFrom);
  std::size_t overflows = 0;
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    overflows += overflowing_lanes(x, overflow_from);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  return overflows + generic::encode_scalar<float_to_half, 0>(dst + i, src + i, n - i);
}

std::size_t encode_bf16(void* dst_v, const float* src, std::size_t n) {
  auto* dst = static_cast<std::uint16_t*>(dst_v);
  const __m256 overflow_from = _mm256_set1_ps(kBf16OverflowFrom);
  std::size_t overflows = 0;
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    overflows += overflowing_lanes(x, overflow_from);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), ps_to_bf16x8(x));
  }
  return overflows + generic::encode_scalar<float_to_bfloat16, 1>(dst + i, src + i, n - i);
}

inline __m256 fp16x8_to_ps(const std::uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <__m256 (*Load)(const std::uint16_t*), float (*ToFloat)(std::uint16_t)>
void decode_wire(float* dst, const void* src_v, std::size_t n) {
  const auto* src = static_cast<const std::uint16_t*>(src_v);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, Load(src + i));
  for (; i < n; ++i) dst[i] = ToFloat(src[i]);
}

template <__m256 (*Load)(const std::uint16_t*), float (*ToFloat)(std::uint16_t)>
void accumulate_wire(float* dst, const void* src_v, std::size_t n, int divisor) {
  const auto* src = static_cast<const std::uint16_t*>(src_v);
  const float scale_value = divisor == 1 ? 1.0f : 1.0f / static_cast<float>(divisor);
  const __m256 scale = _mm256_set1_ps(scale_value);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 sum = _mm256_add_ps(_mm256_loadu_ps(dst + i), Load(src + i));
    if (divisor != 1) sum = _mm256_mul_ps(sum, scale);
    _mm256_storeu_ps(dst + i, sum);
  }
  for (; i < n; ++i) dst[i] = divisor == 1 ? dst[i] + ToFloat(src[i]) : (dst[i] + ToFloat(src[i])) * scale_value;
}

}  // namespace

const KernelTable* avx2_kernels() {
  static const bool supported = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  static const KernelTable table = {
      "avx2+f16c",
      {
          &generic::reduce_float<float>,
          &generic::reduce_float<double>,
          &reduce_fp16,
          &reduce_bf16,
          &generic::reduce_int<std::int32_t>,
          &generic::reduce_int<std::int64_t>,
      },
      {&encode_fp16, &encode_bf16},
      {&decode_wire<fp16x8_to_ps, half_to_float>, &decode_wire<bf16x8_to_ps, bfloat16_to_float>},
      {&accumulate_wire<fp16x8_to_ps, half_to_float>, &accumulate_wire<bf16x8_to_ps, bfloat16_to_float>},
      {&exact::split_int<std::int32_t>, &exact::split_int<std::int64_t>},
      {&exact::join_int<std::int32_t>, &exact::join_int<std::int64_t>},
      {&exact::any_nonfinite<exact::kFp16Exponent>, &exact::any_nonfinite<exact::kBf16Exponent>},
      combine::table<product_fp16, product_bf16>(),
  };
  return supported ? &table : nullptr;
}

}  // namespace ddlfast
