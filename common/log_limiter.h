// Rate-limited log lines: a line that can repeat at the rate of incoming
// traffic (an invalid frame, a refused frame, a stale reply) goes out at
// most once per interval per key, and the line that goes out says how many
// like it were held back since the previous one. Counters of the events
// themselves belong in the caller's stats; the limiter only spares the log.
//
//   LogLimiter limiter(absl::Seconds(10));
//   if (const int64_t held = limiter.Admit(peer); held >= 0)
//     KLOG(Warning, "karat_node") << "invalid frame from " << peer
//                                 << HeldBackNote(held);
#pragma once

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace karat {

// Thread-safe.
class LogLimiter {
 public:
  // `now` is a seam for tests (absl::Now when null).
  explicit LogLimiter(absl::Duration interval = absl::Seconds(10),
                      absl::Time (*now)() = nullptr);

  // Whether a line for `key` may go out now: the lines held back for `key`
  // since the previous one that went out (>= 0), or -1 when this one is
  // held back (counted). The first line of a key always goes out. At most
  // `kMaxKeys` keys are tracked; beyond them lines share one key.
  int64_t Admit(absl::string_view key);
  // Lines held back in all, since the limiter was made.
  uint64_t held_back() const;

  static constexpr size_t kMaxKeys = 1024;

 private:
  struct Key {
    absl::Time last = absl::InfinitePast();
    int64_t held = 0;
  };
  const absl::Duration interval_;
  absl::Time (*const now_)();
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Key> keys_ ABSL_GUARDED_BY(mu_);
  uint64_t held_back_ ABSL_GUARDED_BY(mu_) = 0;
};

// " (N more like it held back)" for N > 0, else "".
std::string HeldBackNote(int64_t held);

}  // namespace karat
