// The libfabric transport between two endpoints of one process: shm, and
// tcp (through ofi_rxm) on 127.0.0.1.
#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <future>
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
    };
  }
  bool WaitFor(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return messages_.size() >= n;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), kDeliveryBound);
  }
  std::vector<std::string> Take() {
    absl::MutexLock lock(&mu_);
    return std::move(messages_);
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> messages_ ABSL_GUARDED_BY(mu_);
};

// Two connected endpoints. Inboxes are declared first so that they outlive
// the endpoints' progress threads.
struct Pair {
  Inbox inbox_a, inbox_b;
  std::unique_ptr<Transport> a, b;
  PeerId b_at_a = kUnknownPeer, a_at_b = kUnknownPeer;

  // Both ends live in this process, where the shm provider hands a peer's
  // own memory region to the other end: once one end has closed, a send to
  // it from the other (such as an RMA credit, which a progress thread sends
  // when it goes idle) would touch freed memory. So first neither end may
  // send to the other any more (FailPeer), then both close. Idempotent.
  void Stop() {
    const absl::Status stopping =
        absl::UnavailableError("the test pair is stopping");
    if (a != nullptr && b_at_a != kUnknownPeer)
      (void)a->FailPeer(b_at_a, stopping);
    if (b != nullptr && a_at_b != kUnknownPeer)
      (void)b->FailPeer(a_at_b, stopping);
    if (a != nullptr) a->Shutdown();
    if (b != nullptr) b->Shutdown();
  }
  ~Pair() { Stop(); }
};

FabricOptions Options(const std::string& provider,
                      size_t max_message_size = 1 << 20) {
  FabricOptions o;
  o.provider = provider;
  if (provider == "tcp") o.node = "127.0.0.1";
  o.max_message_size = max_message_size;
  o.receive_buffers = 8;
  return o;
}

// Opens a pair; returns nullptr when the provider is not available here.
std::unique_ptr<Pair> OpenPair(const FabricOptions& options) {
  auto pair = std::make_unique<Pair>();
  auto a = OpenFabricTransport(options);
  if (!a.ok() && a.status().code() == absl::StatusCode::kUnavailable) {
    WARN("libfabric provider '" << options.provider
                                << "' unavailable, skipping: " << a.status());
    return nullptr;
  }
  REQUIRE(a.ok());
  auto b = OpenFabricTransport(options);
  REQUIRE(b.ok());
  pair->a = std::move(*a);
  pair->b = std::move(*b);
  REQUIRE_FALSE(pair->a->LocalAddress().empty());
  REQUIRE(pair->a->LocalAddress() != pair->b->LocalAddress());
  REQUIRE(pair->a->MaxMessageSize() == options.max_message_size);
  pair->a->SetReceiveHandler(pair->inbox_a.Handler());
  pair->b->SetReceiveHandler(pair->inbox_b.Handler());
  auto b_at_a = pair->a->AddPeer("b", pair->b->LocalAddress());
  REQUIRE(b_at_a.ok());
  auto a_at_b = pair->b->AddPeer("a", pair->a->LocalAddress());
  REQUIRE(a_at_b.ok());
  pair->b_at_a = *b_at_a;
  pair->a_at_b = *a_at_b;
  return pair;
}

std::string Pattern(size_t size, int seed) {
  std::string s(size, '\0');
  for (size_t i = 0; i < size; ++i)
    s[i] = static_cast<char>((i * 131 + seed * 7 + (i >> 12)) & 0xff);
  return s;
}

// Sends the given sizes a->b and b->a and checks every byte.
void ExchangeSizes(Pair& p, const std::vector<size_t>& sizes) {
  for (size_t i = 0; i < sizes.size(); ++i) {
    const std::string to_b = Pattern(sizes[i], static_cast<int>(i));
    const std::string to_a = Pattern(sizes[i], static_cast<int>(i) + 100);
    INFO("size " << sizes[i]);
    REQUIRE(p.a->Send(p.b_at_a, to_b.data(), to_b.size()).ok());
    REQUIRE(p.b->Send(p.a_at_b, to_a.data(), to_a.size()).ok());
    REQUIRE(p.inbox_b.WaitFor(1));
    REQUIRE(p.inbox_a.WaitFor(1));
    const auto got_b = p.inbox_b.Take();
    const auto got_a = p.inbox_a.Take();
    REQUIRE(got_b.size() == 1);
    REQUIRE(got_a.size() == 1);
    CHECK(got_b[0] == to_b);
    CHECK(got_a[0] == to_a);
  }
}

TEST_CASE("shm: messages of 1 B, 4 KiB, 1 MiB and the maximum size, both ways",
          "[fabric]") {
  FabricOptions options = Options("shm", 8 << 20);
  auto p = OpenPair(options);
  REQUIRE(p != nullptr);
  ExchangeSizes(*p, {1, 4096, 1 << 20, options.max_message_size, 0});
}

TEST_CASE("shm: 1000 messages each way arrive in order", "[fabric]") {
  auto p = OpenPair(Options("shm"));
  REQUIRE(p != nullptr);
  constexpr int kMessages = 1000;
  std::atomic<int> failures{0};
  auto send_all = [&](Transport* t, PeerId peer, char tag) {
    for (int i = 0; i < kMessages; ++i) {
      const std::string m =
          absl::StrCat(std::string(1, tag), i, std::string(i % 97, 'p'));
      if (!t->Send(peer, m.data(), m.size()).ok()) ++failures;
    }
  };
  std::thread a_to_b(send_all, p->a.get(), p->b_at_a, 'a');
  std::thread b_to_a(send_all, p->b.get(), p->a_at_b, 'b');
  a_to_b.join();
  b_to_a.join();
  REQUIRE(failures == 0);
  REQUIRE(p->inbox_b.WaitFor(kMessages));
  REQUIRE(p->inbox_a.WaitFor(kMessages));
  const auto got_b = p->inbox_b.Take();
  const auto got_a = p->inbox_a.Take();
  REQUIRE(got_b.size() == kMessages);
  REQUIRE(got_a.size() == kMessages);
  for (int i = 0; i < kMessages; ++i) {
    REQUIRE(got_b[i] == absl::StrCat("a", i, std::string(i % 97, 'p')));
    REQUIRE(got_a[i] == absl::StrCat("b", i, std::string(i % 97, 'p')));
  }
}

TEST_CASE("shm: concurrent senders keep their own order", "[fabric]") {
  auto p = OpenPair(Options("shm"));
  REQUIRE(p != nullptr);
  constexpr int kThreads = 4;
  constexpr int kEach = 250;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        const std::string m = absl::StrCat(t, ":", i);
        if (!p->a->Send(p->b_at_a, m.data(), m.size()).ok()) ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  REQUIRE(failures == 0);
  REQUIRE(p->inbox_b.WaitFor(kThreads * kEach));
  std::vector<int> next(kThreads, 0);
  for (const std::string& m : p->inbox_b.Take()) {
    const int t = std::stoi(m.substr(0, m.find(':')));
    REQUIRE(std::stoi(m.substr(m.find(':') + 1)) == next[t]);
    ++next[t];
  }
}

TEST_CASE("shm: a receive handler may send (echo)", "[fabric]") {
  auto p = OpenPair(Options("shm"));
  REQUIRE(p != nullptr);
  absl::Mutex echo_mu;
  std::vector<std::string> echo_errors;  // guarded by echo_mu
  // b echoes from its progress thread.
  p->b->SetReceiveHandler([&](std::string_view m) {
    const std::string reply = absl::StrCat("echo:", std::string(m));
    const absl::Status s = p->b->Send(p->a_at_b, reply.data(), reply.size());
    if (!s.ok()) {
      absl::MutexLock lock(&echo_mu);
      echo_errors.push_back(s.ToString());
    }
  });
  constexpr int kMessages = 200;
  for (int i = 0; i < kMessages; ++i) {
    const std::string m = absl::StrCat(i, std::string(i * 1000, 'e'));
    const absl::Status s = p->a->Send(p->b_at_a, m.data(), m.size());
    INFO("message " << i << ": " << s.ToString());
    REQUIRE(s.ok());
  }
  const bool arrived = p->inbox_a.WaitFor(kMessages);
  {
    absl::MutexLock lock(&echo_mu);
    for (const std::string& e : echo_errors) UNSCOPED_INFO("echo: " << e);
    CHECK(echo_errors.empty());
  }
  REQUIRE(arrived);
  const auto got = p->inbox_a.Take();
  for (int i = 0; i < kMessages; ++i) {
    REQUIRE(got[i] == absl::StrCat("echo:", i, std::string(i * 1000, 'e')));
  }
  // Stop b's progress thread before its handler's captures go away.
  p->Stop();
}

TEST_CASE("shm: a replaced receive handler gets no later message", "[fabric]") {
  auto p = OpenPair(Options("shm"));
  REQUIRE(p != nullptr);
  // b's first handler takes "1", then replaces itself from inside its call
  // (and keeps running: it still records the message); messages sent after
  // that go to the second, and after SetReceiveHandler() from this thread,
  // to the third.
  Inbox first, second;
  auto first_handler = first.Handler();
  p->b->SetReceiveHandler([&, first_handler](std::string_view m) {
    p->b->SetReceiveHandler(second.Handler());
    first_handler(m);
  });
  auto send = [&](const std::string& m) {
    REQUIRE(p->a->Send(p->b_at_a, m.data(), m.size()).ok());
  };
  send("1");
  REQUIRE(first.WaitFor(1));
  send("2");
  send("3");
  REQUIRE(second.WaitFor(2));
  p->b->SetReceiveHandler(p->inbox_b.Handler());
  send("4");
  REQUIRE(p->inbox_b.WaitFor(1));
  CHECK(first.Take() == std::vector<std::string>{"1"});
  CHECK(second.Take() == std::vector<std::string>{"2", "3"});
  CHECK(p->inbox_b.Take() == std::vector<std::string>{"4"});
  p->Stop();
}

TEST_CASE("shm: oversized messages and bad peers fail cleanly", "[fabric]") {
  auto p = OpenPair(Options("shm", 64 << 10));
  REQUIRE(p != nullptr);
  const std::string big((64 << 10) + 1, 'x');
  absl::Status s = p->a->Send(p->b_at_a, big.data(), big.size());
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(p->a->Send(99, "x", 1).code() == absl::StatusCode::kInvalidArgument);
  CHECK(p->a->Send(kUnknownPeer, "x", 1).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(p->a->AddPeer("empty", "").status().code() ==
        absl::StatusCode::kInvalidArgument);

  auto again = p->a->AddPeer("b again", p->b->LocalAddress());
  REQUIRE(again.ok());
  CHECK(*again == p->b_at_a);

  // The endpoint still works after the refusals.
  const std::string exact(64 << 10, 'y');
  REQUIRE(p->a->Send(p->b_at_a, exact.data(), exact.size()).ok());
  REQUIRE(p->inbox_b.WaitFor(1));
  CHECK(p->inbox_b.Take()[0] == exact);
}

TEST_CASE("shm: invalid options are refused", "[fabric]") {
  FabricOptions o = Options("shm");
  o.receive_buffers = 0;
  CHECK(OpenFabricTransport(o).status().code() ==
        absl::StatusCode::kInvalidArgument);
  o = Options("shm");
  o.max_message_size = 0;
  CHECK(OpenFabricTransport(o).status().code() ==
        absl::StatusCode::kInvalidArgument);
  o = Options("shm");
  o.send_timeout_ms = 0;
  CHECK(OpenFabricTransport(o).status().code() ==
        absl::StatusCode::kInvalidArgument);
  o = Options("shm");
  o.posted_receives = 0;
  CHECK(OpenFabricTransport(o).status().code() ==
        absl::StatusCode::kInvalidArgument);
  o = Options("no-such-provider");
  CHECK(OpenFabricTransport(o).status().code() ==
        absl::StatusCode::kUnavailable);
}

// The peer lives in a child process, as daemons do. (With libfabric 1.17's
// shm provider, closing an endpoint that another endpoint of the same process
// still sends to makes that sender touch the closed endpoint's memory, so an
// in-process version of this test would crash inside the provider.)
TEST_CASE("shm: sending to a peer that has exited returns", "[fabric]") {
  FabricOptions options = Options("shm");
  options.send_timeout_ms = 500;
  int to_parent[2], to_child[2];
  REQUIRE(pipe(to_parent) == 0);
  REQUIRE(pipe(to_child) == 0);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // Child: open an endpoint, publish its address, receive one message,
    // then shut down and exit. Exit code 0 means every step worked.
    close(to_parent[0]);
    close(to_child[1]);
    int code = 0;
    {
      Inbox inbox;
      auto t = OpenFabricTransport(options);
      if (!t.ok()) _exit(2);
      (*t)->SetReceiveHandler(inbox.Handler());
      const std::string address = (*t)->LocalAddress();
      const uint32_t len = static_cast<uint32_t>(address.size());
      if (write(to_parent[1], &len, sizeof(len)) != sizeof(len) ||
          write(to_parent[1], address.data(), len) !=
              static_cast<ssize_t>(len)) {
        _exit(3);
      }
      if (!inbox.WaitFor(1) || inbox.Take()[0] != "hello") code = 4;
      (*t)->Shutdown();
    }
    char done = 0;
    if (read(to_child[0], &done, 1) != 1) code = 5;  // parent: "exit now"
    _exit(code);
  }
  close(to_parent[1]);
  close(to_child[0]);
  uint32_t len = 0;
  REQUIRE(read(to_parent[0], &len, sizeof(len)) == sizeof(len));
  std::string address(len, '\0');
  REQUIRE(read(to_parent[0], address.data(), len) == static_cast<ssize_t>(len));

  Inbox inbox;
  auto t = OpenFabricTransport(options);
  REQUIRE(t.ok());
  (*t)->SetReceiveHandler(inbox.Handler());
  auto peer = (*t)->AddPeer("child", address);
  REQUIRE(peer.ok());
  REQUIRE((*t)->Send(*peer, "hello", 5).ok());
  REQUIRE(write(to_child[1], "x", 1) == 1);
  int wstatus = 0;
  REQUIRE(waitpid(child, &wstatus, 0) == child);
  REQUIRE(WIFEXITED(wstatus));
  REQUIRE(WEXITSTATUS(wstatus) == 0);
  close(to_parent[0]);
  close(to_child[1]);

  // Whether the provider reports the loss or accepts the message into the
  // dead peer's queue, Send() must come back.
  auto result = std::async(std::launch::async, [&] {
    std::vector<absl::Status> statuses;
    for (size_t size : {size_t{4}, size_t{64} << 10}) {
      const std::string m(size, 'l');
      statuses.push_back((*t)->Send(*peer, m.data(), m.size()));
    }
    return statuses;
  });
  REQUIRE(result.wait_for(std::chrono::seconds(60)) ==
          std::future_status::ready);
  for (const absl::Status& s : result.get()) {
    INFO(s);
    CHECK((s.ok() || s.code() == absl::StatusCode::kUnavailable));
    if (!s.ok())
      CHECK(std::string(s.message()).find("'child'") != std::string::npos);
  }
}

// Writes a length-prefixed string to a pipe; reads one.
bool WriteString(int fd, const std::string& s) {
  const uint32_t len = static_cast<uint32_t>(s.size());
  return write(fd, &len, sizeof(len)) == sizeof(len) &&
         write(fd, s.data(), len) == static_cast<ssize_t>(len);
}
bool ReadString(int fd, std::string* s) {
  uint32_t len = 0;
  if (read(fd, &len, sizeof(len)) != sizeof(len)) return false;
  s->assign(len, '\0');
  size_t got = 0;
  while (got < len) {
    const ssize_t n = read(fd, s->data() + got, len - got);
    if (n <= 0) return false;
    got += static_cast<size_t>(n);
  }
  return true;
}

// Removes the shared memory a killed process's shm endpoints left behind
// (the provider names them "<pid>:<uid>:<index>"), so that a later process
// with the same pid does not find them.
void RemoveShmRegionsOf(pid_t pid) {
  const std::string prefix = absl::StrCat(pid, ":");
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return;
  while (const dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    if (name.rfind(prefix, 0) == 0)
      unlink(absl::StrCat("/dev/shm/", name).c_str());
  }
  closedir(dir);
}

// Endpoints a and c in this process exchange messages with b, a forked
// child, in both directions (4 KiB and 1 MiB: inject and CMA paths); b is
// SIGKILLed; then c sends `to_dead` bytes to the dead b (0: nothing) and
// returns the statuses of c's sends to a of 4 KiB + 1 and 1 MiB. Options as
// the daemons set them on shm (no RMA), with `send_endpoint_per_peer`.
std::vector<absl::Status> SendsAfterPeerKilled(size_t to_dead,
                                               bool send_endpoint_per_peer) {
  FabricOptions options = Options("shm", 2 << 20);
  options.send_timeout_ms = 1000;
  options.use_rma = RmaPays("shm");
  options.send_endpoint_per_peer = send_endpoint_per_peer;
  const std::vector<size_t> sizes = {4096, 1 << 20};
  // Fork before this process opens endpoints (no provider state copied).
  int to_parent[2], to_child[2];
  REQUIRE(pipe(to_parent) == 0);
  REQUIRE(pipe(to_child) == 0);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // b: exchanges `sizes` with c, reports, then waits to be killed.
    close(to_parent[0]);
    close(to_child[1]);
    std::string c_address;
    if (!ReadString(to_child[0], &c_address)) _exit(2);
    Inbox inbox;
    auto t = OpenFabricTransport(options);
    if (!t.ok()) _exit(3);
    (*t)->SetReceiveHandler(inbox.Handler());
    auto c_at_b = (*t)->AddPeer("c", c_address);
    if (!c_at_b.ok()) _exit(4);
    if (!WriteString(to_parent[1], (*t)->LocalAddress())) _exit(5);
    for (size_t i = 0; i < sizes.size(); ++i) {
      const std::string m = Pattern(sizes[i], static_cast<int>(i));
      if (!(*t)->Send(*c_at_b, m.data(), m.size()).ok()) _exit(6);
    }
    if (!inbox.WaitFor(sizes.size())) _exit(7);
    if (!WriteString(to_parent[1], "ready")) _exit(8);
    char never;
    [[maybe_unused]] ssize_t n = read(to_child[0], &never, 1);
    _exit(0);
  }
  close(to_parent[1]);
  close(to_child[0]);
  Inbox inbox_a, inbox_c;
  auto a = OpenFabricTransport(options);
  REQUIRE(a.ok());
  auto c = OpenFabricTransport(options);
  REQUIRE(c.ok());
  (*a)->SetReceiveHandler(inbox_a.Handler());
  (*c)->SetReceiveHandler(inbox_c.Handler());
  auto a_at_c = (*c)->AddPeer("a", (*a)->LocalAddress());
  auto c_at_a = (*a)->AddPeer("c", (*c)->LocalAddress());
  REQUIRE(a_at_c.ok());
  REQUIRE(c_at_a.ok());
  REQUIRE(WriteString(to_child[1], (*c)->LocalAddress()));
  std::string b_address, ready;
  REQUIRE(ReadString(to_parent[0], &b_address));
  auto b_at_c = (*c)->AddPeer("b", b_address);
  REQUIRE(b_at_c.ok());
  for (size_t i = 0; i < sizes.size(); ++i) {
    const std::string m = Pattern(sizes[i], static_cast<int>(i) + 10);
    REQUIRE((*c)->Send(*b_at_c, m.data(), m.size()).ok());
  }
  REQUIRE(inbox_c.WaitFor(sizes.size()));
  REQUIRE(ReadString(to_parent[0], &ready));
  REQUIRE(ready == "ready");
  REQUIRE(kill(child, SIGKILL) == 0);
  int wstatus = 0;
  REQUIRE(waitpid(child, &wstatus, 0) == child);
  REQUIRE(WIFSIGNALED(wstatus));
  RemoveShmRegionsOf(child);
  close(to_parent[0]);
  close(to_child[1]);

  if (to_dead > 0) {
    const std::string m(to_dead, 'd');
    const absl::Status s = (*c)->Send(*b_at_c, m.data(), m.size());
    INFO(s);
    CHECK((s.ok() || s.code() == absl::StatusCode::kUnavailable));
  }
  std::vector<absl::Status> statuses;
  std::vector<std::string> completed;
  for (size_t size : {size_t{4097}, size_t{1} << 20}) {
    const std::string m = Pattern(size, 50);
    statuses.push_back((*c)->Send(*a_at_c, m.data(), m.size()));
    if (statuses.back().ok()) completed.push_back(m);
    const std::string back = Pattern(size, 60);
    REQUIRE((*a)->Send(*c_at_a, back.data(), back.size()).ok());
  }
  // a -> c flows in every case.
  REQUIRE(inbox_c.WaitFor(sizes.size() + 2));
  const std::vector<std::string> at_c = inbox_c.Take();
  REQUIRE(at_c.size() == sizes.size() + 2);
  CHECK(at_c[sizes.size()] == Pattern(4097, 60));
  CHECK(at_c[sizes.size() + 1] == Pattern(1 << 20, 60));
  // What c sent to a and saw completed has arrived (a send that timed out
  // may have arrived too: the receiver took it, the sender saw no
  // completion).
  REQUIRE(inbox_a.WaitFor(completed.size()));
  const std::vector<std::string> at_a = inbox_a.Take();
  for (const std::string& m : completed) {
    const bool arrived = std::find(at_a.begin(), at_a.end(), m) != at_a.end();
    CHECK(arrived);
  }
  (*c)->Shutdown();
  (*a)->Shutdown();
  return statuses;
}

TEST_CASE("shm: a killed peer does not stop sends to the others",
          "[fabric][dead-peer]") {
  // Messages over the inject size (4 KiB) left in the dead peer's queue are
  // never answered; with a send endpoint per peer they block only the sends
  // to that peer.
  size_t to_dead = 0;
  SECTION("nothing sent to the dead peer") { to_dead = 0; }
  SECTION("an injected message sent to the dead peer") { to_dead = 4096; }
  SECTION("a message over the inject size sent to the dead peer") {
    to_dead = 4097;
  }
  SECTION("a large message sent to the dead peer") { to_dead = 1 << 20; }
  INFO("bytes sent to the dead peer: " << to_dead);
  for (const absl::Status& s :
       SendsAfterPeerKilled(to_dead, /*send_endpoint_per_peer=*/true)) {
    INFO(s);
    CHECK(s.ok());
  }
}

TEST_CASE(
    "shm: with one send endpoint, a send left in a killed peer's queue is "
    "named when later sends time out",
    "[fabric][dead-peer]") {
  // The shm provider of libfabric 1.17 completes the sends of an endpoint
  // over its inject size in posting order (one response queue per
  // endpoint, read from its head), and a peer killed before it took such a
  // send never responds: every later send over the inject size from that
  // endpoint, to any peer, then stays incomplete. Where the provider
  // completes them, the sends succeed; where it does not, the timeout
  // names the peer whose send blocks them.
  size_t to_dead = 0;
  SECTION("a message over the inject size sent to the dead peer") {
    to_dead = 4097;
  }
  SECTION("a large message sent to the dead peer") { to_dead = 1 << 20; }
  INFO("bytes sent to the dead peer: " << to_dead);
  bool blocked = false;
  for (const absl::Status& s :
       SendsAfterPeerKilled(to_dead, /*send_endpoint_per_peer=*/false)) {
    INFO(s);
    if (s.ok()) continue;
    blocked = true;
    CHECK(s.code() == absl::StatusCode::kUnavailable);
    CHECK(std::string(s.message()).find("earlier send to peer 'b'") !=
          std::string::npos);
  }
  if (blocked) WARN("sends over the inject size stay blocked behind 'b'");
}

TEST_CASE("shm: Send after Shutdown fails", "[fabric]") {
  auto p = OpenPair(Options("shm"));
  REQUIRE(p != nullptr);
  p->a->Shutdown();
  p->a->Shutdown();  // idempotent
  CHECK(p->a->Send(p->b_at_a, "x", 1).code() == absl::StatusCode::kUnavailable);
  // Shut down the sender before the receiver (see the test above).
}

TEST_CASE("tcp: exchange on 127.0.0.1 through ofi_rxm", "[fabric]") {
  FabricOptions options = Options("tcp", 4 << 20);
  auto p = OpenPair(options);
  if (p == nullptr) return;  // provider missing; WARN printed
  ExchangeSizes(*p, {1, 4096, 1 << 20, options.max_message_size});
  constexpr int kMessages = 1000;
  for (int i = 0; i < kMessages; ++i) {
    const std::string m = std::to_string(i);
    REQUIRE(p->a->Send(p->b_at_a, m.data(), m.size()).ok());
  }
  REQUIRE(p->inbox_b.WaitFor(kMessages));
  const auto got = p->inbox_b.Take();
  for (int i = 0; i < kMessages; ++i) REQUIRE(got[i] == std::to_string(i));
}

// SendShared(): large messages go out without a copy; the transport drops
// its reference once the send completed, and the bytes arrive intact, in
// order with copied sends.
void ExchangeShared(Pair& p) {
  std::vector<std::string> want;
  for (size_t size : {size_t{100}, size_t{16} << 10, size_t{1} << 20,
                      size_t{3} << 20, size_t{7}}) {
    auto shared = std::make_shared<const std::string>(
        Pattern(size, static_cast<int>(want.size())));
    REQUIRE(p.a->SendShared(p.b_at_a, shared).ok());
    CHECK(shared.use_count() == 1);
    want.push_back(*shared);
    const std::string copied = Pattern(size / 2 + 1, 50);
    REQUIRE(p.a->Send(p.b_at_a, copied.data(), copied.size()).ok());
    want.push_back(copied);
  }
  REQUIRE(p.inbox_b.WaitFor(want.size()));
  const auto got = p.inbox_b.Take();
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    INFO("message " << i);
    CHECK(got[i] == want[i]);
  }
}

TEST_CASE("shm: SendShared sends large messages in place", "[fabric]") {
  auto p = OpenPair(Options("shm", 4 << 20));
  REQUIRE(p != nullptr);
  ExchangeShared(*p);
}

TEST_CASE("tcp: SendShared sends large messages in place", "[fabric]") {
  auto p = OpenPair(Options("tcp", 4 << 20));
  if (p == nullptr) return;  // provider missing; WARN printed
  ExchangeShared(*p);
}

TEST_CASE("shm: without spinning, messages still flow", "[fabric]") {
  FabricOptions options = Options("shm");
  options.spin_us = 0;
  auto p = OpenPair(options);
  REQUIRE(p != nullptr);
  ExchangeSizes(*p, {1, 4096, 1 << 20});
}

TEST_CASE("shm: a sending thread and a handler that sends share the CQ",
          "[fabric]") {
  // b echoes from its handler while a's main thread keeps sending: a's
  // sender reads the completion queue itself and hands the echoes it finds
  // to the progress thread, in order.
  auto p = OpenPair(Options("shm"));
  REQUIRE(p != nullptr);
  Transport* b = p->b.get();
  const PeerId a_at_b = p->a_at_b;
  b->SetReceiveHandler([b, a_at_b](std::string_view m) {
    (void)b->Send(a_at_b, m.data(), m.size());
  });
  constexpr int kMessages = 2000;
  for (int i = 0; i < kMessages; ++i) {
    const std::string m = std::to_string(i);
    REQUIRE(p->a->Send(p->b_at_a, m.data(), m.size()).ok());
  }
  REQUIRE(p->inbox_a.WaitFor(kMessages));
  const auto got = p->inbox_a.Take();
  for (int i = 0; i < kMessages; ++i) REQUIRE(got[i] == std::to_string(i));
}

// --- RMA bulk path and sender identification ---

double Counter(const Transport& t, const std::string& name) {
  const auto c = t.Counters();
  auto it = c.find(name);
  return it == c.end() ? 0 : it->second;
}

// Waits (bounded) until `t`'s counter `name` reaches `value`.
bool WaitForCounter(const Transport& t, const std::string& name, double value) {
  const absl::Time deadline = absl::Now() + kDeliveryBound;
  while (Counter(t, name) < value) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

// Records each message with the sender id the transport reported.
class SourceInbox {
 public:
  Transport::PeerReceiveHandler Handler() {
    return [this](PeerId from, std::string_view m) {
      absl::MutexLock lock(&mu_);
      messages_.emplace_back(from, std::string(m));
    };
  }
  bool WaitFor(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return messages_.size() >= n;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), kDeliveryBound);
  }
  std::vector<std::pair<PeerId, std::string>> Take() {
    absl::MutexLock lock(&mu_);
    return std::move(messages_);
  }

 private:
  absl::Mutex mu_;
  std::vector<std::pair<PeerId, std::string>> messages_ ABSL_GUARDED_BY(mu_);
};

FabricOptions RmaOptions(const std::string& provider) {
  FabricOptions o = Options(provider, 1 << 20);
  o.rma_threshold = 32 << 10;
  o.rma_zone_bytes = 4 << 20;
  return o;
}

// Sends one large message so that a asks b for a landing zone, and waits
// until a holds it. Returns the number of messages b received meanwhile.
size_t OpenZone(Pair& p) {
  const std::string m = Pattern(100 << 10, 9);
  REQUIRE(p.a->Send(p.b_at_a, m.data(), m.size()).ok());
  REQUIRE(WaitForCounter(*p.a, "rma_zones_ready", 1));
  return 1;
}

// Large messages (some by SendShared, some by Send) interleaved with small
// ones: every byte arrives, in send order, each named with its sender.
void RmaRoundTrip(const FabricOptions& options) {
  auto p = OpenPair(options);
  if (p == nullptr) return;  // provider missing; WARN printed
  SourceInbox inbox;
  p->b->SetPeerReceiveHandler(inbox.Handler());
  if (Counter(*p->a, "rma_enabled") == 0) {
    WARN("provider " << options.provider << " offers no RMA here; skipping");
    return;
  }
  const size_t before = OpenZone(*p);
  std::vector<std::string> want;
  const std::vector<size_t> sizes = {
      7,         32 << 10, 100,     1 << 20, 65,       (1 << 20) - 3,
      4096,      50001,    1,       777777,  32 << 10, 200 << 10,
      300 << 10, 3,        1 << 20, 1 << 20, 1 << 20,  1 << 20};
  for (int round = 0; round < 3; ++round) {
    for (size_t i = 0; i < sizes.size(); ++i) {
      const int seed = round * 100 + static_cast<int>(i);
      if ((i + round) % 2 == 0) {
        auto shared =
            std::make_shared<const std::string>(Pattern(sizes[i], seed));
        REQUIRE(p->a->SendShared(p->b_at_a, shared).ok());
        want.push_back(*shared);
      } else {
        const std::string m = Pattern(sizes[i], seed);
        REQUIRE(p->a->Send(p->b_at_a, m.data(), m.size()).ok());
        want.push_back(m);
      }
    }
  }
  REQUIRE(inbox.WaitFor(before + want.size()));
  auto got = inbox.Take();
  REQUIRE(got.size() == before + want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    INFO("message " << i << " of " << want[i].size() << " bytes");
    CHECK(got[before + i].first == p->a_at_b);
    CHECK(got[before + i].second.size() == want[i].size());
    CHECK(got[before + i].second == want[i]);
  }
  CHECK(p->b->PeerName(got.back().first) == "a");
  // Most large messages went by RMA (a few may have found the zone full
  // while credits were on their way back), none was refused.
  CHECK(Counter(*p->a, "rma_messages_sent") >= 10);
  CHECK(Counter(*p->b, "rma_messages_received") ==
        Counter(*p->a, "rma_messages_sent"));
  CHECK(Counter(*p->a, "rma_zones_refused") == 0);
  CHECK(Counter(*p->b, "rma_zones_granted") == 1);
  CHECK(Counter(*p->b, "control_invalid") == 0);
}

TEST_CASE("shm: RMA writes carry large messages, in order with small ones",
          "[fabric][rma]") {
  RmaRoundTrip(RmaOptions("shm"));
}

TEST_CASE("tcp: RMA writes carry large messages, in order with small ones",
          "[fabric][rma]") {
  RmaRoundTrip(RmaOptions("tcp"));
}

// Checks that `sizes` arrive intact and in order at b.
void ExpectPlainDelivery(Pair& p, SourceInbox& inbox) {
  std::vector<std::string> want;
  for (size_t size : {size_t{100} << 10, size_t{5}, size_t{1} << 20}) {
    for (int i = 0; i < 4; ++i) {
      want.push_back(Pattern(size, i));
      REQUIRE(p.a->Send(p.b_at_a, want.back().data(), size).ok());
    }
  }
  REQUIRE(inbox.WaitFor(want.size()));
  const auto got = inbox.Take();
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < want.size(); ++i) CHECK(got[i].second == want[i]);
}

TEST_CASE("shm: with RMA off, large messages go as messages", "[fabric][rma]") {
  FabricOptions options = RmaOptions("shm");
  options.use_rma = false;
  auto p = OpenPair(options);
  REQUIRE(p != nullptr);
  SourceInbox inbox;
  p->b->SetPeerReceiveHandler(inbox.Handler());
  CHECK(Counter(*p->a, "rma_enabled") == 0);
  ExpectPlainDelivery(*p, inbox);
  CHECK(Counter(*p->a, "rma_messages_sent") == 0);
  CHECK(Counter(*p->b, "rma_zones_granted") == 0);
}

TEST_CASE("shm: a receiver with RMA off refuses a zone; messages still flow",
          "[fabric][rma]") {
  FabricOptions on = RmaOptions("shm");
  FabricOptions off = on;
  off.use_rma = false;
  auto a = OpenFabricTransport(on);
  REQUIRE(a.ok());
  auto b = OpenFabricTransport(off);
  REQUIRE(b.ok());
  SourceInbox inbox;
  (*b)->SetPeerReceiveHandler(inbox.Handler());
  (*a)->SetReceiveHandler([](std::string_view) {});
  Pair p;
  p.a = std::move(*a);
  p.b = std::move(*b);
  p.b_at_a = *p.a->AddPeer("b", p.b->LocalAddress());
  p.a_at_b = *p.b->AddPeer("a", p.a->LocalAddress());
  ExpectPlainDelivery(p, inbox);
  if (Counter(*p.a, "rma_enabled") == 0) return;  // no RMA on this host
  REQUIRE(WaitForCounter(*p.a, "rma_zones_refused", 1));
  ExpectPlainDelivery(p, inbox);
  CHECK(Counter(*p.a, "rma_messages_sent") == 0);
  CHECK(Counter(*p.b, "rma_zones_granted") == 0);
  p.a->Shutdown();
  p.b->Shutdown();
}

TEST_CASE("shm: a full landing zone falls back to messages, order kept",
          "[fabric][rma]") {
  FabricOptions options = RmaOptions("shm");
  options.rma_zone_bytes = 0;  // the zone is max_message_size: 1 MiB
  options.send_timeout_ms = 60000;
  auto p = OpenPair(options);
  REQUIRE(p != nullptr);
  if (Counter(*p->a, "rma_enabled") == 0) {
    WARN("no RMA on this host; skipping");
    return;
  }
  // b's handler holds the first 700 KiB message until released, so its
  // zone space is not credited back.
  absl::Mutex mu;
  bool release = false;
  std::vector<std::string> got;
  p->b->SetReceiveHandler([&](std::string_view m) {
    absl::MutexLock lock(&mu);
    got.emplace_back(m);
    if (m.size() == (700 << 10)) {
      mu.Await(absl::Condition(&release));
    }
  });
  {
    // The zone handshake (its message is delivered; b is not blocked yet).
    const std::string m = Pattern(100 << 10, 1);
    REQUIRE(p->a->Send(p->b_at_a, m.data(), m.size()).ok());
    REQUIRE(WaitForCounter(*p->a, "rma_zones_ready", 1));
  }
  const double sent_before = Counter(*p->a, "rma_messages_sent");
  const std::string first = Pattern(700 << 10, 2);
  REQUIRE(p->a->Send(p->b_at_a, first.data(), first.size()).ok());
  CHECK(Counter(*p->a, "rma_messages_sent") == sent_before + 1);
  // The second does not fit beside the first: it goes as a message, which
  // may need b's progress to complete, so from another thread.
  const std::string second = Pattern(700 << 10, 3);
  auto sent = std::async(std::launch::async, [&] {
    return p->a->Send(p->b_at_a, second.data(), second.size());
  });
  REQUIRE(WaitForCounter(*p->a, "rma_fallback_zone_full", 1));
  {
    absl::MutexLock lock(&mu);
    release = true;
  }
  REQUIRE(sent.get().ok());
  const std::string third = Pattern(300 << 10, 4);
  REQUIRE(p->a->Send(p->b_at_a, third.data(), third.size()).ok());
  absl::MutexLock lock(&mu);
  auto all = [&]() { return got.size() >= 4; };
  REQUIRE(mu.AwaitWithTimeout(absl::Condition(&all), kDeliveryBound));
  REQUIRE(got.size() == 4);
  CHECK(got[1] == first);
  CHECK(got[2] == second);
  CHECK(got[3] == third);
}

TEST_CASE("shm: the receive handler names the sender", "[fabric]") {
  FabricOptions options = Options("shm");
  SECTION("one endpoint (RMA on)") { options.use_rma = true; }
  SECTION("a send endpoint per peer") { options.use_rma = false; }
  SECTION("one endpoint, RMA off") {
    options.use_rma = false;
    options.send_endpoint_per_peer = false;
  }
  auto p = OpenPair(options);
  REQUIRE(p != nullptr);
  SourceInbox inbox;
  p->b->SetPeerReceiveHandler(inbox.Handler());
  auto c = OpenFabricTransport(options);
  REQUIRE(c.ok());
  auto b_at_c = (*c)->AddPeer("b", p->b->LocalAddress());
  REQUIRE(b_at_c.ok());
  REQUIRE(p->a->Send(p->b_at_a, "from a", 6).ok());
  REQUIRE((*c)->Send(*b_at_c, "from c", 6).ok());
  REQUIRE(inbox.WaitFor(2));
  auto got = inbox.Take();
  REQUIRE(got.size() == 2);
  if (Counter(*p->b, "messages_unknown_source") == 0 &&
      got[0].first == kUnknownPeer) {
    WARN("provider reports no source addresses; skipping");
    return;
  }
  std::sort(got.begin(), got.end(),
            [](const auto& x, const auto& y) { return x.second < y.second; });
  CHECK(got[0].second == "from a");
  CHECK(got[0].first == p->a_at_b);
  CHECK(p->b->PeerName(got[0].first) == "a");
  // c was never added at b.
  CHECK(got[1].first == kUnknownPeer);
  CHECK(p->b->PeerName(kUnknownPeer) == "unknown peer");
  CHECK(p->b->PeerName(12345) == "peer #12345");
  // Once added, c is named.
  auto c_at_b = p->b->AddPeer("c", (*c)->LocalAddress());
  REQUIRE(c_at_b.ok());
  REQUIRE((*c)->Send(*b_at_c, "again", 5).ok());
  REQUIRE(inbox.WaitFor(1));
  got = inbox.Take();
  CHECK(got[0].first == *c_at_b);
  CHECK(p->b->PeerName(*c_at_b) == "c");
  (*c)->Shutdown();
}

// A handler that keeps every large message past its return (ReceivedBytes):
// the first half of the receive buffers are held, the rest copied.
class HoldingInbox {
 public:
  explicit HoldingInbox(Transport** transport) : transport_(transport) {}
  Transport::ReceiveHandler Handler() {
    return [this](std::string_view m) {
      ReceivedBytes bytes(*transport_, m);
      absl::MutexLock lock(&mu_);
      messages_.push_back(std::move(bytes));
    };
  }
  bool WaitFor(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return messages_.size() >= n;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), kDeliveryBound);
  }
  std::vector<ReceivedBytes> Take() {
    absl::MutexLock lock(&mu_);
    return std::move(messages_);
  }

 private:
  Transport** transport_;
  absl::Mutex mu_;
  std::vector<ReceivedBytes> messages_ ABSL_GUARDED_BY(mu_);
};

TEST_CASE("shm: a handler holds large messages in their receive buffers",
          "[fabric]") {
  FabricOptions options = Options("shm");
  options.receive_buffers = 8;
  options.use_rma = false;  // as the daemons run shm (RmaPays)
  auto p = OpenPair(options);
  REQUIRE(p != nullptr);
  Transport* b = p->b.get();
  HoldingInbox inbox(&b);
  p->b->SetReceiveHandler(inbox.Handler());
  constexpr size_t kSize = 100 << 10;
  // 12 large messages: 4 held (half the buffers), 8 copied; then a small
  // one, always copied.
  std::vector<std::string> sent;
  for (int i = 0; i < 12; ++i) {
    sent.push_back(Pattern(kSize, i));
    REQUIRE(p->a->Send(p->b_at_a, sent.back().data(), kSize).ok());
  }
  sent.push_back("small");
  REQUIRE(p->a->Send(p->b_at_a, "small", 5).ok());
  REQUIRE(inbox.WaitFor(sent.size()));
  std::vector<ReceivedBytes> got = inbox.Take();
  REQUIRE(got.size() == sent.size());
  int held = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("message " << i);
    CHECK(got[i].view() == sent[i]);
    held += got[i].held() ? 1 : 0;
  }
  CHECK(held == 4);
  CHECK(got.back().held() == false);
  CHECK(Counter(*p->b, "messages_held") == 4);
  // Released, the buffers return: the next messages are held again, and
  // the held bytes were never overwritten meanwhile.
  got.clear();
  for (int round = 0; round < 3; ++round) {
    REQUIRE(WaitForCounter(*p->b, "holds_returned", 4 + 4 * round));
    std::vector<std::string> more;
    for (int i = 0; i < 4; ++i) {
      more.push_back(Pattern(kSize, 50 + 4 * round + i));
      REQUIRE(p->a->Send(p->b_at_a, more.back().data(), kSize).ok());
    }
    REQUIRE(inbox.WaitFor(more.size()));
    got = inbox.Take();
    REQUIRE(got.size() == more.size());
    for (size_t i = 0; i < got.size(); ++i) {
      CHECK(got[i].held());
      CHECK(got[i].view() == more[i]);
    }
    got.clear();
  }
  CHECK(Counter(*p->b, "messages_held") == 16);
}

TEST_CASE("shm: a held message outlives its transport", "[fabric]") {
  FabricOptions options = Options("shm");
  options.use_rma = false;
  auto p = OpenPair(options);
  REQUIRE(p != nullptr);
  Transport* b = p->b.get();
  HoldingInbox inbox(&b);
  p->b->SetReceiveHandler(inbox.Handler());
  const std::string big = Pattern(64 << 10, 3);
  REQUIRE(p->a->Send(p->b_at_a, big.data(), big.size()).ok());
  REQUIRE(inbox.WaitFor(1));
  std::vector<ReceivedBytes> got = inbox.Take();
  REQUIRE(got.size() == 1);
  REQUIRE(got[0].held());
  p->b->Shutdown();
  p->b.reset();
  CHECK(got[0].view() == big);
  got.clear();  // releases into a closed transport: nothing to re-post
}

// --- Asynchronous sends and failed peers ---

// Asynchronous sends of every size class (injected, copied, in place, and
// by RMA where the options allow) interleaved with synchronous ones from
// one thread: everything arrives in call order, and each callback runs
// exactly once, with OK.
void AsyncKeepsOrder(const FabricOptions& options) {
  auto p = OpenPair(options);
  if (p == nullptr) return;  // provider missing; WARN printed
  AsyncOutcomes outcomes;
  const std::vector<size_t> sizes = {7,         100 << 10, 4096,  20 << 10,
                                     1 << 20,   4097,      1,     300 << 10,
                                     (1 << 20), 64,        50001, 16 << 10};
  std::vector<std::string> want;
  size_t async_sends = 0;
  for (int round = 0; round < 20; ++round) {
    for (size_t i = 0; i < sizes.size(); ++i) {
      auto m = std::make_shared<const std::string>(
          Pattern(sizes[i], round * 100 + static_cast<int>(i)));
      want.push_back(*m);
      if ((i + round) % 3 == 0) {
        REQUIRE(p->a->SendShared(p->b_at_a, m).ok());
      } else {
        const size_t slot = async_sends++;
        const absl::Status s =
            p->a->SendSharedAsync(p->b_at_a, m, outcomes.Callback(slot));
        INFO(s);
        REQUIRE(s.ok());
      }
    }
  }
  REQUIRE(p->inbox_b.WaitFor(want.size()));
  REQUIRE(outcomes.WaitFor(static_cast<int>(async_sends)));
  const auto got = p->inbox_b.Take();
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    INFO("message " << i << " of " << want[i].size() << " bytes");
    REQUIRE(got[i] == want[i]);
  }
  for (size_t i = 0; i < async_sends; ++i) {
    INFO("async send " << i << ": " << outcomes.status(i));
    CHECK(outcomes.calls(i) == 1);
    CHECK(outcomes.status(i).ok());
  }
  CHECK(outcomes.total() == static_cast<int>(async_sends));
  CHECK(Counter(*p->a, "async_sends_in_flight") == 0);
}

TEST_CASE("shm: asynchronous sends keep their order with synchronous ones",
          "[fabric][async]") {
  FabricOptions options = Options("shm", 1 << 20);
  SECTION("no RMA (the daemons' setting)") { options.use_rma = false; }
  SECTION("RMA (a write must complete before its notice)") {
    options = RmaOptions("shm");
  }
  AsyncKeepsOrder(options);
}

TEST_CASE("tcp: asynchronous sends keep their order with synchronous ones",
          "[fabric][async]") {
  FabricOptions options = Options("tcp", 1 << 20);
  SECTION("RMA (the daemons' setting)") { options = RmaOptions("tcp"); }
  SECTION("no RMA") { options.use_rma = false; }
  AsyncKeepsOrder(options);
}

TEST_CASE("shm: asynchronous sends refuse bad arguments without a callback",
          "[fabric][async]") {
  auto p = OpenPair(Options("shm"));
  REQUIRE(p != nullptr);
  AsyncOutcomes outcomes;
  auto m = std::make_shared<const std::string>("x");
  CHECK(
      p->a->SendSharedAsync(p->b_at_a, nullptr, outcomes.Callback(0)).code() ==
      absl::StatusCode::kInvalidArgument);
  CHECK(p->a->SendSharedAsync(p->b_at_a, m, nullptr).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(p->a->SendSharedAsync(77, m, outcomes.Callback(0)).code() ==
        absl::StatusCode::kInvalidArgument);
  auto big = std::make_shared<const std::string>((1 << 20) + 1, 'b');
  CHECK(p->a->SendSharedAsync(p->b_at_a, big, outcomes.Callback(0)).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(p->a->FailPeer(77, absl::UnavailableError("x")).code() ==
        absl::StatusCode::kInvalidArgument);
  p->a->Shutdown();
  CHECK(p->a->SendSharedAsync(p->b_at_a, m, outcomes.Callback(0)).code() ==
        absl::StatusCode::kUnavailable);
  CHECK(outcomes.total() == 0);
}

TEST_CASE("shm and tcp: a failed peer's sends fail at once until re-added",
          "[fabric][async]") {
  const std::string provider = GENERATE("shm", "tcp");
  INFO(provider);
  auto p = OpenPair(Options(provider));
  if (p == nullptr) return;  // provider missing; WARN printed
  REQUIRE(p->a->FailPeer(p->b_at_a, absl::UnavailableError(
                                        "GPU rank 3 was removed from the "
                                        "cluster"))
              .ok());
  for (size_t size : {size_t{10}, size_t{200} << 10}) {
    const std::string m(size, 'f');
    const absl::Status s = p->a->Send(p->b_at_a, m.data(), m.size());
    INFO(s);
    CHECK(s.code() == absl::StatusCode::kUnavailable);
    CHECK(std::string(s.message()).find("GPU rank 3 was removed") !=
          std::string::npos);
    CHECK(std::string(s.message()).find("'b'") != std::string::npos);
    AsyncOutcomes outcomes;
    const absl::Status a =
        p->a->SendSharedAsync(p->b_at_a, std::make_shared<const std::string>(m),
                              outcomes.Callback(0));
    CHECK(a.code() == absl::StatusCode::kUnavailable);
    CHECK(outcomes.total() == 0);
  }
  // Added again: usable.
  auto again = p->a->AddPeer("b", p->b->LocalAddress());
  REQUIRE(again.ok());
  REQUIRE(*again == p->b_at_a);
  ExchangeSizes(*p, {1, 100 << 10});
}

// b, a forked child that received one message from c and was then
// SIGKILLed; c is this process's endpoint, with b added as peer "b".
struct KilledPeer {
  std::unique_ptr<Transport> c;
  PeerId b = kUnknownPeer;
  std::string b_address;
};

KilledPeer OpenKilledPeer(const FabricOptions& options) {
  int to_parent[2], to_child[2];
  REQUIRE(pipe(to_parent) == 0);
  REQUIRE(pipe(to_child) == 0);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    close(to_parent[0]);
    close(to_child[1]);
    Inbox inbox;
    auto t = OpenFabricTransport(options);
    if (!t.ok()) _exit(3);
    (*t)->SetReceiveHandler(inbox.Handler());
    if (!WriteString(to_parent[1], (*t)->LocalAddress())) _exit(5);
    if (!inbox.WaitFor(1)) _exit(7);
    if (!WriteString(to_parent[1], "ready")) _exit(8);
    char never;
    [[maybe_unused]] ssize_t n = read(to_child[0], &never, 1);
    _exit(0);
  }
  close(to_parent[1]);
  close(to_child[0]);
  KilledPeer k;
  auto c = OpenFabricTransport(options);
  REQUIRE(c.ok());
  k.c = std::move(*c);
  REQUIRE(ReadString(to_parent[0], &k.b_address));
  auto b = k.c->AddPeer("b", k.b_address);
  REQUIRE(b.ok());
  k.b = *b;
  const std::string hello = Pattern(1 << 20, 1);
  REQUIRE(k.c->Send(k.b, hello.data(), hello.size()).ok());
  std::string ready;
  REQUIRE(ReadString(to_parent[0], &ready));
  REQUIRE(ready == "ready");
  REQUIRE(kill(child, SIGKILL) == 0);
  int wstatus = 0;
  REQUIRE(waitpid(child, &wstatus, 0) == child);
  REQUIRE(WIFSIGNALED(wstatus));
  RemoveShmRegionsOf(child);
  close(to_parent[0]);
  close(to_child[1]);
  return k;
}

// Posts asynchronous sends over the inject size to the dead peer; returns
// how many were posted (the others failed at once, with UNAVAILABLE).
size_t PostToDeadPeer(KilledPeer& k, AsyncOutcomes& outcomes) {
  size_t posted = 0;
  for (size_t size : {size_t{4097}, size_t{1} << 20, size_t{64} << 10}) {
    const absl::Status s = k.c->SendSharedAsync(
        k.b, std::make_shared<const std::string>(size, 'd'),
        outcomes.Callback(posted));
    INFO(s);
    if (s.ok()) {
      ++posted;
    } else {
      CHECK(s.code() == absl::StatusCode::kUnavailable);
    }
  }
  return posted;
}

TEST_CASE("shm: asynchronous sends to a killed peer end once, with an error",
          "[fabric][async][dead-peer]") {
  FabricOptions options = Options("shm", 2 << 20);
  options.use_rma = RmaPays("shm");
  SECTION("the send timeout passes") {
    options.send_timeout_ms = 500;
    KilledPeer k = OpenKilledPeer(options);
    AsyncOutcomes outcomes;
    const size_t posted = PostToDeadPeer(k, outcomes);
    REQUIRE(outcomes.WaitFor(static_cast<int>(posted)));
    for (size_t i = 0; i < posted; ++i) {
      const absl::Status s = outcomes.status(i);
      INFO(s);
      CHECK(outcomes.calls(i) == 1);
      // Where the provider completes a send to the dead peer it is OK;
      // otherwise the timeout names the peer.
      if (!s.ok()) {
        CHECK(s.code() == absl::StatusCode::kUnavailable);
        CHECK(std::string(s.message()).find("'b'") != std::string::npos);
      }
    }
    k.c->Shutdown();
    CHECK(outcomes.total() == static_cast<int>(posted));
  }
  SECTION("the transport shuts down first") {
    options.send_timeout_ms = 600000;  // only Shutdown() can end them
    KilledPeer k = OpenKilledPeer(options);
    AsyncOutcomes outcomes;
    const size_t posted = PostToDeadPeer(k, outcomes);
    k.c->Shutdown();
    REQUIRE(outcomes.WaitFor(static_cast<int>(posted)));
    for (size_t i = 0; i < posted; ++i) {
      const absl::Status s = outcomes.status(i);
      INFO(s);
      CHECK(outcomes.calls(i) == 1);
      CHECK((s.ok() || s.code() == absl::StatusCode::kUnavailable));
    }
    CHECK(outcomes.total() == static_cast<int>(posted));
  }
}

TEST_CASE("shm: FailPeer ends sends blocked on a killed peer at once",
          "[fabric][async][dead-peer]") {
  FabricOptions options = Options("shm", 2 << 20);
  options.use_rma = RmaPays("shm");
  // Only FailPeer() can end the sends within the test's bound.
  options.send_timeout_ms = 600000;
  KilledPeer k = OpenKilledPeer(options);
  AsyncOutcomes outcomes;
  const size_t posted = PostToDeadPeer(k, outcomes);
  Transport* c = k.c.get();
  const PeerId b = k.b;
  auto blocked = std::async(std::launch::async, [c, b] {
    const std::string m(1 << 20, 's');
    return c->Send(b, m.data(), m.size());
  });
  // Whether the send is blocked yet or not, it must end with the reason.
  absl::SleepFor(absl::Milliseconds(100));
  const std::string reason = "GPU rank 2 was removed from the cluster";
  REQUIRE(c->FailPeer(b, absl::UnavailableError(reason)).ok());
  REQUIRE(blocked.wait_for(std::chrono::seconds(60)) ==
          std::future_status::ready);
  const absl::Status s = blocked.get();
  INFO(s);
  CHECK(s.code() == absl::StatusCode::kUnavailable);
  CHECK(std::string(s.message()).find(reason) != std::string::npos);
  REQUIRE(outcomes.WaitFor(static_cast<int>(posted)));
  for (size_t i = 0; i < posted; ++i) {
    const absl::Status a = outcomes.status(i);
    INFO(a);
    CHECK(outcomes.calls(i) == 1);
    if (!a.ok()) {
      CHECK(std::string(a.message()).find(reason) != std::string::npos);
    }
  }
  // Later sends fail at once.
  const absl::Status later = c->Send(b, "x", 1);
  CHECK(std::string(later.message()).find(reason) != std::string::npos);
  // Added again, the peer is sent to again (an injected message is taken
  // into the dead peer's queue or refused by the provider, not by FailPeer).
  REQUIRE(c->AddPeer("b", k.b_address).ok());
  const absl::Status again = c->Send(b, "x", 1);
  INFO(again);
  CHECK(std::string(again.message()).find(reason) == std::string::npos);
  c->Shutdown();
  CHECK(outcomes.total() == static_cast<int>(posted));
}

TEST_CASE("fake transport: ReceivedBytes copies", "[fabric]") {
  FakeFabric fabric;
  auto t = fabric.NewEndpoint("x");
  CHECK(t->HoldMessage() == nullptr);
  const std::string big(1 << 20, 'x');
  ReceivedBytes bytes(t.get(), big);
  CHECK_FALSE(bytes.held());
  CHECK(bytes.view() == big);
  // A large copy's buffer returns to the pool and serves the next one.
  const char* first = bytes.view().data();
  bytes = ReceivedBytes();
  const std::string other(300 << 10, 'y');
  ReceivedBytes again(t.get(), other);
  CHECK(again.view() == other);
  CHECK(again.view().data() == first);
  // Several at once each get a buffer of their own, and the pool keeps at
  // most kPooledCopyBuffers of them; small messages are copied on their own.
  const size_t n = ReceivedBytes::kPooledCopyBuffers + 4;
  auto text = [](size_t i) {
    return std::string(20 << 10, char('a' + i % 26));
  };
  std::vector<ReceivedBytes> many;
  for (size_t i = 0; i < n; ++i) many.emplace_back(t.get(), text(i));
  many.emplace_back(t.get(), "small");
  CHECK(ReceivedBytes::FreeCopyBuffers() == 0);
  for (size_t i = 0; i < n; ++i) CHECK(many[i].view() == text(i));
  CHECK(many.back().view() == "small");
  many.clear();
  CHECK(ReceivedBytes::FreeCopyBuffers() == ReceivedBytes::kPooledCopyBuffers);
  // Nor more than kPooledCopyBytes in all: a buffer that would exceed it is
  // freed.
  many.emplace_back(t.get(), std::string(40 << 10, 'p'));
  CHECK(ReceivedBytes::FreeCopyBuffers() ==
        ReceivedBytes::kPooledCopyBuffers - 1);
  {
    ReceivedBytes huge(t.get(),
                       std::string(ReceivedBytes::kPooledCopyBytes, 'z'));
    CHECK(huge.view().size() == ReceivedBytes::kPooledCopyBytes);
  }
  CHECK(ReceivedBytes::FreeCopyBuffers() ==
        ReceivedBytes::kPooledCopyBuffers - 2);
}

}  // namespace
}  // namespace karat
