// The quota book (coordinator/quota.h) on hand-made sequences: each limit,
// its message, what a refusal leaves, and that principals are counted
// apart.
#include "coordinator/quota.h"

#include <catch2/catch.hpp>
#include <string>

namespace karat::coordinator {
namespace {

namespace cl = ::karat::cluster;

const absl::Time kT0 = absl::FromUnixSeconds(1000);

std::string Message(const absl::Status& s) { return std::string(s.message()); }

TEST_CASE("quota: max_sessions counts open sessions per principal") {
  QuotaBook book;
  cl::ClientLimits limits;
  limits.set_max_sessions(2);
  REQUIRE(book.OpenSession("alice", limits, kT0).ok());
  REQUIRE(book.OpenSession("alice", limits, kT0).ok());
  absl::Status third = book.OpenSession("alice", limits, kT0);
  CHECK(third.code() == absl::StatusCode::kResourceExhausted);
  CHECK(Message(third) ==
        "client \"alice\" has 2 open sessions, its max_sessions limit (2); "
        "close one (CloseSession) before creating another");
  CHECK(book.refusals(QuotaKind::kSessions) == 1);
  CHECK(book.open_sessions("alice") == 2);
  // Another principal has a count of its own.
  CHECK(book.OpenSession("bob", limits, kT0).ok());
  // A close makes room; a restored session counts without a check.
  book.CloseSession("alice", "s-1");
  CHECK(book.OpenSession("alice", limits, kT0).ok());
  book.AddSession("alice");
  CHECK(book.open_sessions("alice") == 3);
  CHECK_FALSE(book.OpenSession("alice", limits, kT0).ok());
  // 0: not limited; the anonymous principal is named as such.
  cl::ClientLimits none;
  for (int i = 0; i < 100; ++i) REQUIRE(book.OpenSession("", none, kT0).ok());
  limits.set_max_sessions(100);
  CHECK(Message(book.OpenSession("", limits, kT0))
            .rfind("the anonymous client has 100 open sessions", 0) == 0);
}

TEST_CASE("quota: sessions_per_second is a token bucket of session_burst") {
  QuotaBook book;
  cl::ClientLimits limits;
  limits.set_sessions_per_second(2);
  limits.set_session_burst(3);
  // A full bucket: a burst of 3, then one every 500 ms.
  for (int i = 0; i < 3; ++i) REQUIRE(book.OpenSession("a", limits, kT0).ok());
  absl::Status refused = book.OpenSession("a", limits, kT0);
  CHECK(refused.code() == absl::StatusCode::kResourceExhausted);
  CHECK(Message(refused) ==
        "client \"a\" creates sessions faster than its sessions_per_second "
        "limit (2 per second, bursts of 3); retry after 500 ms");
  // A refusal takes nothing: the wait shrinks with the time.
  CHECK(Message(book.OpenSession("a", limits, kT0 + absl::Milliseconds(200)))
            .find("retry after 300 ms") != std::string::npos);
  REQUIRE(book.OpenSession("a", limits, kT0 + absl::Milliseconds(500)).ok());
  CHECK_FALSE(
      book.OpenSession("a", limits, kT0 + absl::Milliseconds(500)).ok());
  CHECK(book.refusals(QuotaKind::kSessionRate) == 3);
  // A long pause refills the bucket to its burst, no more.
  const absl::Time later = kT0 + absl::Seconds(60);
  for (int i = 0; i < 3; ++i)
    REQUIRE(book.OpenSession("a", limits, later).ok());
  CHECK_FALSE(book.OpenSession("a", limits, later).ok());
  // Each principal has its own bucket.
  CHECK(book.OpenSession("b", limits, later).ok());
}

TEST_CASE("quota: a burst below 1 is 1, and max_sessions is checked first") {
  QuotaBook book;
  cl::ClientLimits limits;
  limits.set_sessions_per_second(0.5);  // session_burst unset: 1
  REQUIRE(book.OpenSession("a", limits, kT0).ok());
  CHECK(Message(book.OpenSession("a", limits, kT0))
            .find("bursts of 1); retry after 2000 ms") != std::string::npos);
  limits.set_max_sessions(1);
  // At max_sessions the bucket is not touched: a close frees the way at once
  // once the bucket has a token again.
  absl::Status full = book.OpenSession("a", limits, kT0 + absl::Seconds(2));
  CHECK(Message(full).find("max_sessions") != std::string::npos);
  book.CloseSession("a", "s-1");
  CHECK(book.OpenSession("a", limits, kT0 + absl::Seconds(2)).ok());
}

TEST_CASE("quota: max_concurrent_turns counts running and queued turns") {
  QuotaBook book;
  cl::ClientLimits limits;
  limits.set_max_concurrent_turns(2);
  REQUIRE(book.StartTurn("a", limits).ok());
  REQUIRE(book.StartTurn("a", limits).ok());
  absl::Status third = book.StartTurn("a", limits);
  CHECK(third.code() == absl::StatusCode::kResourceExhausted);
  CHECK(Message(third) ==
        "client \"a\" has 2 turns running or queued, its max_concurrent_turns "
        "limit (2); retry once one of them has ended");
  CHECK(book.turns("a") == 2);
  CHECK(book.StartTurn("b", limits).ok());
  book.EndTurn("a");
  CHECK(book.StartTurn("a", limits).ok());
  CHECK(book.refusals(QuotaKind::kConcurrentTurns) == 1);
  // Never below zero.
  for (int i = 0; i < 5; ++i) book.EndTurn("a");
  CHECK(book.turns("a") == 0);
}

TEST_CASE("quota: max_kv_bytes over the principal's placed sessions") {
  QuotaBook book;
  cl::ClientLimits limits;
  limits.set_max_kv_bytes(1000);
  REQUIRE(book.CheckKv("a", limits, "s-1", 600).ok());
  book.SetKv("a", "s-1", 600);
  // The session's own bytes are replaced, not added.
  CHECK(book.CheckKv("a", limits, "s-1", 1000).ok());
  absl::Status over = book.CheckKv("a", limits, "s-2", 500);
  CHECK(over.code() == absl::StatusCode::kResourceExhausted);
  CHECK(Message(over) ==
        "the turn would bring the KV of client \"a\"'s sessions to 1100 bytes "
        "(500 of them this session's), over its max_kv_bytes limit (1000); "
        "close sessions, or shorten the turn (prompt and max_new_tokens)");
  CHECK(book.refusals(QuotaKind::kKvBytes) == 1);
  CHECK(book.kv_bytes("a") == 600);  // a check records nothing
  CHECK(book.CheckKv("a", limits, "s-2", 400).ok());
  book.SetKv("a", "s-2", 400);
  CHECK(book.kv_bytes("a") == 1000);
  // Other principals are not counted.
  CHECK(book.CheckKv("b", limits, "s-3", 1000).ok());
  // Freed KV (0) and closed sessions leave the count.
  book.SetKv("a", "s-1", 0);
  CHECK(book.kv_bytes("a") == 400);
  book.AddSession("a");
  book.CloseSession("a", "s-2");
  CHECK(book.kv_bytes("a") == 0);
  // 0: not limited.
  CHECK(book.CheckKv("a", cl::ClientLimits(), "s-9", int64_t{1} << 50).ok());
}

}  // namespace
}  // namespace karat::coordinator
