// The closed-loop workload of `karatctl bench`: conversations taken from the
// kvcache-tester trace (one row per LLM call) and scaled to fit the machine.
// Pure functions; deterministic for a given seed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace karat::ctl {

// One row of requests.csv (the columns the driver uses).
struct TraceCall {
  std::string trace;
  std::string agent;
  int idx = 0;
  int64_t in = 0;
  int64_t out = 0;
  int64_t new_prefill_tokens = 0;
  double think_time = 0;
};

// Reads the CSV (header row naming at least trace, agent, idx, in, out,
// new_prefill_tokens, think_time). Errors name the file and line.
absl::StatusOr<std::vector<TraceCall>> ReadTrace(const std::string& path);

struct WorkloadOptions {
  int sessions = 8;
  int turns = 3;
  double scale = 1000;
  // Divides the trace's output tokens; 0: the same as `scale`. A smaller
  // value than `scale` keeps decode (what TBT measures) long while the
  // prompts stay short.
  double output_scale = 0;
  int max_new_tokens_cap = 4096;
  double think_scale = 0;
  uint64_t seed = 1;
};

struct PlannedTurn {
  std::string prompt;  // printable bytes, one token each
  int max_new_tokens = 1;
  double think_seconds = 0;  // wait before sending the turn
  // What the trace said (for the report).
  int64_t trace_in = 0;
  int64_t trace_out = 0;
};

struct PlannedSession {
  std::string trace;
  std::vector<PlannedTurn> turns;
};

// Takes the `main`-agent conversations of `sessions` distinct traces that
// have at least `turns` calls (chosen by a seeded shuffle) and scales their
// first `turns` calls: prompt = max(1, round(new_prefill_tokens / scale))
// random printable bytes; max_new_tokens = max(1, min(cap, round(out /
// output_scale))) (output_scale 0: scale); think = think_time *
// think_scale. INVALID_ARGUMENT when too few traces qualify or an option is
// out of range.
absl::StatusOr<std::vector<PlannedSession>> PlanWorkload(
    const std::vector<TraceCall>& calls, const WorkloadOptions& options);

// p in [0, 100], nearest rank; 0 for an empty set.
double Percentile(std::vector<double> values, double p);

}  // namespace karat::ctl
