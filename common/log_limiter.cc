#include "common/log_limiter.h"

#include "absl/strings/str_cat.h"

namespace karat {

LogLimiter::LogLimiter(absl::Duration interval, absl::Time (*now)())
    : interval_(interval), now_(now) {}

int64_t LogLimiter::Admit(absl::string_view key) {
  const absl::Time now = now_ != nullptr ? now_() : absl::Now();
  absl::MutexLock lock(&mu_);
  auto it = keys_.find(key);
  if (it == keys_.end()) {
    // Past the bound, every new key shares one entry.
    const std::string k =
        keys_.size() < kMaxKeys ? std::string(key) : std::string("*");
    it = keys_.try_emplace(k).first;
  }
  Key& e = it->second;
  if (now - e.last < interval_) {
    ++e.held;
    ++held_back_;
    return -1;
  }
  e.last = now;
  const int64_t held = e.held;
  e.held = 0;
  return held;
}

uint64_t LogLimiter::held_back() const {
  absl::MutexLock lock(&mu_);
  return held_back_;
}

std::string HeldBackNote(int64_t held) {
  if (held <= 0) return std::string();
  return absl::StrCat(" (", held, " more like it held back)");
}

}  // namespace karat
