#include "common/numeric.h"

#include <cmath>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "common/simd_reduce.h"
// GCC 12 reports its own AVX-512 intrinsic headers (_mm512_undefined_*)
// as (maybe-)uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace karat {
namespace {

uint32_t FloatBits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

float BitsToFloat(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

constexpr float Pow2(int e) {
  float r = 1.0f;
  for (; e > 0; --e) r *= 2.0f;
  for (; e < 0; ++e) r *= 0.5f;
  return r;
}

// All 256 decoded fp8 values, built at compile time so that decoding is a
// load on the index-scoring hot path and safe during static initialisation.
struct Fp8Table {
  float v[256] = {};
  constexpr Fp8Table() {
    for (int c = 0; c < 256; ++c) {
      const int e = (c >> 3) & 0xF;
      const int m = c & 7;
      float mag;
      if (e == 0xF && m == 7) {
        mag = __builtin_nanf("");
      } else if (e == 0) {
        mag = static_cast<float>(m) * Pow2(-9);
      } else {
        mag = static_cast<float>(8 + m) * Pow2(e - 10);
      }
      v[c] = (c & 0x80) ? -mag : mag;
    }
  }
};
constexpr Fp8Table kFp8Table;

}  // namespace

uint16_t FloatToBf16(float x) {
  const uint32_t b = FloatBits(x);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) {
    // Keep sign and payload top bits; force quiet so truncation cannot turn a
    // NaN into an infinity.
    return static_cast<uint16_t>((b >> 16) | 0x0040u);
  }
  const uint32_t rounded = b + 0x7FFFu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(rounded >> 16);
}

float Bf16ToFloat(uint16_t b) { return BitsToFloat(uint32_t{b} << 16); }

uint8_t FloatToFp8E4M3(float x) {
  const uint32_t b = FloatBits(x);
  const uint8_t sign = static_cast<uint8_t>((b >> 24) & 0x80u);
  const uint32_t mag = b & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return 0x7F;
  // 2^-6 is the smallest normal e4m3 value.
  if (mag < 0x3C800000u) {
    // Subnormal range: the value is m * 2^-9 with m in [0, 8]; scaling by a
    // power of two is exact, so rounding the scaled value is the whole job.
    // m == 8 lands on code 0x08, the smallest normal, as it should.
    // v < 8 here; round it to an integer with ties to even by hand so the
    // result does not depend on the FP environment's rounding mode.
    const float v = BitsToFloat(mag) * 512.0f;
    uint32_t m = static_cast<uint32_t>(v);
    const float frac = v - static_cast<float>(m);
    if (frac > 0.5f || (frac == 0.5f && (m & 1u))) ++m;
    return static_cast<uint8_t>(sign | m);
  }
  // Normal: keep 3 mantissa bits, round the 20 dropped bits to nearest even.
  const uint32_t rounded = mag + 0x7FFFFu + ((mag >> 20) & 1u);
  const int exp = static_cast<int>(rounded >> 23) - 127 + 7;
  const uint32_t mant = (rounded >> 20) & 7u;
  // 448 = exponent 15, mantissa 6; anything larger (including infinity)
  // saturates.
  if (exp > 15 || (exp == 15 && mant > 6))
    return static_cast<uint8_t>(sign | 0x7E);
  return static_cast<uint8_t>(sign | (exp << 3) | mant);
}

float Fp8E4M3ToFloat(uint8_t code) { return kFp8Table.v[code]; }

#if defined(__AVX512F__) && defined(__AVX512BW__)
namespace {

// FloatToFp8E4M3 on 16 lanes, bit for bit: the same cases, as masks.
__m128i FloatToFp8E4M3x16(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i sign =
      _mm512_and_si512(_mm512_srli_epi32(b, 24), _mm512_set1_epi32(0x80));
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF));
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(mag, _mm512_set1_epi32(0x7F800000));
  const __mmask16 sub =
      _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(0x3C800000));
  // Subnormal: round |x| * 2^9 (< 8, exact) to an integer, ties to even.
  const __m512 v =
      _mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(512.0f));
  const __m512i m = _mm512_cvttps_epi32(
      _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  // Normal: 3 mantissa bits, the 20 dropped ones rounded to nearest even.
  const __m512i rounded = _mm512_add_epi32(
      _mm512_add_epi32(mag, _mm512_set1_epi32(0x7FFFF)),
      _mm512_and_si512(_mm512_srli_epi32(mag, 20), _mm512_set1_epi32(1)));
  const __m512i exp = _mm512_sub_epi32(_mm512_srli_epi32(rounded, 23),
                                       _mm512_set1_epi32(127 - 7));
  const __m512i mant =
      _mm512_and_si512(_mm512_srli_epi32(rounded, 20), _mm512_set1_epi32(7));
  // exp > 15, or exp == 15 with mantissa > 6 (beyond 448): saturate, that
  // is exp << 3 | mant > 0x7E.
  const __m512i em = _mm512_or_si512(_mm512_slli_epi32(exp, 3), mant);
  const __mmask16 sat = _mm512_cmpgt_epi32_mask(em, _mm512_set1_epi32(0x7E));
  __m512i code = _mm512_mask_mov_epi32(em, sat, _mm512_set1_epi32(0x7E));
  code = _mm512_mask_mov_epi32(code, sub, m);
  code = _mm512_or_si512(code, sign);
  code = _mm512_mask_mov_epi32(code, nan, _mm512_set1_epi32(0x7F));
  return _mm512_cvtepi32_epi8(code);
}

}  // namespace
#endif

float QuantizeFp8(const float* x, size_t n, uint8_t* codes) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // The same arithmetic 16 at a time; NaN lanes are left out of the
  // maximum, and division is IEEE in both.
  __m512 vmax = _mm512_setzero_ps();
  size_t i = 0;
  for (; i < n; i += 16) {
    const __mmask16 m = FirstLanes16(int64_t(n - i));
    const __m512 a = _mm512_abs_ps(_mm512_maskz_loadu_ps(m, x + i));
    const __mmask16 num = _mm512_mask_cmp_ps_mask(m, a, a, _CMP_ORD_Q);
    vmax = _mm512_mask_max_ps(vmax, num, vmax, a);
  }
  const float amax = _mm512_reduce_max_ps(vmax);
  const float scale = std::fmax(amax, 1e-4f) / 448.0f;
  const __m512 vs = _mm512_set1_ps(scale);
  for (i = 0; i < n; i += 16) {
    const __mmask16 m = FirstLanes16(int64_t(n - i));
    const __m128i c =
        FloatToFp8E4M3x16(_mm512_div_ps(_mm512_maskz_loadu_ps(m, x + i), vs));
    _mm_mask_storeu_epi8(codes + i, m, c);
  }
  return scale;
#else
  float amax = 0.0f;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isnan(x[i])) amax = std::fmax(amax, std::fabs(x[i]));
  }
  const float scale = std::fmax(amax, 1e-4f) / 448.0f;
  for (size_t i = 0; i < n; ++i) codes[i] = FloatToFp8E4M3(x[i] / scale);
  return scale;
#endif
}

void FloatToBf16(const float* x, size_t n, uint16_t* out) {
  for (size_t i = 0; i < n; ++i) out[i] = FloatToBf16(x[i]);
}

void Bf16ToFloat(const uint16_t* b, size_t n, float* out) {
  for (size_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(b[i]);
}

void RoundThroughBf16(float* x, size_t n) {
  for (size_t i = 0; i < n; ++i) x[i] = Bf16ToFloat(FloatToBf16(x[i]));
}

}  // namespace karat
