// The GPU node's decode loop (DESIGN.md §2, CONVENTIONS "one owner per
// resource"): one thread owns the batch. Each iteration builds a step with
// one Segment per active request (a prefill chunk within the step's token
// budget, or the last sampled token), runs ModelRunner::Step, samples a
// token for every request whose feed is complete, and streams it.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cluster.pb.h"
#include "common/model_runner.h"
#include "gpu_node/turn_request.h"
#include "gpu_node/worker_token.h"

namespace karat {

// An AttentionBackend the decode loop drives: it learns where each
// session's KV lives before the session's first step and when it leaves the
// batch, and when a new step begins. Called on the decode-loop thread only.
class StepBackend : public AttentionBackend {
 public:
  // `turn_epoch` (RunTurnRequest.turn_epoch) goes into the turn's frames.
  virtual void SetPlacement(uint64_t session,
                            const cluster::KaratPlacement& placement,
                            uint64_t turn_epoch) {}
  virtual void ClearPlacement(uint64_t session) {}
  virtual void BeginStep() {}
  // The backend micro-batch `mb` (0 or 1) runs its layers with; it calls
  // `hooks` around each blocking wait (may be null). Two micro-batches'
  // backends are used from two threads at once. The default is this backend
  // itself, which then must not block on transfers.
  virtual AttentionBackend* ForMicroBatch(int mb, WaitHooks* hooks) {
    return this;
  }
};

// Where micro-batch `mb`'s MoE layers run their routed experts (expert
// parallelism); null computes them locally.
using ExpertSource = std::function<ExpertBackend*(int mb, WaitHooks* hooks)>;

// The events of one turn, from the decode loop to the RunTurn handler.
// Thread-safe.
class TurnStream {
 public:
  enum class Next { kEvent, kTimeout, kFinished };
  // Waits up to `timeout` for the next event. kFinished once every event has
  // been taken and the turn has ended (see status()).
  Next Pop(absl::Duration timeout, cluster::RunTurnEvent* event);
  // The turn's outcome once finished: OK after the last event, else why it
  // stopped (CANCELLED, UNAVAILABLE, ...).
  absl::Status status() const;
  // Asks the decode loop to drop the turn at the next step boundary.
  void Cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }

  // Producer side (decode loop).
  void Push(cluster::RunTurnEvent event);
  void Finish(absl::Status status);

 private:
  mutable absl::Mutex mu_;
  std::deque<cluster::RunTurnEvent> events_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> cancelled_{false};
};

struct DecodeLoopOptions {
  // Most tokens one step feeds; prefill is chunked to fit.
  int max_step_tokens = 256;
  // Most requests in one step.
  int max_batch = 64;
  // OpenMP threads of the loop thread (omp_set_num_threads); 0 keeps the
  // OpenMP default.
  int threads = 0;
  // Micro-batches per step (1 or 2) and how the rank switches between them.
  int micro_batches = 1;
  Schedule schedule = Schedule::kOfms;
  // The rank's timing model (WorkerToken), off by default.
  GpuTiming timing;
};

struct DecodeStats {
  uint64_t steps = 0;
  uint64_t tokens_prefilled = 0;
  uint64_t tokens_decoded = 0;
  uint64_t tokens_generated = 0;
  uint64_t failed_steps = 0;
  // Requests that failed, alone (their segment failed) or with their step.
  uint64_t failed_requests = 0;
  uint64_t active_requests = 0;
  uint64_t queued_requests = 0;
  double mean_batch_size = 0;   // segments per step
  double mean_step_tokens = 0;  // tokens per step
  // The rank as a worker (WorkerToken): seconds computing (its own
  // micro-batches, and other ranks' dispatches served through
  // service_gate()), seconds with every micro-batch waiting on a transfer,
  // micro-batch switches.
  double busy_seconds = 0;
  double stalled_seconds = 0;
  uint64_t switches = 0;
  // Timing model: seconds the worker waited out the modelled time of its
  // operations (part of busy_seconds), and that modelled time.
  double model_wait_seconds = 0;
  double model_seconds = 0;
  // Steps that ran two micro-batches, and the tokens of each micro-batch
  // (context lengths are the coordinator's; this is the step work).
  uint64_t two_micro_batch_steps = 0;
  uint64_t micro_batch_tokens[2] = {0, 0};
};

// Request lifecycle inside the loop.
enum class RequestState { kPrefill, kDecode, kDone };

class DecodeLoop {
 public:
  // `runner` and `backend` must outlive the loop; the backend is used on
  // the loop thread only.
  DecodeLoop(const ModelRunner* runner, StepBackend* backend,
             const DecodeLoopOptions& options, ExpertSource experts = nullptr);
  ~DecodeLoop();  // Stop()s

  void Start();
  // Queues a turn. The request must have passed ValidateTurnRequest.
  // UNAVAILABLE once stopping.
  absl::StatusOr<std::shared_ptr<TurnStream>> Submit(TurnRequest request);
  // Ends every turn still queued or running with UNAVAILABLE and joins the
  // loop thread. Idempotent.
  void Stop();

  DecodeStats stats() const;

  // Moves running sessions between micro-batches from the next step on;
  // other sessions are ignored (a turn brings its own micro-batch).
  void SetMicroBatches(const absl::flat_hash_map<uint64_t, int>& assignment);

  // The gate through which the rank's expert service takes turns on this
  // loop's worker (ExpertParallel::set_service_gate). Valid as long as the
  // loop.
  ServiceGate* service_gate() { return &service_gate_; }

 private:
  struct Request;
  class MicroBatchThread;
  void Run();
  // One step over `active`; removes finished and failed requests.
  void RunStep(std::vector<std::shared_ptr<Request>>* active);
  // Marks the request done and tells the backend the session left.
  void Retire(Request* request);

  const ModelRunner* const runner_;
  StepBackend* const backend_;
  const DecodeLoopOptions options_;
  const ExpertSource experts_;
  WorkerToken token_;
  TokenWaitHooks hooks_[2];
  TokenServiceGate service_gate_{&token_};
  std::unique_ptr<MicroBatchThread> second_;

  mutable absl::Mutex mu_;
  std::deque<std::shared_ptr<Request>> pending_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  DecodeStats stats_ ABSL_GUARDED_BY(mu_);
  uint64_t segments_total_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t step_tokens_total_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<uint64_t, int> micro_batch_of_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace karat
