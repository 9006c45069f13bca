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
//
// Timing model (GpuTiming, off by default): one operation is what the
// holder computes between taking the token and giving it up (for a
// micro-batch: from one transfer to the next, e.g. a layer's o_proj, FFN
// or router and local experts, and the next layer's projections and
// Index-Build; for the service: one dispatch's experts). While the holder
// has the token its thread's computations charge their cost (kernel_cost.h)
// to the operation, and before it gives the token up — or sends what it
// computed (Pace, WaitHooks::BeforeSend) — it waits, still holding the
// token, until max(bytes / bandwidth, flops / FLOP rate) of the operation
// so far has passed since it took the token: the emulated GPU is busy that
// long. The wait counts as busy time and in model_wait_seconds(). The
// computations themselves are unchanged (tokens are the same).
// Thread-safe.
#pragma once

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/kernel_cost.h"
#include "common/model_runner.h"

namespace karat {

enum class Schedule { kOfms, kScms };

// A GPU rank's timing model (GpuNodeOptions): HBM bandwidth in GB/s (1e9
// bytes/s) and FLOP rate in TFLOP/s (1e12/s); a zero rate leaves its term
// out, both zero turn the model off.
struct GpuTiming {
  double bandwidth_gbps = 0;
  double tflops = 0;
  bool enabled() const { return bandwidth_gbps > 0 || tflops > 0; }
};

// "ofms" / "scms"; INVALID_ARGUMENT otherwise ("" is ofms).
absl::StatusOr<Schedule> ParseSchedule(const std::string& name);
const char* ScheduleName(Schedule s);

class WorkerToken {
 public:
  explicit WorkerToken(Schedule schedule, GpuTiming timing = {})
      : schedule_(schedule), timing_(timing) {}

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
  // The timing model (no-op when off): micro-batch `mb` holding the token
  // waits until the roofline time of what it computed since it took the
  // token has passed, keeping the token. Called before sending a result.
  void Pace(int mb);

  // Seconds the token was held, and free while some micro-batch of the
  // step was still running; hand-overs between micro-batches.
  double busy_seconds() const;
  double stalled_seconds() const;
  uint64_t switches() const;
  // Timing model: seconds spent waiting out operations' modelled time
  // (part of busy), and the modelled time of the operations (their roofline
  // times, each counted once at its last pacing).
  double model_wait_seconds() const;
  double model_seconds() const;

 private:
  // Installs this token's operation meter on the calling thread, which has
  // just taken the token (timing model on).
  void StartOperation() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Paces the operation of `holder` (the calling thread holds the token);
  // with `end`, also takes the meter off the thread.
  void PaceOperation(int holder, bool end) ABSL_LOCKS_EXCLUDED(mu_);
  void ReleaseLocked(int mb) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A step has begun and not every micro-batch of it has ended.
  bool InStepLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  static constexpr int kService = 2;  // holder_ while the service holds it

  const Schedule schedule_;
  const GpuTiming timing_;
  // The operation in progress: what the holder's thread charged since it
  // took the token. Only the holder's thread touches it (the token's
  // hand-over orders the accesses).
  KernelCost op_cost_;
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
  absl::Duration model_wait_ ABSL_GUARDED_BY(mu_);
  double model_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  // Modelled seconds of the operation in progress already counted in
  // model_seconds_ (by an earlier Pace of the same operation).
  double op_counted_ ABSL_GUARDED_BY(mu_) = 0;
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
  void BeforeSend() override { token_->Pace(mb_); }

 private:
  WorkerToken* const token_;
  const int mb_;
};

}  // namespace karat
