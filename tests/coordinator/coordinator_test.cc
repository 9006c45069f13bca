// The coordinator service in-process, with fake GPU and KARAT nodes (also
// in-process gRPC servers on free ports) registered through RegisterNode.
#include "coordinator/coordinator.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "cluster.grpc.pb.h"
#include "coordinator/scheduling.h"
#include "karat.grpc.pb.h"
#include "tests/coordinator/coordinator_fixture.h"

namespace karat::coordinator {
namespace {

namespace v1 = ::karat::v1;
namespace cl = ::karat::cluster;

TEST_CASE("membership: ids from 1, heartbeats, unknown ids, timeouts") {
  Cluster c;
  c.AddNodes({1000}, {65});
  CHECK(c.karat_id == 1);
  CHECK(c.gpu_id == 2);

  cl::HeartbeatRequest hb;
  hb.set_node_id(99);
  cl::HeartbeatResponse hr;
  {
    grpc::ClientContext ctx;
    REQUIRE(c.membership->Heartbeat(&ctx, hb, &hr).ok());
    CHECK_FALSE(hr.known());
  }
  hb.set_node_id(c.karat_id);
  auto* d = hb.add_devices();
  d->set_device(0);
  d->set_capacity_bytes(5000);
  d->set_used_bytes(1234);
  (*hb.mutable_stats())["frames"] = 3;
  c.clock.Advance(absl::Seconds(4));
  {
    grpc::ClientContext ctx;
    REQUIRE(c.membership->Heartbeat(&ctx, hb, &hr).ok());
    CHECK(hr.known());
  }
  c.clock.Advance(absl::Seconds(2));  // gpu0 silent for 6 s, karat0 for 2 s
  v1::ClusterStatus status;
  {
    grpc::ClientContext ctx;
    REQUIRE(c.client->GetClusterStatus(&ctx, {}, &status).ok());
  }
  REQUIRE(status.nodes_size() == 2);
  CHECK(status.nodes(0).name() == "karat0");
  CHECK(status.nodes(0).alive());
  CHECK(status.nodes(0).last_heartbeat_ms_ago() == 2000);
  CHECK(status.nodes(0).devices(0).used_bytes() == 1234);
  CHECK(status.nodes(0).stats().at("frames") == 3);
  CHECK(status.nodes(1).role() == "gpu");
  CHECK_FALSE(status.nodes(1).alive());

  // No alive GPU node: UNAVAILABLE.
  auto r = c.Generate(c.NewSession(), "hi", 3);
  CHECK(r.status.error_code() == grpc::StatusCode::UNAVAILABLE);
}

TEST_CASE("membership: a bad role is refused") {
  Cluster c;
  cl::RegisterNodeRequest req;
  req.set_name("x");
  req.set_role("tpu");
  req.set_grpc_address("127.0.0.1:1");
  cl::RegisterNodeResponse resp;
  grpc::ClientContext ctx;
  CHECK(c.membership->RegisterNode(&ctx, req, &resp).error_code() ==
        grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_CASE("membership: a GPU node without its model fingerprint is refused") {
  Cluster c;
  cl::RegisterNodeRequest req;
  req.set_name("gpu0");
  req.set_role("gpu");
  req.set_grpc_address("127.0.0.1:1");
  cl::RegisterNodeResponse resp;
  grpc::ClientContext ctx;
  const grpc::Status st = c.membership->RegisterNode(&ctx, req, &resp);
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(st.error_message().find("model_fingerprint") != std::string::npos);
}

TEST_CASE("generate: validation errors") {
  Cluster c(/*limit=*/16);
  std::string sid = c.NewSession();
  REQUIRE(sid.size() == 18);
  CHECK(sid.rfind("s-", 0) == 0);

  SECTION("unknown session") {
    auto r = c.Generate("s-0000000000000000", "hi", 3);
    CHECK(r.status.error_code() == grpc::StatusCode::NOT_FOUND);
  }
  SECTION("max_new_tokens out of range names the limit") {
    auto r = c.Generate(sid, "hi", 17);
    CHECK(r.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(r.status.error_message().find("16") != std::string::npos);
    CHECK(c.Generate(sid, "hi", 0).status.error_code() ==
          grpc::StatusCode::INVALID_ARGUMENT);
  }
  SECTION("empty prompt") {
    CHECK(c.Generate(sid, "", 3).status.error_code() ==
          grpc::StatusCode::INVALID_ARGUMENT);
  }
  SECTION("token ids out of range") {
    v1::GenerateRequest req;
    req.set_session_id(sid);
    req.set_max_new_tokens(3);
    req.add_prompt_tokens(65);
    req.add_prompt_tokens(258);
    CHECK(c.Generate(req).status.error_code() ==
          grpc::StatusCode::INVALID_ARGUMENT);
  }
  SECTION("negative or NaN temperature") {
    v1::GenerateRequest req;
    req.set_session_id(sid);
    req.set_max_new_tokens(3);
    req.set_prompt("hi");
    req.set_temperature(-0.5f);
    CHECK(c.Generate(req).status.error_code() ==
          grpc::StatusCode::INVALID_ARGUMENT);
    req.set_temperature(std::nanf(""));
    CHECK(c.Generate(req).status.error_code() ==
          grpc::StatusCode::INVALID_ARGUMENT);
  }
  SECTION("no nodes at all") {
    auto r = c.Generate(sid, "hi", 3);
    CHECK(r.status.error_code() == grpc::StatusCode::UNAVAILABLE);
  }
}

TEST_CASE("generate: RESOURCE_EXHAUSTED leaves the session unchanged") {
  Cluster c;
  c.AddNodes({5, 6}, {65});
  std::string sid = c.NewSession();
  // 1 BOS + 2 prompt + 4 new = 7 positions: fits neither device.
  auto r = c.Generate(sid, "hi", 4);
  CHECK(r.status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(r.status.error_message().find("7 positions") != std::string::npos);
  v1::Session s = c.Get(sid);
  CHECK(s.num_tokens() == 0);
  CHECK(s.turns() == 0);
  CHECK(s.home_node().empty());
  CHECK(s.state() == "idle");
  CHECK(c.karat->reserves().size() == 2);
  CHECK(c.gpu->runs().empty());

  // 1 + 2 + 3 = 6 positions: device 0 (least occupied) refuses, device 1
  // takes it.
  r = c.Generate(sid, "hi", 3);
  REQUIRE(r.status.ok());
  s = c.Get(sid);
  CHECK(s.home_node() == "karat0");
  CHECK(s.home_device() == 1);
  auto reserves = c.karat->reserves();
  REQUIRE(reserves.size() == 4);
  CHECK(reserves[2].device() == 0);
  CHECK(reserves[3].device() == 1);
  CHECK(reserves[3].tokens() == 6);
}

TEST_CASE("generate: history and kv_len across two turns") {
  Cluster c;
  c.AddNodes({1000, 1000}, {'A', 'B', 'C'});
  std::string sid = c.NewSession(42);

  auto r1 = c.Generate(sid, "hi", 3);
  REQUIRE(r1.status.ok());
  REQUIRE(r1.tokens.size() == 3);
  CHECK(r1.tokens[0].text() == "A");
  CHECK(r1.tokens[0].position() == 3);
  CHECK(r1.tokens[2].position() == 5);
  REQUIRE(r1.done.has_value());
  CHECK(r1.done->finish_reason() == "length");
  CHECK(r1.done->generated_tokens() == 3);
  CHECK(r1.done->prompt_tokens() == 2);

  auto runs = c.gpu->runs();
  REQUIRE(runs.size() == 1);
  CHECK(runs[0].pos_start() == 0);
  CHECK(std::vector<int32_t>(runs[0].feed_tokens().begin(),
                             runs[0].feed_tokens().end()) ==
        std::vector<int32_t>{256, 'h', 'i'});
  CHECK(runs[0].seed() == 42);
  CHECK(runs[0].placement().node_name() == "karat0");
  CHECK(runs[0].placement().fabric_address() == "fabric-karat0");
  CHECK(runs[0].placement().device() == 0);
  CHECK(runs[0].session() != 0);

  v1::Session s = c.Get(sid);
  CHECK(std::vector<int32_t>(s.tokens().begin(), s.tokens().end()) ==
        std::vector<int32_t>{256, 'h', 'i', 'A', 'B', 'C'});
  CHECK(s.turns() == 1);

  auto r2 = c.Generate(sid, "x", 2);
  REQUIRE(r2.status.ok());
  runs = c.gpu->runs();
  REQUIRE(runs.size() == 2);
  CHECK(runs[1].pos_start() == 5);  // the last sampled token is re-fed
  CHECK(std::vector<int32_t>(runs[1].feed_tokens().begin(),
                             runs[1].feed_tokens().end()) ==
        std::vector<int32_t>{'C', 'x'});
  CHECK(runs[1].session() == runs[0].session());
  auto reserves = c.karat->reserves();
  REQUIRE(reserves.size() == 2);
  CHECK(reserves[1].tokens() == 6 + 1 + 2);
  CHECK(reserves[1].device() == 0);  // the home is kept
  s = c.Get(sid);
  CHECK(s.num_tokens() == 9);
  CHECK(s.turns() == 2);

  v1::ClusterStatus status;
  grpc::ClientContext ctx;
  REQUIRE(c.client->GetClusterStatus(&ctx, {}, &status).ok());
  CHECK(status.tokens_generated() == 5);
  CHECK(status.sessions() == 1);
  CHECK(status.active_generations() == 0);
}

TEST_CASE("generate: a long prompt's prefill progress reaches the client") {
  Cluster c;
  c.AddNodes({1000}, {'A', 'B'});
  const std::string sid = c.NewSession();
  c.gpu->progress_step = 4;
  auto r = c.Generate(sid, "0123456789", 2);  // BOS + 10: 11 to feed
  REQUIRE(r.status.ok());
  CHECK(r.prefill == std::vector<std::pair<int, int>>{{4, 11}, {8, 11}});
  // Reports are not tokens: the turn, the history and the counters are
  // those of a turn without them.
  REQUIRE(r.tokens.size() == 2);
  CHECK(r.tokens[0].position() == 11);
  REQUIRE(r.done.has_value());
  CHECK(r.done->generated_tokens() == 2);
  CHECK(c.Get(sid).num_tokens() == 13);
  CHECK(c.Status().tokens_generated() == 2);
  // A feed that fits one step reports nothing.
  c.gpu->progress_step = 0;
  r = c.Generate(sid, "x", 1);
  REQUIRE(r.status.ok());
  CHECK(r.prefill.empty());
}

TEST_CASE("generate: EOS ends the turn") {
  Cluster c;
  c.AddNodes({1000}, {'A', 257});
  std::string sid = c.NewSession();
  auto r = c.Generate(sid, "q", 10);
  REQUIRE(r.status.ok());
  REQUIRE(r.tokens.size() == 2);
  CHECK(r.tokens[1].text().empty());
  CHECK(r.done->finish_reason() == "eos");
}

TEST_CASE("generate: cancelling mid-stream leaves the session usable") {
  Cluster c;
  c.AddNodes({1000}, {'A', 'B', 'C', 'D'});
  c.gpu->hold_after = 2;
  std::string sid = c.NewSession();
  auto r = c.Generate(sid, "hi", 8, /*cancel_after=*/2);
  CHECK(r.status.error_code() == grpc::StatusCode::CANCELLED);
  CHECK(r.tokens.size() == 2);
  c.WaitIdle(sid);
  v1::Session s = c.Get(sid);
  CHECK(std::vector<int32_t>(s.tokens().begin(), s.tokens().end()) ==
        std::vector<int32_t>{256, 'h', 'i', 'A', 'B'});

  c.gpu->hold_after = -1;
  auto r2 = c.Generate(sid, "z", 1);
  REQUIRE(r2.status.ok());
  auto runs = c.gpu->runs();
  REQUIRE(runs.size() == 2);
  CHECK(runs[1].pos_start() == 4);
  CHECK(std::vector<int32_t>(runs[1].feed_tokens().begin(),
                             runs[1].feed_tokens().end()) ==
        std::vector<int32_t>{'B', 'z'});
}

TEST_CASE("generate: a second generate on a busy session is refused") {
  Cluster c;
  c.AddNodes({1000}, {'A'});
  c.gpu->hold_after = 1;
  std::string sid = c.NewSession();
  grpc::ClientContext ctx;
  v1::GenerateRequest req;
  req.set_session_id(sid);
  req.set_prompt("hi");
  req.set_max_new_tokens(4);
  auto reader = c.client->Generate(&ctx, req);
  v1::GenerateResponse resp;
  REQUIRE(reader->Read(&resp));  // the first token: the turn is running
  CHECK(c.Get(sid).state() == "generating");

  auto r = c.Generate(sid, "again", 2);
  CHECK(r.status.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(r.status.error_message().find(sid) != std::string::npos);

  // Closing ends the running turn first (its call: ABORTED).
  v1::CloseSessionRequest close;
  close.set_session_id(sid);
  v1::CloseSessionResponse closed;
  {
    grpc::ClientContext cctx;
    CHECK(c.client->CloseSession(&cctx, close, &closed).ok());
  }
  while (reader->Read(&resp)) {
  }
  CHECK(reader->Finish().error_code() == grpc::StatusCode::ABORTED);
  grpc::ClientContext gctx;
  v1::GetSessionRequest get;
  get.set_session_id(sid);
  v1::Session session;
  CHECK(c.client->GetSession(&gctx, get, &session).error_code() ==
        grpc::StatusCode::NOT_FOUND);
}

TEST_CASE("generate: a GPU failure mid-turn is UNAVAILABLE, session usable") {
  Cluster c;
  c.AddNodes({1000}, {'A', 'B', 'C'});
  c.gpu->fail_after = 2;
  std::string sid = c.NewSession();
  auto r = c.Generate(sid, "hi", 5);
  CHECK(r.status.error_code() == grpc::StatusCode::UNAVAILABLE);
  CHECK(r.status.error_message().find("gpu0") != std::string::npos);
  CHECK(r.tokens.size() == 2);
  v1::Session s = c.Get(sid);
  CHECK(s.num_tokens() == 5);
  CHECK(s.state() == "idle");

  c.gpu->fail_after = -1;
  auto r2 = c.Generate(sid, "k", 1);
  REQUIRE(r2.status.ok());
  auto runs = c.gpu->runs();
  CHECK(runs[1].pos_start() == 4);
}

TEST_CASE("close: frees the home and later calls are NOT_FOUND") {
  Cluster c;
  c.AddNodes({1000}, {'A'});
  std::string sid = c.NewSession();
  REQUIRE(c.Generate(sid, "hi", 1).status.ok());
  uint64_t key = c.gpu->runs()[0].session();
  v1::CloseSessionRequest close;
  close.set_session_id(sid);
  v1::CloseSessionResponse closed;
  {
    grpc::ClientContext ctx;
    REQUIRE(c.client->CloseSession(&ctx, close, &closed).ok());
  }
  CHECK(c.karat->freed() == std::vector<uint64_t>{key});
  {
    grpc::ClientContext ctx;
    CHECK(c.client->CloseSession(&ctx, close, &closed).error_code() ==
          grpc::StatusCode::NOT_FOUND);
  }
  CHECK(c.Generate(sid, "hi", 1).status.error_code() ==
        grpc::StatusCode::NOT_FOUND);
  v1::GetSessionRequest get;
  get.set_session_id(sid);
  v1::Session s;
  grpc::ClientContext ctx;
  CHECK(c.client->GetSession(&ctx, get, &s).error_code() ==
        grpc::StatusCode::NOT_FOUND);
}

// A turn holds its GPU node's batch until released; with max_batch 1 the
// others wait in the queue and see their positions.
TEST_CASE("admission: queued turns see their position and run in order") {
  Cluster c(64, [](Options& o) { o.max_batch_by_rank = {1}; });
  c.AddNodes({1000}, {'A', 'B'});
  c.gpu->hold_after = 1;
  std::string a = c.NewSession(), b = c.NewSession(), d = c.NewSession();
  Cluster::Result ra, rb, rd;
  std::thread ta([&] { ra = c.Generate(a, "hi", 2); });
  c.WaitStat("rank.0.active_requests", 1);
  std::thread tb([&] { rb = c.Generate(b, "yo", 2); });
  c.WaitStat("queue_length", 1);
  std::thread td([&] { rd = c.Generate(d, "ok", 2); });
  c.WaitStat("queue_length", 2);
  WaitRuns(*c.gpu, 1);
  CHECK(c.gpu->runs().size() == 1);
  c.gpu->release = true;  // a's turn ends: b, then d run
  ta.join();
  tb.join();
  td.join();
  REQUIRE(ra.status.ok());
  REQUIRE(rb.status.ok());
  REQUIRE(rd.status.ok());
  CHECK(ra.queued.empty());
  CHECK(rb.queued == std::vector<int>{0});
  CHECK(rd.queued == std::vector<int>{1, 0});
  CHECK(rb.done.has_value());
  auto runs = c.gpu->runs();
  REQUIRE(runs.size() == 3);
  CHECK(runs[1].session() != runs[0].session());
  auto stats = c.Status().stats();
  CHECK(stats.at("turns_admitted") == 3);
  CHECK(stats.at("turns_queued") == 2);
  CHECK(stats.at("queue_length") == 0);
  CHECK(stats.at("ttft_ms_count") == 3);
  CHECK(stats.at("ttft_ms_bucket_le_inf") == 3);
}

TEST_CASE("admission: a turn waiting past queue_timeout_ms is refused") {
  Cluster c(64, [](Options& o) {
    o.max_batch_by_rank = {1};
    o.scheduling.set_queue_timeout_ms(1000);
  });
  c.AddNodes({1000}, {'A'});
  c.gpu->hold_after = 1;
  std::string a = c.NewSession(), b = c.NewSession();
  Cluster::Result ra, rb;
  std::thread ta([&] { ra = c.Generate(a, "hi", 3, /*cancel_after=*/-1); });
  c.WaitStat("rank.0.active_requests", 1);
  std::thread tb([&] { rb = c.Generate(b, "yo", 2); });
  c.WaitStat("queue_length", 1);
  c.clock.Advance(absl::Milliseconds(1500));
  tb.join();
  CHECK(rb.status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(rb.status.error_message().find("waited 1500 ms") != std::string::npos);
  CHECK(rb.queued == std::vector<int>{0});
  CHECK(c.Get(b).num_tokens() == 0);
  CHECK(c.Get(b).state() == "idle");
  CHECK(c.Status().stats().at("turns_timed_out") == 1);
  c.gpu->release = true;
  ta.join();
  CHECK(ra.status.ok());
}

TEST_CASE("admission: a client cancel while queued leaves the queue") {
  Cluster c(64, [](Options& o) { o.max_batch_by_rank = {1}; });
  c.AddNodes({1000}, {'A'});
  c.gpu->hold_after = 1;
  std::string a = c.NewSession(), b = c.NewSession();
  Cluster::Result ra;
  std::thread ta([&] { ra = c.Generate(a, "hi", 3); });
  c.WaitStat("rank.0.active_requests", 1);

  grpc::ClientContext ctx;
  v1::GenerateRequest req;
  req.set_session_id(b);
  req.set_prompt("yo");
  req.set_max_new_tokens(2);
  auto reader = c.client->Generate(&ctx, req);
  v1::GenerateResponse resp;
  REQUIRE(reader->Read(&resp));
  REQUIRE(resp.has_queued());
  CHECK(resp.queued().position() == 0);
  ctx.TryCancel();
  while (reader->Read(&resp)) {
  }
  CHECK(reader->Finish().error_code() == grpc::StatusCode::CANCELLED);
  c.WaitStat("queue_length", 0);
  c.WaitStat("turns_cancelled_queued", 1);
  c.WaitIdle(b);
  CHECK(c.Get(b).num_tokens() == 0);
  c.gpu->release = true;
  ta.join();
  CHECK(ra.status.ok());
  CHECK(c.gpu->runs().size() == 1);
  // The session that left the queue runs later.
  CHECK(c.Generate(b, "yo", 1).status.ok());
}

TEST_CASE("admission: the TBT target caps a rank's batch") {
  Cluster c(64, [](Options& o) {
    o.scheduling.set_tbt_slo_ms(10);
    // 4 ms fixed + 4 ms per request: one request fits 10 ms, two do not.
    o.step_cost = {4.0, 4.0, 0.0};
    o.scheduling.set_step_cost_mode("fixed");
  });
  c.AddNodes({1000}, {'A'});
  c.gpu->hold_after = 1;
  std::string a = c.NewSession(), b = c.NewSession();
  Cluster::Result ra, rb;
  std::thread ta([&] { ra = c.Generate(a, "hi", 3); });
  c.WaitStat("rank.0.active_requests", 1);
  std::thread tb([&] { rb = c.Generate(b, "yo", 2); });
  c.WaitStat("queue_length", 1);
  c.gpu->release = true;
  ta.join();
  tb.join();
  CHECK(ra.status.ok());
  CHECK(rb.status.ok());
  CHECK(rb.queued == std::vector<int>{0});
}

TEST_CASE("admission: the TBT cap follows the rank's measured steps") {
  // The prior (2 ms + 0.5 ms per request + 0.0005 ms per token) would admit
  // about 98 requests within 100 ms. The rank's steps measure 120 ms at a
  // batch of one: learned, even one request misses the target, so a second
  // waits while one runs (a lone request always runs); "fixed" keeps the
  // prior and admits both.
  for (const std::string mode : {"learned", "fixed"}) {
    INFO("step_cost_mode " << mode);
    Cluster c(64, [&](Options& o) {
      o.scheduling.set_tbt_slo_ms(100);
      o.scheduling.set_step_cost_mode(mode);
    });
    c.AddNodes({1000}, {'A'});
    c.gpu->step_us = 120000;
    std::string a = c.NewSession(), b = c.NewSession();
    REQUIRE(c.Generate(a, "hi", 20).status.ok());
    const auto stats = c.Status().stats();
    if (mode == "learned") {
      // 19 decode steps: the prefill's step does not count.
      CHECK(stats.at("rank.0.step_cost_samples") == 19);
      CHECK(stats.at("rank.0.step_cost_learned") == 1);
      CHECK(stats.at("rank.0.step_cost_fixed_ms") +
                stats.at("rank.0.step_cost_per_request_ms") >
            100);
    } else {
      CHECK(stats.at("rank.0.step_cost_samples") == 0);
      CHECK(stats.at("rank.0.step_cost_learned") == 0);
      CHECK(stats.at("rank.0.step_cost_fixed_ms") == 2.0);
    }
    c.gpu->hold_after = 1;
    Cluster::Result ra, rb;
    std::thread ta([&] { ra = c.Generate(a, "hi", 3); });
    c.WaitStat("rank.0.active_requests", 1);
    std::thread tb([&] { rb = c.Generate(b, "yo", 2); });
    if (mode == "learned") {
      c.WaitStat("queue_length", 1);
    } else {
      c.WaitStat("rank.0.active_requests", 2);
    }
    c.gpu->release = true;
    ta.join();
    tb.join();
    CHECK(ra.status.ok());
    CHECK(rb.status.ok());
    CHECK(rb.queued ==
          (mode == "learned" ? std::vector<int>{0} : std::vector<int>{}));
  }
}

TEST_CASE("ranks: registration checks, SetPeers push, rank choice") {
  Cluster c;
  c.karat = std::make_unique<FakeKaratNode>(std::vector<int>{1000});
  c.karat_server = std::make_unique<FakeServer>(c.karat.get());
  c.Register("karat0", "karat", c.karat_server->address, 1);
  FakeGpuNode g0({'A'}), g1({'B'});
  FakeServer s0(&g0), s1(&g1);
  uint32_t id0 = c.Register("gpu0", "gpu", s0.address, 0, 0, 2);
  uint32_t id1 = c.Register("gpu1", "gpu", s1.address, 0, 1, 2);

  // Every GPU node learns both ranks.
  for (int i = 0; i < 500; ++i) {
    auto p = g0.peers();
    if (!p.empty() && p.back().peers_size() == 2 && !g1.peers().empty()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  REQUIRE_FALSE(g0.peers().empty());
  REQUIRE_FALSE(g1.peers().empty());
  cl::SetPeersRequest peers = g0.peers().back();
  REQUIRE(peers.peers_size() == 2);
  CHECK(peers.peers(0).rank() == 0);
  CHECK(peers.peers(0).name() == "gpu0");
  CHECK(peers.peers(0).node_id() == id0);
  CHECK(peers.peers(0).fabric_address() == "fabric-gpu0");
  CHECK(peers.peers(1).rank() == 1);
  CHECK(peers.peers(1).node_id() == id1);
  CHECK(g1.peers().back().peers_size() == 2);

  SECTION("a live rank or another rank count is refused") {
    cl::RegisterNodeRequest req;
    req.set_name("gpu2");
    req.set_role("gpu");
    req.set_model_fingerprint("test-model");
    req.set_grpc_address("127.0.0.1:1");
    req.set_rank(1);
    req.set_ranks(2);
    cl::RegisterNodeResponse resp;
    {
      grpc::ClientContext ctx;
      auto st = c.membership->RegisterNode(&ctx, req, &resp);
      CHECK(st.error_code() == grpc::StatusCode::ALREADY_EXISTS);
      CHECK(st.error_message().find("gpu1") != std::string::npos);
    }
    req.set_rank(2);
    req.set_ranks(3);
    {
      grpc::ClientContext ctx;
      CHECK(c.membership->RegisterNode(&ctx, req, &resp).error_code() ==
            grpc::StatusCode::FAILED_PRECONDITION);
    }
    req.set_rank(2);
    req.set_ranks(2);
    {
      grpc::ClientContext ctx;
      CHECK(c.membership->RegisterNode(&ctx, req, &resp).error_code() ==
            grpc::StatusCode::INVALID_ARGUMENT);
    }
  }

  SECTION("turns go to the rank with the fewest running requests") {
    g0.hold_after = 1;
    g1.hold_after = 1;
    std::string a = c.NewSession(), b = c.NewSession(), d = c.NewSession();
    Cluster::Result ra, rb, rd;
    std::thread ta([&] { ra = c.Generate(a, "hi", 2); });
    c.WaitStat("rank.0.active_requests", 1);
    std::thread tb([&] { rb = c.Generate(b, "hi", 2); });
    c.WaitStat("rank.1.active_requests", 1);
    WaitRuns(g0, 1);
    WaitRuns(g1, 1);
    CHECK(g0.runs().size() == 1);
    CHECK(g1.runs().size() == 1);
    g1.release = true;
    tb.join();
    // Rank 1 is idle again: the next turn goes there.
    std::thread td([&] { rd = c.Generate(d, "hi", 2); });
    td.join();
    CHECK(g1.runs().size() == 2);
    g0.release = true;
    ta.join();
    CHECK(ra.status.ok());
    CHECK(rb.status.ok());
    CHECK(rd.status.ok());
  }

  SECTION("a dense model: a turn runs on the alive rank") {
    // The fake ranks report no routed experts: every rank holds every
    // weight, so a silent rank only takes itself out.
    c.clock.Advance(absl::Seconds(4));
    cl::HeartbeatRequest hb;
    cl::HeartbeatResponse hr;
    for (uint32_t id : {1u, id0}) {
      hb.set_node_id(id);
      grpc::ClientContext ctx;
      REQUIRE(c.membership->Heartbeat(&ctx, hb, &hr).ok());
    }
    c.clock.Advance(absl::Seconds(2));  // gpu1 silent for 6 s
    const size_t runs1 = g1.runs().size();
    auto r = c.Generate(c.NewSession(), "hi", 2);
    INFO(r.status.error_message());
    CHECK(r.status.ok());
    CHECK(g0.runs().size() == 1);
    CHECK(g1.runs().size() == runs1);
    // The alive rank was told the new table.
    CHECK(g0.peers().back().peers_size() == 1);
  }
}

TEST_CASE("heartbeat: an id is known only under the name it was given") {
  // A restarted coordinator hands out ids from 1 again: a node still
  // holding an id from before must not pass for the node that now has it.
  Cluster c;
  FakeKaratNode k({1000});
  FakeServer ks(&k);
  const uint32_t id = c.Register("karat0", "karat", ks.address, 1);
  auto beat = [&](uint32_t node, const std::string& name) {
    cl::HeartbeatRequest hb;
    hb.set_node_id(node);
    hb.set_name(name);
    cl::HeartbeatResponse hr;
    grpc::ClientContext ctx;
    REQUIRE(c.membership->Heartbeat(&ctx, hb, &hr).ok());
    return hr.known();
  };
  CHECK(beat(id, "karat0"));
  CHECK(beat(id, ""));  // a node that does not send its name
  CHECK_FALSE(beat(id, "karat1"));
  CHECK_FALSE(beat(id + 7, "karat0"));
}

TEST_CASE("ranks: a turn needs every rank until each has registered once") {
  Cluster c;
  c.karat = std::make_unique<FakeKaratNode>(std::vector<int>{1000});
  c.karat_server = std::make_unique<FakeServer>(c.karat.get());
  c.Register("karat0", "karat", c.karat_server->address, 1);
  FakeGpuNode g0({'A'});
  FakeServer s0(&g0);
  c.Register("gpu0", "gpu", s0.address, 0, 0, 2);
  auto r = c.Generate(c.NewSession(), "hi", 2);
  CHECK(r.status.error_code() == grpc::StatusCode::UNAVAILABLE);
  CHECK(r.status.error_message().find("rank 1 of 2") != std::string::npos);
  CHECK(r.status.error_message().find("not every rank has registered") !=
        std::string::npos);
  CHECK(r.status.error_message().find("started with --rank 1 --ranks 2") !=
        std::string::npos);
  CHECK(g0.runs().empty());
}

// Two fake GPU ranks that report 8 routed experts, with both acknowledging
// the block ownership.
struct TwoRanks {
  Cluster c;
  FakeGpuNode g0{{'A', 'B', 'C'}}, g1{{'X', 'Y', 'Z'}};
  std::unique_ptr<FakeServer> s0, s1;
  TwoRanks() {
    c.routed_experts = 8;
    c.karat = std::make_unique<FakeKaratNode>(std::vector<int>{1000});
    c.karat_server = std::make_unique<FakeServer>(c.karat.get());
    c.Register("karat0", "karat", c.karat_server->address, 1);
    g0.name = "gpu0";
    g1.name = "gpu1";
    s0 = std::make_unique<FakeServer>(&g0);
    s1 = std::make_unique<FakeServer>(&g1);
    c.Register("gpu0", "gpu", s0->address, 0, 0, 2);
    c.Register("gpu1", "gpu", s1->address, 0, 1, 2);
    for (int i = 0; i < 1000 && !(HasBlocks(g0) && HasBlocks(g1)); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    REQUIRE(HasBlocks(g0));
    REQUIRE(HasBlocks(g1));
  }
  static bool HasBlocks(FakeGpuNode& g) {
    auto p = g.peers();
    if (p.empty() || p.back().peers_size() != 2) return false;
    const std::vector<int> owners(p.back().expert_owner().begin(),
                                  p.back().expert_owner().end());
    return owners == std::vector<int>{0, 0, 0, 0, 1, 1, 1, 1};
  }
};

TEST_CASE("a lost GPU rank: its turn resumes on the other rank") {
  TwoRanks t;
  Cluster& c = t.c;
  // The first turn goes to rank 0, which stops after 2 tokens and then
  // goes away (its server shuts down, cancelling the call).
  t.g0.hold_after = 2;
  std::string sid = c.NewSession();
  Cluster::Result r;
  std::thread turn([&] { r = c.Generate(sid, "hi", 5); });
  WaitRuns(t.g0, 1);
  for (int i = 0; i < 1000 && c.Get(sid).num_tokens() < 5; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  REQUIRE(c.Get(sid).num_tokens() == 5);  // BOS, h, i, A, B
  t.s0->server->Shutdown(std::chrono::system_clock::now());
  turn.join();
  INFO(r.status.error_message());
  REQUIRE(r.status.ok());
  REQUIRE(r.tokens.size() == 5);
  CHECK(r.tokens[0].token_id() == 'A');
  CHECK(r.tokens[1].token_id() == 'B');
  CHECK(r.tokens[2].token_id() == 'X');  // rank 1 continues
  CHECK(r.tokens[4].position() == 7);
  REQUIRE(r.done.has_value());
  CHECK(r.done->generated_tokens() == 5);
  // Rank 1 got every expert, then the rest of the turn: the KV holds
  // positions [0, 4); position 4 (the last sampled token) is fed again.
  auto peers = t.g1.peers();
  REQUIRE_FALSE(peers.empty());
  CHECK(peers.back().peers_size() == 1);
  CHECK(std::vector<int>(peers.back().expert_owner().begin(),
                         peers.back().expert_owner().end()) ==
        std::vector<int>(8, 1));
  auto runs = t.g1.runs();
  REQUIRE(runs.size() == 1);
  CHECK(runs[0].pos_start() == 4);
  CHECK(std::vector<int32_t>(runs[0].feed_tokens().begin(),
                             runs[0].feed_tokens().end()) ==
        std::vector<int32_t>{'B'});
  CHECK(runs[0].max_new_tokens() == 3);
  CHECK(runs[0].seed() == t.g0.runs()[0].seed());
  CHECK(runs[0].prefill_ends_size() == 0);
  CHECK(runs[0].resumed_decode());
  CHECK_FALSE(t.g0.runs()[0].resumed_decode());
  auto stats = c.Status().stats();
  CHECK(stats.at("turns_resumed") == 1);
  CHECK(stats.at("gpu_ranks_lost") == 1);
  CHECK(stats.at("rank.0.active_requests") == 0);
  CHECK(stats.at("rank.1.active_requests") == 0);
  // Later turns run on rank 1 alone.
  auto r2 = c.Generate(sid, "k", 2);
  CHECK(r2.status.ok());
  CHECK(t.g1.runs().size() == 2);
}

TEST_CASE("a lost KARAT node: the running turn resumes on a new home") {
  Cluster c;
  FakeKaratNode k0({1000}), k1({1000});
  auto s0 = std::make_unique<FakeServer>(&k0);
  auto s1 = std::make_unique<FakeServer>(&k1);
  c.Register("karat0", "karat", s0->address, 1);
  c.Register("karat1", "karat", s1->address, 1);
  FakeGpuNode g({'A', 'B', 'C'});
  FakeServer gs(&g);
  c.Register("gpu0", "gpu", gs.address, 0);
  std::string sid = c.NewSession();
  // After 2 tokens the session's home goes away and the GPU call fails.
  std::string home;
  g.fail_after = 2;
  g.fail_once = true;
  g.on_fail = [&] {
    home = c.Get(sid).home_node();
    (home == "karat0" ? s0 : s1)
        ->server->Shutdown(std::chrono::system_clock::now());
  };
  auto r = c.Generate(sid, "hi", 5);
  INFO(r.status.error_message());
  REQUIRE(r.status.ok());
  REQUIRE((home == "karat0" || home == "karat1"));
  const std::string other = home == "karat0" ? "karat1" : "karat0";
  REQUIRE(r.tokens.size() == 5);
  CHECK(r.tokens[0].token_id() == 'A');
  CHECK(r.tokens[1].token_id() == 'B');
  CHECK(r.tokens[2].token_id() == 'A');  // the resumed call's first token
  CHECK(r.tokens[4].position() == 7);
  CHECK(c.Get(sid).home_node() == other);
  // The new home holds nothing yet: the whole token log (BOS, h, i, A, B)
  // is fed again, cut where the turn's prefill ended, and ends with a
  // sampled token.
  auto runs = g.runs();
  REQUIRE(runs.size() == 2);
  CHECK(runs[1].placement().node_name() == other);
  CHECK(runs[1].pos_start() == 0);
  CHECK(runs[1].feed_tokens_size() == 5);
  CHECK(runs[1].feed_tokens(3) == 'A');
  CHECK(runs[1].feed_tokens(4) == 'B');
  CHECK(std::vector<int>(runs[1].prefill_ends().begin(),
                         runs[1].prefill_ends().end()) == std::vector<int>{3});
  CHECK(runs[1].resumed_decode());
  CHECK(runs[1].max_new_tokens() == 3);
  CHECK(runs[1].seed() == runs[0].seed());
  // KV for the token log and the rest of the turn was reserved there.
  auto reserves = (other == "karat0" ? k0 : k1).reserves();
  REQUIRE_FALSE(reserves.empty());
  CHECK(reserves.back().tokens() == 8);
  auto stats = c.Status().stats();
  CHECK(stats.at("karat_nodes_lost") == 1);
  CHECK(stats.at("sessions_rehomed") == 1);
  CHECK(stats.at("turns_resumed") == 1);
  // The GPU node was told.
  for (int i = 0; i < 1000 && g.karat_lost().empty(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  CHECK(g.karat_lost() == std::vector<std::string>{home});
  // The next turn runs on the new home from where the KV ends.
  auto r2 = c.Generate(sid, "k", 1);
  CHECK(r2.status.ok());
  runs = g.runs();
  REQUIRE(runs.size() == 3);
  CHECK(runs[2].placement().node_name() == other);
  CHECK(runs[2].pos_start() == 7);
}

TEST_CASE("a turn resumes at most 3 times, then fails naming the rank") {
  Cluster c;
  c.routed_experts = 8;
  c.karat = std::make_unique<FakeKaratNode>(std::vector<int>{1000});
  c.karat_server = std::make_unique<FakeServer>(c.karat.get());
  c.Register("karat0", "karat", c.karat_server->address, 1);
  std::vector<std::unique_ptr<FakeGpuNode>> gpus;
  std::vector<std::unique_ptr<FakeServer>> servers;
  for (int r = 0; r < 4; ++r) {
    gpus.push_back(std::make_unique<FakeGpuNode>(std::vector<int32_t>{'A'}));
    gpus[r]->hold_after = 1;  // one token, then it waits to go away
    servers.push_back(std::make_unique<FakeServer>(gpus[r].get()));
    c.Register("gpu" + std::to_string(r), "gpu", servers[r]->address, 0, r, 4);
  }
  for (int i = 0; i < 1000; ++i) {
    bool all = true;
    for (auto& g : gpus) {
      auto p = g->peers();
      all = all && !p.empty() && p.back().peers_size() == 4;
    }
    if (all) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::string sid = c.NewSession();
  Cluster::Result r;
  std::thread turn([&] { r = c.Generate(sid, "hi", 10); });
  // Each rank in turn streams a token and goes away: ranks 0, 1, 2, 3.
  for (int k = 0; k < 4; ++k) {
    WaitRuns(*gpus[k], 1);
    REQUIRE(gpus[k]->runs().size() == 1);
    for (int i = 0; i < 1000 && c.Get(sid).num_tokens() < 4 + k; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    servers[k]->server->Shutdown(std::chrono::system_clock::now());
  }
  turn.join();
  CHECK(r.status.error_code() == grpc::StatusCode::UNAVAILABLE);
  CHECK(r.status.error_message().find("gpu3 (rank 3)") != std::string::npos);
  CHECK(r.status.error_message().find("after 4 tokens") != std::string::npos);
  CHECK(r.status.error_message().find("resumed 3 times") != std::string::npos);
  CHECK(r.tokens.size() == 4);
  CHECK(c.Status().stats().at("turns_resumed") == 3);
  CHECK(gpus[3]->runs()[0].max_new_tokens() == 7);
}

TEST_CASE("a lost GPU rank whose experts do not fit: turns are refused") {
  TwoRanks t;
  Cluster& c = t.c;
  t.g0.refuse_more_experts = true;
  // gpu1 stops answering and misses its heartbeats.
  t.s1->server->Shutdown(std::chrono::system_clock::now());
  c.clock.Advance(absl::Seconds(4));
  cl::HeartbeatRequest hb;
  cl::HeartbeatResponse hr;
  for (uint32_t id : {1u, 2u}) {  // karat0, gpu0
    hb.set_node_id(id);
    grpc::ClientContext ctx;
    REQUIRE(c.membership->Heartbeat(&ctx, hb, &hr).ok());
  }
  c.clock.Advance(absl::Seconds(2));  // gpu1 silent for 6 s
  // gpu0 is offered every expert and refuses.
  for (int i = 0; i < 1000; ++i) {
    auto p = t.g0.peers();
    if (p.back().peers_size() == 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  Cluster::Result r;
  for (int i = 0; i < 200; ++i) {
    r = c.Generate(c.NewSession(), "hi", 2);
    if (r.status.error_message().find("cannot take") != std::string::npos)
      break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(r.status.error_code() == grpc::StatusCode::UNAVAILABLE);
  CHECK(r.status.error_message().find("GPU rank 0 (node gpu0) cannot take") !=
        std::string::npos);
  CHECK(r.status.error_message().find("--hbm-bytes") != std::string::npos);
  CHECK(r.status.error_message().find("rank 1 (node gpu1) is down") !=
        std::string::npos);
  CHECK(t.g0.runs().empty());
}

TEST_CASE("micro-batches: CMR's assignment is pushed to the rank") {
  Cluster c;
  c.AddNodes({1000}, {'A'});
  c.gpu->hold_after = 1;
  std::string a = c.NewSession(), b = c.NewSession();
  Cluster::Result ra, rb;
  // a: 1 + 2 prompt tokens; b: 1 + 10: longer.
  std::thread ta([&] { ra = c.Generate(a, "hi", 3); });
  c.WaitStat("rank.0.active_requests", 1);
  for (int i = 0; i < 500 && c.Get(a).num_tokens() < 4; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  REQUIRE(c.Get(a).num_tokens() == 4);
  std::thread tb([&] { rb = c.Generate(b, "0123456789", 3); });
  c.WaitStat("rank.0.active_requests", 2);
  WaitRuns(*c.gpu, 2);
  auto runs = c.gpu->runs();
  REQUIRE(runs.size() == 2);
  const uint64_t ka = runs[0].session(), kb = runs[1].session();
  CHECK(runs[0].micro_batch() == 0);
  // CMR over {a: 4 tokens (3 + the first generated), b: 11}: the longest
  // first, into micro-batch 0; a moves to 1.
  auto plan = AssignByContextLength({{ka, {1, 0}, 4}, {kb, {1, 0}, 11}});
  REQUIRE(plan.ok());
  CHECK(runs[1].micro_batch() == static_cast<int>(*plan->Find(kb)));
  CHECK(runs[1].micro_batch() == 0);
  std::map<uint64_t, int> pushed;
  for (int i = 0; i < 500 && pushed.empty(); ++i) {
    auto all = c.gpu->micro_batches();
    if (!all.empty()) pushed = all.back();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  CHECK(pushed == std::map<uint64_t, int>{{ka, 1}});
  auto stats = c.Status().stats();
  CHECK(stats.at("rank.0.micro_batch_0_requests") == 1);
  CHECK(stats.at("rank.0.micro_batch_1_requests") == 1);
  // Recomputations: {a} alone (imbalance 1), then {b | a}: 7/15.
  CHECK(stats.at("microbatch_token_imbalance_samples") == 2);
  CHECK(stats.at("microbatch_token_imbalance_mean") ==
        Approx((1.0 + 7.0 / 15.0) / 2));
  c.gpu->release = true;
  ta.join();
  tb.join();
  CHECK(ra.status.ok());
  CHECK(rb.status.ok());
}

TEST_CASE("micro-batches: count mode appends, one micro-batch mode is all 0") {
  const bool count = GENERATE(true, false);
  Cluster c(64, [count](Options& o) {
    if (count)
      o.scheduling.set_balance("count");
    else
      o.scheduling.set_micro_batches(1);
  });
  c.AddNodes({1000}, {'A'});
  c.gpu->hold_after = 1;
  std::string a = c.NewSession(), b = c.NewSession();
  Cluster::Result ra, rb;
  std::thread ta([&] { ra = c.Generate(a, "hi", 3); });
  c.WaitStat("rank.0.active_requests", 1);
  std::thread tb([&] { rb = c.Generate(b, "0123456789", 3); });
  c.WaitStat("rank.0.active_requests", 2);
  WaitRuns(*c.gpu, 2);
  auto runs = c.gpu->runs();
  REQUIRE(runs.size() == 2);
  CHECK(runs[0].micro_batch() == 0);
  CHECK(runs[1].micro_batch() == (count ? 1 : 0));
  c.gpu->release = true;
  ta.join();
  tb.join();
  CHECK(c.gpu->micro_batches().empty());  // nobody moved
}

TEST_CASE("gpu_only: the KV is reserved on the rank, which the session keeps") {
  Cluster c(64, [](Options& o) { o.mode = "gpu_only"; });
  FakeGpuNode g0({'A'}), g1({'B'});
  FakeServer s0(&g0), s1(&g1);
  c.Register("gpu0", "gpu", s0.address, 0, 0, 2);
  c.Register("gpu1", "gpu", s1.address, 0, 1, 2);
  std::string a = c.NewSession(), b = c.NewSession();
  // A turn bigger than every empty rank's HBM fails at once.
  g0.kv_capacity_tokens = 4;
  g1.kv_capacity_tokens = 4;
  auto big = c.Generate(a, "abcdef", 3);
  CHECK(big.status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(big.status.error_message().find("10 positions") != std::string::npos);
  g0.kv_capacity_tokens = 1000;
  g1.kv_capacity_tokens = 1000;
  // No KARAT node is needed.
  REQUIRE(c.Generate(a, "hi", 2).status.ok());
  REQUIRE(g0.reserves().size() == 2);
  CHECK(g0.reserves()[1].tokens() == 5);
  auto runs = g0.runs();
  REQUIRE(runs.size() == 1);
  CHECK_FALSE(runs[0].has_placement());
  CHECK(c.Get(a).home_node() == "gpu0");

  // b holds rank 0's batch; a's next turn still goes to rank 0 (its KV).
  g0.hold_after = 1;
  Cluster::Result rb;
  std::thread tb([&] { rb = c.Generate(b, "yo", 2); });
  c.WaitStat("rank.0.active_requests", 1);
  g0.hold_after = -1;
  auto r2 = c.Generate(a, "x", 1);
  REQUIRE(r2.status.ok());
  WaitRuns(g0, 3);
  CHECK(g0.runs().size() == 3);
  CHECK(g1.runs().empty());
  g0.release = true;
  tb.join();
  CHECK(rb.status.ok());

  v1::CloseSessionRequest close;
  close.set_session_id(a);
  v1::CloseSessionResponse closed;
  grpc::ClientContext ctx;
  REQUIRE(c.client->CloseSession(&ctx, close, &closed).ok());
  CHECK(g0.freed() == std::vector<uint64_t>{runs[0].session()});
}

TEST_CASE("gpu_only: a lost rank's turn moves its KV to an alive rank") {
  Cluster c(64, [](Options& o) { o.mode = "gpu_only"; });
  FakeGpuNode g0({'A', 'B', 'C'}), g1({'X', 'Y', 'Z'});
  FakeServer s0(&g0), s1(&g1);
  c.Register("gpu0", "gpu", s0.address, 0, 0, 2);
  const uint32_t id1 = c.Register("gpu1", "gpu", s1.address, 0, 1, 2);
  std::string sid = c.NewSession();
  // The turn goes to rank 0, whose heartbeats stop: after 2 tokens its
  // call fails and it has been silent for 6 s.
  g0.fail_after = 2;
  g0.on_fail = [&] {
    c.clock.Advance(absl::Seconds(4));
    cl::HeartbeatRequest hb;
    cl::HeartbeatResponse hr;
    hb.set_node_id(id1);
    grpc::ClientContext ctx;
    REQUIRE(c.membership->Heartbeat(&ctx, hb, &hr).ok());
    c.clock.Advance(absl::Seconds(2));
  };
  auto r = c.Generate(sid, "hi", 5);
  INFO(r.status.error_message());
  REQUIRE(r.status.ok());
  REQUIRE(r.tokens.size() == 5);
  CHECK(r.tokens[1].token_id() == 'B');
  CHECK(r.tokens[2].token_id() == 'X');
  CHECK(c.Get(sid).home_node() == "gpu1");
  // Rank 1 holds no KV of the session: the whole token log is fed again.
  auto runs = g1.runs();
  REQUIRE(runs.size() == 1);
  CHECK(runs[0].pos_start() == 0);
  CHECK(runs[0].feed_tokens_size() == 5);
  CHECK(runs[0].resumed_decode());
  CHECK(std::vector<int>(runs[0].prefill_ends().begin(),
                         runs[0].prefill_ends().end()) == std::vector<int>{3});
  REQUIRE_FALSE(g1.reserves().empty());
  CHECK(g1.reserves().back().tokens() == 8);
  auto stats = c.Status().stats();
  CHECK(stats.at("sessions_rehomed") == 1);
  CHECK(stats.at("turns_resumed") == 1);
  // Its next turn stays on rank 1.
  REQUIRE(c.Generate(sid, "k", 1).status.ok());
  runs = g1.runs();
  REQUIRE(runs.size() == 2);
  CHECK(runs[1].pos_start() == 7);
}

TEST_CASE(
    "recovery: a rebuild from the token log carries the turn boundaries") {
  Cluster c;
  c.AddNodes({1000}, {'A', 'B'});
  std::string sid = c.NewSession();
  REQUIRE(c.Generate(sid, "hi", 2).status.ok());   // prefill ends at 3
  REQUIRE(c.Generate(sid, "xyz", 2).status.ok());  // pos 4, feed 4: ends at 8
  // karat0 dies; karat1 takes over.
  FakeKaratNode k1({1000});
  FakeServer s1(&k1);
  // The GPU node's heartbeat comes in time; karat0's do not.
  c.clock.Advance(absl::Seconds(4));
  cl::HeartbeatRequest hb;
  hb.set_node_id(c.gpu_id);
  cl::HeartbeatResponse hr;
  {
    grpc::ClientContext ctx;
    REQUIRE(c.membership->Heartbeat(&ctx, hb, &hr).ok());
    REQUIRE(hr.known());
  }
  c.clock.Advance(absl::Seconds(2));
  c.Register("karat1", "karat", s1.address, 1);
  REQUIRE(c.Generate(sid, "q", 1).status.ok());
  auto runs = c.gpu->runs();
  REQUIRE(runs.size() == 3);
  CHECK(runs[2].pos_start() == 0);
  CHECK(runs[2].feed_tokens_size() == 11);
  CHECK(std::vector<int32_t>(runs[2].prefill_ends().begin(),
                             runs[2].prefill_ends().end()) ==
        std::vector<int32_t>{3, 8});
  CHECK(runs[2].placement().node_name() == "karat1");
  CHECK(runs[1].prefill_ends_size() == 0);
}

// A fresh directory under the system temp dir, removed at scope exit.
class StateDir {
 public:
  StateDir() {
    std::string tmpl =
        (std::filesystem::temp_directory_path() / "karat_state_XXXXXX")
            .string();
    REQUIRE(mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~StateDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string path;
};

std::vector<int32_t> Tokens(const v1::Session& s) {
  return std::vector<int32_t>(s.tokens().begin(), s.tokens().end());
}

TEST_CASE("state_dir: a restarted coordinator serves the logged sessions") {
  StateDir dir;
  auto configure = [&](Options& o) { o.state_dir = dir.path; };
  std::string kept, closed, fresh;
  std::vector<int32_t> history;
  uint64_t kept_key = 0;
  auto turn = [](Cluster& c, const std::string& id, std::vector<int32_t> prompt,
                 int max_new) {
    v1::GenerateRequest req;
    req.set_session_id(id);
    req.mutable_prompt_tokens()->Assign(prompt.begin(), prompt.end());
    req.set_max_new_tokens(max_new);
    return c.Generate(req);
  };
  {
    Cluster c(64, configure);
    c.AddNodes({1000}, {65, 66, 67});
    kept = c.NewSession(11);
    closed = c.NewSession(12);
    fresh = c.NewSession(13);  // never runs a turn
    REQUIRE(turn(c, kept, {1, 2}, 3).status.ok());
    REQUIRE(turn(c, kept, {3}, 2).status.ok());
    REQUIRE(!c.karat->reserves().empty());
    kept_key = c.karat->reserves()[0].session();
    auto r = turn(c, closed, {4}, 2);
    REQUIRE(r.status.ok());
    v1::CloseSessionRequest close;
    close.set_session_id(closed);
    v1::CloseSessionResponse resp;
    grpc::ClientContext ctx;
    REQUIRE(c.client->CloseSession(&ctx, close, &resp).ok());
    history = Tokens(c.Get(kept));
    // BOS 1 2 | 65 66 67 | 3 | 65 66
    REQUIRE(history.size() == 9);
  }
  Cluster c(64, configure);
  c.AddNodes({1000}, {70});
  v1::Session s = c.Get(kept);
  CHECK(Tokens(s) == history);
  CHECK(s.turns() == 2);
  CHECK(s.seed() == 11);
  CHECK(s.state() == "idle");
  CHECK(s.home_node().empty());  // no home until the next turn
  CHECK(c.Get(fresh).num_tokens() == 0);
  {
    v1::GetSessionRequest req;
    req.set_session_id(closed);
    v1::Session out;
    grpc::ClientContext ctx;
    CHECK(c.client->GetSession(&ctx, req, &out).error_code() ==
          grpc::StatusCode::NOT_FOUND);
  }
  CHECK(c.Status().sessions() == 2);

  // The next turn rebuilds the KV from the whole token log, cut at the
  // earlier turns' prefill ends.
  auto r = turn(c, kept, {5, 6}, 2);
  REQUIRE(r.status.ok());
  auto runs = c.gpu->runs();
  REQUIRE(runs.size() == 1);
  CHECK(runs[0].pos_start() == 0);
  std::vector<int32_t> feed = history;
  feed.insert(feed.end(), {5, 6});
  CHECK(std::vector<int32_t>(runs[0].feed_tokens().begin(),
                             runs[0].feed_tokens().end()) == feed);
  CHECK(std::vector<int32_t>(runs[0].prefill_ends().begin(),
                             runs[0].prefill_ends().end()) ==
        std::vector<int32_t>{3, 7});
  CHECK(runs[0].seed() == 11);
  REQUIRE(c.karat->reserves().size() == 1);
  const uint64_t key = c.karat->reserves()[0].session();
  CHECK(key == kept_key);  // the session's data-plane key is kept
  CHECK(runs[0].session() == key);
  CHECK(c.Get(kept).turns() == 3);

  // New sessions get new ids and keys.
  const std::string other = c.NewSession(14);
  CHECK(other != kept);
  CHECK(other != fresh);
  REQUIRE(turn(c, other, {7}, 1).status.ok());
  REQUIRE(c.karat->reserves().size() == 2);
  CHECK(c.karat->reserves()[1].session() != key);

  // A third start sees the turn run since the second.
  std::vector<int32_t> now = Tokens(c.Get(kept));
  REQUIRE(now.size() == 13);
  c.coordinator->Shutdown(absl::Seconds(1));
  c.coordinator.reset();
  Cluster again(64, configure);
  CHECK(Tokens(again.Get(kept)) == now);
  CHECK(again.Get(kept).turns() == 3);
  CHECK(again.Get(other).num_tokens() == 3);
  CHECK(again.Status().sessions() == 3);
}

TEST_CASE("state_dir: link rules set at run time survive a restart") {
  StateDir dir;
  auto configure = [&](Options& o) {
    o.state_dir = dir.path;
    cl::LinkConfig every;  // the config's rule
    every.set_source("*");
    every.set_destination("*");
    every.set_latency_us(5);
    o.links = {every};
  };
  auto set_link = [](Cluster& c, const std::string& source,
                     const std::string& destination, int64_t latency_us,
                     bool remove) {
    auto admin = cl::Admin::NewStub(grpc::CreateChannel(
        c.coordinator->admin_address(), grpc::InsecureChannelCredentials()));
    cl::SetLinkRequest req;
    req.mutable_link()->set_source(source);
    req.mutable_link()->set_destination(destination);
    req.mutable_link()->set_latency_us(latency_us);
    req.set_remove(remove);
    cl::SetLinkResponse resp;
    grpc::ClientContext ctx;
    return admin->SetLink(&ctx, req, &resp);
  };
  auto links = [](Cluster& c) {
    auto admin = cl::Admin::NewStub(grpc::CreateChannel(
        c.coordinator->admin_address(), grpc::InsecureChannelCredentials()));
    cl::GetLinksRequest req;
    cl::GetLinksResponse resp;
    grpc::ClientContext ctx;
    REQUIRE(admin->GetLinks(&ctx, req, &resp).ok());
    std::vector<std::string> out;
    for (const auto& l : resp.links()) {
      out.push_back(l.source() + ">" + l.destination() + ":" +
                    std::to_string(l.latency_us()));
    }
    return out;
  };
  {
    // Nothing set at run time yet: the config's rules.
    Cluster c(64, configure);
    CHECK(links(c) == std::vector<std::string>{"*>*:5"});
  }
  {
    Cluster c(64, configure);
    CHECK(links(c) == std::vector<std::string>{"*>*:5"});
    REQUIRE(set_link(c, "gpu0", "karat0", 300, false).ok());
    REQUIRE(set_link(c, "gpu0", "karat0", 400, false).ok());  // replaced
    REQUIRE(set_link(c, "karat0", "gpu0", 100, false).ok());
    REQUIRE(set_link(c, "*", "*", 0, true).ok());  // the config's, removed
    CHECK(set_link(c, "*", "*", 0, true).error_code() ==
          grpc::StatusCode::NOT_FOUND);
  }
  const std::vector<std::string> want = {"gpu0>karat0:400", "karat0>gpu0:100"};
  {
    Cluster c(64, configure);
    CHECK(links(c) == want);
  }
  // And again, after the log was compacted at the last start.
  Cluster c(64, configure);
  CHECK(links(c) == want);
  // Every rule removed is a state too: none, not the config's.
  REQUIRE(set_link(c, "gpu0", "karat0", 0, true).ok());
  REQUIRE(set_link(c, "karat0", "gpu0", 0, true).ok());
  c.coordinator->Shutdown(absl::Seconds(1));
  c.coordinator.reset();
  Cluster again(64, configure);
  CHECK(links(again).empty());
}

TEST_CASE("Admin.SetLink warns about names no node registered under") {
  Cluster c(64);
  c.AddNodes({1000}, {65});
  auto admin = cl::Admin::NewStub(grpc::CreateChannel(
      c.coordinator->admin_address(), grpc::InsecureChannelCredentials()));
  auto set_link = [&](const std::string& source, const std::string& destination,
                      bool remove = false) {
    cl::SetLinkRequest req;
    req.mutable_link()->set_source(source);
    req.mutable_link()->set_destination(destination);
    req.mutable_link()->set_latency_us(10);
    req.set_remove(remove);
    cl::SetLinkResponse resp;
    grpc::ClientContext ctx;
    REQUIRE(admin->SetLink(&ctx, req, &resp).ok());
    return std::vector<std::string>(resp.warnings().begin(),
                                    resp.warnings().end());
  };
  CHECK(set_link("gpu0", "karat0").empty());
  CHECK(set_link("*", "karat0").empty());
  const std::vector<std::string> w = set_link("gpu0", "karta0");
  REQUIRE(w.size() == 1);
  CHECK(w[0].find("'karta0'") != std::string::npos);
  // The rule is kept all the same.
  CHECK(set_link("gpu0", "karta0", /*remove=*/true).empty());
  CHECK(set_link("nobody", "nobody").size() == 1);
  CHECK(set_link("nobody", "*").size() == 1);
}

TEST_CASE("state_dir: a turn's tokens are logged when it fails") {
  StateDir dir;
  auto configure = [&](Options& o) { o.state_dir = dir.path; };
  std::string sid;
  std::vector<int32_t> history;
  {
    Cluster c(64, configure);
    c.AddNodes({1000}, {65, 66, 67});
    sid = c.NewSession();
    c.gpu->fail_after = 2;
    auto r = c.Generate(sid, "ab", 5);
    CHECK_FALSE(r.status.ok());
    CHECK(r.tokens.size() == 2);
    c.WaitIdle(sid);
    history = Tokens(c.Get(sid));
    REQUIRE(history.size() == 5);  // BOS a b 65 66
  }
  Cluster c(64, configure);
  CHECK(Tokens(c.Get(sid)) == history);
  CHECK(c.Get(sid).turns() == 1);
}

TEST_CASE("state_dir: a state dir that cannot be used fails the start") {
  StateDir dir;
  const std::string file = dir.path + "/file";
  { std::ofstream(file) << "x"; }
  Options o;
  o.state_dir = file + "/state";
  auto c = Coordinator::Start(o);
  REQUIRE_FALSE(c.ok());
  CHECK(c.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(c.status().message().find(file) != std::string::npos);
}

}  // namespace
}  // namespace karat::coordinator
