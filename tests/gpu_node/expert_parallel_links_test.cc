// Expert-parallel MoE over lossy and broken links: ranks over a FakeFabric
// behind LinkEmulators (loss, down). Steps must complete with the bits of a
// lossless run, every dispatch computed once; a step fails only past its
// deadline or when its peer leaves the rank table. Plus the serving rank's
// duplicate handling with raw frames, and the rate-limited log.
#include <catch2/catch.hpp>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/frame.h"
#include "common/link_emulation.h"
#include "common/link_rules.h"
#include "gpu_node/expert_parallel.h"
#include "tests/gpu_node/expert_parallel_fixtures.h"

namespace karat {
namespace {

using namespace moe_test;  // NOLINT: the fixtures of these tests

// Counts the expert service's computations (it enters the gate once per
// dispatch it computes); while held, a computation waits in Enter().
class CountingGate : public ServiceGate {
 public:
  void Enter() override {
    absl::MutexLock lock(&mu_);
    ++entered_;
    auto open = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !held_; };
    mu_.Await(absl::Condition(&open));
  }
  void Leave() override {}
  void Hold() {
    absl::MutexLock lock(&mu_);
    held_ = true;
  }
  void Release() {
    absl::MutexLock lock(&mu_);
    held_ = false;
  }
  int entered() {
    absl::MutexLock lock(&mu_);
    return entered_;
  }
  // False past a generous bound, so that a broken build fails instead of
  // hanging.
  bool WaitEntered(int n) {
    absl::MutexLock lock(&mu_);
    auto reached = [this, n]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return entered_ >= n;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&reached), absl::Seconds(60));
  }

 private:
  absl::Mutex mu_;
  int entered_ ABSL_GUARDED_BY(mu_) = 0;
  bool held_ ABSL_GUARDED_BY(mu_) = false;
};

LinkSettings Lossy(double loss) {
  LinkSettings s;
  s.loss = loss;
  return s;
}

LinkSettings Down() {
  LinkSettings s;
  s.down = true;
  return s;
}

double Stat(const ExpertParallel& ep, const std::string& key) {
  return ep.Stats()[key];
}

TEST_CASE(
    "10% loss both ways: every step completes with the lossless bits, each "
    "dispatch computed once",
    "[expert_parallel][links]") {
  const ModelFiles& f = Files("dsa-small");
  auto reference = MakeRunner(f, 0, 1);
  CountingGate gates[2];  // outlive the cluster's service threads
  ExpertParallelOptions options;
  options.timeout = absl::Seconds(120);  // a bound: loss must not fail steps
  Cluster cluster(f, 2, options, /*set_peers=*/true, /*emulate_links=*/true,
                  /*seed=*/7);
  for (int r = 0; r < 2; ++r) {
    cluster.ranks[r].ep->set_service_gate(&gates[r]);
    REQUIRE(cluster.ranks[r].links->SetLinks({{"*", "*", Lossy(0.1)}}).ok());
  }
  // Two micro-batches on rank 0, one on rank 1, seven steps each.
  RunAllAgainstOneRank(cluster, *reference, /*decodes=*/6);

  uint64_t dropped = 0;
  for (auto& rank : cluster.ranks) {
    for (const auto& [peer, c] : rank.links->stats()->Snapshot()) {
      dropped += c.dropped;
    }
  }
  const ExpertParallel& ep0 = *cluster.ranks[0].ep;
  const ExpertParallel& ep1 = *cluster.ranks[1].ep;
  INFO("frames dropped " << dropped);
  CHECK(dropped > 0);
  // Each lost frame was made up by sending its dispatch again.
  CHECK(Stat(ep0, "moe_retransmits") + Stat(ep1, "moe_retransmits") > 0);
  CHECK(Stat(ep0, "moe_calls_failed") == 0);
  CHECK(Stat(ep1, "moe_calls_failed") == 0);
  // Every dispatch computed exactly once by the rank it went to, however
  // often it was sent (each call succeeded, so none was left out).
  CHECK(gates[1].entered() == Stat(ep0, "moe_dispatches_sent"));
  CHECK(gates[0].entered() == Stat(ep1, "moe_dispatches_sent"));
  CHECK(Stat(ep0, "moe_dispatches_sent") > 0);
  CHECK(Stat(ep0, "moe_frames_invalid") + Stat(ep1, "moe_frames_invalid") == 0);
  // The RTO was measured, within its bounds.
  for (const ExpertParallel* ep : {&ep0, &ep1}) {
    CHECK(Stat(*ep, "moe_rto_ms") >= 5);
    CHECK(Stat(*ep, "moe_rto_max_ms") <= 1000);
  }
}

// Rank 0 runs a stream (a prefill that routes rows to rank 1, and decode
// steps) while `fault` holds; once it has hit the link (`hit` reaches 1 on
// `witness`), the fault stays about a second more, then the links are
// plain again. The stream must complete with the bits of one rank.
struct DownThenUp {
  absl::Status status = absl::UnknownError("not run");
  absl::Time finished, restored;

  void Run(Cluster& cluster, LinkEmulator* faulty, const LinkRule& fault,
           const ExpertParallel& witness, const std::string& hit) {
    const ModelFiles& f = Files("dsa-small");
    auto reference = MakeRunner(f, 0, 1);
    Stream stream;
    stream.sessions = {7, 8, 9};
    stream.decodes = 2;
    std::vector<std::vector<float>> logits, expected;
    REQUIRE(faulty->SetLinks({fault}).ok());
    std::thread run([&] {
      status = RunStream(*cluster.ranks[0].runner,
                         cluster.ranks[0].ep->ForMicroBatch(0, nullptr), stream,
                         &logits);
      finished = absl::Now();
    });
    const bool reached = WaitForStat(witness, hit, 1);
    absl::SleepFor(absl::Seconds(1));
    restored = absl::Now();
    REQUIRE(faulty->SetLinks({}).ok());
    run.join();
    REQUIRE(reached);
    INFO(status);
    REQUIRE(status.ok());
    REQUIRE(RunStream(*reference, nullptr, stream, &expected).ok());
    CHECK(SameBits(logits, expected));
    // It could not complete while the link was down: it waited for it.
    CHECK(finished >= restored);
  }
};

TEST_CASE("a link that is down for a while stalls the step, which completes",
          "[expert_parallel][links]") {
  const ModelFiles& f = Files("dsa-small");
  CountingGate gates[2];
  ExpertParallelOptions options;
  options.timeout = absl::Seconds(120);  // a bound: the outage must not fail
  Cluster cluster(f, 2, options, /*set_peers=*/true, /*emulate_links=*/true);
  for (int r = 0; r < 2; ++r) cluster.ranks[r].ep->set_service_gate(&gates[r]);
  ExpertParallel& ep0 = *cluster.ranks[0].ep;
  ExpertParallel& ep1 = *cluster.ranks[1].ep;

  SECTION("rank 0 -> rank 1 down: refused sends are tried again") {
    DownThenUp run;
    run.Run(cluster, cluster.ranks[0].links, {"gpu0", "gpu1", Down()}, ep0,
            "moe_send_errors");
    CHECK(Stat(ep0, "moe_retransmits") > 0);
    CHECK(Stat(ep0, "moe_calls_failed") == 0);
    CHECK(gates[1].entered() == Stat(ep0, "moe_dispatches_sent"));
  }
  SECTION("rank 1 -> rank 0 down: the combine is kept and sent again") {
    DownThenUp run;
    // Rank 1 computed the dispatch but could not answer.
    run.Run(cluster, cluster.ranks[1].links, {"gpu1", "gpu0", Down()}, ep1,
            "moe_send_errors");
    CHECK(Stat(ep0, "moe_retransmits") > 0);
    CHECK(Stat(ep1, "moe_duplicates_served") > 0);
    CHECK(gates[1].entered() == Stat(ep0, "moe_dispatches_sent"));
    CHECK(Stat(ep0, "moe_calls_failed") == 0);
  }
}

TEST_CASE("a peer that never answers still fails the step at the deadline",
          "[expert_parallel][links]") {
  const ModelFiles& f = Files("dsa-small");
  ExpertParallelOptions options;
  options.timeout = absl::Seconds(1);
  Cluster cluster(f, 2, options, /*set_peers=*/true, /*emulate_links=*/true);
  ExpertParallel& ep0 = *cluster.ranks[0].ep;
  LinkEmulator* links = cluster.ranks[0].links;
  absl::Status s;
  SECTION("every dispatch lost") {
    REQUIRE(links->SetLinks({{"gpu0", "gpu1", Lossy(1.0)}}).ok());
    s = PrefillOnRank0(*cluster.ranks[0].runner, ep0.ForMicroBatch(0, nullptr));
    CHECK(s.message().find("within 1000 ms; sent ") != std::string::npos);
  }
  SECTION("the link stays down") {
    REQUIRE(links->SetLinks({{"gpu0", "gpu1", Down()}}).ok());
    s = PrefillOnRank0(*cluster.ranks[0].runner, ep0.ForMicroBatch(0, nullptr));
    CHECK(s.message().find("the last failed send") != std::string::npos);
    CHECK(s.message().find("is down") != std::string::npos);
    CHECK(Stat(ep0, "moe_send_errors") > 0);
  }
  INFO(s);
  CHECK(s.code() == absl::StatusCode::kUnavailable);
  CHECK(s.message().find("no MoeCombine from GPU rank 1") != std::string::npos);
  CHECK(Stat(ep0, "moe_retransmits") > 0);  // 200 ms RTO, 1 s deadline
  CHECK(Stat(ep0, "moe_calls_failed") == 1);
  CHECK(Stat(*cluster.ranks[1].ep, "moe_dispatches_served") == 0);
}

TEST_CASE("a peer removed from the rank table fails its resent step at once",
          "[expert_parallel][links]") {
  const ModelFiles& f = Files("dsa-small");
  ExpertParallelOptions options;
  options.timeout = absl::Seconds(600);  // only the new table can end it
  Cluster cluster(f, 2, options, /*set_peers=*/true, /*emulate_links=*/true);
  ExpertParallel& ep0 = *cluster.ranks[0].ep;
  REQUIRE(cluster.ranks[0].links->SetLinks({{"gpu0", "gpu1", Down()}}).ok());
  absl::Status s = absl::UnknownError("not run");
  std::thread run([&] {
    s = PrefillOnRank0(*cluster.ranks[0].runner, ep0.ForMicroBatch(0, nullptr));
  });
  // Sending again while the link is down...
  const bool resending = WaitForStat(ep0, "moe_retransmits", 1);
  // ...until the coordinator's table says rank 1 is lost.
  const absl::Status set = ep0.SetPeers({cluster.peers[0]});
  run.join();
  REQUIRE(resending);
  CHECK(set.ok());
  INFO(s);
  CHECK(s.code() == absl::StatusCode::kUnavailable);
  CHECK(s.message().find("left the rank table") != std::string::npos);
}

TEST_CASE(
    "a dispatch that comes again is never computed twice: answered by the "
    "first copy's combine or from the cache",
    "[expert_parallel][links]") {
  const ModelFiles& f = Files("dsa-small");
  const int D = f.config.hidden_size;
  const int layer = f.config.first_k_dense_replace;
  FakeFabric fabric;
  auto runner = MakeRunner(f, 0, 2);  // owns experts 0..3
  auto t0 = fabric.NewEndpoint("gpu0");
  auto raw = fabric.NewEndpoint("gpu1");  // plays rank 1
  CountingGate gate;
  ExpertParallel ep(runner.get(), t0.get());
  ep.set_node_id(kNodeIdBase);
  ep.set_service_gate(&gate);
  t0->SetReceiveHandler([&ep](std::string_view m) { ep.OnMessage(m); });
  Inbox inbox;
  inbox.Collect(raw.get());
  const cluster::GpuPeer p1 = RankEntry(1, raw->LocalAddress());
  REQUIRE(ep.SetPeers({p1}).ok());
  auto to_rank0 = raw->AddPeer("gpu0", t0->LocalAddress());
  REQUIRE(to_rank0.ok());
  auto send = [&](const std::string& bytes) {
    REQUIRE(raw->Send(*to_rank0, bytes.data(), bytes.size()).ok());
  };
  std::vector<float> rows(size_t(2) * D);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = float(i % 11) / 8.0f;
  const std::string dispatch =
      Dispatch(kNodeIdBase + 1, 5, layer, {1, 3}, {2, 1}, {0, 1, 1}, rows, D);

  // The first copy is being computed (held in the gate) when the second
  // comes: the second is answered by the first's combine.
  gate.Hold();
  send(dispatch);
  REQUIRE(gate.WaitEntered(1));
  send(dispatch);
  REQUIRE(WaitForStat(ep, "moe_duplicates_joined", 1));
  gate.Release();
  REQUIRE(inbox.WaitFor(1));
  // A third copy, after the answer: the kept combine, the same bytes.
  send(dispatch);
  REQUIRE(inbox.WaitFor(2));
  REQUIRE(WaitForStat(ep, "moe_duplicates_served", 1));
  size_t combine_bytes = 0;
  {
    absl::MutexLock lock(&inbox.mu);
    CHECK(inbox.frames[0] == inbox.frames[1]);
    auto combine = DecodeFrame(inbox.frames[0]);
    REQUIRE(combine.ok());
    CHECK(combine->header.status == 0);
    CHECK(combine->header.session == 5);
    combine_bytes = inbox.frames[0].size();
  }
  CHECK(gate.entered() == 1);
  auto stats = ep.Stats();
  CHECK(stats["moe_frames_sent"] == 2);  // none for the joined copy
  CHECK(stats["moe_dispatches_served"] == 1);
  CHECK(stats["moe_combine_cache_entries"] == 1);
  CHECK(stats["moe_combine_cache_bytes"] == double(combine_bytes));

  // The same request id for another layer is other work: computed.
  send(Dispatch(kNodeIdBase + 1, 5, layer + 1, {2}, {1}, {0}, rows, D));
  REQUIRE(inbox.WaitFor(3));
  CHECK(gate.entered() == 2);

  // A sender that leaves the table takes its cache along: back in it, the
  // same dispatch is computed again.
  REQUIRE(ep.SetPeers({}).ok());
  CHECK(ep.Stats()["moe_combine_cache_entries"] == 0);
  REQUIRE(ep.SetPeers({p1}).ok());
  send(dispatch);
  REQUIRE(inbox.WaitFor(4));
  CHECK(gate.entered() == 3);
  t0->Shutdown();
  raw->Shutdown();
}

TEST_CASE("a flood of bad frames is counted in full but logged sparingly",
          "[expert_parallel][links]") {
  const ModelFiles& f = Files("dsa-small");
  FakeFabric fabric;
  auto runner = MakeRunner(f, 0, 2);
  auto t0 = fabric.NewEndpoint("gpu0");
  auto raw = fabric.NewEndpoint("gpu1");
  ExpertParallel ep(runner.get(), t0.get());
  ep.set_node_id(kNodeIdBase);
  t0->SetReceiveHandler([&ep](std::string_view m) { ep.OnMessage(m); });
  REQUIRE(ep.SetPeers({RankEntry(1, raw->LocalAddress())}).ok());
  auto to_rank0 = raw->AddPeer("gpu0", t0->LocalAddress());
  REQUIRE(to_rank0.ok());
  FrameHeader stale;
  stale.type = static_cast<uint16_t>(FrameType::kMoeCombine);
  stale.src_node = kNodeIdBase + 1;
  std::string stale_bytes;
  for (int i = 0; i < 50; ++i) {
    const std::string garbage = "not a frame " + std::to_string(i);
    REQUIRE(raw->Send(*to_rank0, garbage.data(), garbage.size()).ok());
    stale.session = uint64_t(1000 + i);
    EncodeFrame(stale, {std::string_view("xxxxxxxx")}, &stale_bytes);
    REQUIRE(raw->Send(*to_rank0, stale_bytes.data(), stale_bytes.size()).ok());
  }
  REQUIRE(WaitForStat(ep, "moe_frames_received", 100));
  auto stats = ep.Stats();
  CHECK(stats["moe_frames_invalid"] == 50);
  CHECK(stats["moe_frames_stale"] == 50);
  // One line per kind and sender per 10 s went out; the rest were held
  // back (the stale lines are debug lines, which are off here).
  CHECK(stats["moe_log_lines_held_back"] >= 40);
  t0->Shutdown();
  raw->Shutdown();
}

}  // namespace
}  // namespace karat
