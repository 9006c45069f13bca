// LinkEmulator over the FakeFabric, and LinkStats. Timing checks are lower
// bounds only (a message must not arrive before the delay it was given).
#include "common/link_emulation.h"

#include <catch2/catch.hpp>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/link_stats.h"
#include "common/transport.h"
#include "tests/common/async_outcomes.h"

namespace karat {
namespace {

// Bound on waiting for deliveries, so that a lost message fails the test
// instead of hanging it. Not a performance expectation.
constexpr absl::Duration kDeliveryBound = absl::Seconds(60);

class Inbox {
 public:
  Transport::ReceiveHandler Handler() {
    return [this](std::string_view m) {
      absl::MutexLock lock(&mu_);
      messages_.emplace_back(m);
      times_.push_back(absl::Now());
    };
  }
  bool WaitFor(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return messages_.size() >= n;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), kDeliveryBound);
  }
  std::vector<std::string> Messages() {
    absl::MutexLock lock(&mu_);
    return messages_;
  }
  std::vector<absl::Time> Times() {
    absl::MutexLock lock(&mu_);
    return times_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> messages_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Time> times_ ABSL_GUARDED_BY(mu_);
};

// Node "a" (emulated) sends to node "b" (plain fake endpoint).
struct Pair {
  explicit Pair(std::vector<LinkRule> rules, uint64_t seed = 7) {
    LinkEmulatorOptions o;
    o.local_name = "a";
    o.seed = seed;
    a = std::make_unique<LinkEmulator>(fabric.NewEndpoint("a"), o);
    b = fabric.NewEndpoint("b");
    b->SetReceiveHandler(inbox.Handler());
    a->SetReceiveHandler([](std::string_view) {});
    REQUIRE(a->SetLinks(std::move(rules)).ok());
    auto id = a->AddPeer("b", b->LocalAddress());
    REQUIRE(id.ok());
    peer = *id;
  }
  ~Pair() {
    a->Shutdown();
    b->Shutdown();
  }
  absl::Status Send(const std::string& m) {
    return a->Send(peer, m.data(), m.size());
  }
  // A delayed link counts a message after its send returned, which may be
  // after the receiver got it: waits (up to 60 s) until `n` are counted to
  // "b" and returns the count.
  uint64_t AwaitSent(uint64_t n) {
    const absl::Time bound = absl::Now() + absl::Seconds(60);
    while (a->stats()->Snapshot().at("b").messages < n && absl::Now() < bound) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    return a->stats()->Snapshot().at("b").messages;
  }

  Inbox inbox;  // outlives the endpoints
  FakeFabric fabric;
  std::unique_ptr<LinkEmulator> a;
  std::unique_ptr<Transport> b;
  PeerId peer = kUnknownPeer;
};

LinkRule Rule(const std::string& src, const std::string& dst, LinkSettings s) {
  return LinkRule{src, dst, s};
}

TEST_CASE("rules resolve exact names before wildcards", "[link]") {
  LinkSettings any, to_b, a_to_b;
  any.latency_us = 1;
  to_b.latency_us = 2;
  a_to_b.latency_us = 3;
  const std::vector<LinkRule> rules = {
      Rule("*", "*", any), Rule("a", "b", a_to_b), Rule("*", "b", to_b)};
  CHECK(ResolveLink(rules, "a", "b").latency_us == 3);
  CHECK(ResolveLink(rules, "c", "b").latency_us == 2);
  CHECK(ResolveLink(rules, "a", "c").latency_us == 1);
  CHECK(!ResolveLink({}, "a", "b").Active());
  LinkSettings bad;
  bad.loss = 1.5;
  CHECK(ValidateLinkRule(Rule("a", "b", bad)).code() ==
        absl::StatusCode::kInvalidArgument);
  // The message names the rule, or the field when one is given.
  CHECK(ValidateLinkRule(Rule("a", "b", bad)).message() ==
        "link a -> b: loss must be within [0, 1], got 1.5");
  CHECK(ValidateLinkRule(Rule("a", "b", bad), "links[2]").message() ==
        "links[2].loss: must be within [0, 1], got 1.5");
  bad = {};
  bad.latency_us = -1;
  CHECK(!ValidateLinkRule(Rule("a", "b", bad)).ok());
  CHECK(!ValidateLinkRule(Rule("", "b", {})).ok());
}

TEST_CASE("a plain link passes messages through and counts them", "[link]") {
  Pair p({});
  for (int i = 0; i < 5; ++i) REQUIRE(p.Send(absl::StrCat("m", i)).ok());
  REQUIRE(p.inbox.WaitFor(5));
  CHECK(p.inbox.Messages() ==
        std::vector<std::string>{"m0", "m1", "m2", "m3", "m4"});
  const auto links = p.a->stats()->Snapshot();
  REQUIRE(links.count("b") == 1);
  CHECK(links.at("b").messages == 5);
  CHECK(links.at("b").bytes == 10);
  CHECK(links.at("b").latency_count == 5);
}

TEST_CASE("added latency delays delivery and keeps the order", "[link]") {
  LinkSettings s;
  s.latency_us = 20000;
  s.jitter_us = 15000;
  Pair p({Rule("a", "b", s)});
  std::vector<absl::Time> sent;
  constexpr int kN = 20;
  for (int i = 0; i < kN; ++i) {
    sent.push_back(absl::Now());
    REQUIRE(p.Send(absl::StrCat(i)).ok());
  }
  REQUIRE(p.inbox.WaitFor(kN));
  const auto messages = p.inbox.Messages();
  const auto times = p.inbox.Times();
  for (int i = 0; i < kN; ++i) {
    CHECK(messages[i] == absl::StrCat(i));
    CHECK(times[i] - sent[i] >= absl::Microseconds(s.latency_us));
  }
  CHECK(p.AwaitSent(kN) == kN);
  const auto links = p.a->stats()->Snapshot();
  CHECK(LinkLatencyQuantileUs(links.at("b"), 0.5) >= 20000);
}

TEST_CASE("SendShared passes through plain and delayed links", "[link]") {
  LinkSettings s;
  s.latency_us = 1000;
  for (bool delayed : {false, true}) {
    Pair p(delayed ? std::vector<LinkRule>{Rule("a", "b", s)}
                   : std::vector<LinkRule>{});
    auto large = std::make_shared<const std::string>(kSharedSendMinBytes, 'L');
    auto small = std::make_shared<const std::string>("s");
    REQUIRE(p.a->SendShared(p.peer, large).ok());
    REQUIRE(p.a->SendShared(p.peer, small).ok());
    REQUIRE(p.Send("m").ok());
    REQUIRE(p.inbox.WaitFor(3));
    CHECK(p.inbox.Messages() == std::vector<std::string>{*large, "s", "m"});
    CHECK(p.AwaitSent(3) == 3);
    CHECK(absl::IsInvalidArgument(p.a->SendShared(p.peer, nullptr)));
  }
}

TEST_CASE("a rule set at run time applies to later messages", "[link]") {
  Pair p({});
  REQUIRE(p.Send("before").ok());
  LinkSettings s;
  s.latency_us = 30000;
  REQUIRE(p.a->SetLinks({Rule("*", "*", s)}).ok());
  CHECK(p.a->SettingsFor(p.peer).latency_us == 30000);
  const absl::Time t0 = absl::Now();
  REQUIRE(p.Send("after").ok());
  REQUIRE(p.inbox.WaitFor(2));
  CHECK(p.inbox.Messages()[1] == "after");
  CHECK(p.inbox.Times()[1] - t0 >= absl::Milliseconds(30));
  // Rules whose source is another node do not apply here.
  REQUIRE(p.a->SetLinks({Rule("x", "*", s)}).ok());
  CHECK(!p.a->SettingsFor(p.peer).Active());
}

TEST_CASE("loss 1.0 drops every message", "[link]") {
  LinkSettings s;
  s.loss = 1.0;
  Pair p({Rule("a", "*", s)});
  for (int i = 0; i < 10; ++i) REQUIRE(p.Send("x").ok());
  // A marker sent after lifting the loss arrives; nothing before it did.
  REQUIRE(p.a->SetLinks({}).ok());
  REQUIRE(p.Send("marker").ok());
  REQUIRE(p.inbox.WaitFor(1));
  CHECK(p.inbox.Messages() == std::vector<std::string>{"marker"});
  CHECK(p.a->stats()->Snapshot().at("b").dropped == 10);
}

TEST_CASE("partial loss is reproducible from the seed", "[link]") {
  LinkSettings s;
  s.loss = 0.5;
  auto run = [&](uint64_t seed) {
    Pair p({Rule("a", "b", s)}, seed);
    for (int i = 0; i < 40; ++i) REQUIRE(p.Send(absl::StrCat(i)).ok());
    REQUIRE(p.a->SetLinks({}).ok());
    REQUIRE(p.Send("end").ok());
    const uint64_t dropped = p.a->stats()->Snapshot().at("b").dropped;
    REQUIRE(p.inbox.WaitFor(41 - dropped));
    return p.inbox.Messages();
  };
  const auto first = run(11);
  CHECK(first == run(11));
  CHECK(first.size() > 1);
  CHECK(first.size() < 41);
}

TEST_CASE("a down link fails sends with UNAVAILABLE", "[link]") {
  LinkSettings s;
  s.down = true;
  Pair p({Rule("a", "b", s)});
  const absl::Status st = p.Send("x");
  CHECK(st.code() == absl::StatusCode::kUnavailable);
  CHECK(st.message().find("down") != std::string::npos);
  CHECK(p.a->stats()->Snapshot().at("b").failed == 1);
  REQUIRE(p.a->SetLinks({}).ok());
  REQUIRE(p.Send("up again").ok());
  REQUIRE(p.inbox.WaitFor(1));
  CHECK(p.inbox.Messages() == std::vector<std::string>{"up again"});
}

TEST_CASE("a bandwidth cap delays in proportion to size", "[link]") {
  LinkSettings s;
  s.bandwidth_mbps = 80;  // 10 bytes per microsecond
  Pair p({Rule("a", "b", s)});
  // 400 kB at 10 B/us: the last byte cannot leave before 40 ms.
  const std::string chunk(100000, 'x');
  const absl::Time t0 = absl::Now();
  for (int i = 0; i < 4; ++i) REQUIRE(p.Send(chunk).ok());
  REQUIRE(p.inbox.WaitFor(4));
  const auto times = p.inbox.Times();
  for (int i = 0; i < 4; ++i) {
    CHECK(times[i] - t0 >= absl::Microseconds(10000 * (i + 1)));
  }
  // A small message after the queue drained takes its own small share.
  const absl::Time t1 = absl::Now();
  REQUIRE(p.Send(std::string(1000, 'y')).ok());
  REQUIRE(p.inbox.WaitFor(5));
  CHECK(p.inbox.Times()[4] - t1 >= absl::Microseconds(100));
}

TEST_CASE("shutdown with queued messages does not hang", "[link]") {
  LinkSettings s;
  s.latency_us = 10'000'000;
  Pair p({Rule("a", "b", s)});
  for (int i = 0; i < 3; ++i) REQUIRE(p.Send("late").ok());
  p.a->Shutdown();
  CHECK(p.Send("after").code() == absl::StatusCode::kUnavailable);
  CHECK(p.inbox.Messages().empty());
}

TEST_CASE("asynchronous sends pass plain and delayed links, in order",
          "[link]") {
  LinkSettings s;
  s.latency_us = 1000;
  s.jitter_us = 2000;
  for (bool delayed : {false, true}) {
    INFO("delayed " << delayed);
    Pair p(delayed ? std::vector<LinkRule>{Rule("a", "b", s)}
                   : std::vector<LinkRule>{});
    AsyncOutcomes outcomes;
    std::vector<std::string> want;
    size_t async = 0;
    for (int i = 0; i < 20; ++i) {
      const std::string m = absl::StrCat("m", i);
      want.push_back(m);
      if (i % 3 == 0) {
        REQUIRE(p.Send(m).ok());
      } else {
        REQUIRE(p.a->SendSharedAsync(p.peer,
                                     std::make_shared<const std::string>(m),
                                     outcomes.Callback(async++))
                    .ok());
      }
    }
    REQUIRE(p.inbox.WaitFor(want.size()));
    CHECK(p.inbox.Messages() == want);
    REQUIRE(outcomes.WaitFor(static_cast<int>(async)));
    for (size_t i = 0; i < async; ++i) {
      CHECK(outcomes.calls(i) == 1);
      CHECK(outcomes.status(i).ok());
    }
    CHECK(p.AwaitSent(want.size()) == want.size());
    CHECK(absl::IsInvalidArgument(
        p.a->SendSharedAsync(p.peer, nullptr, outcomes.Callback(async))));
  }
}

TEST_CASE("asynchronous sends report loss as OK and a down link as an error",
          "[link]") {
  LinkSettings lossy;
  lossy.loss = 1.0;
  Pair p({Rule("a", "b", lossy)});
  AsyncOutcomes outcomes;
  REQUIRE(p.a->SendSharedAsync(p.peer, std::make_shared<const std::string>("x"),
                               outcomes.Callback(0))
              .ok());
  REQUIRE(outcomes.WaitFor(1));
  CHECK(outcomes.status(0).ok());
  LinkSettings down;
  down.down = true;
  REQUIRE(p.a->SetLinks({Rule("a", "b", down)}).ok());
  const absl::Status st = p.a->SendSharedAsync(
      p.peer, std::make_shared<const std::string>("y"), outcomes.Callback(1));
  CHECK(st.code() == absl::StatusCode::kUnavailable);
  CHECK(outcomes.total() == 1);
}

TEST_CASE("FailPeer and shutdown end queued asynchronous sends", "[link]") {
  LinkSettings s;
  s.latency_us = 10'000'000;  // nothing leaves within the test
  Pair p({Rule("a", "b", s)});
  AsyncOutcomes outcomes;
  for (size_t i = 0; i < 3; ++i) {
    REQUIRE(p.a->SendSharedAsync(p.peer,
                                 std::make_shared<const std::string>("late"),
                                 outcomes.Callback(i))
                .ok());
  }
  REQUIRE(p.a->FailPeer(p.peer, absl::UnavailableError("rank 4 removed")).ok());
  REQUIRE(outcomes.WaitFor(3));
  for (size_t i = 0; i < 3; ++i) {
    CHECK(outcomes.calls(i) == 1);
    CHECK(outcomes.status(i).code() == absl::StatusCode::kUnavailable);
    CHECK(std::string(outcomes.status(i).message()).find("rank 4 removed") !=
          std::string::npos);
  }
  const absl::Status later = p.Send("x");
  CHECK(std::string(later.message()).find("rank 4 removed") !=
        std::string::npos);
  CHECK(p.a->FailPeer(77, absl::UnavailableError("x")).code() ==
        absl::StatusCode::kInvalidArgument);
  // Added again: queued as before; shutdown ends what is queued.
  REQUIRE(p.a->AddPeer("b", p.b->LocalAddress()).ok());
  REQUIRE(p.a->SendSharedAsync(p.peer,
                               std::make_shared<const std::string>("again"),
                               outcomes.Callback(3))
              .ok());
  p.a->Shutdown();
  REQUIRE(outcomes.WaitFor(4));
  CHECK(outcomes.calls(3) == 1);
  CHECK(outcomes.status(3).code() == absl::StatusCode::kUnavailable);
  CHECK(p.inbox.Messages().empty());
}

// A transport whose sends block until it is shut down, as a send towards a
// dead peer blocks until the send timeout.
class BlockingTransport final : public Transport {
 public:
  std::string LocalAddress() const override { return "blocking"; }
  absl::StatusOr<PeerId> AddPeer(const std::string&,
                                 const std::string&) override {
    return 0;
  }
  absl::Status Send(PeerId, const void*, size_t) override {
    absl::MutexLock lock(&mu_);
    sending_ = true;
    mu_.Await(absl::Condition(&shut_down_));
    return absl::UnavailableError("shut down");
  }
  void SetPeerReceiveHandler(PeerReceiveHandler) override {}
  std::string PeerName(PeerId) const override { return "b"; }
  size_t MaxMessageSize() const override { return 1 << 20; }
  absl::Status FailPeer(PeerId, const absl::Status&) override {
    return absl::OkStatus();
  }
  void Shutdown() override {
    absl::MutexLock lock(&mu_);
    shut_down_ = true;
  }
  bool WaitSending() {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(&sending_), kDeliveryBound);
  }

 private:
  absl::Mutex mu_;
  bool sending_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

TEST_CASE("shutdown ends a delivery blocked in the inner transport", "[link]") {
  // The inner transport is shut down before the delivery threads are
  // joined; the other order would wait for the blocked send for ever.
  auto inner = std::make_unique<BlockingTransport>();
  BlockingTransport* blocking = inner.get();
  LinkEmulatorOptions o;
  o.local_name = "a";
  LinkEmulator a(std::move(inner), o);
  LinkSettings s;
  s.latency_us = 1;
  REQUIRE(a.SetLinks({Rule("a", "b", s)}).ok());
  auto peer = a.AddPeer("b", "b-address");
  REQUIRE(peer.ok());
  REQUIRE(a.Send(*peer, "m", 1).ok());
  REQUIRE(blocking->WaitSending());
  a.Shutdown();
  CHECK(a.Send(*peer, "n", 1).code() == absl::StatusCode::kUnavailable);
}

TEST_CASE("link stats export as a stats map and Prometheus text", "[link]") {
  LinkStats stats;
  stats.RecordSent("karat0", 100, absl::Microseconds(3));
  stats.RecordSent("karat0", 50, absl::Microseconds(700));
  stats.RecordDropped("karat0");
  stats.RecordReceived(42);
  google::protobuf::Map<std::string, double> map;
  stats.ExportTo(&map);
  CHECK(map["link.karat0.messages"] == 2);
  CHECK(map["link.karat0.bytes"] == 150);
  CHECK(map["link.karat0.dropped"] == 1);
  CHECK(map["link.karat0.latency_us_p50"] == 5);
  CHECK(map["link.karat0.latency_us_p99"] == 1000);
  CHECK(map["link.received_bytes"] == 42);

  const std::string text = stats.Prometheus("gpu0");
  CHECK(text.find("# TYPE karat_link_messages_total counter") !=
        std::string::npos);
  CHECK(
      text.find("karat_link_messages_total{node=\"gpu0\",peer=\"karat0\"} 2") !=
      std::string::npos);
  CHECK(text.find("karat_link_send_latency_seconds_bucket{node=\"gpu0\","
                  "peer=\"karat0\",le=\"+Inf\"} 2") != std::string::npos);
  CHECK(text.find("karat_link_send_latency_seconds_count{node=\"gpu0\","
                  "peer=\"karat0\"} 2") != std::string::npos);

  std::map<std::string, double> flat(map.begin(), map.end());
  flat["tokens"] = 7;
  const std::string from_map = PrometheusFromStatsMap("gpu0", flat);
  CHECK(from_map.find("karat_link_bytes_total{node=\"gpu0\",peer=\"karat0\"} "
                      "150") != std::string::npos);
  CHECK(from_map.find("karat_node_stat{node=\"gpu0\",name=\"tokens\"} 7") !=
        std::string::npos);
}

TEST_CASE("peer names map transport names to node names", "[link]") {
  // The KARAT node knows a GPU node as "node-<id>"; rules use node names.
  LinkSettings s;
  s.down = true;
  Inbox inbox;
  FakeFabric fabric;
  LinkEmulatorOptions o;
  o.local_name = "karat0";
  LinkEmulator a(fabric.NewEndpoint("karat0"), o);
  auto b = fabric.NewEndpoint("gpu0");
  b->SetReceiveHandler(inbox.Handler());
  REQUIRE(a.SetLinks({Rule("karat0", "gpu0", s)}).ok());
  auto peer = a.AddPeer("node-3", b->LocalAddress());
  REQUIRE(peer.ok());
  CHECK(a.Send(*peer, "x", 1).ok());  // the rule names gpu0, not node-3
  a.SetPeerNames({{"node-3", "gpu0"}});
  CHECK(a.Send(*peer, "y", 1).code() == absl::StatusCode::kUnavailable);
  const auto links = a.stats()->Snapshot();
  CHECK(links.at("node-3").messages == 1);
  CHECK(links.at("gpu0").failed == 1);
  REQUIRE(inbox.WaitFor(1));
  a.Shutdown();
  b->Shutdown();
}

TEST_CASE("the seed decides which messages are lost", "[link]") {
  LinkSettings s;
  s.loss = 0.5;
  auto run = [&](uint64_t seed) {
    Pair p({Rule("a", "b", s)}, 1);
    p.a->SetSeed(seed);
    for (int i = 0; i < 40; ++i) REQUIRE(p.Send(absl::StrCat(i)).ok());
    REQUIRE(p.a->SetLinks({}).ok());
    REQUIRE(p.Send("end").ok());
    const uint64_t dropped = p.a->stats()->Snapshot().at("b").dropped;
    REQUIRE(p.inbox.WaitFor(41 - dropped));
    return p.inbox.Messages();
  };
  const auto first = run(5);
  CHECK(first == run(5));
  // 40 fair coin flips agree for two seeds with probability 2^-40.
  CHECK(first != run(6));
}

TEST_CASE("the emulator passes sender ids and peer names through", "[link]") {
  absl::Mutex mu;
  std::vector<PeerId> senders;
  FakeFabric fabric;
  LinkEmulatorOptions o;
  o.local_name = "b";
  LinkEmulator b(fabric.NewEndpoint("b"), o);
  auto a = fabric.NewEndpoint("a");
  b.SetPeerReceiveHandler([&](PeerId from, std::string_view) {
    absl::MutexLock lock(&mu);
    senders.push_back(from);
  });
  auto a_at_b = b.AddPeer("a", a->LocalAddress());
  REQUIRE(a_at_b.ok());
  auto b_at_a = a->AddPeer("b", b.LocalAddress());
  REQUIRE(b_at_a.ok());
  REQUIRE(a->Send(*b_at_a, "x", 1).ok());
  {
    absl::MutexLock lock(&mu);
    auto one = [&]() { return !senders.empty(); };
    REQUIRE(mu.AwaitWithTimeout(absl::Condition(&one), absl::Seconds(60)));
    CHECK(senders[0] == *a_at_b);
  }
  CHECK(b.PeerName(*a_at_b) == "a");
  CHECK(b.PeerName(kUnknownPeer) == "unknown peer");
  CHECK(b.stats()->received_messages() == 1);
  b.Shutdown();
  a->Shutdown();
}

}  // namespace
}  // namespace karat
