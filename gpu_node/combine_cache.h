// The serving rank's memory of the dispatches it answered
// (gpu_node/expert_parallel.h), so that a dispatch its sender sends again
// (its combine was lost, late, or the dispatch itself seemed lost) is not
// computed twice: per sender node id, the dispatches queued or being
// computed, and the encoded combines of the latest ones answered.
//
// Bounds, per sender: at most `max_entries` combines and `max_bytes` of
// them; the oldest go first, and a combine larger than `max_bytes` alone
// is not kept. A sender has at most a few dispatches to one rank waiting at
// a time (one layer per micro-batch, split by the frame limit), so the
// defaults keep every combine it can still ask for; one evicted anyway is
// computed again when asked (same bits: the expert kernels are
// deterministic). Dispatches in progress are not bounded here: each is a
// queued job of the service, whose number is the senders' to bound.
//
// Not thread-safe: the caller serialises access.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"

namespace karat {

// A dispatch as its sender names it: the request id (`session`) and the
// layer, step and micro-batch (all from the frame header). A sender that
// reused a request id for other work is not answered with the old combine.
struct DispatchKey {
  uint64_t request = 0;
  uint64_t step = 0;
  uint32_t layer = 0;
  uint32_t micro_batch = 0;

  bool operator==(const DispatchKey&) const = default;
  template <typename H>
  friend H AbslHashValue(H h, const DispatchKey& k) {
    return H::combine(std::move(h), k.request, k.step, k.layer, k.micro_batch);
  }
};

struct CombineCacheLimits {
  size_t max_entries = 256;
  size_t max_bytes = size_t(64) << 20;
};

class CombineCache {
 public:
  explicit CombineCache(const CombineCacheLimits& limits = {});

  enum class State {
    kNew,         // not seen (or forgotten): now in progress, serve it
    kInProgress,  // queued or being computed: its combine will answer
    kAnswered,    // `answer` is the combine to send again
  };
  struct Seen {
    State state = State::kNew;
    std::shared_ptr<const std::string> answer;
  };
  // What to do with a dispatch that arrived; a new one is marked in
  // progress.
  Seen Begin(uint32_t sender, const DispatchKey& key);
  // The encoded combine of a dispatch Begin() found new: no longer in
  // progress, and kept within the bounds (evicting the sender's oldest).
  // Not kept when the sender was forgotten since Begin().
  void Finish(uint32_t sender, const DispatchKey& key,
              std::shared_ptr<const std::string> answer);
  // A dispatch Begin() found new that will not be answered (dropped at
  // shutdown): no longer in progress, nothing kept.
  void Abandon(uint32_t sender, const DispatchKey& key);
  // Forgets every sender outside `senders` (gone from the rank table).
  void RetainSenders(const absl::flat_hash_set<uint32_t>& senders);
  void Clear();

  const CombineCacheLimits& limits() const { return limits_; }
  size_t entries() const { return entries_; }
  size_t bytes() const { return bytes_; }
  size_t in_progress() const;
  // Combines dropped to stay within the bounds (or too large to keep).
  uint64_t evictions() const { return evictions_; }

 private:
  struct Sender {
    absl::flat_hash_set<DispatchKey> in_progress;
    absl::flat_hash_map<DispatchKey, std::shared_ptr<const std::string>>
        answers;
    std::deque<DispatchKey> order;  // of `answers`, oldest first
    size_t bytes = 0;
  };
  void Forget(Sender& s);

  const CombineCacheLimits limits_;
  absl::flat_hash_map<uint32_t, Sender> senders_;
  size_t entries_ = 0;
  size_t bytes_ = 0;
  uint64_t evictions_ = 0;
};

}  // namespace karat
