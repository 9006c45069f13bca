#include "common/numeric.h"

#include <cmath>
#include <cstring>

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

float QuantizeFp8(const float* x, size_t n, uint8_t* codes) {
  float amax = 0.0f;
  for (size_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float scale = std::fmax(amax, 1e-4f) / 448.0f;
  for (size_t i = 0; i < n; ++i) codes[i] = FloatToFp8E4M3(x[i] / scale);
  return scale;
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
