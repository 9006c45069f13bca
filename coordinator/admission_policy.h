// The admission queue's fairness rule (SchedulingConfig.queue_bypass_ms):
// which waiting turn may try to be admitted now. Pure.
//
// Turns try in arrival order, and a turn tries only after every turn ahead
// of it has tried since room last changed (the state's capacity epoch) and
// found none: so a head that does not fit yet does not hold back smaller
// turns that do. Aging bounds what that costs the head: once a turn ahead
// has waited `bypass` or longer, nobody passes it any more, and the next
// room that appears is its (until it is admitted or times out). A negative
// `bypass` keeps strict FIFO: only the head tries.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>

#include "absl/time/time.h"

namespace karat::coordinator {

// A turn waiting in the admission queue.
struct QueuedTurn {
  uint64_t id = 0;
  absl::Time enqueued;
  // The capacity epoch at which its last attempt found no room; 0: it has
  // not tried since room last changed.
  uint64_t waited_at = 0;
};

// Whether queue[index] may try now, at `capacity_epoch` (never 0).
bool MayTryAdmission(const std::deque<QueuedTurn>& queue, size_t index,
                     uint64_t capacity_epoch, absl::Time now,
                     absl::Duration bypass);

// SchedulingConfig.queue_bypass_ms as a duration: 0 is the default 5 s,
// negative is strict FIFO.
absl::Duration QueueBypass(int queue_bypass_ms);

}  // namespace karat::coordinator
