// Per-principal quotas of the client API (docs/security.md "Quotas"): what
// each caller of the coordinator holds (open sessions, turns running or
// queued, KV bytes of its placed sessions, its session-creation token
// bucket) and whether a request stays within its cluster::ClientLimits
// (0: not limited). The decisions are pure: every method takes the time it
// needs, nothing reads a clock. Not thread-safe (State::mu_ guards it).
//
// Usage (the handlers, under the state's lock):
//   RETURN_IF_ERROR(book.OpenSession(caller.principal, caller.limits, now));
//   ...
//   book.CloseSession(owner, session_id);
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "cluster.pb.h"

namespace karat::coordinator {

// What a refusal was about (GetClusterStatus.stats "quota_refusals_<name>").
enum class QuotaKind { kSessions, kSessionRate, kConcurrentTurns, kKvBytes };
inline constexpr QuotaKind kQuotaKinds[] = {
    QuotaKind::kSessions, QuotaKind::kSessionRate, QuotaKind::kConcurrentTurns,
    QuotaKind::kKvBytes};
// "sessions", "session_rate", "concurrent_turns", "kv_bytes".
const char* QuotaKindName(QuotaKind kind);

class QuotaBook {
 public:
  // CreateSession at `now`: counts one more open session of `principal`
  // and takes a token of its bucket, when it is under max_sessions and
  // its bucket (sessions_per_second, session_burst >= 1) holds a token.
  // Otherwise RESOURCE_EXHAUSTED naming the limit (the rate's message says
  // "retry after N ms"), nothing taken, and the refusal counted.
  absl::Status OpenSession(const std::string& principal,
                           const cluster::ClientLimits& limits, absl::Time now);
  // Counts an open session without a check (one restored from the
  // write-ahead log at start).
  void AddSession(const std::string& principal);
  // The session is gone (closed, or its creation failed after
  // OpenSession): one open session less, its KV bytes no longer counted.
  void CloseSession(const std::string& principal,
                    const std::string& session_id);

  // A turn (Generate) starts running or queued: counted when under
  // max_concurrent_turns, else RESOURCE_EXHAUSTED (counted as refused).
  absl::Status StartTurn(const std::string& principal,
                         const cluster::ClientLimits& limits);
  void EndTurn(const std::string& principal);

  // Whether `principal`'s sessions may hold `bytes` of KV in session
  // `session_id` (its other sessions as recorded): RESOURCE_EXHAUSTED
  // naming max_kv_bytes (the refusal counted) when the total would exceed
  // it. Records nothing.
  absl::Status CheckKv(const std::string& principal,
                       const cluster::ClientLimits& limits,
                       const std::string& session_id, int64_t bytes);
  // Records the KV bytes session `session_id` holds on its home (0: none,
  // e.g. its KV was freed).
  void SetKv(const std::string& principal, const std::string& session_id,
             int64_t bytes);

  int open_sessions(const std::string& principal) const;
  int turns(const std::string& principal) const;
  int64_t kv_bytes(const std::string& principal) const;
  int64_t refusals(QuotaKind kind) const;

 private:
  struct Principal {
    int sessions = 0;
    int turns = 0;
    std::map<std::string, int64_t> kv;  // by session id; no zeros
    int64_t kv_total = 0;
    // The session-creation bucket: tokens at `bucket_at` (full at first).
    bool bucket_started = false;
    double bucket_tokens = 0;
    absl::Time bucket_at;
  };
  absl::Status Refuse(QuotaKind kind, std::string message);
  const Principal* Find(const std::string& principal) const;

  std::map<std::string, Principal> principals_;
  int64_t refusals_[std::size(kQuotaKinds)] = {};
};

// How a principal is named in quota messages: client "NAME", or "the
// anonymous client" (plaintext mode).
std::string QuotaWho(const std::string& principal);

}  // namespace karat::coordinator
