#include "coordinator/idle_evict.h"

#include <string>
#include <utility>
#include <vector>

#include "coordinator/kv_release.h"
#include "security/tokens.h"

namespace karat::coordinator {

bool KvEvictionDue(const KvIdleState& session, absl::Time now,
                   absl::Duration idle) {
  if (idle <= absl::ZeroDuration()) return false;
  if (!session.placed || session.busy || session.closing || session.evicting)
    return false;
  return now - session.last_turn_end >= idle;
}

int EvictIdleKv(State* s) {
  const absl::Duration idle = s->options().idle_kv_evict;
  if (idle <= absl::ZeroDuration()) return 0;
  std::vector<std::pair<std::string, std::optional<KvHome>>> evicted;
  {
    absl::MutexLock lock(&s->mu_);
    const absl::Time now = s->Now();
    for (auto& [id, session] : s->sessions_) {
      const KvIdleState state{session.has_home, session.busy, session.closing,
                              session.evicting, session.last_turn_end};
      if (!KvEvictionDue(state, now, idle)) continue;
      session.evicting = true;
      evicted.emplace_back(id, DetachHomeLocked(s, &session));
      KLOG(Info, kLog) << "session=" << security::ShortId(id) << " idle for "
                       << absl::FormatDuration(now - session.last_turn_end)
                       << ": its KV is freed (its next turn rebuilds it)";
    }
  }
  if (evicted.empty()) return 0;
  for (const auto& [id, home] : evicted)
    if (home.has_value()) FreeKv(s, id, *home, "idle KV eviction");
  absl::MutexLock lock(&s->mu_);
  for (const auto& [id, home] : evicted) {
    auto it = s->sessions_.find(id);
    if (it != s->sessions_.end()) it->second.evicting = false;
  }
  s->kv_evictions_ += int64_t(evicted.size());
  // Room on the devices, and turns that waited for the eviction may go.
  s->capacity_epoch_++;
  return int(evicted.size());
}

IdleKvEvictor::IdleKvEvictor(State* s) : s_(s) {
  if (s_->options().idle_kv_evict > absl::ZeroDuration())
    thread_ = std::thread([this] { Loop(); });
}

void IdleKvEvictor::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void IdleKvEvictor::Loop() {
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(100));
      if (stop_) return;
    }
    EvictIdleKv(s_);
  }
}

}  // namespace karat::coordinator
