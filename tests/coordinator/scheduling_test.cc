#include "coordinator/scheduling.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <vector>

namespace karat::coordinator {
namespace {

constexpr MicroBatch k0 = MicroBatch::k0;
constexpr MicroBatch k1 = MicroBatch::k1;

const HomeDevice kDevA{1, 0};
const HomeDevice kDevB{1, 1};
const HomeDevice kDevC{2, 0};

RankRequest Req(uint64_t id, HomeDevice home, int64_t ctx) {
  return RankRequest{id, home, ctx};
}

// The request ids a plan puts into `mb`, increasing.
std::vector<uint64_t> Members(const MicroBatchPlan& plan, MicroBatch mb) {
  std::vector<uint64_t> out;
  for (const MicroBatchAssignment& a : plan.assignments) {
    if (a.micro_batch == mb) out.push_back(a.request_id);
  }
  return out;
}

MicroBatchPlan Cmr(const std::vector<RankRequest>& requests) {
  absl::StatusOr<MicroBatchPlan> plan = AssignByContextLength(requests);
  REQUIRE(plan.ok());
  return *plan;
}

MicroBatchPlan ByCount(const std::vector<RankRequest>& requests,
                       const MicroBatchPlan& previous) {
  absl::StatusOr<MicroBatchPlan> plan =
      AssignByRequestCount(requests, previous);
  REQUIRE(plan.ok());
  return *plan;
}

MicroBatchImbalance Measure(const std::vector<RankRequest>& requests,
                            const MicroBatchPlan& plan) {
  absl::StatusOr<MicroBatchImbalance> m = Imbalance(requests, plan);
  REQUIRE(m.ok());
  return *m;
}

// ---------------------------------------------------------------------------
// CMR
// ---------------------------------------------------------------------------

TEST_CASE("cmr: hand-worked example on one device") {
  // Longest first: 10 -> µB0 (both empty, equal counts); 7 -> µB1 (0 < 10);
  // 5 -> µB1 (7 < 10, now 12); 4 -> µB0 (10 < 12, now 14);
  // 1 -> µB1 (12 < 14, now 13). Final 14 vs 13.
  std::vector<RankRequest> r = {Req(1, kDevA, 10), Req(2, kDevA, 7),
                                Req(3, kDevA, 5), Req(4, kDevA, 4),
                                Req(5, kDevA, 1)};
  MicroBatchPlan plan = Cmr(r);
  CHECK(Members(plan, k0) == std::vector<uint64_t>{1, 4});
  CHECK(Members(plan, k1) == std::vector<uint64_t>{2, 3, 5});
  MicroBatchImbalance m = Measure(r, plan);
  REQUIRE(m.devices.size() == 1);
  CHECK(m.devices[0].context_tokens[0] == 14);
  CHECK(m.devices[0].context_tokens[1] == 13);
  CHECK(m.devices[0].requests[0] == 2);
  CHECK(m.devices[0].requests[1] == 3);
  CHECK(m.sum_device_imbalance == 1);
  CHECK(m.max_device_imbalance == 1);
  CHECK(m.token_imbalance == 1);
  CHECK(plan.Find(3) == k1);
  CHECK_FALSE(plan.Find(9).has_value());
}

TEST_CASE("cmr: equal contexts go by request id and alternate") {
  // Listed in reverse; ids decide: 1 -> µB0, 2 -> µB1 (5 > 0 on µB0),
  // 3 -> µB0 (5 = 5, 1 = 1 requests), 4 -> µB1.
  std::vector<RankRequest> r = {Req(4, kDevA, 5), Req(3, kDevA, 5),
                                Req(2, kDevA, 5), Req(1, kDevA, 5)};
  MicroBatchPlan plan = Cmr(r);
  CHECK(Members(plan, k0) == std::vector<uint64_t>{1, 3});
  CHECK(Members(plan, k1) == std::vector<uint64_t>{2, 4});
}

TEST_CASE("cmr: equal context sums go to the micro-batch with fewer requests") {
  // 4 -> µB0, 4 -> µB1, then the zero-length requests always see 4 = 4:
  // id 3 -> µB0 (1 = 1 requests, then µB0), id 4 -> µB1 (it has 1 < 2),
  // id 5 -> µB0 (2 = 2).
  std::vector<RankRequest> r = {Req(1, kDevA, 4), Req(2, kDevA, 4),
                                Req(3, kDevA, 0), Req(4, kDevA, 0),
                                Req(5, kDevA, 0)};
  MicroBatchPlan plan = Cmr(r);
  CHECK(Members(plan, k0) == std::vector<uint64_t>{1, 3, 5});
  CHECK(Members(plan, k1) == std::vector<uint64_t>{2, 4});
}

TEST_CASE("cmr: devices are balanced independently") {
  std::vector<RankRequest> a = {Req(1, kDevA, 10), Req(2, kDevA, 7),
                                Req(3, kDevA, 5), Req(4, kDevA, 4),
                                Req(5, kDevA, 1)};
  std::vector<RankRequest> b = {Req(6, kDevB, 8), Req(7, kDevB, 8),
                                Req(8, kDevB, 3)};
  std::vector<RankRequest> c = {Req(9, kDevC, 100)};
  std::vector<RankRequest> all;
  // Interleave the devices to show the input order does not matter either.
  for (size_t i = 0; i < 5; ++i) {
    all.push_back(a[i]);
    if (i < b.size()) all.push_back(b[i]);
    if (i < c.size()) all.push_back(c[i]);
  }
  MicroBatchPlan together = Cmr(all);
  // Each device's split is as good as when it is planned alone; only which
  // micro-batch takes which side of a tie may differ.
  for (const auto* part : {&a, &b, &c}) {
    CHECK(Measure(*part, Cmr(*part)).sum_device_imbalance ==
          Measure(*part, together).sum_device_imbalance);
  }
  // A: 10 -> µB0, 7 -> µB1, 5 -> µB1, 4 -> µB0, 1 -> µB1: 14 vs 13.
  // B: ties on the device go to the micro-batch lighter over the rank:
  // id 6 (8) -> µB1 (rank 14 vs 13), id 7 (8) -> µB0, id 8 (3) -> µB1 (tie
  // on B, rank 22 vs 21): 8 vs 11. C: 100 -> µB0 (rank 22 vs 24).
  // Rank: 122 vs 24.
  MicroBatchImbalance m = Measure(all, together);
  REQUIRE(m.devices.size() == 3);
  CHECK(m.devices[0].device == kDevA);
  CHECK(m.devices[1].device == kDevB);
  CHECK(m.devices[2].device == kDevC);
  CHECK(m.devices[1].imbalance == 3);
  CHECK(m.devices[2].imbalance == 100);
  CHECK(m.sum_device_imbalance == 1 + 3 + 100);
  CHECK(m.max_device_imbalance == 100);
  CHECK(m.rank_context_tokens[0] == 14 + 8 + 100);
  CHECK(m.rank_context_tokens[1] == 13 + 11);
  CHECK(m.rank_requests[0] == 2 + 1 + 1);
  CHECK(m.rank_requests[1] == 3 + 2);
  CHECK(m.token_imbalance == 122 - 24);
}

TEST_CASE("cmr: one request per device still fills both micro-batches") {
  // Every device holds one of the rank's requests: each is a tie on its
  // device, decided by the rank-wide load.
  const HomeDevice devs[] = {kDevA, kDevB, kDevC};
  std::vector<RankRequest> r;
  for (int i = 0; i < 3; ++i) r.push_back(Req(uint64_t(i + 1), devs[i], 50));
  MicroBatchPlan plan = Cmr(r);
  CHECK(Members(plan, k0) == std::vector<uint64_t>{1, 3});
  CHECK(Members(plan, k1) == std::vector<uint64_t>{2});
}

TEST_CASE("cmr: empty rank and bad input") {
  CHECK(Cmr({}).assignments.empty());
  CHECK(AssignByContextLength({Req(1, kDevA, 3), Req(1, kDevB, 4)})
            .status()
            .code() == absl::StatusCode::kInvalidArgument);
  CHECK(AssignByContextLength({Req(1, kDevA, -1)}).status().code() ==
        absl::StatusCode::kInvalidArgument);
  MicroBatchPlan partial;
  partial.assignments = {{1, k0}};
  CHECK(Imbalance({Req(1, kDevA, 3), Req(2, kDevA, 4)}, partial)
            .status()
            .code() == absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------
// Count mode
// ---------------------------------------------------------------------------

TEST_CASE("count mode: append-only by request count, ties to µB0") {
  MicroBatchPlan plan;
  std::vector<RankRequest> r = {Req(1, kDevA, 100)};
  plan = ByCount(r, plan);
  CHECK(plan.Find(1) == k0);
  r.push_back(Req(2, kDevA, 1));
  r.push_back(Req(3, kDevA, 1));
  plan = ByCount(r, plan);
  // 2 -> µB1 (1 vs 0), 3 -> µB0 (1 = 1): contexts do not matter.
  CHECK(Members(plan, k0) == std::vector<uint64_t>{1, 3});
  CHECK(Members(plan, k1) == std::vector<uint64_t>{2});
  // Request 1 and 3 finish; 2 stays in µB1; new 4 and 5 go 4 -> µB0 (0 < 1),
  // 5 -> µB0 (1 = 1 ties to µB0).
  r = {Req(2, kDevA, 1), Req(5, kDevA, 9), Req(4, kDevA, 9)};
  plan = ByCount(r, plan);
  CHECK(Members(plan, k0) == std::vector<uint64_t>{4, 5});
  CHECK(Members(plan, k1) == std::vector<uint64_t>{2});
  CHECK(plan.assignments.size() == 3);

  MicroBatchPlan twice;
  twice.assignments = {{2, k0}, {2, k1}};
  CHECK(AssignByRequestCount(r, twice).status().code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("mode switch dispatches to either policy") {
  std::vector<RankRequest> r = {Req(1, kDevA, 10), Req(2, kDevA, 7),
                                Req(3, kDevA, 5)};
  MicroBatchPlan prev;
  prev.assignments = {{1, k1}};
  auto cmr = AssignMicroBatches(MicroBatchMode::kContextLength, r, prev);
  auto cnt = AssignMicroBatches(MicroBatchMode::kRequestCount, r, prev);
  REQUIRE(cmr.ok());
  REQUIRE(cnt.ok());
  CHECK(*cmr == Cmr(r));  // CMR ignores the previous plan
  CHECK(*cnt == ByCount(r, prev));
  CHECK(cnt->Find(1) == k1);
}

// A reachable state in which count mode beats CMR, so "CMR is never worse"
// does not hold in general: greedy longest-first is not an optimal partition
// (two-way partition is NP-hard), and count mode can land on the optimum by
// chance.
TEST_CASE("count mode can beat CMR on a lucky history") {
  // Arrivals (id: context): 1:3, 2:2, 3:3, 4:2, 5:9, 6:2, then 5 finishes.
  std::vector<RankRequest> all = {Req(1, kDevA, 3), Req(2, kDevA, 2),
                                  Req(3, kDevA, 3), Req(4, kDevA, 2),
                                  Req(5, kDevA, 9), Req(6, kDevA, 2)};
  MicroBatchPlan plan;
  std::vector<RankRequest> live;
  for (const RankRequest& r : all) {
    live.push_back(r);
    plan = ByCount(live, plan);
  }
  live.erase(live.begin() + 4);  // request 5 finishes
  plan = ByCount(live, plan);
  // µB0 {1, 3} = 6, µB1 {2, 4, 6} = 6: perfectly balanced.
  CHECK(Members(plan, k0) == std::vector<uint64_t>{1, 3});
  CHECK(Members(plan, k1) == std::vector<uint64_t>{2, 4, 6});
  CHECK(Measure(live, plan).sum_device_imbalance == 0);
  // CMR: 3 -> µB0, 3 -> µB1, 2 -> µB0 (tie), 2 -> µB1, 2 -> µB0: 7 vs 5.
  MicroBatchPlan cmr = Cmr(live);
  CHECK(Measure(live, cmr).sum_device_imbalance == 2);
}

// Random rank histories with a fixed seed. Raw engine output (not
// std::uniform_int_distribution, whose output differs between standard
// libraries) keeps the cases the same everywhere.
struct RandomHistory {
  std::vector<RankRequest> live;
  MicroBatchPlan count_plan;
};

RandomHistory MakeHistory(std::mt19937_64& rng) {
  auto pick = [&rng](uint64_t n) { return rng() % n; };
  const int devices = 1 + int(pick(4));
  const int events = 4 + int(pick(60));
  RandomHistory h;
  uint64_t next_id = 1;
  for (int e = 0; e < events; ++e) {
    if (!h.live.empty() && pick(4) == 0) {
      h.live.erase(h.live.begin() + long(pick(h.live.size())));
    } else {
      const HomeDevice d{uint32_t(1 + pick(2)),
                         int32_t(pick(uint64_t(devices)))};
      // Context lengths spread over three orders of magnitude, as in
      // multi-turn chat.
      const int64_t ctx = int64_t(1 + pick(uint64_t(1) << (4 + pick(9))));
      h.live.push_back(Req(next_id++, d, ctx));
    }
    // Count mode only ever sees arrivals and departures.
    h.count_plan = ByCount(h.live, h.count_plan);
  }
  return h;
}

TEST_CASE("cmr vs count mode on random histories") {
  std::mt19937_64 rng(20240611);
  constexpr int kCases = 2000;
  int64_t cmr_total = 0;
  int64_t count_total = 0;
  int cmr_worse = 0;
  int bound_violations = 0;
  for (int c = 0; c < kCases; ++c) {
    RandomHistory h = MakeHistory(rng);
    MicroBatchImbalance cmr = Measure(h.live, Cmr(h.live));
    MicroBatchImbalance cnt = Measure(h.live, h.count_plan);
    cmr_total += cmr.sum_device_imbalance;
    count_total += cnt.sum_device_imbalance;
    if (cmr.sum_device_imbalance > cnt.sum_device_imbalance) ++cmr_worse;
    // The property that always holds (greedy bound): on every device the
    // gap is at most the longest context there. Putting x on the lighter
    // side turns a gap g into |g − x| <= max(g, x).
    std::map<std::pair<uint32_t, int32_t>, int64_t> longest;
    for (const RankRequest& r : h.live) {
      int64_t& l = longest[{r.home.node_id, r.home.device}];
      l = std::max(l, r.context_tokens);
    }
    for (const DeviceMicroBatchLoad& d : cmr.devices) {
      if (d.imbalance > longest[{d.device.node_id, d.device.device}]) {
        ++bound_violations;
      }
    }
  }
  // CMR is not pointwise never-worse (see the lucky-history case above), so
  // the pointwise claim is not asserted. What is asserted: CMR wins clearly
  // in aggregate and loses at most on rare histories. With this seed it
  // loses on none and its total is 0.54 of count mode's; much of what is
  // left is irreducible (a device whose longest context exceeds the rest).
  INFO("cmr total " << cmr_total << ", count total " << count_total
                    << ", cmr worse in " << cmr_worse << " of " << kCases);
  CHECK(bound_violations == 0);
  CHECK(cmr_total * 3 < count_total * 2);
  CHECK(cmr_worse * 100 <= kCases);
}

TEST_CASE("plans do not depend on input order") {
  std::mt19937_64 rng(7);
  for (int c = 0; c < 200; ++c) {
    RandomHistory h = MakeHistory(rng);
    const MicroBatchPlan cmr = Cmr(h.live);
    const MicroBatchPlan cnt = ByCount(h.live, h.count_plan);
    // Sorted by id, each id once.
    for (size_t i = 1; i < cmr.assignments.size(); ++i) {
      CHECK(cmr.assignments[i - 1].request_id < cmr.assignments[i].request_id);
    }
    std::vector<RankRequest> shuffled = h.live;
    for (int s = 0; s < 3; ++s) {
      for (size_t i = shuffled.size(); i > 1; --i) {
        std::swap(shuffled[i - 1], shuffled[rng() % i]);
      }
      CHECK(Cmr(shuffled) == cmr);
      CHECK(ByCount(shuffled, h.count_plan) == cnt);
      CHECK(Measure(shuffled, cmr).sum_device_imbalance ==
            Measure(h.live, cmr).sum_device_imbalance);
    }
  }
}

// ---------------------------------------------------------------------------
// Admission
// ---------------------------------------------------------------------------

TEST_CASE("max batch for a TBT target") {
  StepCostModel m{5.0, 0.5, 0.0001};
  // Per request 0.5 + 0.0001 * 4000 = 0.9 ms; (50 − 5) / 0.9 = 50 exactly,
  // which floating point computes as 49.99…; the batch of 50 meets it.
  CHECK(*MaxBatchForSlo(50.0, m, 4000) == 50);
  CHECK(*MaxBatchForSlo(49.9, m, 4000) == 49);
  CHECK(*MaxBatchForSlo(4.0, m, 4000) == 0);  // even an empty step is late
  CHECK(*MaxBatchForSlo(10.0, StepCostModel{1.0, 0, 0}, 1000) ==
        kUnboundedBatch);
  CHECK(*MaxBatchForSlo(10.0, StepCostModel{0, 1e-30, 0}, 0) ==
        kUnboundedBatch);
  CHECK(MaxBatchForSlo(0, m, 1).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(MaxBatchForSlo(10, StepCostModel{-1, 0, 0}, 1).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(MaxBatchForSlo(10, m, -1).status().code() ==
        absl::StatusCode::kInvalidArgument);
}

// The estimator's fit, checked against the parameters it was fed.
void CheckModel(const StepCostModel& got, const StepCostModel& want,
                double tolerance) {
  INFO("fixed " << got.fixed_ms << " per request " << got.per_request_ms
                << " per token " << got.per_context_token_ms);
  CHECK(std::abs(got.fixed_ms - want.fixed_ms) <= tolerance);
  CHECK(std::abs(got.per_request_ms - want.per_request_ms) <= tolerance);
  CHECK(std::abs(got.per_context_token_ms - want.per_context_token_ms) <=
        tolerance * 1e-3);
}

double StepMs(const StepCostModel& m, int batch, int64_t context) {
  return m.fixed_ms + m.per_request_ms * batch +
         m.per_context_token_ms * double(context);
}

TEST_CASE("step cost: the prior until enough steps, then the measured fit") {
  const StepCostModel prior{2.0, 0.5, 0.0005};
  const StepCostModel truth{30.0, 12.0, 0.002};
  StepCostEstimator e(prior);
  CheckModel(e.Model(), prior, 1e-12);
  // Batches 1..6 with varied contexts, noiseless.
  std::mt19937_64 rng(7);
  int n = 0;
  for (; n < 15; ++n) {
    const int b = 1 + int(rng() % 6);
    const int64_t ctx = b * int64_t(100 + rng() % 4000);
    REQUIRE(e.Add(b, ctx, StepMs(truth, b, ctx)));
    CheckModel(e.Model(), prior, 1e-12);  // fewer than min_samples
    CHECK_FALSE(e.learned());
  }
  for (; n < 400; ++n) {
    const int b = 1 + int(rng() % 6);
    const int64_t ctx = b * int64_t(100 + rng() % 4000);
    REQUIRE(e.Add(b, ctx, StepMs(truth, b, ctx)));
  }
  CHECK(e.samples() == 400);
  CHECK(e.learned());
  // The prior's pull (1 sample's worth against ~200 effective) is small.
  CheckModel(e.Model(), truth, 0.5);
  // The cap follows: with the prior a 100 ms target admits (100 - 2) /
  // (0.5 + 0.5) = 98 requests of 1000 tokens; measured, (100 - 30) /
  // (12 + 2) = 5.
  CHECK(*MaxBatchForSlo(100, prior, 1000) == 98);
  CHECK(*MaxBatchForSlo(100, e.Model(), 1000) == 5);
}

TEST_CASE("step cost: what the steps cannot tell apart stays near the prior") {
  const StepCostModel prior{2.0, 0.5, 0.0};
  StepCostEstimator e(prior);
  // Always one request and no context: only fixed + per_request = 20.5 is
  // measured. Most of the excess goes to the fixed cost (a larger batch is
  // not assumed slower than measured), neither goes negative, and the
  // per-token cost, never exercised, keeps its prior.
  for (int i = 0; i < 200; ++i) REQUIRE(e.Add(1, 0, 20.5));
  const StepCostModel m = e.Model();
  CHECK(std::abs(m.fixed_ms + m.per_request_ms - 20.5) < 0.2);
  CHECK(m.fixed_ms > 15.0);
  CHECK(m.per_request_ms >= prior.per_request_ms);
  CHECK(m.per_request_ms < 4.0);
  CHECK(m.per_context_token_ms == 0.0);
}

TEST_CASE("step cost: parameters stay >= 0 and recent steps weigh most") {
  StepCostEstimator e(StepCostModel{2.0, 0.5, 0.0005});
  // Steps that get faster with the batch would fit a negative per-request
  // cost: it is held at 0 and the rest fitted.
  for (int i = 0; i < 100; ++i) {
    const int b = 1 + i % 8;
    REQUIRE(e.Add(b, 0, 50.0 - 4.0 * b));
  }
  StepCostModel m = e.Model();
  CHECK(m.per_request_ms == 0.0);
  CHECK(m.fixed_ms >= 0.0);
  CHECK(m.per_context_token_ms >= 0.0);
  CHECK(*MaxBatchForSlo(100, m, 0) == kUnboundedBatch);
  // The rank slows down: after a few forgetting windows the fit follows.
  const StepCostModel slow{10.0, 20.0, 0.0};
  for (int i = 0; i < 3000; ++i) {
    const int b = 1 + i % 8;
    REQUIRE(e.Add(b, 0, StepMs(slow, b, 0)));
  }
  m = e.Model();
  CHECK(std::abs(m.fixed_ms - slow.fixed_ms) < 1.0);  // the prior's pull
  CHECK(std::abs(m.per_request_ms - slow.per_request_ms) < 0.5);
}

TEST_CASE("step cost: bad samples are ignored") {
  StepCostEstimator e(StepCostModel{2.0, 0.5, 0.0005}, {0.99, 1, 0});
  CHECK_FALSE(e.Add(0, 10, 5.0));
  CHECK_FALSE(e.Add(1, -1, 5.0));
  CHECK_FALSE(e.Add(1, 10, -5.0));
  CHECK_FALSE(e.Add(1, 10, std::nan("")));
  CHECK_FALSE(e.Add(1, 10, std::numeric_limits<double>::infinity()));
  CHECK(e.samples() == 0);
  // min_samples 0: the first good sample already moves the fit.
  CHECK(e.Add(2, 100, 40.0));
  const StepCostModel m = e.Model();
  CHECK(StepMs(m, 2, 100) > StepMs(StepCostModel{2.0, 0.5, 0.0005}, 2, 100));
  CHECK(std::isfinite(m.fixed_ms));
}

}  // namespace
}  // namespace karat::coordinator
