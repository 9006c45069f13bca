// Expert-parallel MoE with a data-plane secret (ExpertParallel::
// set_authenticated, docs/security.md "Data plane"): a frame is taken only
// from the transport peer the rank table names for its src_node. A
// stranger's dispatch or combine claiming a rank's node id is dropped and
// counted; without the secret (plaintext) the same dispatch is served, as
// it always was.
#include <catch2/catch.hpp>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "tests/gpu_node/expert_parallel_fixtures.h"

namespace karat {
namespace {

using namespace moe_test;

TEST_CASE("with a secret, MoE frames are taken only from the table's peers",
          "[expert_parallel][security]") {
  const bool authenticated = GENERATE(true, false);
  INFO((authenticated ? "authenticated" : "plaintext"));
  const ModelFiles& f = Files("dsa-small");
  const int D = f.config.hidden_size;
  const int layer = f.config.first_k_dense_replace;
  FakeFabric fabric;
  auto runner = MakeRunner(f, 0, 2);  // owns experts 0..3
  auto t0 = fabric.NewEndpoint("gpu0");
  auto rank1 = fabric.NewEndpoint("gpu1");     // rank 1 of the table
  auto stranger = fabric.NewEndpoint("gpu9");  // in no table
  Inbox rank1_inbox, stranger_inbox;
  rank1_inbox.Collect(rank1.get());
  stranger_inbox.Collect(stranger.get());
  ExpertParallel ep(runner.get(), t0.get());
  ep.set_node_id(kNodeIdBase);
  ep.set_authenticated(authenticated);
  t0->SetPeerReceiveHandler(
      [&ep](PeerId from, std::string_view m) { ep.OnMessage(m, from); });
  REQUIRE(ep.SetPeers({RankEntry(1, rank1->LocalAddress())}).ok());
  auto from_rank1 = rank1->AddPeer("gpu0", t0->LocalAddress());
  auto from_stranger = stranger->AddPeer("gpu0", t0->LocalAddress());
  REQUIRE(from_rank1.ok());
  REQUIRE(from_stranger.ok());
  std::vector<float> rows(size_t(2) * D, 0.5f);

  // The stranger claims rank 1's node id: a dispatch, and a combine for a
  // request no one made; then a dispatch under a node id no table names.
  const std::string forged =
      Dispatch(kNodeIdBase + 1, 1, layer, {1}, {2}, {0, 1}, rows, D);
  REQUIRE(stranger->Send(*from_stranger, forged.data(), forged.size()).ok());
  {
    FrameHeader h;
    h.type = static_cast<uint16_t>(FrameType::kMoeCombine);
    h.src_node = kNodeIdBase + 1;
    h.session = 4242;
    std::string bytes;
    EncodeFrame(h, {std::string_view("xxxxxxxx")}, &bytes);
    REQUIRE(stranger->Send(*from_stranger, bytes.data(), bytes.size()).ok());
  }
  const std::string unknown =
      Dispatch(999, 2, layer, {1}, {2}, {0, 1}, rows, D);
  REQUIRE(stranger->Send(*from_stranger, unknown.data(), unknown.size()).ok());
  // Rank 1 itself: served either way.
  const std::string genuine =
      Dispatch(kNodeIdBase + 1, 3, layer, {1}, {2}, {0, 1}, rows, D);
  REQUIRE(rank1->Send(*from_rank1, genuine.data(), genuine.size()).ok());

  if (authenticated) {
    REQUIRE(rank1_inbox.WaitFor(1));
    REQUIRE(WaitForStat(ep, "moe_frames_unauthenticated", 3));
    REQUIRE(WaitForStat(ep, "moe_dispatches_served", 1));
    auto stats = ep.Stats();
    CHECK(stats["moe_dispatches_served"] == 1);
    CHECK(stats["moe_dispatches_parked"] == 0);
    CHECK(stats["moe_frames_stale"] == 0);
    absl::MutexLock lock(&rank1_inbox.mu);
    REQUIRE(rank1_inbox.frames.size() == 1);
    auto answer = DecodeFrame(rank1_inbox.frames[0]);
    REQUIRE(answer.ok());
    CHECK(answer->header.session == 3);
    CHECK(answer->header.status == 0);
  } else {
    // The forged dispatch is computed (its combine goes to rank 1's
    // address), the forged combine counted stale, the unknown one parked.
    REQUIRE(rank1_inbox.WaitFor(2));
    REQUIRE(WaitForStat(ep, "moe_dispatches_served", 2));
    REQUIRE(WaitForStat(ep, "moe_frames_stale", 1));
    REQUIRE(WaitForStat(ep, "moe_dispatches_parked", 1));
    auto stats = ep.Stats();
    CHECK(stats["moe_frames_unauthenticated"] == 0);
    CHECK(stats["moe_frames_stale"] == 1);
    CHECK(stats["moe_dispatches_parked"] == 1);
  }
  t0->Shutdown();
  rank1->Shutdown();
  stranger->Shutdown();
  absl::MutexLock lock(&stranger_inbox.mu);
  CHECK(stranger_inbox.frames.empty());
}

TEST_CASE(
    "with a secret, a parked dispatch is served only from the peer "
    "the new table names",
    "[expert_parallel][security]") {
  const ModelFiles& f = Files("dsa-small");
  const int D = f.config.hidden_size;
  const int layer = f.config.first_k_dense_replace;
  FakeFabric fabric;
  auto runner = MakeRunner(f, 0, 4);  // owns experts 0 and 1
  auto t0 = fabric.NewEndpoint("gpu0");
  auto rank1 = fabric.NewEndpoint("gpu1");
  auto rank2 = fabric.NewEndpoint("gpu2");
  Inbox inbox1, inbox2;
  inbox1.Collect(rank1.get());
  inbox2.Collect(rank2.get());
  ExpertParallelOptions options;
  options.peer_wait = absl::Seconds(600);  // released by SetPeers only
  ExpertParallel ep(runner.get(), t0.get(), options);
  ep.set_node_id(kNodeIdBase);
  ep.set_authenticated(true);
  t0->SetPeerReceiveHandler(
      [&ep](PeerId from, std::string_view m) { ep.OnMessage(m, from); });
  // Both addresses are known to rank 0's transport (ranks 1 and 2), so
  // their frames are attributed; nodes 201 and 202 are new to the table.
  cluster::GpuPeer p1 = RankEntry(1, rank1->LocalAddress());
  cluster::GpuPeer p2 = RankEntry(2, rank2->LocalAddress());
  REQUIRE(ep.SetPeers({p1, p2}).ok());
  auto s1 = rank1->AddPeer("gpu0", t0->LocalAddress());
  auto s2 = rank2->AddPeer("gpu0", t0->LocalAddress());
  REQUIRE(s1.ok());
  REQUIRE(s2.ok());
  std::vector<float> rows(size_t(2) * D, 0.25f);
  // From rank 1's address: one claiming node 201, one claiming 202.
  for (auto [node, request] : {std::pair<uint32_t, uint64_t>{201, 1},
                               std::pair<uint32_t, uint64_t>{202, 2}}) {
    const std::string d =
        Dispatch(node, request, layer, {1}, {2}, {0, 1}, rows, D);
    REQUIRE(rank1->Send(*s1, d.data(), d.size()).ok());
  }
  REQUIRE(WaitForStat(ep, "moe_dispatches_parked", 2));
  // The new table: node 201 is rank 1 (the address it came from), node 202
  // is rank 2 (another address).
  p1.set_node_id(201);
  p2.set_node_id(202);
  REQUIRE(ep.SetPeers({p1, p2}).ok());
  REQUIRE(inbox1.WaitFor(1));
  REQUIRE(WaitForStat(ep, "moe_frames_unauthenticated", 1));
  // The answer is sent before the dispatch is counted as served.
  REQUIRE(WaitForStat(ep, "moe_dispatches_served", 1));
  auto stats = ep.Stats();
  CHECK(stats["moe_parked_released"] == 1);
  CHECK(stats["moe_dispatches_served"] == 1);
  {
    absl::MutexLock lock(&inbox1.mu);
    auto answer = DecodeFrame(inbox1.frames[0]);
    REQUIRE(answer.ok());
    CHECK(answer->header.session == 1);
  }
  t0->Shutdown();
  rank1->Shutdown();
  rank2->Shutdown();
  absl::MutexLock lock(&inbox2.mu);
  CHECK(inbox2.frames.empty());
}

}  // namespace
}  // namespace karat
