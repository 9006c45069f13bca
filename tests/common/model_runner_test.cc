// The forward pass: batch invariance, chunking invariance, multi-turn
// equivalence and sampling, on a small generated model.
#include <catch2/catch.hpp>

#include <cstring>

#include "common/model_runner.h"
#include "common/reference_engine.h"
#include "common/tokenizer.h"
#include "common/weights.h"

namespace karat {
namespace {

ModelFiles SmallModel(const std::string& preset = "dsa-small") {
  ModelFiles f;
  auto cfg = PresetConfig(preset);
  REQUIRE(cfg.ok());
  f.config = *cfg;
  f.tensors = GenerateWeights(f.config, 1);
  return f;
}

std::vector<int32_t> Prompt(int i, int len) {
  std::vector<int32_t> p{kBosToken};
  for (int j = 0; j < len; ++j) p.push_back((i * 37 + j * 11) % 256);
  return p;
}

TEST_CASE("logits are bit-identical alone and inside a batch of 16",
          "[model]") {
  ModelFiles f = SmallModel();
  auto runner = ModelRunner::Create(f);
  REQUIRE(runner.ok());
  const int kBatch = 16;
  // Each request alone: its own backend, a prefill then one decode step.
  std::vector<std::vector<float>> alone_prefill(kBatch), alone_decode(kBatch);
  for (int i = 0; i < kBatch; ++i) {
    LocalAttentionBackend be(f.config, 16, size_t(64) << 20);
    REQUIRE(be.Init().ok());
    REQUIRE(be.Reserve(i + 1, 64).ok());
    Segment seg{uint64_t(i + 1), 0, Prompt(i, 5 + i)};
    auto l1 = (*runner)->Step({seg}, &be);
    REQUIRE(l1.ok());
    alone_prefill[i] = (*l1)[0];
    Segment dec{uint64_t(i + 1), int(seg.tokens.size()), {42}};
    auto l2 = (*runner)->Step({dec}, &be);
    REQUIRE(l2.ok());
    alone_decode[i] = (*l2)[0];
  }
  // All 16 in one batch.
  LocalAttentionBackend be(f.config, 16, size_t(64) << 20);
  REQUIRE(be.Init().ok());
  std::vector<Segment> pre, dec;
  for (int i = 0; i < kBatch; ++i) {
    REQUIRE(be.Reserve(i + 1, 64).ok());
    pre.push_back({uint64_t(i + 1), 0, Prompt(i, 5 + i)});
    dec.push_back({uint64_t(i + 1), int(pre.back().tokens.size()), {42}});
  }
  auto b1 = (*runner)->Step(pre, &be);
  REQUIRE(b1.ok());
  auto b2 = (*runner)->Step(dec, &be);
  REQUIRE(b2.ok());
  for (int i = 0; i < kBatch; ++i) {
    const size_t bytes = alone_prefill[i].size() * sizeof(float);
    CHECK(std::memcmp((*b1)[i].data(), alone_prefill[i].data(), bytes) == 0);
    CHECK(std::memcmp((*b2)[i].data(), alone_decode[i].data(), bytes) == 0);
  }
}

TEST_CASE("chunked prefill and multi-turn give the same tokens", "[model]") {
  ModelFiles f = SmallModel();
  // Long enough that the context exceeds index_topk and the top-k is sparse.
  std::string p1(90, 'a'), p2 = "second turn";
  for (size_t i = 0; i < p1.size(); ++i) p1[i] = char('a' + (i * 7) % 26);

  ReferenceOptions whole;
  ReferenceOptions chunked;
  chunked.prefill_chunk = 7;
  auto e1 = ReferenceEngine::Create(f, whole);
  auto e2 = ReferenceEngine::Create(f, chunked);
  REQUIRE(e1.ok());
  REQUIRE(e2.ok());
  ReferenceSession s1, s2;
  auto a1 = (*e1)->RunTurn(&s1, EncodeText(p1), 12, 0.0f);
  auto b1 = (*e2)->RunTurn(&s2, EncodeText(p1), 12, 0.0f);
  REQUIRE(a1.ok());
  REQUIRE(b1.ok());
  CHECK(*a1 == *b1);
  auto a2 = (*e1)->RunTurn(&s1, EncodeText(p2), 12, 0.0f);
  REQUIRE(a2.ok());

  // One turn over the whole history gives turn 2's tokens.
  auto e3 = ReferenceEngine::Create(f, whole);
  REQUIRE(e3.ok());
  ReferenceSession s3;
  std::vector<int32_t> hist = EncodeText(p1);
  hist.insert(hist.end(), a1->begin(), a1->end());
  auto p2ids = EncodeText(p2);
  hist.insert(hist.end(), p2ids.begin(), p2ids.end());
  auto c = (*e3)->RunTurn(&s3, hist, 12, 0.0f);
  REQUIRE(c.ok());
  CHECK(*c == *a2);
}

TEST_CASE("sampling: greedy ties to the lower id; seeded draws repeat",
          "[model]") {
  std::vector<float> l = {0.5f, 2.0f, 2.0f, -1.0f};
  CHECK(SampleToken(l, 0.0f, 1, 0) == 1);
  std::vector<float> flat(258, 0.0f);
  int a = SampleToken(flat, 1.0f, 99, 10), b = SampleToken(flat, 1.0f, 99, 10);
  CHECK(a == b);
  // u for (seed 0, position 0) picks the id floor(u * 258) from a flat
  // distribution (up to rounding at a boundary).
  const uint64_t key = 0 ^ (0x9E3779B97F4A7C15ull * 1);
  const double u = double(SplitMix64(key) >> 11) * 0x1.0p-53;
  CHECK(SampleToken(flat, 1.0f, 0, 0) == int(u * 258));
  // Different positions give different draws somewhere.
  bool differs = false;
  for (int p = 1; p < 20; ++p) differs |= SampleToken(flat, 1.0f, 5, p) != a;
  CHECK(differs);
}

}  // namespace
}  // namespace karat
