#include "coordinator/scheduling.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace karat::coordinator {
namespace {

using DeviceKey = std::pair<uint32_t, int32_t>;

DeviceKey Key(const HomeDevice& d) { return {d.node_id, d.device}; }

int Index(MicroBatch mb) { return static_cast<int>(mb); }

absl::Status ValidateRequests(const std::vector<RankRequest>& requests) {
  std::unordered_set<uint64_t> seen;
  for (const RankRequest& r : requests) {
    if (!seen.insert(r.request_id).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("request ", r.request_id, " is listed twice"));
    }
    if (r.context_tokens < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("request ", r.request_id, " has a negative context (",
                       r.context_tokens, " tokens)"));
    }
  }
  return absl::OkStatus();
}

void SortById(std::vector<MicroBatchAssignment>& a) {
  std::sort(a.begin(), a.end(),
            [](const MicroBatchAssignment& x, const MicroBatchAssignment& y) {
              return x.request_id < y.request_id;
            });
}

}  // namespace

std::optional<MicroBatch> MicroBatchPlan::Find(uint64_t request_id) const {
  auto it = std::lower_bound(assignments.begin(), assignments.end(), request_id,
                             [](const MicroBatchAssignment& a, uint64_t id) {
                               return a.request_id < id;
                             });
  if (it == assignments.end() || it->request_id != request_id) {
    return std::nullopt;
  }
  return it->micro_batch;
}

absl::StatusOr<MicroBatchPlan> AssignByContextLength(
    const std::vector<RankRequest>& requests) {
  RETURN_IF_ERROR(ValidateRequests(requests));
  // Devices are balanced independently: µB0 and µB1 of device d both run on
  // d's cores, so only their split on d decides how long one waits for the
  // other there (§III-F). An ordered map keeps the walk order fixed.
  std::map<DeviceKey, std::vector<const RankRequest*>> by_device;
  for (const RankRequest& r : requests) by_device[Key(r.home)].push_back(&r);

  MicroBatchPlan plan;
  plan.assignments.reserve(requests.size());
  // Rank-wide totals, for the ties on a device: a device whose two shares
  // are equal (most often: both empty) takes the request into the
  // micro-batch that is lighter over the whole rank, so a rank whose
  // devices each hold one of its requests still gets two micro-batches.
  int64_t rank_ctx[2] = {0, 0};
  int rank_count[2] = {0, 0};
  for (auto& [device, on_device] : by_device) {
    // Longest first (Algorithm 1, line "sort by context length, descending"):
    // placing large items first is what bounds the final gap by the largest
    // context. Equal lengths go by id so the result does not depend on the
    // order the caller listed the requests in.
    std::sort(on_device.begin(), on_device.end(),
              [](const RankRequest* a, const RankRequest* b) {
                if (a->context_tokens != b->context_tokens) {
                  return a->context_tokens > b->context_tokens;
                }
                return a->request_id < b->request_id;
              });
    int64_t ctx[2] = {0, 0};
    int count[2] = {0, 0};
    for (const RankRequest* r : on_device) {
      int mb;
      if (ctx[0] != ctx[1]) {
        mb = ctx[0] < ctx[1] ? 0 : 1;
      } else if (count[0] != count[1]) {
        mb = count[1] < count[0] ? 1 : 0;
      } else if (rank_ctx[0] != rank_ctx[1]) {
        mb = rank_ctx[1] < rank_ctx[0] ? 1 : 0;
      } else {
        mb = rank_count[1] < rank_count[0] ? 1 : 0;
      }
      ctx[mb] += r->context_tokens;
      ++count[mb];
      rank_ctx[mb] += r->context_tokens;
      ++rank_count[mb];
      plan.assignments.push_back({r->request_id, static_cast<MicroBatch>(mb)});
    }
  }
  SortById(plan.assignments);
  return plan;
}

absl::StatusOr<MicroBatchPlan> AssignByRequestCount(
    const std::vector<RankRequest>& requests, const MicroBatchPlan& previous) {
  RETURN_IF_ERROR(ValidateRequests(requests));
  std::unordered_map<uint64_t, MicroBatch> before;
  for (const MicroBatchAssignment& a : previous.assignments) {
    if (!before.emplace(a.request_id, a.micro_batch).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "previous plan assigns request ", a.request_id, " twice"));
    }
  }
  MicroBatchPlan plan;
  plan.assignments.reserve(requests.size());
  int count[2] = {0, 0};
  std::vector<uint64_t> fresh;
  for (const RankRequest& r : requests) {
    auto it = before.find(r.request_id);
    if (it == before.end()) {
      fresh.push_back(r.request_id);
      continue;
    }
    ++count[Index(it->second)];
    plan.assignments.push_back({r.request_id, it->second});
  }
  // Ids are issued in arrival order, so increasing id replays arrival order
  // whatever order the caller listed the requests in.
  std::sort(fresh.begin(), fresh.end());
  for (uint64_t id : fresh) {
    const int mb = count[1] < count[0] ? 1 : 0;
    ++count[mb];
    plan.assignments.push_back({id, static_cast<MicroBatch>(mb)});
  }
  SortById(plan.assignments);
  return plan;
}

absl::StatusOr<MicroBatchPlan> AssignMicroBatches(
    MicroBatchMode mode, const std::vector<RankRequest>& requests,
    const MicroBatchPlan& previous) {
  switch (mode) {
    case MicroBatchMode::kContextLength:
      return AssignByContextLength(requests);
    case MicroBatchMode::kRequestCount:
      return AssignByRequestCount(requests, previous);
  }
  return absl::InvalidArgumentError("unknown micro-batch mode");
}

absl::StatusOr<MicroBatchImbalance> Imbalance(
    const std::vector<RankRequest>& requests, const MicroBatchPlan& plan) {
  RETURN_IF_ERROR(ValidateRequests(requests));
  // A map rather than Find() so that a plan built by hand need not be sorted.
  std::unordered_map<uint64_t, MicroBatch> where;
  for (const MicroBatchAssignment& a : plan.assignments) {
    where.emplace(a.request_id, a.micro_batch);
  }
  std::map<DeviceKey, DeviceMicroBatchLoad> loads;
  MicroBatchImbalance out;
  for (const RankRequest& r : requests) {
    auto it = where.find(r.request_id);
    if (it == where.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the plan does not assign request ", r.request_id));
    }
    const int mb = Index(it->second);
    DeviceMicroBatchLoad& load = loads[Key(r.home)];
    load.device = r.home;
    load.context_tokens[mb] += r.context_tokens;
    ++load.requests[mb];
    out.rank_context_tokens[mb] += r.context_tokens;
    ++out.rank_requests[mb];
  }
  for (auto& [key, load] : loads) {
    load.imbalance = std::abs(load.context_tokens[0] - load.context_tokens[1]);
    out.sum_device_imbalance += load.imbalance;
    out.max_device_imbalance =
        std::max(out.max_device_imbalance, load.imbalance);
    out.devices.push_back(load);
  }
  out.token_imbalance =
      std::abs(out.rank_context_tokens[0] - out.rank_context_tokens[1]);
  return out;
}

absl::StatusOr<int> MaxBatchForSlo(double tbt_slo_ms,
                                   const StepCostModel& model,
                                   int64_t mean_context_tokens) {
  if (!std::isfinite(tbt_slo_ms) || tbt_slo_ms <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tbt_slo_ms must be finite and > 0, got ", tbt_slo_ms));
  }
  for (double p :
       {model.fixed_ms, model.per_request_ms, model.per_context_token_ms}) {
    if (!std::isfinite(p) || p < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step cost model parameters must be finite and >= 0, got ", p));
    }
  }
  if (mean_context_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("mean context must be >= 0, got ", mean_context_tokens));
  }
  // A relative slack so that a batch whose modelled step lands exactly on the
  // target (up to rounding of the model's decimal parameters) counts as
  // meeting it.
  const double limit = tbt_slo_ms * (1 + 1e-9);
  if (model.fixed_ms > limit) return 0;
  const double per_request =
      model.per_request_ms +
      model.per_context_token_ms * static_cast<double>(mean_context_tokens);
  if (per_request == 0) return kUnboundedBatch;
  const double b = std::floor((limit - model.fixed_ms) / per_request);
  if (b >= static_cast<double>(kUnboundedBatch)) return kUnboundedBatch;
  int batch = static_cast<int>(b);
  while (batch > 0 && model.fixed_ms + per_request * batch > limit) --batch;
  return batch;
}

StepCostEstimator::StepCostEstimator(const StepCostModel& prior)
    : StepCostEstimator(prior, Options()) {}

StepCostEstimator::StepCostEstimator(const StepCostModel& prior,
                                     const Options& options)
    : prior_(prior), options_(options), fit_(prior) {}

bool StepCostEstimator::Add(int batch, int64_t context_tokens, double step_ms,
                            double weight) {
  if (batch < 1 || context_tokens < 0 || !std::isfinite(step_ms) ||
      step_ms < 0 || !(weight > 0 && weight <= 1)) {
    return false;
  }
  const double x[3] = {1.0, static_cast<double>(batch),
                       static_cast<double>(context_tokens)};
  const double f =
      weight == 1 ? options_.forget : std::pow(options_.forget, weight);
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 3; ++j) {
      xx_[i][j] = f * xx_[i][j] + weight * x[i] * x[j];
    }
    xy_[i] = f * xy_[i] + weight * x[i] * step_ms;
  }
  weight_ = f * weight_ + weight;
  ++samples_;
  if (learned()) fit_ = Solve();
  return true;
}

StepCostModel StepCostEstimator::Model() const {
  return learned() ? fit_ : prior_;
}

StepCostModel StepCostEstimator::Solve() const {
  const double theta0[3] = {prior_.fixed_ms, prior_.per_request_ms,
                            prior_.per_context_token_ms};
  // Ridge towards the prior, prior_weight samples' worth, each parameter at
  // the scale of its feature's spread over the samples (the variance of the
  // batch, of the context; a feature never seen non-zero keeps its prior
  // exactly). Where the samples cannot tell two parameters apart (the batch
  // never changed) the floor of kFloor · mean square decides: the fixed
  // cost, whose pull is weakest, takes most of the difference. That errs
  // towards admitting more, which then shows in the steps, rather than
  // towards a cap that keeps the batch where nothing new can be learned.
  constexpr double kInterceptPull = 0.01, kFloor = 0.05;
  double lambda[3];
  lambda[0] = options_.prior_weight * kInterceptPull;
  for (int j = 1; j < 3; ++j) {
    const double mean = weight_ > 0 ? xx_[0][j] / weight_ : 0;
    const double mean_square = weight_ > 0 ? xx_[j][j] / weight_ : 0;
    lambda[j] = mean_square > 0
                    ? options_.prior_weight *
                          (std::max(mean_square - mean * mean, 0.0) +
                           kFloor * mean_square)
                    : options_.prior_weight;
  }
  // Least squares with the parameters in `zero` held at 0; a parameter that
  // comes out negative joins them and the rest is solved again.
  bool zero[3] = {false, false, false};
  double theta[3] = {0, 0, 0};
  for (int round = 0; round < 3; ++round) {
    int idx[3], n = 0;
    for (int j = 0; j < 3; ++j) {
      if (!zero[j]) idx[n++] = j;
    }
    double a[3][4] = {};
    for (int r = 0; r < n; ++r) {
      for (int c = 0; c < n; ++c) a[r][c] = xx_[idx[r]][idx[c]];
      a[r][r] += lambda[idx[r]];
      a[r][n] = xy_[idx[r]] + lambda[idx[r]] * theta0[idx[r]];
    }
    // Gaussian elimination with partial pivoting; the ridge keeps the
    // system positive definite.
    for (int c = 0; c < n; ++c) {
      int pivot = c;
      for (int r = c + 1; r < n; ++r) {
        if (std::abs(a[r][c]) > std::abs(a[pivot][c])) pivot = r;
      }
      for (int k = 0; k <= n; ++k) std::swap(a[c][k], a[pivot][k]);
      if (a[c][c] == 0) return prior_;
      for (int r = c + 1; r < n; ++r) {
        const double m = a[r][c] / a[c][c];
        for (int k = c; k <= n; ++k) a[r][k] -= m * a[c][k];
      }
    }
    double sol[3] = {0, 0, 0};
    for (int r = n - 1; r >= 0; --r) {
      double v = a[r][n];
      for (int k = r + 1; k < n; ++k) v -= a[r][k] * sol[k];
      sol[r] = v / a[r][r];
    }
    for (int j = 0; j < 3; ++j) theta[j] = 0;
    bool negative = false;
    for (int r = 0; r < n; ++r) {
      theta[idx[r]] = sol[r];
      if (!(sol[r] >= 0)) {
        zero[idx[r]] = true;
        negative = true;
      }
    }
    if (!negative) break;
    if (round == 2) {
      for (double& t : theta) t = std::max(t, 0.0);
    }
  }
  for (const double t : theta) {
    if (!std::isfinite(t)) return prior_;
  }
  return StepCostModel{theta[0], theta[1], theta[2]};
}

}  // namespace karat::coordinator
