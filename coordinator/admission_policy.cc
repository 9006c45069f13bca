#include "coordinator/admission_policy.h"

namespace karat::coordinator {

bool MayTryAdmission(const std::deque<QueuedTurn>& queue, size_t index,
                     uint64_t capacity_epoch, absl::Time now,
                     absl::Duration bypass) {
  if (index >= queue.size()) return false;
  if (queue[index].waited_at == capacity_epoch) return false;  // tried
  if (bypass < absl::ZeroDuration()) return index == 0;
  for (size_t i = 0; i < index; ++i) {
    const QueuedTurn& ahead = queue[i];
    if (ahead.waited_at != capacity_epoch) return false;  // not tried yet
    if (now - ahead.enqueued >= bypass) return false;     // aged: no passing
  }
  return true;
}

absl::Duration QueueBypass(int queue_bypass_ms) {
  if (queue_bypass_ms == 0) return absl::Seconds(5);
  if (queue_bypass_ms < 0) return -absl::Milliseconds(1);
  return absl::Milliseconds(queue_bypass_ms);
}

}  // namespace karat::coordinator
