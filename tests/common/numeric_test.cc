#include "common/numeric.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace karat {
namespace {

uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}
float FromBits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

// Round-to-nearest-even by brute force: the representable value nearest to
// x, ties to the one with the even code. `values[c]` for codes c ascending
// in magnitude.
uint8_t NearestFp8(float x) {
  if (std::isnan(x)) return 0x7F;
  const float a = std::fabs(x);
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (a >= 448.0f) return sign | 0x7E;
  uint8_t best = 0;
  double best_err = 1e30;
  for (int c = 0; c <= 0x7E; ++c) {
    const double err = std::fabs(double(Fp8E4M3ToFloat(uint8_t(c))) - a);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = uint8_t(c);
      best_err = err;
    }
  }
  return sign | best;
}

TEST_CASE("bf16 rounds to nearest even", "[numeric]") {
  CHECK(FloatToBf16(1.0f) == 0x3F80);
  CHECK(FloatToBf16(-2.0f) == 0xC000);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
  CHECK(FloatToBf16(FromBits(0x3F808000)) == 0x3F80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6: rounds up.
  CHECK(FloatToBf16(FromBits(0x3F818000)) == 0x3F82);
  // Just above half rounds up, just below rounds down.
  CHECK(FloatToBf16(FromBits(0x3F808001)) == 0x3F81);
  CHECK(FloatToBf16(FromBits(0x3F807FFF)) == 0x3F80);
  // -0.0 keeps its sign.
  CHECK(FloatToBf16(-0.0f) == 0x8000);
  CHECK(std::signbit(Bf16ToFloat(0x8000)));
  // Infinities stay infinite; the largest float rounds up to infinity.
  CHECK(FloatToBf16(std::numeric_limits<float>::infinity()) == 0x7F80);
  CHECK(FloatToBf16(-std::numeric_limits<float>::infinity()) == 0xFF80);
  CHECK(FloatToBf16(std::numeric_limits<float>::max()) == 0x7F80);
  // Subnormals round like everything else.
  CHECK(FloatToBf16(FromBits(0x00008000)) == 0x0000);  // tie to even 0
  CHECK(FloatToBf16(FromBits(0x00018000)) == 0x0002);  // tie to even 2
}

TEST_CASE("bf16 keeps NaN a NaN", "[numeric]") {
  // A NaN whose payload sits only in the low 16 bits must not truncate to
  // infinity.
  const float low_payload = FromBits(0x7F800001);
  REQUIRE(std::isnan(low_payload));
  CHECK(std::isnan(Bf16ToFloat(FloatToBf16(low_payload))));
  CHECK(std::isnan(Bf16ToFloat(FloatToBf16(FromBits(0xFFFFFFFF)))));
  CHECK(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
}

TEST_CASE("bf16 round-trips every bf16 value exactly", "[numeric]") {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float x = Bf16ToFloat(uint16_t(b));
    if (std::isnan(x)) {
      CHECK(std::isnan(Bf16ToFloat(FloatToBf16(x))));
      continue;
    }
    REQUIRE(FloatToBf16(x) == b);
  }
}

TEST_CASE("bf16 matches round-to-nearest-even on a sweep", "[numeric]") {
  // Every 4099th float bit pattern (a prime stride hits all low-bit
  // residues), checked against the two neighbouring bf16 values.
  for (uint64_t b = 0; b <= 0xFFFFFFFFull; b += 4099) {
    const float x = FromBits(uint32_t(b));
    if (std::isnan(x)) continue;
    const uint16_t r = FloatToBf16(x);
    const uint32_t lo = uint32_t(b) & 0xFFFF0000u;
    const uint32_t rest = uint32_t(b) & 0xFFFFu;
    uint32_t expect = lo >> 16;
    if (rest > 0x8000 || (rest == 0x8000 && (expect & 1))) ++expect;
    REQUIRE(r == expect);
    // The rounded value is never farther than half an ulp.
    const double err = std::fabs(double(Bf16ToFloat(r)) - double(x));
    if (std::isfinite(Bf16ToFloat(r))) {
      const double ulp = std::ldexp(1.0, std::max(std::ilogb(x), -126) - 7);
      REQUIRE(err <= ulp / 2);
    }
  }
}

TEST_CASE("bulk bf16 helpers agree with the scalar ones", "[numeric]") {
  std::vector<float> x = {0.1f, -3.3f, 1e-30f, 65504.f, 0.0f};
  std::vector<uint16_t> b(x.size());
  std::vector<float> back(x.size());
  FloatToBf16(x.data(), x.size(), b.data());
  Bf16ToFloat(b.data(), b.size(), back.data());
  std::vector<float> rounded = x;
  RoundThroughBf16(rounded.data(), rounded.size());
  for (size_t i = 0; i < x.size(); ++i) {
    CHECK(b[i] == FloatToBf16(x[i]));
    CHECK(back[i] == Bf16ToFloat(FloatToBf16(x[i])));
    CHECK(rounded[i] == back[i]);
  }
}

TEST_CASE("fp8 e4m3 decodes the documented values", "[numeric]") {
  CHECK(Fp8E4M3ToFloat(0x00) == 0.0f);
  CHECK(std::signbit(Fp8E4M3ToFloat(0x80)));
  CHECK(Fp8E4M3ToFloat(0x01) == std::ldexp(1.0f, -9));  // min subnormal
  CHECK(Fp8E4M3ToFloat(0x07) == 7 * std::ldexp(1.0f, -9));
  CHECK(Fp8E4M3ToFloat(0x08) == std::ldexp(1.0f, -6));  // min normal
  CHECK(Fp8E4M3ToFloat(0x38) == 1.0f);
  CHECK(Fp8E4M3ToFloat(0x7E) == 448.0f);
  CHECK(Fp8E4M3ToFloat(0xFE) == -448.0f);
  CHECK(std::isnan(Fp8E4M3ToFloat(0x7F)));
  CHECK(std::isnan(Fp8E4M3ToFloat(0xFF)));
  // 0x78 (exponent 15, mantissa 0) is a finite 256 in E4M3FN.
  CHECK(Fp8E4M3ToFloat(0x78) == 256.0f);
}

TEST_CASE("fp8 round-trips all 256 codes", "[numeric]") {
  for (int c = 0; c < 256; ++c) {
    const float x = Fp8E4M3ToFloat(uint8_t(c));
    if ((c & 0x7F) == 0x7F) {
      CHECK(std::isnan(x));
      CHECK(FloatToFp8E4M3(x) == 0x7F);
      continue;
    }
    REQUIRE(FloatToFp8E4M3(x) == c);
  }
}

TEST_CASE("fp8 rounds to nearest even", "[numeric]") {
  // Between 1.0 (0x38) and 1.125 (0x39): the midpoint ties to even 1.0.
  CHECK(FloatToFp8E4M3(1.0625f) == 0x38);
  CHECK(FloatToFp8E4M3(std::nextafter(1.0625f, 2.0f)) == 0x39);
  // Between 1.125 (odd) and 1.25: the midpoint rounds up to 1.25.
  CHECK(FloatToFp8E4M3(1.1875f) == 0x3A);
  CHECK(FloatToFp8E4M3(std::nextafter(1.1875f, 0.0f)) == 0x39);
  // Subnormals: halfway between 0 and 2^-9 ties to 0; 1.5 * 2^-9 ties to
  // 2 * 2^-9; anything above 2^-10 goes to the min subnormal.
  CHECK(FloatToFp8E4M3(std::ldexp(1.0f, -10)) == 0x00);
  CHECK(FloatToFp8E4M3(-std::ldexp(1.0f, -10)) == 0x80);
  CHECK(FloatToFp8E4M3(std::nextafter(std::ldexp(1.0f, -10), 1.0f)) == 0x01);
  CHECK(FloatToFp8E4M3(1.5f * std::ldexp(1.0f, -9)) == 0x02);
  CHECK(FloatToFp8E4M3(2.5f * std::ldexp(1.0f, -9)) == 0x02);
  // 7.5 * 2^-9 is halfway between the largest subnormal (odd) and the
  // smallest normal: rounds up into the normal range.
  CHECK(FloatToFp8E4M3(7.5f * std::ldexp(1.0f, -9)) == 0x08);
  CHECK(FloatToFp8E4M3(1e-30f) == 0x00);
  // Rounding up across an exponent boundary: 1.9375 -> 2.0.
  CHECK(FloatToFp8E4M3(1.9375f) == 0x40);
}

TEST_CASE("fp8 saturates at 448 and maps NaN to 0x7F", "[numeric]") {
  CHECK(FloatToFp8E4M3(448.0f) == 0x7E);
  CHECK(FloatToFp8E4M3(500.0f) == 0x7E);
  CHECK(FloatToFp8E4M3(-500.0f) == 0xFE);
  // 464 is the midpoint between 448 and the (unrepresentable) 480.
  CHECK(FloatToFp8E4M3(464.0f) == 0x7E);
  CHECK(FloatToFp8E4M3(std::nextafter(464.0f, 0.0f)) == 0x7E);
  CHECK(FloatToFp8E4M3(std::nextafter(464.0f, 1000.0f)) == 0x7E);
  CHECK(FloatToFp8E4M3(1e30f) == 0x7E);
  CHECK(FloatToFp8E4M3(std::numeric_limits<float>::infinity()) == 0x7E);
  CHECK(FloatToFp8E4M3(-std::numeric_limits<float>::infinity()) == 0xFE);
  // 432 (0x7D) and 448 tie at 440: even mantissa 6 wins.
  CHECK(FloatToFp8E4M3(440.0f) == 0x7E);
  CHECK(FloatToFp8E4M3(std::nanf("")) == 0x7F);
  CHECK(FloatToFp8E4M3(-std::nanf("")) == 0x7F);
  CHECK(FloatToFp8E4M3(-0.0f) == 0x80);
  CHECK(FloatToFp8E4M3(0.0f) == 0x00);
}

TEST_CASE("fp8 matches brute-force nearest on a dense sweep", "[numeric]") {
  // All float bit patterns from 2^-12 to 512 at a stride that visits
  // midpoints, both signs.
  for (uint32_t b = Bits(std::ldexp(1.0f, -12)); b <= Bits(512.0f); b += 1021) {
    for (float x : {FromBits(b), -FromBits(b)}) {
      REQUIRE(FloatToFp8E4M3(x) == NearestFp8(x));
    }
  }
  // Every midpoint between neighbouring codes, exactly.
  for (int c = 0; c < 0x7E; ++c) {
    const float mid =
        (Fp8E4M3ToFloat(uint8_t(c)) + Fp8E4M3ToFloat(uint8_t(c + 1))) / 2;
    REQUIRE(FloatToFp8E4M3(mid) == ((c & 1) ? c + 1 : c));
  }
}

TEST_CASE("QuantizeFp8 scales by amax / 448", "[numeric]") {
  std::vector<float> x = {0.5f, -2.0f, 1.0f, 0.0f};
  std::vector<uint8_t> codes(x.size());
  const float scale = QuantizeFp8(x.data(), x.size(), codes.data());
  CHECK(scale == 2.0f / 448.0f);
  CHECK(codes[1] == 0xFE);  // -amax -> -448
  for (size_t i = 0; i < x.size(); ++i) {
    CHECK(codes[i] == FloatToFp8E4M3(x[i] / scale));
    const float back = Fp8E4M3ToFloat(codes[i]) * scale;
    CHECK(std::fabs(back - x[i]) <= std::fabs(x[i]) / 16 + 1e-12f);
  }
  // All zeros: the floor 1e-4 keeps the scale positive.
  std::vector<float> zeros(8, 0.0f);
  std::vector<uint8_t> zc(8, 0xAA);
  CHECK(QuantizeFp8(zeros.data(), zeros.size(), zc.data()) == 1e-4f / 448.0f);
  for (uint8_t c : zc) CHECK(c == 0);
}

TEST_CASE("QuantizeFp8 equals the scalar code of x / scale, every case",
          "[numeric]") {
  // QuantizeFp8 may compute 16 lanes at a time; it must give exactly the
  // scale of the largest non-NaN |x| and FloatToFp8E4M3(x / scale) for
  // each element:
  // normal and subnormal codes, ties, saturation, NaN and infinities, and
  // every length up to a few vectors (tails).
  uint32_t seed = 12345;
  auto next = [&seed]() {
    seed = seed * 1664525u + 1013904223u;
    return seed;
  };
  for (int trial = 0; trial < 400; ++trial) {
    const size_t n = 1 + trial % 70;
    std::vector<float> x(n);
    for (auto& v : x) {
      const uint32_t r = next();
      switch (r % 8) {
        case 0:  // any bit pattern: NaN, infinity, subnormal included
          v = FromBits(next());
          break;
        case 7:  // NaN of either kind (signalling ones too) and sign
          v = FromBits(0x7F800001u | (next() & 0x807FFFFFu));
          break;
        case 1:  // a tiny value: a subnormal code after scaling
          v = float(int(next() % 2001) - 1000) * 1e-7f;
          break;
        case 2:  // an exact code value times a power of 2: ties nearby
          v = Fp8E4M3ToFloat(uint8_t(next() % 256)) * 0.5f;
          break;
        default:
          v = (float(next() % 20001) - 10000.0f) / 1000.0f;
      }
    }
    if (trial % 5 == 0) x[next() % n] = std::numeric_limits<float>::infinity();
    float amax = 0.0f;  // NaN never counts
    for (float v : x) {
      if (!std::isnan(v)) amax = std::max(amax, std::fabs(v));
    }
    const float want_scale = std::fmax(amax, 1e-4f) / 448.0f;
    std::vector<uint8_t> codes(n + 1, 0xAA);
    const float scale = QuantizeFp8(x.data(), n, codes.data());
    INFO("trial " << trial << ", n " << n);
    CHECK(Bits(scale) == Bits(want_scale));
    for (size_t i = 0; i < n; ++i) {
      INFO("x " << x[i] << " (bits " << Bits(x[i]) << ")");
      CHECK(codes[i] == FloatToFp8E4M3(x[i] / want_scale));
    }
    CHECK(codes[n] == 0xAA);  // nothing written past the end
  }
}

}  // namespace
}  // namespace karat
