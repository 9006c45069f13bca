// Scheduling policies of the scale-out design (DESIGN.md §4 "Scheduling"):
// micro-batch assignment (CMR and the request-count mode it is compared
// against), its imbalance, and the batch cap that admission applies under a
// TBT target.
//
// Every function here is a pure policy: it takes the state it needs as plain
// values and returns a decision. None reads a clock, does I/O, keeps state
// between calls or touches a global, so each is safe to call from any thread
// concurrently and gives the same answer for the same input. Malformed input
// (duplicate ids, negative sizes) is reported as INVALID_ARGUMENT rather than
// silently repaired.
//
// Use in the runtime (coordinator.cc): AssignMicroBatches() recomputes a
// rank's micro-batches on every admission and finish (pushed to the rank
// with GpuNode.SetMicroBatches), Imbalance() feeds the token-imbalance
// metric, and MaxBatchForSlo() caps a rank's batch under the TBT target at
// admission. Pages are not placed here: the coordinator admits a turn by
// asking its home device to reserve (KaratNode.Reserve, which spills inside
// the node) and picks home devices with ChooseHomeDevices() (placement.h).
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/placement.h"

namespace karat::coordinator {

// ---------------------------------------------------------------------------
// Micro-batch assignment (§III-F, Algorithm 1; DESIGN.md §4 "CMR")
// ---------------------------------------------------------------------------

// The two micro-batches of a GPU rank. Their operations interleave so that
// one micro-batch's KARAT-side attention overlaps the other's GPU work.
enum class MicroBatch : int { k0 = 0, k1 = 1 };

// One request of a GPU rank, as the micro-batch policies see it.
struct RankRequest {
  uint64_t request_id = 0;     // unique within the rank
  HomeDevice home;             // the device holding the request's KV
  int64_t context_tokens = 0;  // tokens its attention reads; >= 0
};

struct MicroBatchAssignment {
  uint64_t request_id = 0;
  MicroBatch micro_batch = MicroBatch::k0;
  bool operator==(const MicroBatchAssignment& o) const {
    return request_id == o.request_id && micro_batch == o.micro_batch;
  }
};

// A micro-batch for every request of a rank. Invariant: `assignments` is
// sorted by increasing request id and holds each id once, so two plans for
// the same requests compare equal whatever order the requests came in.
struct MicroBatchPlan {
  std::vector<MicroBatchAssignment> assignments;

  // The micro-batch of `request_id`, or nullopt if the plan has none.
  std::optional<MicroBatch> Find(uint64_t request_id) const;
  bool operator==(const MicroBatchPlan& o) const {
    return assignments == o.assignments;
  }
};

// Context-length-aware micro-batch rebalancing (CMR, §III-F Algorithm 1).
// Recomputes the whole plan from scratch; the caller runs it whenever a
// request of the rank is admitted or finishes. For every device d
// independently: the requests whose KV is on d, in decreasing context length
// (ties: lower request id first), each go to the micro-batch whose aggregate
// context length on d is smaller; ties go to the micro-batch with fewer
// requests on d, then to the one with less context over the whole rank (as
// placed so far, devices in (node, device) order), then to the one with
// fewer requests over the rank, then to micro-batch 0. The plan moves no KV.
//
// Guarantee (greedy bound): on every device the final |ctx(µB0) − ctx(µB1)|
// is at most the longest context on that device.
//
// Errors: INVALID_ARGUMENT for a duplicate request id or a negative context.
absl::StatusOr<MicroBatchPlan> AssignByContextLength(
    const std::vector<RankRequest>& requests);

// The prior approach, kept for comparison: balance by request count over the
// whole rank, append-only. Requests that `previous` assigns keep their
// micro-batch; entries of `previous` for requests not in `requests` (they
// finished) are dropped. Each new request, in increasing request id (the
// order ids are issued in), goes to the micro-batch that holds fewer
// requests at that moment; ties go to micro-batch 0.
//
// Errors: INVALID_ARGUMENT for a duplicate request id or a negative context.
absl::StatusOr<MicroBatchPlan> AssignByRequestCount(
    const std::vector<RankRequest>& requests, const MicroBatchPlan& previous);

// Which of the two above the runtime uses (configuration).
enum class MicroBatchMode { kContextLength, kRequestCount };

// Dispatches to AssignByContextLength (which ignores `previous`) or
// AssignByRequestCount.
absl::StatusOr<MicroBatchPlan> AssignMicroBatches(
    MicroBatchMode mode, const std::vector<RankRequest>& requests,
    const MicroBatchPlan& previous);

// Load of one device's share of the two micro-batches.
struct DeviceMicroBatchLoad {
  HomeDevice device;
  int64_t context_tokens[2] = {0, 0};  // indexed by MicroBatch
  int requests[2] = {0, 0};
  int64_t imbalance = 0;  // |context_tokens[0] − context_tokens[1]|
};

// How evenly a plan splits a rank's attention work. Per-device imbalance is
// what CMR minimises: both micro-batches' attention on device d runs on d's
// cores, so the longer one sets the pipeline's pace on d.
struct MicroBatchImbalance {
  std::vector<DeviceMicroBatchLoad> devices;  // by (node_id, device)
  int64_t sum_device_imbalance = 0;           // Σ_d imbalance(d)
  int64_t max_device_imbalance = 0;           // max_d imbalance(d); 0 if none
  int64_t rank_context_tokens[2] = {0, 0};    // over all devices
  int rank_requests[2] = {0, 0};
  int64_t token_imbalance = 0;  // |rank_context_tokens[0] − [1]|
};

// Measures `plan` over `requests`. Errors: INVALID_ARGUMENT for a duplicate
// request id, a negative context, or a request the plan does not assign.
absl::StatusOr<MicroBatchImbalance> Imbalance(
    const std::vector<RankRequest>& requests, const MicroBatchPlan& plan);

// ---------------------------------------------------------------------------
// Admission (DESIGN.md §4 "Admission")
// ---------------------------------------------------------------------------

// Decode step time of one rank as a linear model:
//   step_ms = fixed_ms + per_request_ms · batch + per_context_token_ms · Σctx
// All parameters must be finite and >= 0. A prior from the configuration,
// refined from the rank's measured steps by StepCostEstimator.
struct StepCostModel {
  double fixed_ms = 0;
  double per_request_ms = 0;
  double per_context_token_ms = 0;
};

// A batch size that no TBT target limits.
inline constexpr int kUnboundedBatch = std::numeric_limits<int>::max();

// The largest batch B whose step time meets the TBT target when every request
// reads `mean_context_tokens`: fixed + (per_request + per_ctx · ctx) · B <=
// tbt_slo_ms. 0 when even an empty step misses it; kUnboundedBatch when the
// per-request cost is 0. Errors: INVALID_ARGUMENT for a non-positive or
// non-finite target, a negative context, or a negative / non-finite model
// parameter.
absl::StatusOr<int> MaxBatchForSlo(double tbt_slo_ms,
                                   const StepCostModel& model,
                                   int64_t mean_context_tokens);

// Fits a rank's StepCostModel to its measured decode steps, so that the TBT
// cap follows the hardware the rank runs on instead of assumed figures.
// Each sample is one step: `batch` requests holding `context_tokens` in all
// took `step_ms`. The fit is least squares over the samples, older ones
// weighed down by `forget` per sample (the model follows a rank whose speed
// changes), pulled towards the prior with the weight of `prior_weight`
// samples (per parameter, at the spread of its feature; what the samples
// cannot tell apart, e.g. the fixed and per-request costs while the batch
// never changes, goes mostly to the fixed cost), and with every parameter
// kept >= 0. Until `min_samples` samples arrived, Model() is the prior. Not
// thread-safe.
class StepCostEstimator {
 public:
  struct Options {
    double forget = 0.995;     // per sample; in (0, 1]
    double prior_weight = 1;   // samples' worth; > 0
    int64_t min_samples = 16;  // >= 0
  };
  // `prior` must be valid (finite, >= 0); `options` in range.
  explicit StepCostEstimator(const StepCostModel& prior);
  StepCostEstimator(const StepCostModel& prior, const Options& options);

  // Ignores a sample with batch < 1, a negative context, a negative or
  // non-finite time or a weight outside (0, 1] (returns false). A sample of
  // weight w counts as w samples (in the fit and in the forgetting): a step
  // that B requests each report comes in as B samples of weight 1 / B.
  bool Add(int batch, int64_t context_tokens, double step_ms,
           double weight = 1.0);
  // The current fit (the prior before min_samples samples).
  StepCostModel Model() const;
  // Samples added (whatever their weight).
  int64_t samples() const { return samples_; }
  // Whether Model() is the fit (min_samples reached) rather than the prior.
  bool learned() const { return samples_ >= options_.min_samples; }

 private:
  StepCostModel prior_;
  Options options_;
  int64_t samples_ = 0;
  // Weighted sums over the samples of x·xᵀ, x·y and x_j² with
  // x = (1, batch, context_tokens), y = step_ms.
  double xx_[3][3] = {};
  double xy_[3] = {};
  double weight_ = 0;  // Σ weights (the weight of feature 0's x_0² sums)
  StepCostModel fit_;  // cached result of the last Add
  StepCostModel Solve() const;
};

}  // namespace karat::coordinator
