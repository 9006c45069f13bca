// Expert-parallel MoE over an in-process FakeFabric, the failure paths: a
// rank table that comes late (dispatches parked until it names their
// sender), a dead or missing peer, unknown senders, malformed frames and
// answers, a rank that leaves the table, tables that do not fit, shutdown.
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
#include "gpu_node/expert_parallel.h"
#include "tests/gpu_node/expert_parallel_fixtures.h"

namespace karat {
namespace {

using namespace moe_test;  // NOLINT: the fixtures of these tests

TEST_CASE("a rank table that arrives during the first step is waited for",
          "[expert_parallel]") {
  const ModelFiles& f = Files("dsa-small");
  ExpertParallelOptions options;
  options.peer_wait = absl::Seconds(30);  // a bound, not an expectation
  Cluster cluster(f, 2, options, /*set_peers=*/false);
  absl::Status status = absl::UnknownError("not run");
  std::thread step([&] {
    status = PrefillOnRank0(*cluster.ranks[0].runner,
                            cluster.ranks[0].ep->ForMicroBatch(0, nullptr));
  });
  // Long enough for rank 0 to reach its first MoE layer and wait there.
  // The dispatching rank gets its table first: its dispatch may reach rank
  // 1 before rank 1's own table, and is then parked there until it comes.
  absl::SleepFor(absl::Milliseconds(300));
  REQUIRE(cluster.ranks[0].ep->SetPeers(cluster.peers).ok());
  REQUIRE(cluster.ranks[1].ep->SetPeers(cluster.peers).ok());
  step.join();
  INFO(status);
  CHECK(status.ok());
  CHECK(cluster.ranks[1].ep->Stats()["moe_dispatches_served"] > 0);
}

TEST_CASE(
    "a dispatch that reaches a rank before its own table is parked, then "
    "served",
    "[expert_parallel]") {
  const ModelFiles& f = Files("dsa-small");
  auto reference = MakeRunner(f, 0, 1);
  ExpertParallelOptions options;
  // Bounds, not expectations: a dropped dispatch would fail the step with
  // UNAVAILABLE after `timeout` instead of completing it.
  options.peer_wait = absl::Seconds(60);
  options.timeout = absl::Seconds(60);
  Cluster cluster(f, 2, options, /*set_peers=*/false);
  // The dispatching rank gets its table first; the serving rank only once
  // a dispatch from rank 0 waits there.
  REQUIRE(cluster.ranks[0].ep->SetPeers(cluster.peers).ok());
  Stream stream;
  stream.sessions = {7, 8, 9};
  stream.decodes = 2;
  std::vector<std::vector<float>> logits;
  absl::Status status = absl::UnknownError("not run");
  std::thread run([&] {
    status = RunStream(*cluster.ranks[0].runner,
                       cluster.ranks[0].ep->ForMicroBatch(0, nullptr), stream,
                       &logits);
  });
  const bool parked =
      WaitForStat(*cluster.ranks[1].ep, "moe_dispatches_parked", 1);
  REQUIRE(cluster.ranks[1].ep->SetPeers(cluster.peers).ok());
  run.join();
  REQUIRE(parked);
  INFO(status);
  REQUIRE(status.ok());
  std::vector<std::vector<float>> expected;
  REQUIRE(RunStream(*reference, nullptr, stream, &expected).ok());
  CHECK(SameBits(logits, expected));
  auto served = cluster.ranks[1].ep->Stats();
  CHECK(served["moe_parked_released"] == served["moe_dispatches_parked"]);
  CHECK(served["moe_parked_expired"] == 0);
  CHECK(served["moe_frames_unknown_sender"] == 0);
  CHECK(served["moe_frames_invalid"] == 0);
  CHECK(served["moe_dispatches_served"] >= served["moe_dispatches_parked"]);
  CHECK(cluster.ranks[0].ep->Stats()["moe_calls_failed"] == 0);
}

TEST_CASE("a dead or missing peer fails the step with UNAVAILABLE",
          "[expert_parallel]") {
  const ModelFiles& f = Files("dsa-small");
  FakeFabric fabric;
  auto runner = MakeRunner(f, 0, 2);
  auto t0 = fabric.NewEndpoint("gpu0");
  auto t1 = fabric.NewEndpoint("gpu1");  // no handler: frames vanish
  ExpertParallelOptions options;
  options.timeout = absl::Milliseconds(200);
  options.peer_wait = absl::Milliseconds(100);
  ExpertParallel ep(runner.get(), t0.get(), options);
  ep.set_node_id(kNodeIdBase);
  t0->SetReceiveHandler([&ep](std::string_view m) { ep.OnMessage(m); });

  SECTION("no rank table within the bound") {
    absl::Status s = PrefillOnRank0(*runner, ep.ForMicroBatch(0, nullptr));
    CHECK(s.code() == absl::StatusCode::kUnavailable);
    CHECK(s.message().find("rank 1") != std::string::npos);
    CHECK(s.message().find("SetPeers") != std::string::npos);
  }
  SECTION("Abort ends a wait for a rank's table at once") {
    ExpertParallelOptions patient;
    patient.peer_wait = absl::Seconds(30);
    ExpertParallel slow(runner.get(), t0.get(), patient);
    absl::Status s;
    const absl::Time start = absl::Now();
    std::thread step(
        [&] { s = PrefillOnRank0(*runner, slow.ForMicroBatch(0, nullptr)); });
    absl::SleepFor(absl::Milliseconds(200));  // into the wait
    slow.Abort();
    step.join();
    CHECK(absl::Now() - start < absl::Seconds(10));
    CHECK(s.code() == absl::StatusCode::kUnavailable);
    CHECK(s.message().find("shutting down") != std::string::npos);
  }

  const cluster::GpuPeer p1 = RankEntry(1, t1->LocalAddress());
  REQUIRE(ep.SetPeers({p1}).ok());

  SECTION("a peer that never answers: bounded wait") {
    CountingHooks hooks;
    absl::Status s = PrefillOnRank0(*runner, ep.ForMicroBatch(0, &hooks));
    CHECK(s.code() == absl::StatusCode::kUnavailable);
    CHECK(s.message().find("rank 1") != std::string::npos);
    CHECK(hooks.before() == 1);
    CHECK(hooks.after() == 1);
    CHECK(ep.Stats()["moe_calls_failed"] == 1);
  }
  SECTION("a peer whose endpoint is gone") {
    t1->Shutdown();
    absl::Status s = PrefillOnRank0(*runner, ep.ForMicroBatch(1, nullptr));
    CHECK(s.code() == absl::StatusCode::kUnavailable);
    CHECK(s.message().find("rank 1") != std::string::npos);
    CHECK(ep.Stats()["moe_send_errors"] >= 1);
  }
  SECTION("a rank dropped from the table fails its transport peer") {
    // t0 issued id 0 to rank 1's address (its only peer).
    const PeerId rank1 = 0;
    REQUIRE(t0->PeerName(rank1) == p1.name());
    REQUIRE(ep.SetPeers({}).ok());
    absl::Status s = t0->Send(rank1, "x", 1);
    CHECK(s.code() == absl::StatusCode::kUnavailable);
    CHECK(s.message().find("GPU rank 1 was removed from the cluster") !=
          std::string::npos);
    // Back in the table: sendable again.
    REQUIRE(ep.SetPeers({p1}).ok());
    CHECK(t0->Send(rank1, "x", 1).ok());
  }
  SECTION("Abort ends a wait at once and refuses later calls") {
    ExpertParallelOptions patient;
    patient.timeout = absl::Seconds(600);
    ExpertParallel slow(runner.get(), t0.get(), patient);
    REQUIRE(slow.SetPeers({p1}).ok());
    struct AbortOnWait : WaitHooks {
      ExpertParallel* ep;
      void BeforeWait() override { ep->Abort(); }
      void AfterWait() override {}
    } hooks;
    hooks.ep = &slow;
    absl::Status s = PrefillOnRank0(*runner, slow.ForMicroBatch(0, &hooks));
    CHECK(s.code() == absl::StatusCode::kUnavailable);
    CHECK(s.message().find("shutting down") != std::string::npos);
    s = PrefillOnRank0(*runner, slow.ForMicroBatch(1, nullptr));
    CHECK(s.code() == absl::StatusCode::kUnavailable);
  }
  t0->Shutdown();
}

TEST_CASE("invalid, unknown-sender and stale frames are dropped and counted",
          "[expert_parallel]") {
  const ModelFiles& f = Files("dsa-small");
  const int D = f.config.hidden_size;
  const int layer = f.config.first_k_dense_replace;
  FakeFabric fabric;
  auto runner = MakeRunner(f, 0, 2);  // owns experts 0..3
  auto full = MakeRunner(f, 0, 1);
  auto t0 = fabric.NewEndpoint("gpu0");
  auto raw = fabric.NewEndpoint("gpu1");
  ExpertParallelOptions options;
  options.peer_wait = absl::Milliseconds(100);
  ExpertParallel ep(runner.get(), t0.get(), options);
  ep.set_node_id(kNodeIdBase);
  // The sender's address is not passed on: the dispatch from an unknown
  // node id is dropped once it has waited `peer_wait`.
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
  for (size_t i = 0; i < rows.size(); ++i)
    rows[i] = float(i % 17) / 8.0f - 1.0f;
  // Unknown node id (parked, then dropped), garbage, a stale combine:
  // dropped without an answer.
  send(Dispatch(999, 1, layer, {1}, {2}, {0, 1}, rows, D));
  send("not a frame at all");
  {
    FrameHeader h;
    h.type = static_cast<uint16_t>(FrameType::kMoeCombine);
    h.src_node = kNodeIdBase + 1;
    h.session = 12345;
    std::string bytes;
    EncodeFrame(h, {std::string_view("xxxxxxxx")}, &bytes);
    send(bytes);
  }
  // From the known rank: an expert rank 0 does not own, a bad index, a
  // dense layer; each answered with an error combine.
  send(Dispatch(kNodeIdBase + 1, 2, layer, {5}, {2}, {0, 1}, rows, D));
  send(Dispatch(kNodeIdBase + 1, 3, layer, {1}, {2}, {0, 7}, rows, D));
  send(Dispatch(kNodeIdBase + 1, 4, 0, {1}, {2}, {0, 1}, rows, D));
  // A valid one: expert 1 on both rows, expert 3 on row 1.
  send(Dispatch(kNodeIdBase + 1, 5, layer, {1, 3}, {2, 1}, {0, 1, 1}, rows, D));
  REQUIRE(inbox.WaitFor(4));

  std::vector<FrameView> answers;
  {
    absl::MutexLock lock(&inbox.mu);
    for (const std::string& bytes : inbox.frames) {
      auto v = DecodeFrame(bytes);
      REQUIRE(v.ok());
      answers.push_back(*v);
    }
  }
  REQUIRE(answers.size() == 4);
  const uint16_t kCombine = static_cast<uint16_t>(FrameType::kMoeCombine);
  for (int i = 0; i < 3; ++i) {
    INFO("answer " << i);
    CHECK(answers[i].header.type == kCombine);
    CHECK(answers[i].header.session == uint64_t(2 + i));
    CHECK(answers[i].header.status != 0);
    CHECK(answers[i].sections[0].size() > 0);  // the message
  }
  CHECK(answers[0].header.status ==
        uint32_t(absl::StatusCode::kFailedPrecondition));
  CHECK(answers[1].header.status ==
        uint32_t(absl::StatusCode::kInvalidArgument));
  const FrameView& combine = answers[3];
  CHECK(combine.header.type == kCombine);
  CHECK(combine.header.status == 0);
  CHECK(combine.header.session == 5);
  CHECK(combine.header.src_node == kNodeIdBase);
  REQUIRE(combine.sections[0].size() == size_t(3) * D * 4);
  std::vector<float> want(size_t(3) * D);
  const int32_t rows_1[] = {0, 1}, rows_3[] = {1};
  REQUIRE(
      full->ApplyExpert(layer, 1, rows.data(), rows_1, 2, want.data()).ok());
  REQUIRE(
      full->ApplyExpert(layer, 3, rows.data(), rows_3, 1, want.data() + 2 * D)
          .ok());
  CHECK(std::memcmp(combine.sections[0].data(), want.data(), want.size() * 4) ==
        0);

  REQUIRE(WaitForStat(ep, "moe_parked_expired", 1));
  auto stats = ep.Stats();
  CHECK(stats["moe_frames_received"] == 7);
  CHECK(stats["moe_dispatches_parked"] == 1);
  CHECK(stats["moe_parked_answered"] == 0);
  CHECK(stats["moe_frames_unknown_sender"] == 1);
  CHECK(stats["moe_frames_stale"] == 1);
  CHECK(stats["moe_frames_invalid"] == 5);  // unknown, garbage, 3 malformed
  t0->Shutdown();
  raw->Shutdown();
}

TEST_CASE(
    "a parked dispatch whose sender never appears is answered or dropped "
    "within the bound, and counted",
    "[expert_parallel]") {
  const ModelFiles& f = Files("dsa-small");
  const int D = f.config.hidden_size;
  const int layer = f.config.first_k_dense_replace;
  FakeFabric fabric;
  auto runner = MakeRunner(f, 0, 2);  // owns experts 0..3
  auto t0 = fabric.NewEndpoint("gpu0");
  auto raw = fabric.NewEndpoint("gpu1");       // rank 1 in the table
  auto stranger = fabric.NewEndpoint("gpu9");  // an address never added
  Inbox inbox, stranger_inbox;
  inbox.Collect(raw.get());
  stranger_inbox.Collect(stranger.get());
  const cluster::GpuPeer p1 = RankEntry(1, raw->LocalAddress());
  std::vector<float> rows(size_t(2) * D);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = float(i % 5) / 4.0f;
  auto decode = [](Inbox& box, size_t i) {
    absl::MutexLock lock(&box.mu);
    REQUIRE(i < box.frames.size());
    auto v = DecodeFrame(box.frames[i]);
    REQUIRE(v.ok());
    return v->header;
  };
  const uint16_t kCombine = static_cast<uint16_t>(FrameType::kMoeCombine);

  SECTION("after peer_wait: answered where the address is known") {
    ExpertParallelOptions options;
    options.peer_wait = absl::Milliseconds(200);
    ExpertParallel ep(runner.get(), t0.get(), options);
    ep.set_node_id(kNodeIdBase);
    t0->SetPeerReceiveHandler(
        [&ep](PeerId from, std::string_view m) { ep.OnMessage(m, from); });
    REQUIRE(ep.SetPeers({p1}).ok());
    auto to_rank0 = raw->AddPeer("gpu0", t0->LocalAddress());
    auto stranger_to_rank0 = stranger->AddPeer("gpu0", t0->LocalAddress());
    REQUIRE(to_rank0.ok());
    REQUIRE(stranger_to_rank0.ok());
    // Node 999 from rank 1's address: the transport knows the address.
    const std::string d1 = Dispatch(999, 1, layer, {1}, {2}, {0, 1}, rows, D);
    REQUIRE(raw->Send(*to_rank0, d1.data(), d1.size()).ok());
    REQUIRE(inbox.WaitFor(1));
    const FrameHeader answer = decode(inbox, 0);
    CHECK(answer.type == kCombine);
    CHECK(answer.session == 1);
    CHECK(answer.status == uint32_t(absl::StatusCode::kUnavailable));
    // Node 998 from an address never added: dropped.
    const std::string d2 = Dispatch(998, 2, layer, {1}, {2}, {0, 1}, rows, D);
    REQUIRE(stranger->Send(*stranger_to_rank0, d2.data(), d2.size()).ok());
    REQUIRE(WaitForStat(ep, "moe_parked_expired", 2));
    auto stats = ep.Stats();
    CHECK(stats["moe_dispatches_parked"] == 2);
    CHECK(stats["moe_parked_answered"] == 1);
    CHECK(stats["moe_parked_released"] == 0);
    CHECK(stats["moe_frames_unknown_sender"] == 2);
    CHECK(stats["moe_dispatches_served"] == 0);
    t0->Shutdown();
  }

  SECTION("beyond the bound: refused at once; known senders never wait") {
    ExpertParallelOptions options;
    options.peer_wait = absl::Seconds(600);  // never reached here
    options.max_parked = 1;
    ExpertParallel ep(runner.get(), t0.get(), options);
    ep.set_node_id(kNodeIdBase);
    t0->SetPeerReceiveHandler(
        [&ep](PeerId from, std::string_view m) { ep.OnMessage(m, from); });
    REQUIRE(ep.SetPeers({p1}).ok());
    auto to_rank0 = raw->AddPeer("gpu0", t0->LocalAddress());
    REQUIRE(to_rank0.ok());
    auto send = [&](const std::string& bytes) {
      REQUIRE(raw->Send(*to_rank0, bytes.data(), bytes.size()).ok());
    };
    send(Dispatch(999, 1, layer, {1}, {2}, {0, 1}, rows, D));  // parked
    send(Dispatch(998, 2, layer, {1}, {2}, {0, 1}, rows, D));  // refused
    send(Dispatch(kNodeIdBase + 1, 3, layer, {2}, {2}, {0, 1}, rows, D));
    REQUIRE(inbox.WaitFor(2));
    std::map<uint64_t, FrameHeader> answers;
    for (size_t i = 0; i < 2; ++i) {
      const FrameHeader h = decode(inbox, i);
      answers[h.session] = h;
    }
    REQUIRE(answers.count(2) == 1);
    REQUIRE(answers.count(3) == 1);
    CHECK(answers[2].status == uint32_t(absl::StatusCode::kUnavailable));
    CHECK(answers[3].status == 0);  // served while node 999's dispatch waits
    REQUIRE(WaitForStat(ep, "moe_dispatches_served", 1));  // counted on send
    auto stats = ep.Stats();
    CHECK(stats["moe_dispatches_parked"] == 1);
    CHECK(stats["moe_parked_refused"] == 1);
    CHECK(stats["moe_parked_expired"] == 0);
    CHECK(stats["moe_frames_unknown_sender"] == 1);
    CHECK(stats["moe_dispatches_served"] == 1);
    t0->Shutdown();  // drops the parked dispatch unanswered
  }
  raw->Shutdown();
  stranger->Shutdown();
  absl::MutexLock lock(&stranger_inbox.mu);
  CHECK(stranger_inbox.frames.empty());
}

TEST_CASE("an error or malformed answer fails the call at once",
          "[expert_parallel]") {
  const ModelFiles& f = Files("dsa-small");
  const int D = f.config.hidden_size, E = f.config.n_routed_experts;
  const int layer = f.config.first_k_dense_replace;
  FakeFabric fabric;
  auto runner = MakeRunner(f, 0, 2);
  auto t0 = fabric.NewEndpoint("gpu0");
  auto raw = fabric.NewEndpoint("gpu1");
  ExpertParallelOptions options;
  options.timeout = absl::Seconds(600);  // the answers must end the wait
  ExpertParallel ep(runner.get(), t0.get(), options);
  ep.set_node_id(kNodeIdBase);
  t0->SetReceiveHandler([&ep](std::string_view m) { ep.OnMessage(m); });
  const cluster::GpuPeer p1 = RankEntry(1, raw->LocalAddress());
  REQUIRE(ep.SetPeers({p1}).ok());
  auto to_rank0 = raw->AddPeer("gpu0", t0->LocalAddress());
  REQUIRE(to_rank0.ok());

  // Rank 1 answers every dispatch in the way `mode` says.
  std::atomic<int> mode{0};
  Transport* reply = raw.get();
  const PeerId back = *to_rank0;
  raw->SetReceiveHandler([&mode, reply, back](std::string_view m) {
    auto v = DecodeFrame(m);
    if (!v.ok()) return;
    FrameHeader h;
    h.src_node = kNodeIdBase + 1;
    h.layer = v->header.layer;
    h.session = v->header.session;
    std::string bytes;
    if (mode.load() == 0) {  // an error combine
      h.type = static_cast<uint16_t>(FrameType::kMoeCombine);
      h.status = uint32_t(absl::StatusCode::kResourceExhausted);
      EncodeFrame(h, {std::string_view("out of memory")}, &bytes);
    } else if (mode.load() == 1) {  // a kError frame
      h.type = static_cast<uint16_t>(FrameType::kError);
      h.status = uint32_t(absl::StatusCode::kInternal);
      EncodeFrame(h, {std::string_view("broken")}, &bytes);
    } else {  // a combine of the wrong size
      h.type = static_cast<uint16_t>(FrameType::kMoeCombine);
      EncodeFrame(h, {std::string_view("12345678")}, &bytes);
    }
    (void)reply->Send(back, bytes.data(), bytes.size());
  });

  std::vector<float> xn(size_t(2) * D, 0.25f);
  ExpertWork work;
  work.layer = layer;
  work.rows = 2;
  work.xn = xn.data();
  work.rows_of.resize(E);
  work.rows_of[0] = {0};
  work.rows_of[6] = {0, 1};  // rank 1
  ExpertBackend* experts = ep.ForMicroBatch(0, nullptr);
  std::vector<std::vector<float>> out;
  absl::Status s = experts->RunExperts(work, &out);
  CHECK(s.code() == absl::StatusCode::kResourceExhausted);
  CHECK(s.message().find("GPU rank 1") != std::string::npos);
  CHECK(s.message().find("out of memory") != std::string::npos);
  mode.store(1);
  s = experts->RunExperts(work, &out);
  CHECK(s.code() == absl::StatusCode::kInternal);
  mode.store(2);
  s = experts->RunExperts(work, &out);
  CHECK(s.code() == absl::StatusCode::kDataLoss);
  CHECK(ep.Stats()["moe_calls_failed"] == 3);
  t0->Shutdown();
  raw->Shutdown();
}

TEST_CASE("a step waiting on a rank that leaves the table fails at once",
          "[expert_parallel]") {
  const ModelFiles& f = Files("dsa-small");
  FakeFabric fabric;
  auto runner = MakeRunner(f, 0, 2);
  auto t0 = fabric.NewEndpoint("gpu0");
  auto t1 = fabric.NewEndpoint("gpu1");  // no handler: never answers
  ExpertParallelOptions options;
  options.timeout = absl::Seconds(600);  // the new table must end the wait
  ExpertParallel ep(runner.get(), t0.get(), options);
  ep.set_node_id(kNodeIdBase);
  t0->SetReceiveHandler([&ep](std::string_view m) { ep.OnMessage(m); });
  const cluster::GpuPeer p1 = RankEntry(1, t1->LocalAddress());
  REQUIRE(ep.SetPeers({p1}).ok());
  // The coordinator's next table lacks rank 1 (lost) or names a new node
  // for it (restarted).
  cluster::GpuPeer restarted = p1;
  restarted.set_node_id(kNodeIdBase + 7);
  for (const auto& table : {std::vector<cluster::GpuPeer>{},
                            std::vector<cluster::GpuPeer>{restarted}}) {
    REQUIRE(ep.SetPeers({p1}).ok());
    struct NewTableOnWait : WaitHooks {
      ExpertParallel* ep;
      std::vector<cluster::GpuPeer> table;
      absl::Status set;
      void BeforeWait() override { set = ep->SetPeers(table); }
      void AfterWait() override {}
    } hooks;
    hooks.ep = &ep;
    hooks.table = table;
    absl::Status s = PrefillOnRank0(*runner, ep.ForMicroBatch(0, &hooks));
    CHECK(hooks.set.ok());
    CHECK(s.code() == absl::StatusCode::kUnavailable);
    CHECK(s.message().find("left the rank table") != std::string::npos);
  }
  t0->Shutdown();
  t1->Shutdown();
}

TEST_CASE("rank tables and shardings that do not fit are refused",
          "[expert_parallel]") {
  const ModelFiles& f = Files("dsa-small");  // 8 routed experts
  auto three = ModelRunner::Create(f, RunnerOptions{0, 3});
  REQUIRE(three.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(three.status().message().find("n_routed_experts") != std::string::npos);
  CHECK(ModelRunner::Create(f, RunnerOptions{2, 2}).status().code() ==
        absl::StatusCode::kInvalidArgument);

  FakeFabric fabric;
  auto runner = MakeRunner(f, 0, 2);
  auto t0 = fabric.NewEndpoint("gpu0");
  ExpertParallel ep(runner.get(), t0.get());
  cluster::GpuPeer p;
  // CheckPeers (the GPU node's check before it moves experts) refuses
  // exactly what SetPeers refuses.
  auto refused = [&ep](const std::vector<cluster::GpuPeer>& table) {
    return ep.CheckPeers(table).code() == absl::StatusCode::kInvalidArgument &&
           ep.SetPeers(table).code() == absl::StatusCode::kInvalidArgument;
  };
  p.set_rank(2);
  p.set_node_id(1);
  p.set_fabric_address("fake:9");
  CHECK(refused({p}));
  p.set_rank(1);
  p.set_fabric_address("");
  CHECK(refused({p}));
  p.set_fabric_address("fake:9");
  CHECK(refused({p, p}));
  CHECK(ep.CheckPeers({p}).ok());
  CHECK(ep.SetPeers({p}).ok());
  t0->Shutdown();
}

}  // namespace
}  // namespace karat
