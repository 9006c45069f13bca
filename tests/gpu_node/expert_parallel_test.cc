// Expert-parallel MoE over an in-process FakeFabric: G ranks, each with its
// own ModelRunner (rank r of G) and ExpertParallel, must produce logits
// bit-identical to a single-rank runner, for prefill and decode, with two
// micro-batches of one rank running at once; dispatches only where rows
// go, split to fit the frame limit; experts taken over and given back.
// The failure paths are in expert_parallel_peers_test.cc, lossy and broken
// links in expert_parallel_links_test.cc.
#include "gpu_node/expert_parallel.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/frame.h"
#include "common/model_runner.h"
#include "common/transport.h"
#include "common/weights.h"
#include "tests/gpu_node/expert_parallel_fixtures.h"

namespace karat {
namespace {

using namespace moe_test;  // NOLINT: the fixtures of these tests

// Runs, on every rank at once, one stream per micro-batch (two on rank 0,
// one on the others) and checks every logit against a single-rank runner.
void CheckAgainstOneRank(const std::string& preset, int ranks) {
  const ModelFiles& f = Files(preset);
  auto reference = MakeRunner(f, 0, 1);
  Cluster cluster(f, ranks);
  RunAllAgainstOneRank(cluster, *reference);
  // The MoE layers did cross ranks.
  double sent = 0, served = 0, invalid = 0, stale = 0, resent = 0;
  for (auto& rank : cluster.ranks) {
    auto stats = rank.ep->Stats();
    sent += stats["moe_dispatches_sent"];
    served += stats["moe_frames_received"];
    invalid += stats["moe_frames_invalid"];
    stale += stats["moe_frames_stale"];
    resent += stats["moe_retransmits"];
  }
  CHECK(sent > 0);
  CHECK(served >= sent);  // dispatches and combines
  CHECK(invalid == 0);
  // Nothing is lost here, but on a busy machine an answer can take longer
  // than the RTO: its dispatch is sent again and answered twice. A second
  // combine comes only from such a resend.
  CHECK(stale <= resent);
}

TEST_CASE("2 ranks: logits bit-identical to one rank, prefill and decode",
          "[expert_parallel]") {
  CheckAgainstOneRank("dsa-small", 2);
}

TEST_CASE("4 ranks: logits bit-identical to one rank", "[expert_parallel]") {
  CheckAgainstOneRank("dsa-small", 4);
}

TEST_CASE("2 ranks with block-sparse GQA attention", "[expert_parallel]") {
  CheckAgainstOneRank("minimax-small", 2);
}

TEST_CASE("only ranks that own routed rows get a dispatch; rows travel once",
          "[expert_parallel]") {
  const ModelFiles& f = Files("dsa-small");
  const int D = f.config.hidden_size, E = f.config.n_routed_experts;
  REQUIRE(E == 8);
  auto full = MakeRunner(f, 0, 1);
  Cluster cluster(f, 4);  // rank r owns experts 2r, 2r+1
  const int layer = f.config.first_k_dense_replace;

  std::vector<float> xn(size_t(3) * D);
  for (size_t i = 0; i < xn.size(); ++i)
    xn[i] = float((i * 7919) % 113) / 97.0f - 0.5f;
  ExpertWork work;
  work.layer = layer;
  work.rows = 3;
  work.xn = xn.data();
  work.rows_of.resize(E);
  work.rows_of[0] = {0, 2};  // rank 0 (local)
  work.rows_of[4] = {1};     // rank 2
  work.rows_of[5] = {1, 2};  // rank 2: row 1 travels once
  CountingHooks hooks;
  ExpertBackend* experts = cluster.ranks[0].ep->ForMicroBatch(0, &hooks);
  std::vector<std::vector<float>> out;
  REQUIRE(experts->RunExperts(work, &out).ok());
  REQUIRE(out.size() == size_t(E));
  for (int e = 0; e < E; ++e) {
    INFO("expert " << e);
    const auto& rows = work.rows_of[e];
    REQUIRE(out[e].size() == rows.size() * D);
    if (rows.empty()) continue;
    std::vector<float> want(rows.size() * D);
    REQUIRE(full->ApplyExpert(layer, e, xn.data(), rows.data(),
                              int(rows.size()), want.data())
                .ok());
    CHECK(std::memcmp(out[e].data(), want.data(), want.size() * 4) == 0);
  }
  auto s0 = cluster.ranks[0].ep->Stats();
  CHECK(s0["moe_dispatches_sent"] == 1);
  CHECK(s0["moe_rows_sent"] == 2);
  CHECK(cluster.ranks[1].ep->Stats()["moe_frames_received"] == 0);
  // One dispatch; more copies only if the answer took longer than the RTO
  // (a stalled machine).
  const double copies = cluster.ranks[2].ep->Stats()["moe_frames_received"];
  CHECK(copies >= 1);
  CHECK(copies <= 1 + s0["moe_retransmits"]);
  CHECK(cluster.ranks[3].ep->Stats()["moe_frames_received"] == 0);
  CHECK(hooks.before() == 1);
  CHECK(hooks.after() == 1);

  // Only local experts: no frame, no wait.
  ExpertWork local;
  local.layer = layer;
  local.rows = 3;
  local.xn = xn.data();
  local.rows_of.resize(E);
  local.rows_of[1] = {0, 1, 2};
  REQUIRE(experts->RunExperts(local, &out).ok());
  CHECK(cluster.ranks[0].ep->Stats()["moe_dispatches_sent"] == 1);
  CHECK(hooks.before() == 1);

  // No rows at all.
  ExpertWork empty;
  empty.layer = layer;
  empty.rows_of.resize(E);
  REQUIRE(experts->RunExperts(empty, &out).ok());
  CHECK(out.size() == size_t(E));

  // Malformed work.
  ExpertWork bad = work;
  bad.rows_of[3] = {2, 1};
  CHECK(experts->RunExperts(bad, &out).code() ==
        absl::StatusCode::kInvalidArgument);
  bad = work;
  bad.rows_of.resize(E - 1);
  CHECK(experts->RunExperts(bad, &out).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(cluster.ranks[0].ep->ForMicroBatch(2, nullptr) == nullptr);
}

TEST_CASE("a rank's rows are split over several frames to fit the limit",
          "[expert_parallel]") {
  const ModelFiles& f = Files("dsa-small");
  const int D = f.config.hidden_size, E = f.config.n_routed_experts;
  const int layer = f.config.first_k_dense_replace;
  auto full = MakeRunner(f, 0, 1);
  ExpertParallelOptions options;
  // A combine of at most 8 rows per frame.
  options.max_frame_bytes = EncodedFrameSize({size_t(8) * D * 4});
  Cluster cluster(f, 2, options);  // rank 1 owns experts 4..7

  std::vector<float> xn(size_t(8) * D);
  for (size_t i = 0; i < xn.size(); ++i)
    xn[i] = float((i * 31) % 29) / 16.0f - 0.9f;
  ExpertWork work;
  work.layer = layer;
  work.rows = 8;
  work.xn = xn.data();
  work.rows_of.resize(E);
  work.rows_of[1] = {1, 3};
  work.rows_of[4] = {0, 1, 2, 3};
  work.rows_of[5] = {2, 3, 4, 5};
  work.rows_of[6] = {4, 5, 6, 7};
  work.rows_of[7] = {0, 7};
  ExpertBackend* experts = cluster.ranks[0].ep->ForMicroBatch(1, nullptr);
  std::vector<std::vector<float>> out;
  REQUIRE(experts->RunExperts(work, &out).ok());
  for (int e = 0; e < E; ++e) {
    INFO("expert " << e);
    const auto& rows = work.rows_of[e];
    REQUIRE(out[e].size() == rows.size() * D);
    if (rows.empty()) continue;
    std::vector<float> want(rows.size() * D);
    REQUIRE(full->ApplyExpert(layer, e, xn.data(), rows.data(),
                              int(rows.size()), want.data())
                .ok());
    CHECK(std::memcmp(out[e].data(), want.data(), want.size() * 4) == 0);
  }
  auto stats = cluster.ranks[0].ep->Stats();
  CHECK(stats["moe_dispatches_sent"] == 2);  // {4, 5} and {6, 7}
  CHECK(stats["moe_rows_sent"] == 6 + 5);    // distinct rows per frame

  // One expert alone over the limit cannot be sent.
  work.rows_of[6] = {0, 1, 2, 3, 4, 5, 6, 7};
  ExpertParallelOptions tiny = options;
  tiny.max_frame_bytes = EncodedFrameSize({size_t(7) * D * 4});
  Cluster small(f, 2, tiny);
  CHECK(small.ranks[0]
            .ep->ForMicroBatch(0, nullptr)
            ->RunExperts(work, &out)
            .code() == absl::StatusCode::kResourceExhausted);
}

TEST_CASE("a rank takes over a lost rank's experts and gives them back",
          "[expert_parallel]") {
  const ModelFiles& f = Files("dsa-small");  // 8 routed experts
  const int E = f.config.n_routed_experts;
  auto reference = MakeRunner(f, 0, 1);
  Cluster cluster(f, 2);
  ModelRunner& runner = *cluster.ranks[0].runner;
  ExpertParallel& ep = *cluster.ranks[0].ep;
  Stream stream;
  stream.sessions = {7, 8, 9};
  stream.decodes = 2;
  std::vector<std::vector<float>> expected;
  REQUIRE(RunStream(*reference, nullptr, stream, &expected).ok());
  const std::vector<int> blocks{0, 0, 0, 0, 1, 1, 1, 1};
  CHECK(runner.ExpertOwners() == blocks);
  CHECK(runner.HeldExperts() == std::vector<int>{0, 1, 2, 3});

  // Malformed tables and missing weights change nothing.
  CHECK(runner.SetExpertOwners({0, 0}, ModelFiles()).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(runner.SetExpertOwners(std::vector<int>(size_t(E), 2), ModelFiles())
            .code() == absl::StatusCode::kInvalidArgument);
  CHECK(runner.SetExpertOwners(std::vector<int>(size_t(E), 0), ModelFiles())
            .code() == absl::StatusCode::kInvalidArgument);
  CHECK(runner.ExpertOwners() == blocks);

  // Rank 1 is lost: rank 0 owns every expert and needs nobody.
  const std::vector<int> all0(size_t(E), 0);
  auto missing = runner.MissingExperts(all0);
  REQUIRE(missing.ok());
  CHECK(*missing == std::vector<int>{4, 5, 6, 7});
  auto weights = LoadExpertWeights("", *missing);  // no directory
  CHECK_FALSE(weights.ok());
  REQUIRE(runner.SetExpertOwners(all0, f).ok());
  REQUIRE(ep.SetPeers({cluster.peers[0]}).ok());
  CHECK(runner.HeldExperts().size() == size_t(E));
  CHECK(runner.OwnsExpert(6));
  std::vector<std::vector<float>> logits;
  REQUIRE(
      RunStream(runner, ep.ForMicroBatch(0, nullptr), stream, &logits).ok());
  CHECK(SameBits(logits, expected));
  CHECK(ep.Stats()["moe_dispatches_sent"] == 0);

  // Rank 1 is back: the blocks again, and rank 0 releases experts 4..7.
  REQUIRE(runner.SetExpertOwners(blocks, ModelFiles()).ok());
  REQUIRE(ep.SetPeers(cluster.peers).ok());
  CHECK(runner.HeldExperts() == std::vector<int>{0, 1, 2, 3});
  CHECK_FALSE(runner.HoldsExpert(5));
  logits.clear();
  REQUIRE(
      RunStream(runner, ep.ForMicroBatch(1, nullptr), stream, &logits).ok());
  CHECK(SameBits(logits, expected));
  CHECK(ep.Stats()["moe_dispatches_sent"] > 0);
  CHECK(cluster.ranks[1].ep->Stats()["moe_dispatches_served"] > 0);
}

TEST_CASE("experts handed back during a step are still computed by it",
          "[expert_parallel]") {
  const ModelFiles& f = Files("dsa-small");  // 8 routed experts
  auto reference = MakeRunner(f, 0, 1);
  Cluster cluster(f, 2);
  ModelRunner& runner = *cluster.ranks[0].runner;
  ExpertParallel& ep = *cluster.ranks[0].ep;
  // Rank 0 holds experts 4 and 5 of rank 1 besides its own block (rank 1
  // was lost and came back); the table that gives them back arrives while
  // a step of rank 0 is between its ownership snapshot and its local
  // experts (here: as it sends its dispatches to rank 1).
  const std::vector<int> taken{0, 0, 0, 0, 0, 0, 1, 1};
  const std::vector<int> blocks{0, 0, 0, 0, 1, 1, 1, 1};
  REQUIRE(runner.SetExpertOwners(taken, f).ok());
  struct GiveBackOnSend : WaitHooks {
    ModelRunner* runner;
    std::vector<int> owners;
    bool given = false;
    absl::Status set;
    void BeforeSend() override {
      if (given) return;
      given = true;
      set = runner->SetExpertOwners(owners, ModelFiles());
    }
    void BeforeWait() override {}
    void AfterWait() override {}
  } hooks;
  hooks.runner = &runner;
  hooks.owners = blocks;
  Stream stream;
  stream.sessions = {7, 8, 9};
  stream.decodes = 1;
  std::vector<std::vector<float>> expected, logits;
  REQUIRE(RunStream(*reference, nullptr, stream, &expected).ok());
  const absl::Status s =
      RunStream(runner, ep.ForMicroBatch(0, &hooks), stream, &logits);
  INFO(s);
  REQUIRE(hooks.given);
  CHECK(hooks.set.ok());
  CHECK(runner.HeldExperts() == std::vector<int>{0, 1, 2, 3});
  REQUIRE(s.ok());
  CHECK(SameBits(logits, expected));
}

}  // namespace
}  // namespace karat