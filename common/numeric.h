// Numeric storage formats of MODEL.md: bf16 (KV cache, weights on disk) and
// fp8 e4m3 with one fp32 scale per vector (DSA index keys, indexer queries).
// All conversions round to nearest even. Pure functions, thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

namespace karat {

// bf16: the top 16 bits of an IEEE fp32, rounded to nearest even. NaN stays
// NaN (quiet), infinities stay infinite.
uint16_t FloatToBf16(float x);
float Bf16ToFloat(uint16_t b);

// fp8 e4m3 (OCP "E4M3FN": bias 7, no infinities, 0x7F/0xFF are NaN, max
// finite 448). Round to nearest even; finite values beyond ±448 saturate to
// ±448; NaN maps to NaN (0x7F).
uint8_t FloatToFp8E4M3(float x);
float Fp8E4M3ToFloat(uint8_t code);

// Quantises `n` values to fp8 codes with one scale:
// scale = max(amax, 1e-4) / 448 (amax: the largest |x[i]| that is not NaN);
// codes[i] = FloatToFp8E4M3(x[i] / scale).
// Returns the scale. Decoding is `Fp8E4M3ToFloat(code) * scale`.
float QuantizeFp8(const float* x, size_t n, uint8_t* codes);

// Bulk helpers.
void FloatToBf16(const float* x, size_t n, uint16_t* out);
void Bf16ToFloat(const uint16_t* b, size_t n, float* out);
// Rounds each value through bf16 in place (what storing in bf16 and reading
// back does).
void RoundThroughBf16(float* x, size_t n);

}  // namespace karat
