#include "common/linear.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/numeric.h"

namespace karat {
namespace {

std::vector<float> RandomVector(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& f : v) f = dist(rng);
  return v;
}

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// Applies W to `batch` rows of x and checks every element bit for bit
// against LinearReferenceDot. With `bf16` the weights are bf16 values, so
// the packed copy keeps bf16 (and a kFp32 copy must agree with it).
void CheckAgainstReference(int out, int in, int batch, uint32_t seed,
                           bool bf16 = false) {
  std::vector<float> w = RandomVector(static_cast<size_t>(out) * in, seed);
  if (bf16) RoundThroughBf16(w.data(), w.size());
  const std::vector<float> x =
      RandomVector(static_cast<size_t>(batch) * in, seed + 1);
  const LinearWeight lw(w.data(), out, in);
  INFO("out=" << out << " in=" << in << " batch=" << batch << " bf16=" << bf16);
  CHECK(lw.bf16() == bf16);
  std::vector<float> y(static_cast<size_t>(batch) * out, NAN);
  lw.Apply(x.data(), batch, y.data());
  int mismatches = 0;
  for (int b = 0; b < batch; ++b) {
    for (int o = 0; o < out; ++o) {
      const float want = LinearReferenceDot(
          &w[static_cast<size_t>(o) * in], &x[static_cast<size_t>(b) * in], in);
      if (Bits(y[static_cast<size_t>(b) * out + o]) != Bits(want)) ++mismatches;
    }
  }
  CHECK(mismatches == 0);
  if (bf16) {
    const LinearWeight fp32(w.data(), out, in, LinearWeight::Storage::kFp32);
    CHECK_FALSE(fp32.bf16());
    // Half the bytes, up to a padding row per panel for an odd `in`.
    CHECK(2 * lw.bytes() <= fp32.bytes() + 128 * size_t((out + 15) / 16 + 1));
    std::vector<float> y32(y.size(), NAN);
    fp32.Apply(x.data(), batch, y32.data());
    CHECK(std::memcmp(y.data(), y32.data(), y.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("Linear matches the reference order bit for bit", "[linear]") {
  // Hand-picked edge shapes: single elements, panel and segment boundaries
  // (16 outputs, 64 inputs) and one past them.
  const int shapes[][2] = {{1, 1},     {1, 64},  {16, 64},  {17, 65},
                           {15, 63},   {33, 1},  {7, 13},   {64, 128},
                           {65, 129},  {8, 512}, {32, 512}, {258, 512},
                           {100, 200}, {49, 300}};
  uint32_t seed = 1;
  for (const auto& s : shapes) {
    // 97: 17 row blocks, where bf16 weights are widened once per panel
    // group rather than in the tiles.
    for (int batch : {1, 2, 5, 6, 7, 13, 33, 97}) {
      CheckAgainstReference(s[0], s[1], batch, seed++);
      CheckAgainstReference(s[0], s[1], batch, seed++, /*bf16=*/true);
    }
  }
}

TEST_CASE("Linear matches the reference on random shapes", "[linear]") {
  std::mt19937 rng(42);
  std::uniform_int_distribution<int> dim(1, 300);
  std::uniform_int_distribution<int> rows(1, 40);
  for (int trial = 0; trial < 40; ++trial) {
    const int out = dim(rng), in = dim(rng), batch = rows(rng);
    CheckAgainstReference(out, in, batch, 1000 + trial);
    CheckAgainstReference(out, in, batch, 2000 + trial, /*bf16=*/true);
  }
}

TEST_CASE("Linear is batch invariant", "[linear]") {
  const int shapes[][2] = {{258, 512}, {512, 192}, {1536, 128},
                           {7, 13},    {8, 512},   {144, 512}};
  std::vector<int> batches;
  for (int b = 1; b <= 70; ++b) batches.push_back(b);
  batches.push_back(256);
  for (bool bf16 : {false, true})
    for (const auto& s : shapes) {
      const int out = s[0];
      const int in = s[1];
      std::vector<float> w = RandomVector(static_cast<size_t>(out) * in, 7);
      if (bf16) RoundThroughBf16(w.data(), w.size());
      const LinearWeight lw(w.data(), out, in);
      REQUIRE(lw.bf16() == bf16);
      const std::vector<float> x =
          RandomVector(static_cast<size_t>(256) * in, 8);
      // Each row computed alone.
      std::vector<float> alone(static_cast<size_t>(256) * out);
      for (int b = 0; b < 256; ++b) {
        lw.Apply(&x[static_cast<size_t>(b) * in], 1,
                 &alone[static_cast<size_t>(b) * out]);
      }
      for (int batch : batches) {
        // Rows taken from varying places so that a row sits at different
        // positions (and tile slots) in different batches.
        const int first = (batch * 37) % (256 - batch + 1);
        std::vector<float> y(static_cast<size_t>(batch) * out);
        lw.Apply(&x[static_cast<size_t>(first) * in], batch, y.data());
        const bool same =
            std::memcmp(y.data(), &alone[static_cast<size_t>(first) * out],
                        y.size() * sizeof(float)) == 0;
        INFO("out=" << out << " in=" << in << " batch=" << batch
                    << " bf16=" << bf16);
        CHECK(same);
      }
      // And whatever the thread count.
      for (int threads : {1, 2, 3}) {
        std::vector<float> y(static_cast<size_t>(256) * out);
        lw.Apply(x.data(), in, 256, y.data(), out, threads);
        INFO("out=" << out << " in=" << in << " threads=" << threads
                    << " bf16=" << bf16);
        CHECK(std::memcmp(y.data(), alone.data(), y.size() * sizeof(float)) ==
              0);
      }
    }
}

TEST_CASE("Linear is close to a double-precision product", "[linear]") {
  const int shapes[][3] = {
      {258, 512, 9}, {1024, 512, 20}, {512, 1024, 3}, {13, 7, 4}};
  for (const auto& s : shapes) {
    const int out = s[0], in = s[1], batch = s[2];
    const std::vector<float> w = RandomVector(static_cast<size_t>(out) * in, 3);
    const std::vector<float> x =
        RandomVector(static_cast<size_t>(batch) * in, 4);
    const LinearWeight lw(w.data(), out, in);
    std::vector<float> y(static_cast<size_t>(batch) * out);
    lw.Apply(x.data(), batch, y.data());
    for (int b = 0; b < batch; ++b) {
      for (int o = 0; o < out; ++o) {
        double sum = 0.0, mag = 0.0;
        for (int i = 0; i < in; ++i) {
          const double p =
              static_cast<double>(w[static_cast<size_t>(o) * in + i]) *
              x[static_cast<size_t>(b) * in + i];
          sum += p;
          mag += std::fabs(p);
        }
        // fp32 summation error bound ~ in * eps * sum|p|, taken loosely.
        const double tol = 1e-6 * in * mag + 1e-30;
        REQUIRE(std::fabs(y[static_cast<size_t>(b) * out + o] - sum) <= tol);
      }
    }
  }
}

TEST_CASE("Linear honours row strides", "[linear]") {
  const int out = 37, in = 70, batch = 11;
  const int xs = in + 5, ys = out + 9;
  const std::vector<float> w = RandomVector(static_cast<size_t>(out) * in, 5);
  const std::vector<float> x = RandomVector(static_cast<size_t>(batch) * xs, 6);
  const LinearWeight lw(w.data(), out, in);
  const float kSentinel = 12345.0f;
  std::vector<float> y(static_cast<size_t>(batch) * ys, kSentinel);
  lw.Apply(x.data(), xs, batch, y.data(), ys);
  for (int b = 0; b < batch; ++b) {
    for (int o = 0; o < ys; ++o) {
      const float got = y[static_cast<size_t>(b) * ys + o];
      if (o < out) {
        const float want =
            LinearReferenceDot(&w[static_cast<size_t>(o) * in],
                               &x[static_cast<size_t>(b) * xs], in);
        REQUIRE(Bits(got) == Bits(want));
      } else {
        REQUIRE(got == kSentinel);  // padding between rows untouched
      }
    }
  }
}

TEST_CASE("Linear handles empty shapes", "[linear]") {
  const std::vector<float> w = RandomVector(4 * 3, 9);
  const std::vector<float> x = RandomVector(2 * 3, 10);
  const LinearWeight lw(w.data(), 4, 3);
  std::vector<float> y(8, 7.0f);
  lw.Apply(x.data(), 0, y.data());  // batch 0 writes nothing
  for (float v : y) CHECK(v == 7.0f);

  const LinearWeight no_in(nullptr, 4, 0);
  no_in.Apply(x.data(), 2, y.data());
  for (float v : y) CHECK(Bits(v) == Bits(0.0f));
  CHECK(LinearReferenceDot(nullptr, nullptr, 0) == 0.0f);

  const LinearWeight none;
  CHECK(none.empty());
  none.Apply(x.data(), 2, y.data());  // out 0: nothing to do

  // A copied weight keeps working (packed storage is copied, aligned).
  const LinearWeight copy = lw;
  std::vector<float> a(8), b(8);
  lw.Apply(x.data(), 2, a.data());
  copy.Apply(x.data(), 2, b.data());
  CHECK(std::memcmp(a.data(), b.data(), sizeof(float) * 8) == 0);
}

}  // namespace
}  // namespace karat
