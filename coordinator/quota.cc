#include "coordinator/quota.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace karat::coordinator {

const char* QuotaKindName(QuotaKind kind) {
  switch (kind) {
    case QuotaKind::kSessions:
      return "sessions";
    case QuotaKind::kSessionRate:
      return "session_rate";
    case QuotaKind::kConcurrentTurns:
      return "concurrent_turns";
    case QuotaKind::kKvBytes:
      return "kv_bytes";
  }
  return "unknown";
}

std::string QuotaWho(const std::string& principal) {
  return principal.empty() ? std::string("the anonymous client")
                           : absl::StrCat("client \"", principal, "\"");
}

absl::Status QuotaBook::Refuse(QuotaKind kind, std::string message) {
  refusals_[static_cast<int>(kind)]++;
  return absl::ResourceExhaustedError(std::move(message));
}

const QuotaBook::Principal* QuotaBook::Find(
    const std::string& principal) const {
  auto it = principals_.find(principal);
  return it == principals_.end() ? nullptr : &it->second;
}

absl::Status QuotaBook::OpenSession(const std::string& principal,
                                    const cluster::ClientLimits& limits,
                                    absl::Time now) {
  Principal& p = principals_[principal];
  if (limits.max_sessions() > 0 && p.sessions >= limits.max_sessions()) {
    return Refuse(
        QuotaKind::kSessions,
        absl::StrCat(QuotaWho(principal), " has ", p.sessions,
                     " open sessions, its max_sessions limit (",
                     limits.max_sessions(),
                     "); close one (CloseSession) before creating another"));
  }
  const double rate = limits.sessions_per_second();
  if (rate > 0 && std::isfinite(rate)) {
    const double burst = std::max(1, limits.session_burst());
    double tokens = burst;
    if (p.bucket_started) {
      const double elapsed =
          std::max(0.0, absl::ToDoubleSeconds(now - p.bucket_at));
      tokens = std::min(burst, p.bucket_tokens + rate * elapsed);
    }
    if (tokens < 1.0) {
      const int64_t wait_ms = std::max<int64_t>(
          1, int64_t(std::ceil((1.0 - tokens) / rate * 1000.0)));
      return Refuse(
          QuotaKind::kSessionRate,
          absl::StrCat(QuotaWho(principal),
                       " creates sessions faster than its sessions_per_second "
                       "limit (",
                       rate, " per second, bursts of ", burst,
                       "); retry after ", wait_ms, " ms"));
    }
    p.bucket_started = true;
    p.bucket_tokens = tokens - 1.0;
    p.bucket_at = now;
  }
  p.sessions++;
  return absl::OkStatus();
}

void QuotaBook::AddSession(const std::string& principal) {
  principals_[principal].sessions++;
}

void QuotaBook::CloseSession(const std::string& principal,
                             const std::string& session_id) {
  auto it = principals_.find(principal);
  if (it == principals_.end()) return;
  SetKv(principal, session_id, 0);
  if (it->second.sessions > 0) it->second.sessions--;
}

absl::Status QuotaBook::StartTurn(const std::string& principal,
                                  const cluster::ClientLimits& limits) {
  Principal& p = principals_[principal];
  if (limits.max_concurrent_turns() > 0 &&
      p.turns >= limits.max_concurrent_turns()) {
    return Refuse(
        QuotaKind::kConcurrentTurns,
        absl::StrCat(QuotaWho(principal), " has ", p.turns,
                     " turns running or queued, its max_concurrent_turns "
                     "limit (",
                     limits.max_concurrent_turns(),
                     "); retry once one of them has ended"));
  }
  p.turns++;
  return absl::OkStatus();
}

void QuotaBook::EndTurn(const std::string& principal) {
  auto it = principals_.find(principal);
  if (it != principals_.end() && it->second.turns > 0) it->second.turns--;
}

absl::Status QuotaBook::CheckKv(const std::string& principal,
                                const cluster::ClientLimits& limits,
                                const std::string& session_id, int64_t bytes) {
  if (limits.max_kv_bytes() <= 0) return absl::OkStatus();
  const Principal* p = Find(principal);
  int64_t others = 0;
  if (p != nullptr) {
    others = p->kv_total;
    auto it = p->kv.find(session_id);
    if (it != p->kv.end()) others -= it->second;
  }
  if (others + bytes <= limits.max_kv_bytes()) return absl::OkStatus();
  return Refuse(
      QuotaKind::kKvBytes,
      absl::StrCat("the turn would bring the KV of ", QuotaWho(principal),
                   "'s sessions to ", others + bytes, " bytes (", bytes,
                   " of them this session's), over its max_kv_bytes limit (",
                   limits.max_kv_bytes(),
                   "); close sessions, or shorten the turn (prompt and "
                   "max_new_tokens)"));
}

void QuotaBook::SetKv(const std::string& principal,
                      const std::string& session_id, int64_t bytes) {
  bytes = std::max<int64_t>(0, bytes);
  auto pit = principals_.find(principal);
  if (pit == principals_.end()) {
    if (bytes == 0) return;
    pit = principals_.emplace(principal, Principal()).first;
  }
  Principal& p = pit->second;
  auto it = p.kv.find(session_id);
  if (it != p.kv.end()) {
    p.kv_total -= it->second;
    if (bytes == 0) {
      p.kv.erase(it);
    } else {
      it->second = bytes;
    }
  } else if (bytes > 0) {
    p.kv.emplace(session_id, bytes);
  }
  p.kv_total += bytes;
}

int QuotaBook::open_sessions(const std::string& principal) const {
  const Principal* p = Find(principal);
  return p == nullptr ? 0 : p->sessions;
}

int QuotaBook::turns(const std::string& principal) const {
  const Principal* p = Find(principal);
  return p == nullptr ? 0 : p->turns;
}

int64_t QuotaBook::kv_bytes(const std::string& principal) const {
  const Principal* p = Find(principal);
  return p == nullptr ? 0 : p->kv_total;
}

int64_t QuotaBook::refusals(QuotaKind kind) const {
  return refusals_[static_cast<int>(kind)];
}

}  // namespace karat::coordinator
