#include "gpu_node/worker_token.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace karat {

absl::StatusOr<Schedule> ParseSchedule(const std::string& name) {
  if (name.empty() || name == "ofms") return Schedule::kOfms;
  if (name == "scms") return Schedule::kScms;
  return absl::InvalidArgumentError(absl::StrCat(
      "schedule must be \"ofms\" or \"scms\", got \"", name, "\""));
}

const char* ScheduleName(Schedule s) {
  return s == Schedule::kScms ? "scms" : "ofms";
}

void WorkerToken::BeginStep(int n) {
  absl::MutexLock lock(&mu_);
  participants_ = n;
  // The service may hold the token across the start of a step.
  if (holder_ != kService) holder_ = -1;
  turn_ = 0;
  finished_[0] = finished_[1] = false;
  wanting_[0] = wanting_[1] = false;
  free_since_ = absl::Now();
}

void WorkerToken::Acquire(int mb) {
  absl::MutexLock lock(&mu_);
  wanting_[mb] = true;
  auto may_take = [this, mb]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    if (holder_ != -1 || service_wanting_) return false;
    const int other = 1 - mb;
    const bool other_active = participants_ == 2 && !finished_[other];
    if (!other_active || turn_ == mb) return true;
    // The other micro-batch has the turn. SCMS waits for it; OFMS takes
    // the token unless the other one is ready to run too.
    return schedule_ == Schedule::kOfms && !wanting_[other];
  };
  mu_.Await(absl::Condition(&may_take));
  wanting_[mb] = false;
  holder_ = mb;
  const absl::Time now = absl::Now();
  stalled_ += now - free_since_;
  held_since_ = now;
  if (last_holder_ != -1 && last_holder_ != mb) ++switches_;
  last_holder_ = mb;
  StartOperation();
}

void WorkerToken::StartOperation() {
  op_counted_ = 0;
  if (!timing_.enabled()) return;
  op_cost_ = KernelCost();
  SetKernelMeter(&op_cost_);
}

void WorkerToken::PaceOperation(int holder, bool end) {
  if (!timing_.enabled()) return;
  absl::Time start;
  bool held;
  {
    absl::MutexLock lock(&mu_);
    held = holder_ == holder;
    start = held_since_;
  }
  if (end) SetKernelMeter(nullptr);
  if (!held) return;
  const double modelled =
      RooflineSeconds(op_cost_, timing_.bandwidth_gbps, timing_.tflops);
  const absl::Time until = start + absl::Seconds(modelled);
  const absl::Time before = absl::Now();
  absl::Time now = before;
  // The token stays with the holder meanwhile: the emulated GPU is busy.
  while (now < until) {
    absl::SleepFor(until - now);
    now = absl::Now();
  }
  absl::MutexLock lock(&mu_);
  model_wait_ += now - before;
  model_seconds_ += std::max(0.0, modelled - op_counted_);
  op_counted_ = std::max(op_counted_, modelled);
}

void WorkerToken::Pace(int mb) { PaceOperation(mb, /*end=*/false); }

bool WorkerToken::InStepLocked() const {
  if (participants_ == 1) return !finished_[0];
  if (participants_ == 2) return !(finished_[0] && finished_[1]);
  return false;
}

void WorkerToken::AcquireService() {
  absl::MutexLock lock(&mu_);
  service_wanting_ = true;
  auto free = [this]()
                  ABSL_SHARED_LOCKS_REQUIRED(mu_) { return holder_ == -1; };
  mu_.Await(absl::Condition(&free));
  service_wanting_ = false;
  holder_ = kService;
  const absl::Time now = absl::Now();
  if (InStepLocked()) stalled_ += now - free_since_;
  held_since_ = now;
  StartOperation();
}

void WorkerToken::ReleaseService() {
  PaceOperation(kService, /*end=*/true);
  absl::MutexLock lock(&mu_);
  if (holder_ != kService) return;
  const absl::Time now = absl::Now();
  busy_ += now - held_since_;
  free_since_ = now;
  holder_ = -1;
}

void WorkerToken::ReleaseLocked(int mb) {
  if (holder_ != mb) return;
  const absl::Time now = absl::Now();
  busy_ += now - held_since_;
  free_since_ = now;
  holder_ = -1;
  // The static order hands the next operation to the other micro-batch.
  if (participants_ == 2 && !finished_[1 - mb]) turn_ = 1 - mb;
}

void WorkerToken::Release(int mb) {
  PaceOperation(mb, /*end=*/true);
  absl::MutexLock lock(&mu_);
  ReleaseLocked(mb);
}

void WorkerToken::End(int mb) {
  PaceOperation(mb, /*end=*/true);
  absl::MutexLock lock(&mu_);
  ReleaseLocked(mb);
  finished_[mb] = true;
  if (participants_ == 2 && !finished_[1 - mb]) turn_ = 1 - mb;
  // After the last micro-batch the step is over: no stall accrues.
  if (participants_ == 1 || finished_[1 - mb]) free_since_ = absl::Now();
}

double WorkerToken::busy_seconds() const {
  absl::MutexLock lock(&mu_);
  return absl::ToDoubleSeconds(busy_);
}

double WorkerToken::stalled_seconds() const {
  absl::MutexLock lock(&mu_);
  return absl::ToDoubleSeconds(stalled_);
}

uint64_t WorkerToken::switches() const {
  absl::MutexLock lock(&mu_);
  return switches_;
}

double WorkerToken::model_wait_seconds() const {
  absl::MutexLock lock(&mu_);
  return absl::ToDoubleSeconds(model_wait_);
}

double WorkerToken::model_seconds() const {
  absl::MutexLock lock(&mu_);
  return model_seconds_;
}

}  // namespace karat
