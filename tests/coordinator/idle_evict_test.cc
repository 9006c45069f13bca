// The idle KV eviction policy (coordinator/idle_evict.h, KvEvictionDue).
#include "coordinator/idle_evict.h"

#include <catch2/catch.hpp>

namespace karat::coordinator {
namespace {

TEST_CASE("idle eviction: due once a placed, idle session waited its time") {
  const absl::Time end = absl::FromUnixSeconds(5000);
  const absl::Duration idle = absl::Seconds(30);
  KvIdleState s;
  s.placed = true;
  s.last_turn_end = end;
  CHECK_FALSE(KvEvictionDue(s, end + absl::Seconds(29), idle));
  CHECK(KvEvictionDue(s, end + absl::Seconds(30), idle));
  CHECK(KvEvictionDue(s, end + absl::Hours(1), idle));
  // Off.
  CHECK_FALSE(KvEvictionDue(s, end + absl::Hours(1), absl::ZeroDuration()));
  // Nothing to free, or not now: a turn runs or waits, the session is
  // being closed, its KV is being freed already.
  KvIdleState t = s;
  t.placed = false;
  CHECK_FALSE(KvEvictionDue(t, end + absl::Hours(1), idle));
  t = s;
  t.busy = true;
  CHECK_FALSE(KvEvictionDue(t, end + absl::Hours(1), idle));
  t = s;
  t.closing = true;
  CHECK_FALSE(KvEvictionDue(t, end + absl::Hours(1), idle));
  t = s;
  t.evicting = true;
  CHECK_FALSE(KvEvictionDue(t, end + absl::Hours(1), idle));
}

}  // namespace
}  // namespace karat::coordinator
