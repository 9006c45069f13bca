// Idle KV eviction (ClusterConfig.security.idle_kv_evict_s, docs/security.md
// "Sessions"): a session without a turn for Options::idle_kv_evict has its
// KV freed on its home device (kv_release.h) and its home cleared, so that
// an idle client does not hold device memory. Its next turn places it
// again and rebuilds the KV from the token log by prefill, the path a
// session restored after a coordinator restart takes; the tokens are those
// of a run without the eviction.
#pragma once

#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/state.h"

namespace karat::coordinator {

// What the eviction policy looks at of a session.
struct KvIdleState {
  bool placed = false;    // it has a home holding its KV
  bool busy = false;      // a turn runs or waits in admission
  bool closing = false;   // CloseSession is under way
  bool evicting = false;  // its KV is being freed already
  absl::Time last_turn_end = absl::InfinitePast();
};

// Whether the session's KV is to be freed at `now`: eviction is on
// (`idle` > 0), the session is placed, no turn runs or waits, it is not
// being closed or freed already, and its last turn ended at least `idle`
// ago. Pure.
bool KvEvictionDue(const KvIdleState& session, absl::Time now,
                   absl::Duration idle);

// One pass: frees the KV of every session KvEvictionDue at State::Now()
// (FreeSession on its home, without the lock; a turn that arrives
// meanwhile waits in admission until it is done) and counts them
// (State::kv_evictions_). Returns how many.
int EvictIdleKv(State* s);

// Runs EvictIdleKv every 100 ms (real time) while Options::idle_kv_evict
// is on; does nothing otherwise.
class IdleKvEvictor {
 public:
  explicit IdleKvEvictor(State* s);
  ~IdleKvEvictor() { Stop(); }
  void Stop();

 private:
  void Loop();

  State* const s_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace karat::coordinator
