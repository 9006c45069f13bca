// The GPU rank as one worker shared by its two micro-batches (DESIGN.md §4,
// §III-E of the paper). Each micro-batch's step runs on its own thread, but
// only the thread holding the token computes; a micro-batch gives the token
// up when its head operation blocks on a transfer (WaitHooks::BeforeWait)
// and asks for it back when the transfer is done (AfterWait).
//
//   * SCMS keeps the static order: the token alternates µB0, µB1, µB0, ...
//     at every hand-over, so the worker idles while the micro-batch whose
//     turn it is still waits, even if the other one is ready.
//   * OFMS follows the same order but lets the other micro-batch run when
//     the one whose turn it is still waits: the token goes to whichever is
//     ready, the static order breaking ties.
//
// The rank also serves other ranks' MoE dispatches (expert parallelism) on
// the same worker: the service takes the token for each dispatch it
// computes (AcquireService / ReleaseService), as soon as the token is free
// and ahead of a waiting micro-batch, since the other rank's step waits for
// the answer; it may do so between steps as well.
//
// The token also accounts the worker's time: busy (held, by a micro-batch or
// the service) and stalled (free while a step is in progress, every
// micro-batch waiting).
// Thread-safe.
#pragma once

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/model_runner.h"

namespace karat {

enum class Schedule { kOfms, kScms };

// "ofms" / "scms"; INVALID_ARGUMENT otherwise ("" is ofms).
absl::StatusOr<Schedule> ParseSchedule(const std::string& name);
const char* ScheduleName(Schedule s);

class WorkerToken {
 public:
  explicit WorkerToken(Schedule schedule) : schedule_(schedule) {}

  // Starts a step with micro-batches 0 .. n-1 (n is 1 or 2), µB0 first.
  void BeginStep(int n);
  // A micro-batch's thread starts its step (waits for the token).
  void Begin(int mb) { Acquire(mb); }
  // A micro-batch's step is over: it gives up the token for good.
  void End(int mb);
  // Around a blocking wait on a transfer.
  void Release(int mb);
  void Acquire(int mb);
  // The expert service: takes the token (waits until it is free) and gives
  // it back. Not nested, one caller at a time.
  void AcquireService();
  void ReleaseService();

  // Seconds the token was held, and free while some micro-batch of the
  // step was still running; hand-overs between micro-batches.
  double busy_seconds() const;
  double stalled_seconds() const;
  uint64_t switches() const;

 private:
  void ReleaseLocked(int mb) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A step has begun and not every micro-batch of it has ended.
  bool InStepLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  static constexpr int kService = 2;  // holder_ while the service holds it

  const Schedule schedule_;
  mutable absl::Mutex mu_;
  int participants_ ABSL_GUARDED_BY(mu_) = 0;
  int holder_ ABSL_GUARDED_BY(mu_) = -1;
  // Whose turn it is in the static order.
  int turn_ ABSL_GUARDED_BY(mu_) = 0;
  bool finished_[2] ABSL_GUARDED_BY(mu_) = {false, false};
  bool wanting_[2] ABSL_GUARDED_BY(mu_) = {false, false};
  bool service_wanting_ ABSL_GUARDED_BY(mu_) = false;
  int last_holder_ ABSL_GUARDED_BY(mu_) = -1;
  absl::Time held_since_ ABSL_GUARDED_BY(mu_);
  absl::Time free_since_ ABSL_GUARDED_BY(mu_);
  absl::Duration busy_ ABSL_GUARDED_BY(mu_);
  absl::Duration stalled_ ABSL_GUARDED_BY(mu_);
  uint64_t switches_ ABSL_GUARDED_BY(mu_) = 0;
};

// Where a rank's expert service (ExpertParallel) takes its turns on the
// rank's worker: Enter() before computing a dispatch's experts, Leave()
// after.
class ServiceGate {
 public:
  virtual ~ServiceGate() = default;
  virtual void Enter() = 0;
  virtual void Leave() = 0;
};

// The expert service's turns on a token (ExpertParallel::set_service_gate).
class TokenServiceGate : public ServiceGate {
 public:
  explicit TokenServiceGate(WorkerToken* token) : token_(token) {}
  void Enter() override { token_->AcquireService(); }
  void Leave() override { token_->ReleaseService(); }

 private:
  WorkerToken* const token_;
};

// WaitHooks of one micro-batch on a token.
class TokenWaitHooks : public WaitHooks {
 public:
  TokenWaitHooks(WorkerToken* token, int mb) : token_(token), mb_(mb) {}
  void BeforeWait() override { token_->Release(mb_); }
  void AfterWait() override { token_->Acquire(mb_); }

 private:
  WorkerToken* const token_;
  const int mb_;
};

}  // namespace karat
