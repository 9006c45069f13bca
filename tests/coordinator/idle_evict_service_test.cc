// Idle KV eviction through the coordinator (Options::idle_kv_evict,
// docs/security.md "Sessions"), with the test clock: the KV of an idle
// session is freed on its home and rebuilt at its next turn, with the same
// tokens as without the eviction.
#include <catch2/catch.hpp>
#include <functional>
#include <string>
#include <vector>

#include "tests/coordinator/sessions_auth.h"

namespace karat::coordinator {
namespace {

// Two turns of one session, with `between` run between them; the streamed
// tokens of both, and the GPU node's runs.
struct TwoTurns {
  std::vector<int32_t> first, second;
  std::vector<cl::RunTurnRequest> runs;
  std::vector<cl::ReserveRequest> reserves;
  std::vector<uint64_t> freed;
  std::vector<int32_t> history;
};
TwoTurns RunTwoTurns(absl::Duration evict_after,
                     const std::function<void(Cluster&)>& between) {
  Cluster c(64, [&](Options& o) {
    o.idle_kv_evict = evict_after;
    o.node_timeout_ms = 3600 * 1000;  // the nodes outlive the clock's jumps
  });
  c.AddNodes({1000}, {'a', 'b', 'c', 'd', 'e'});
  c.gpu->by_position = true;  // tokens by position, as a real model's
  const std::string id = c.NewSession(9);
  TwoTurns t;
  Cluster::Result r1 = c.Generate(id, "hello", 4);
  REQUIRE(r1.status.ok());
  between(c);
  Cluster::Result r2 = c.Generate(id, "again", 4);
  REQUIRE(r2.status.ok());
  t.first = StreamedIds(r1);
  t.second = StreamedIds(r2);
  t.runs = c.gpu->runs();
  t.reserves = c.karat->reserves();
  t.freed = c.karat->freed();
  t.history = TokenIds(c.Get(id));
  return t;
}

TEST_CASE("idle eviction: an idle session's KV is freed and rebuilt") {
  const TwoTurns kept = RunTwoTurns(absl::ZeroDuration(), [](Cluster& c) {
    c.clock.Advance(absl::Seconds(120));
  });
  const TwoTurns evicted = RunTwoTurns(absl::Seconds(60), [](Cluster& c) {
    c.clock.Advance(absl::Seconds(61));
    c.WaitStat("kv_evictions", 1);
    const v1::ClusterStatus status = c.Status();
    CHECK(status.sessions() == 1);
  });
  // The same tokens, with or without the eviction.
  CHECK(evicted.first == kept.first);
  CHECK(evicted.second == kept.second);
  CHECK(evicted.history == kept.history);
  // Without it the second turn feeds its prompt after the stored KV; with
  // it the home's KV was freed and the whole token log is fed again, cut
  // at the first turn's prefill end.
  REQUIRE(kept.runs.size() == 2);
  REQUIRE(evicted.runs.size() == 2);
  CHECK(kept.freed.empty());
  CHECK(kept.runs[1].pos_start() > 0);
  const uint64_t key = evicted.runs[0].session();
  CHECK(evicted.freed == std::vector<uint64_t>{key});
  CHECK(evicted.runs[1].session() == key);
  CHECK(evicted.runs[1].pos_start() == 0);
  // BOS hello(5) abcd(4) again(5): the feed is all but the last 4 tokens.
  CHECK(
      std::vector<int32_t>(evicted.runs[1].feed_tokens().begin(),
                           evicted.runs[1].feed_tokens().end()) ==
      std::vector<int32_t>(evicted.history.begin(), evicted.history.end() - 4));
  CHECK(std::vector<int32_t>(evicted.runs[1].prefill_ends().begin(),
                             evicted.runs[1].prefill_ends().end()) ==
        std::vector<int32_t>{6});
  REQUIRE(evicted.reserves.size() == 2);
  CHECK(evicted.reserves[1].kv_tokens() == 0);
}

TEST_CASE("idle eviction: gpu_only frees the KV on the rank") {
  Cluster c(64, [](Options& o) {
    o.mode = "gpu_only";
    o.idle_kv_evict = absl::Seconds(10);
    o.node_timeout_ms = 3600 * 1000;
  });
  FakeGpuNode g0({'A'});
  FakeServer s0(&g0);
  c.Register("gpu0", "gpu", s0.address, 0, 0, 1);
  const std::string id = c.NewSession();
  REQUIRE(c.Generate(id, "hi", 2).status.ok());
  CHECK(c.Get(id).home_node() == "gpu0");
  c.clock.Advance(absl::Seconds(10));
  c.WaitStat("kv_evictions", 1);
  CHECK(g0.freed() == std::vector<uint64_t>{g0.runs()[0].session()});
  CHECK(c.Get(id).home_node().empty());
  REQUIRE(c.Generate(id, "yo", 1).status.ok());
  REQUIRE(g0.runs().size() == 2);
  CHECK(g0.runs()[1].pos_start() == 0);
  CHECK(g0.reserves().back().kv_tokens() == 0);
  CHECK(c.Get(id).home_node() == "gpu0");
}

}  // namespace
}  // namespace karat::coordinator
