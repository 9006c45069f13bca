#include "gpu_node/combine_cache.h"

#include <utility>

namespace karat {

CombineCache::CombineCache(const CombineCacheLimits& limits)
    : limits_(limits) {}

CombineCache::Seen CombineCache::Begin(uint32_t sender,
                                       const DispatchKey& key) {
  Sender& s = senders_[sender];
  if (auto it = s.answers.find(key); it != s.answers.end()) {
    return {State::kAnswered, it->second};
  }
  if (!s.in_progress.insert(key).second) return {State::kInProgress, nullptr};
  return {State::kNew, nullptr};
}

void CombineCache::Finish(uint32_t sender, const DispatchKey& key,
                          std::shared_ptr<const std::string> answer) {
  auto found = senders_.find(sender);
  if (found == senders_.end()) return;  // forgotten meanwhile
  Sender& s = found->second;
  s.in_progress.erase(key);
  if (answer == nullptr || limits_.max_entries == 0 ||
      answer->size() > limits_.max_bytes) {
    ++evictions_;
    return;
  }
  if (auto old = s.answers.find(key); old != s.answers.end()) {
    // Begin() would have answered it: only after a Clear() raced a
    // service that finished late. Keep the newer one.
    s.bytes -= old->second->size();
    bytes_ -= old->second->size();
    --entries_;
    s.answers.erase(old);
    std::erase(s.order, key);
  }
  s.bytes += answer->size();
  bytes_ += answer->size();
  ++entries_;
  s.answers.emplace(key, std::move(answer));
  s.order.push_back(key);
  while (s.answers.size() > limits_.max_entries ||
         s.bytes > limits_.max_bytes) {
    auto oldest = s.answers.find(s.order.front());
    s.order.pop_front();
    s.bytes -= oldest->second->size();
    bytes_ -= oldest->second->size();
    --entries_;
    s.answers.erase(oldest);
    ++evictions_;
  }
}

void CombineCache::Abandon(uint32_t sender, const DispatchKey& key) {
  auto found = senders_.find(sender);
  if (found != senders_.end()) found->second.in_progress.erase(key);
}

void CombineCache::Forget(Sender& s) {
  entries_ -= s.answers.size();
  bytes_ -= s.bytes;
}

void CombineCache::RetainSenders(const absl::flat_hash_set<uint32_t>& senders) {
  for (auto it = senders_.begin(); it != senders_.end();) {
    if (senders.contains(it->first)) {
      ++it;
      continue;
    }
    Forget(it->second);
    senders_.erase(it++);
  }
}

void CombineCache::Clear() {
  senders_.clear();
  entries_ = 0;
  bytes_ = 0;
}

size_t CombineCache::in_progress() const {
  size_t n = 0;
  for (const auto& [id, s] : senders_) n += s.in_progress.size();
  return n;
}

}  // namespace karat
