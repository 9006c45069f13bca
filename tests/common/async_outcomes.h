// Test helper: records the outcomes of asynchronous sends
// (Transport::SendSharedAsync), one slot per send.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/transport.h"

namespace karat {

// Counts the outcomes of asynchronous sends, one slot per send.
class AsyncOutcomes {
 public:
  // A callback for send `i` (slots grow as needed).
  Transport::SendDone Callback(size_t i) {
    {
      absl::MutexLock lock(&mu_);
      if (calls_.size() <= i) {
        calls_.resize(i + 1, 0);
        statuses_.resize(i + 1);
      }
    }
    return [this, i](absl::Status status) {
      absl::MutexLock lock(&mu_);
      ++calls_[i];
      ++total_;
      statuses_[i] = std::move(status);
    };
  }
  // Waits (bounded) until `n` callbacks ran in all.
  bool WaitFor(int n, absl::Duration bound = absl::Seconds(60)) {
    absl::MutexLock lock(&mu_);
    auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return total_ >= n;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), bound);
  }
  int calls(size_t i) {
    absl::MutexLock lock(&mu_);
    return i < calls_.size() ? calls_[i] : 0;
  }
  absl::Status status(size_t i) {
    absl::MutexLock lock(&mu_);
    return statuses_.at(i);
  }
  int total() {
    absl::MutexLock lock(&mu_);
    return total_;
  }

 private:
  absl::Mutex mu_;
  std::vector<int> calls_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Status> statuses_ ABSL_GUARDED_BY(mu_);
  int total_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace karat
