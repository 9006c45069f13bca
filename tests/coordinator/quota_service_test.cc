// Quotas through the client API (docs/security.md "Quotas"), for the
// anonymous principal of plaintext mode with security.default_limits.
#include <catch2/catch.hpp>
#include <functional>
#include <string>
#include <thread>

#include "tests/coordinator/sessions_auth.h"

namespace karat::coordinator {
namespace {

// Options with `limits` as every caller's (plaintext).
std::function<void(Options&)> WithLimits(
    const cluster::ClientLimits& limits,
    std::function<void(Options&)> more = nullptr) {
  return [limits, more](Options& o) {
    *o.security.mutable_default_limits() = limits;
    if (more) more(o);
  };
}

double Stat(Cluster& c, const std::string& name) {
  auto stats = c.Status().stats();
  REQUIRE(stats.count(name) == 1);
  return stats.at(name);
}

grpc::Status Create(Cluster& c) {
  v1::CreateSessionRequest req;
  v1::Session s;
  grpc::ClientContext ctx;
  return c.client->CreateSession(&ctx, req, &s);
}

grpc::Status Close(Cluster& c, const std::string& id) {
  v1::CloseSessionRequest req;
  req.set_session_id(id);
  v1::CloseSessionResponse resp;
  grpc::ClientContext ctx;
  return c.client->CloseSession(&ctx, req, &resp);
}

TEST_CASE("quota: max_sessions refuses CreateSession until one closes") {
  cluster::ClientLimits limits;
  limits.set_max_sessions(2);
  Cluster c(64, WithLimits(limits));
  const std::string a = c.NewSession();
  c.NewSession();
  grpc::Status third = Create(c);
  CHECK(third.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(third.error_message().find("max_sessions limit (2)") !=
        std::string::npos);
  CHECK(c.Status().sessions() == 2);
  CHECK(Stat(c, "quota_refusals_sessions") == 1);
  REQUIRE(Close(c, a).ok());
  CHECK(Create(c).ok());
}

TEST_CASE("quota: sessions_per_second says when to retry") {
  cluster::ClientLimits limits;
  limits.set_sessions_per_second(1);
  limits.set_session_burst(2);
  Cluster c(64, WithLimits(limits));
  c.NewSession();
  c.NewSession();
  grpc::Status refused = Create(c);
  CHECK(refused.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(refused.error_message().find("retry after 1000 ms") !=
        std::string::npos);
  c.clock.Advance(absl::Milliseconds(400));
  CHECK(Create(c).error_message().find("retry after 600 ms") !=
        std::string::npos);
  c.clock.Advance(absl::Milliseconds(600));
  CHECK(Create(c).ok());
  CHECK(Stat(c, "quota_refusals_session_rate") == 2);
  CHECK(c.Status().sessions() == 3);
}

TEST_CASE("quota: max_concurrent_turns refuses a turn at once, not queued") {
  cluster::ClientLimits limits;
  limits.set_max_concurrent_turns(2);
  // One turn at a time on the rank: the second waits in the queue.
  Cluster c(64,
            WithLimits(limits, [](Options& o) { o.max_batch_by_rank = {1}; }));
  c.AddNodes({1000}, {'A'});
  c.gpu->hold_after = 1;
  const std::string a = c.NewSession(), b = c.NewSession(), d = c.NewSession();
  Cluster::Result ra, rb;
  std::thread ta([&] { ra = c.Generate(a, "hi", 2); });
  c.WaitStat("rank.0.active_requests", 1);
  std::thread tb([&] { rb = c.Generate(b, "yo", 2); });
  c.WaitStat("queue_length", 1);
  // a runs, b is queued: d's turn is the third.
  Cluster::Result rd = c.Generate(d, "ok", 2);
  CHECK(rd.status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(rd.status.error_message().find("max_concurrent_turns limit (2)") !=
        std::string::npos);
  CHECK(rd.queued.empty());
  CHECK(c.Get(d).num_tokens() == 0);
  CHECK(Stat(c, "quota_refusals_concurrent_turns") == 1);
  CHECK(Stat(c, "turns_refused") == 0);
  c.gpu->release = true;
  ta.join();
  tb.join();
  REQUIRE(ra.status.ok());
  REQUIRE(rb.status.ok());
  c.gpu->hold_after = -1;
  CHECK(c.Generate(d, "ok", 2).status.ok());
}

TEST_CASE("quota: max_kv_bytes refuses the turn that would exceed it") {
  cluster::ClientLimits limits;
  limits.set_max_kv_bytes(3000);  // the fake devices: 100 bytes a position
  Cluster c(64, WithLimits(limits));
  c.AddNodes({1000}, {'A'});
  const std::string a = c.NewSession(), b = c.NewSession();
  // a: BOS + 2 + 5 = 8 positions (800 bytes); b: 1 + 10 + 10 (2100).
  REQUIRE(c.Generate(a, "hi", 5).status.ok());
  REQUIRE(c.Generate(b, "0123456789", 10).status.ok());
  const uint64_t a_key = c.karat->reserves()[0].session();
  const std::vector<int32_t> history = TokenIds(c.Get(a));
  // a's next turn needs 8 + 2 + 5 = 15 positions: 1500 + 2100 > 3000.
  Cluster::Result over = c.Generate(a, "hi", 5);
  CHECK(over.status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(over.status.error_message() ==
        "the turn would bring the KV of the anonymous client's sessions to "
        "3600 bytes (1500 of them this session's), over its max_kv_bytes "
        "limit (3000); close sessions, or shorten the turn (prompt and "
        "max_new_tokens)");
  CHECK(over.tokens.empty());
  CHECK(Stat(c, "quota_refusals_kv_bytes") == 1);
  CHECK(Stat(c, "turns_refused") == 0);
  // The session is as before the turn; the KV the refused reservation
  // grew is freed, and the home with it.
  v1::Session s = c.Get(a);
  CHECK(TokenIds(s) == history);
  CHECK(s.turns() == 1);
  CHECK(s.home_node().empty());
  CHECK(c.karat->freed() == std::vector<uint64_t>{a_key});
  // With b closed it fits, rebuilt from the token log.
  REQUIRE(Close(c, b).ok());
  REQUIRE(c.Generate(a, "hi", 5).status.ok());
  const cl::RunTurnRequest last = c.gpu->runs().back();
  CHECK(last.session() == a_key);
  CHECK(last.pos_start() == 0);
  CHECK(last.feed_tokens_size() == int(history.size()) + 2);
  CHECK(c.karat->reserves().back().kv_tokens() == 0);
}

}  // namespace
}  // namespace karat::coordinator
