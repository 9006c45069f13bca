// The forward pass: batch invariance, chunking invariance, multi-turn
// equivalence and sampling, on a small generated model.
#include "common/model_runner.h"

#include <catch2/catch.hpp>
#include <cstring>

#include "common/reference_engine.h"
#include "common/stable_hash.h"
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

// Computes each routed expert on the runner of the rank that owns it, as
// expert parallelism does across processes.
class ShardedExperts : public ExpertBackend {
 public:
  explicit ShardedExperts(std::vector<const ModelRunner*> ranks)
      : ranks_(std::move(ranks)) {}
  absl::Status RunExperts(const ExpertWork& work,
                          std::vector<std::vector<float>>* out) override {
    const int D = ranks_[0]->config().hidden_size;
    out->assign(work.rows_of.size(), {});
    for (size_t e = 0; e < work.rows_of.size(); ++e) {
      const auto& rows = work.rows_of[e];
      if (rows.empty()) continue;
      (*out)[e].resize(rows.size() * D);
      const ModelRunner* owner = ranks_[ranks_[0]->ExpertOwner(int(e))];
      absl::Status s =
          owner->ApplyExpert(work.layer, int(e), work.xn, rows.data(),
                             int(rows.size()), (*out)[e].data());
      if (!s.ok()) return s;
    }
    ++calls;
    return absl::OkStatus();
  }
  int calls = 0;

 private:
  std::vector<const ModelRunner*> ranks_;
};

TEST_CASE("experts sharded over ranks give the same logits", "[model]") {
  ModelFiles f = SmallModel();
  auto whole = ModelRunner::Create(f);
  REQUIRE(whole.ok());
  const int E = f.config.n_routed_experts;  // 8
  std::vector<std::unique_ptr<ModelRunner>> shards;
  std::vector<const ModelRunner*> ranks;
  for (int r = 0; r < 4; ++r) {
    auto s = ModelRunner::Create(f, RunnerOptions{r, 4});
    REQUIRE(s.ok());
    ranks.push_back(s->get());
    shards.push_back(std::move(*s));
  }
  for (int e = 0; e < E; ++e) {
    CHECK(ranks[0]->ExpertOwner(e) == e / 2);
    CHECK(ranks[e / 2]->OwnsExpert(e));
    CHECK_FALSE(ranks[(e / 2 + 1) % 4]->OwnsExpert(e));
    CHECK((*whole)->OwnsExpert(e));
  }
  CHECK(ranks[0]->ExpertOwner(E) == -1);
  CHECK(ranks[0]->ExpertOwner(-1) == -1);

  ShardedExperts experts(ranks);
  std::vector<Segment> pre, dec;
  for (int i = 0; i < 4; ++i) {
    pre.push_back({uint64_t(i + 1), 0, Prompt(i, 9 + 4 * i)});
    dec.push_back({uint64_t(i + 1), int(pre.back().tokens.size()), {42}});
  }
  std::vector<std::vector<float>> want, got;
  for (int pass = 0; pass < 2; ++pass) {
    LocalAttentionBackend be(f.config, 16, size_t(64) << 20);
    REQUIRE(be.Init().ok());
    for (int i = 0; i < 4; ++i) REQUIRE(be.Reserve(i + 1, 64).ok());
    // Rank 1's runner with experts from every rank, or the whole model.
    const ModelRunner& runner = pass == 0 ? **whole : *ranks[1];
    ExpertBackend* backend = pass == 0 ? nullptr : &experts;
    auto a = runner.Step(pre, &be, backend);
    REQUIRE(a.ok());
    auto b = runner.Step(dec, &be, backend);
    REQUIRE(b.ok());
    auto& dst = pass == 0 ? want : got;
    dst.insert(dst.end(), a->begin(), a->end());
    dst.insert(dst.end(), b->begin(), b->end());
  }
  CHECK(experts.calls ==
        2 * (f.config.num_hidden_layers - f.config.first_k_dense_replace));
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    CHECK(std::memcmp(got[i].data(), want[i].data(),
                      want[i].size() * sizeof(float)) == 0);
  }

  // Without an expert backend a shard cannot run a step that routes to
  // another rank's experts; ApplyExpert refuses experts it does not own.
  LocalAttentionBackend be(f.config, 16, size_t(64) << 20);
  REQUIRE(be.Init().ok());
  REQUIRE(be.Reserve(1, 64).ok());
  auto refused = ranks[1]->Step({pre[0]}, &be);
  CHECK(refused.status().code() == absl::StatusCode::kFailedPrecondition);
  std::vector<float> row(f.config.hidden_size, 0.5f), y(f.config.hidden_size);
  const int32_t first = 0;
  const int moe_layer = f.config.first_k_dense_replace;
  CHECK(ranks[1]
            ->ApplyExpert(moe_layer, 0, row.data(), &first, 1, y.data())
            .code() == absl::StatusCode::kFailedPrecondition);
  CHECK(ranks[1]
            ->ApplyExpert(moe_layer, 2, row.data(), &first, 1, y.data())
            .ok());
  CHECK(ranks[1]->ApplyExpert(0, 2, row.data(), &first, 1, y.data()).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(ranks[1]
            ->ApplyExpert(moe_layer, E, row.data(), &first, 1, y.data())
            .code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("expert sharding must divide the experts evenly", "[model]") {
  ModelFiles f = SmallModel();
  auto three = ModelRunner::Create(f, RunnerOptions{0, 3});
  CHECK(three.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(three.status().message().find("n_routed_experts (8)") !=
        std::string::npos);
  CHECK(ModelRunner::Create(f, RunnerOptions{1, 1}).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(ModelRunner::Create(f, RunnerOptions{0, 0}).status().code() ==
        absl::StatusCode::kInvalidArgument);
  // A dense model has nothing to shard: any rank count works.
  ModelFiles dense = SmallModel("llama-small");
  REQUIRE(dense.config.n_routed_experts == 0);
  CHECK(ModelRunner::Create(dense, RunnerOptions{2, 3}).ok());
}

}  // namespace
}  // namespace karat
