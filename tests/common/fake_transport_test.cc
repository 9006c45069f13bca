#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/transport.h"

namespace karat {
namespace {

// Bound on waiting for deliveries, so that a lost message fails the test
// instead of hanging it. Not a performance expectation.
constexpr absl::Duration kDeliveryBound = absl::Seconds(60);

// Collects delivered messages.
class Inbox {
 public:
  Transport::ReceiveHandler Handler() {
    return [this](std::string_view m) {
      absl::MutexLock lock(&mu_);
      messages_.emplace_back(m);
    };
  }
  // Waits until `n` messages arrived; false if they did not within the bound.
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

 private:
  absl::Mutex mu_;
  std::vector<std::string> messages_ ABSL_GUARDED_BY(mu_);
};

TEST_CASE("fake endpoints exchange messages in order", "[fake_transport]") {
  Inbox inbox_a, inbox_b;  // outlive the endpoints that fill them
  FakeFabric fabric;
  auto a = fabric.NewEndpoint("a");
  auto b = fabric.NewEndpoint("b");
  CHECK(a->LocalAddress().rfind("fake:", 0) == 0);
  CHECK(a->LocalAddress() != b->LocalAddress());
  a->SetReceiveHandler(inbox_a.Handler());
  b->SetReceiveHandler(inbox_b.Handler());

  auto b_at_a = a->AddPeer("b", b->LocalAddress());
  REQUIRE(b_at_a.ok());
  auto again = a->AddPeer("b-again", b->LocalAddress());
  REQUIRE(again.ok());
  CHECK(*again == *b_at_a);
  auto a_at_b = b->AddPeer("a", a->LocalAddress());
  REQUIRE(a_at_b.ok());

  constexpr int kMessages = 10000;
  for (int i = 0; i < kMessages; ++i) {
    const std::string m = std::to_string(i);
    REQUIRE(a->Send(*b_at_a, m.data(), m.size()).ok());
  }
  REQUIRE(b->Send(*a_at_b, "", 0).ok());
  REQUIRE(inbox_b.WaitFor(kMessages));
  REQUIRE(inbox_a.WaitFor(1));
  const auto got = inbox_b.Messages();
  REQUIRE(got.size() == kMessages);
  for (int i = 0; i < kMessages; ++i) REQUIRE(got[i] == std::to_string(i));
  CHECK(inbox_a.Messages()[0].empty());
}

TEST_CASE("fake SendShared delivers the caller's string and then drops it",
          "[fake_transport]") {
  Inbox inbox;
  FakeFabric fabric;
  auto a = fabric.NewEndpoint("a");
  auto b = fabric.NewEndpoint("b");
  b->SetReceiveHandler(inbox.Handler());
  auto b_at_a = a->AddPeer("b", b->LocalAddress());
  REQUIRE(b_at_a.ok());
  auto message = std::make_shared<const std::string>(kSharedSendMinBytes, 'x');
  REQUIRE(a->SendShared(*b_at_a, message).ok());
  REQUIRE(inbox.WaitFor(1));
  CHECK(inbox.Messages()[0] == *message);
  // The delivery thread drops its reference right after the handler.
  for (int i = 0; i < 6000 && message.use_count() > 1; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  CHECK(message.use_count() == 1);
  CHECK(absl::IsInvalidArgument(a->SendShared(*b_at_a, nullptr)));
  CHECK(absl::IsInvalidArgument(a->SendShared(
      *b_at_a,
      std::make_shared<const std::string>(a->MaxMessageSize() + 1, 'y'))));
}

TEST_CASE("fake transport keeps per-sender order with concurrent senders",
          "[fake_transport]") {
  Inbox inbox;
  FakeFabric fabric;
  auto sink = fabric.NewEndpoint("sink");
  sink->SetReceiveHandler(inbox.Handler());
  constexpr int kSenders = 4;
  constexpr int kEach = 2000;
  std::vector<std::unique_ptr<Transport>> senders;
  for (int s = 0; s < kSenders; ++s) {
    senders.push_back(fabric.NewEndpoint(absl::StrCat("s", s)));
  }
  // Catch2 assertions are not thread-safe: threads only count failures.
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int s = 0; s < kSenders; ++s) {
    threads.emplace_back([&, s] {
      auto peer = senders[s]->AddPeer("sink", sink->LocalAddress());
      if (!peer.ok()) {
        ++failures;
        return;
      }
      for (int i = 0; i < kEach; ++i) {
        const std::string m = absl::StrCat(s, ":", i);
        if (!senders[s]->Send(*peer, m.data(), m.size()).ok()) ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  REQUIRE(failures == 0);
  REQUIRE(inbox.WaitFor(kSenders * kEach));
  std::vector<int> next(kSenders, 0);
  for (const std::string& m : inbox.Messages()) {
    const int s = std::stoi(m.substr(0, m.find(':')));
    const int i = std::stoi(m.substr(m.find(':') + 1));
    REQUIRE(i == next[s]);
    ++next[s];
  }
}

TEST_CASE("fake transport rejects unknown and unreachable peers",
          "[fake_transport]") {
  FakeFabric fabric;
  auto a = fabric.NewEndpoint("a");
  auto b = fabric.NewEndpoint("b");

  CHECK(a->Send(42, "x", 1).code() == absl::StatusCode::kInvalidArgument);
  CHECK(a->Send(kUnknownPeer, "x", 1).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(a->AddPeer("empty", "").status().code() ==
        absl::StatusCode::kInvalidArgument);

  auto nowhere = a->AddPeer("nowhere", "fake:999");
  REQUIRE(nowhere.ok());
  absl::Status s = a->Send(*nowhere, "x", 1);
  CHECK(s.code() == absl::StatusCode::kUnavailable);
  CHECK(std::string(s.message()).find("nowhere") != std::string::npos);

  auto peer_b = a->AddPeer("b", b->LocalAddress());
  REQUIRE(peer_b.ok());
  REQUIRE(a->Send(*peer_b, "x", 1).ok());
  b->Shutdown();
  b->Shutdown();  // idempotent
  s = a->Send(*peer_b, "x", 1);
  CHECK(s.code() == absl::StatusCode::kUnavailable);
  CHECK(std::string(s.message()).find("'b'") != std::string::npos);

  const std::string big(a->MaxMessageSize() + 1, 'x');
  CHECK(a->Send(*peer_b, big.data(), big.size()).code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("fake asynchronous sends complete once, in order with others",
          "[fake_transport]") {
  FakeFabric fabric;
  auto a = fabric.NewEndpoint("a");
  auto b = fabric.NewEndpoint("b");
  Inbox inbox;
  b->SetReceiveHandler(inbox.Handler());
  auto peer_b = a->AddPeer("b", b->LocalAddress());
  REQUIRE(peer_b.ok());
  std::vector<int> calls(10, 0);
  std::vector<absl::Status> statuses(10);
  std::vector<std::string> want;
  for (int i = 0; i < 10; ++i) {
    const std::string m = absl::StrCat("m", i);
    want.push_back(m);
    if (i % 2 == 0) {
      REQUIRE(a->Send(*peer_b, m.data(), m.size()).ok());
      continue;
    }
    REQUIRE(a->SendSharedAsync(*peer_b, std::make_shared<const std::string>(m),
                               [&calls, &statuses, i](absl::Status s) {
                                 ++calls[i];
                                 statuses[i] = std::move(s);
                               })
                .ok());
    // The fake queues at once: the outcome is known before the call returns.
    CHECK(calls[i] == 1);
    CHECK(statuses[i].ok());
  }
  REQUIRE(inbox.WaitFor(want.size()));
  CHECK(inbox.Messages() == want);
  for (int i = 1; i < 10; i += 2) CHECK(calls[i] == 1);
  // Failed early: an error and no callback.
  int late_calls = 0;
  CHECK(a->SendSharedAsync(42, std::make_shared<const std::string>("x"),
                           [&](absl::Status) { ++late_calls; })
            .code() == absl::StatusCode::kInvalidArgument);
  CHECK(late_calls == 0);
}

TEST_CASE("fake FailPeer fails later sends until the peer is added again",
          "[fake_transport]") {
  FakeFabric fabric;
  auto a = fabric.NewEndpoint("a");
  auto b = fabric.NewEndpoint("b");
  Inbox inbox;
  b->SetReceiveHandler(inbox.Handler());
  auto peer_b = a->AddPeer("b", b->LocalAddress());
  REQUIRE(peer_b.ok());
  CHECK(a->FailPeer(42, absl::UnavailableError("x")).code() ==
        absl::StatusCode::kInvalidArgument);
  REQUIRE(a->FailPeer(*peer_b, absl::UnavailableError("rank 1 removed")).ok());
  const absl::Status s = a->Send(*peer_b, "x", 1);
  CHECK(s.code() == absl::StatusCode::kUnavailable);
  CHECK(std::string(s.message()).find("rank 1 removed") != std::string::npos);
  CHECK(std::string(s.message()).find("'b'") != std::string::npos);
  int calls = 0;
  CHECK(a->SendSharedAsync(*peer_b, std::make_shared<const std::string>("y"),
                           [&](absl::Status) { ++calls; })
            .code() == absl::StatusCode::kUnavailable);
  CHECK(calls == 0);
  auto again = a->AddPeer("b", b->LocalAddress());
  REQUIRE(again.ok());
  CHECK(*again == *peer_b);
  REQUIRE(a->Send(*peer_b, "z", 1).ok());
  REQUIRE(inbox.WaitFor(1));
  CHECK(inbox.Messages() == std::vector<std::string>{"z"});
}

TEST_CASE("fake transport handlers may send", "[fake_transport]") {
  Inbox inbox;
  FakeFabric fabric;
  auto client = fabric.NewEndpoint("client");
  auto server = fabric.NewEndpoint("server");
  auto client_at_server = server->AddPeer("client", client->LocalAddress());
  REQUIRE(client_at_server.ok());
  // Echo server: replies from its delivery thread.
  server->SetReceiveHandler([&](std::string_view m) {
    std::string reply = absl::StrCat("echo:", std::string(m));
    (void)server->Send(*client_at_server, reply.data(), reply.size());
  });
  client->SetReceiveHandler(inbox.Handler());
  auto server_at_client = client->AddPeer("server", server->LocalAddress());
  REQUIRE(server_at_client.ok());
  for (int i = 0; i < 100; ++i) {
    const std::string m = std::to_string(i);
    REQUIRE(client->Send(*server_at_client, m.data(), m.size()).ok());
  }
  REQUIRE(inbox.WaitFor(100));
  const auto got = inbox.Messages();
  for (int i = 0; i < 100; ++i) CHECK(got[i] == absl::StrCat("echo:", i));
  server->Shutdown();
}

TEST_CASE("fake endpoints name the sender of each message",
          "[fake_transport]") {
  absl::Mutex mu;
  std::vector<std::pair<PeerId, std::string>> got;
  FakeFabric fabric;
  auto a = fabric.NewEndpoint("a");
  auto b = fabric.NewEndpoint("b");
  auto c = fabric.NewEndpoint("c");
  b->SetPeerReceiveHandler([&](PeerId from, std::string_view m) {
    absl::MutexLock lock(&mu);
    got.emplace_back(from, std::string(m));
  });
  auto a_at_b = b->AddPeer("a", a->LocalAddress());
  REQUIRE(a_at_b.ok());
  auto b_at_a = a->AddPeer("b", b->LocalAddress());
  auto b_at_c = c->AddPeer("b", b->LocalAddress());
  REQUIRE(b_at_a.ok());
  REQUIRE(b_at_c.ok());
  REQUIRE(a->Send(*b_at_a, "from a", 6).ok());
  REQUIRE(c->Send(*b_at_c, "from c", 6).ok());
  {
    absl::MutexLock lock(&mu);
    auto two = [&]() { return got.size() >= 2; };
    REQUIRE(mu.AwaitWithTimeout(absl::Condition(&two), kDeliveryBound));
  }
  // Each sender has its own delivery order only; sort by text.
  std::sort(got.begin(), got.end(),
            [](const auto& x, const auto& y) { return x.second < y.second; });
  CHECK(got[0].first == *a_at_b);
  CHECK(got[1].first == kUnknownPeer);  // c was never added at b
  CHECK(b->PeerName(*a_at_b) == "a");
  CHECK(b->PeerName(kUnknownPeer) == "unknown peer");
  CHECK(b->PeerName(42) == "peer #42");
  CHECK(b->Counters().empty());
  a->Shutdown();
  b->Shutdown();
  c->Shutdown();
}

}  // namespace
}  // namespace karat
