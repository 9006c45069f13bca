// `karatctl bench`: the closed-loop workload driver. Up to `concurrency`
// sessions run at once (one thread each), each sending its planned turns in
// order and waiting for each to finish (plus the think time) before the
// next; a finished session's thread takes the next planned session.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "tools/karatctl/client.h"
#include "tools/karatctl/retry.h"
#include "tools/karatctl/workload.h"

namespace karat::ctl {

struct BenchOptions {
  std::string trace;
  WorkloadOptions workload;
  float temperature = 0;
  // Sessions in flight at once; 0: all of them.
  int concurrency = 0;
  // When > 0, the report counts the sessions served within this TBT target
  // (every turn succeeded and the session's TBT p99 is at most this).
  double tbt_slo_ms = 0;
  std::string json_path;  // also write the report here as JSON when set
  // --retry: every turn has an idempotency key and is retried as
  // RetryPolicy says; session calls are retried too.
  RetryPolicy retry;
  // --tokens-out: one JSON line per turn (TurnRecordJson) when set.
  std::string tokens_out_path;
};

// The figures of one run. Latencies are client-side: TTFT from sending the
// request to the first token, TBT between consecutive tokens of a turn.
struct BenchReport {
  int sessions = 0;
  int concurrency = 0;
  int turns = 0;          // planned
  int turns_ok = 0;       // completed (possibly after retries)
  int turns_failed = 0;   // lost: never completed
  bool retry = false;     // --retry was on
  int turns_retried = 0;  // needed more than one attempt
  int64_t attempts = 0;   // Generate calls, every attempt of every turn
  // Tokens at a position already received, and position gaps (retry.h).
  int duplicate_tokens = 0;
  int position_gaps = 0;
  // Failed CreateSession / CloseSession attempts.
  int session_call_errors = 0;
  // Each turn's longest gap between consecutive tokens (a wait across a
  // retry included), over the turns with two tokens or more, and over
  // those of them that were retried.
  double turn_max_gap_ms_p50 = 0, turn_max_gap_ms_p99 = 0,
         turn_max_gap_ms_max = 0;
  double retried_turn_max_gap_ms_p50 = 0, retried_turn_max_gap_ms_p99 = 0,
         retried_turn_max_gap_ms_max = 0;
  int sessions_ok = 0;           // sessions whose every turn succeeded
  int64_t prompt_tokens = 0;     // of the turns that succeeded
  int64_t generated_tokens = 0;  // every token received, failed turns too
  double wall_s = 0;
  double ttft_ms_p50 = 0, ttft_ms_p90 = 0, ttft_ms_p99 = 0, ttft_ms_mean = 0;
  double tbt_ms_p50 = 0, tbt_ms_p90 = 0, tbt_ms_p99 = 0, tbt_ms_mean = 0;
  // Only meaningful when tbt_slo_ms > 0.
  double tbt_slo_ms = 0;
  int sessions_within_tbt_slo = 0;
  double tbt_within_slo_fraction = 0;  // of all TBT samples
  // Lost turns by their last attempt's gRPC status code name
  // ("RESOURCE_EXHAUSTED": 3).
  std::map<std::string, int> errors_by_code;
  // Failed Generate attempts by code (equal to errors_by_code without
  // --retry).
  std::map<std::string, int> attempt_errors_by_code;
  // The first few error messages, for the reader.
  std::vector<std::string> error_samples;

  double throughput() const {
    return wall_s > 0 ? static_cast<double>(generated_tokens) / wall_s : 0;
  }
};

// The report as one JSON object on one line (keys: sessions, concurrency,
// turns, turns_ok, turns_failed, sessions_ok, prompt_tokens,
// generated_tokens, wall_s, throughput_tokens_per_s, ttft_ms_{p50,p90,p99,
// mean}, tbt_ms_{p50,p90,p99,mean}, errors, errors_by_code, error_samples;
// when a TBT target was set, tbt_slo_ms, sessions_within_tbt_slo,
// tbt_within_slo_fraction; then retry, turns_completed, turns_retried,
// turns_lost, attempts, attempt_errors_by_code, duplicate_tokens,
// position_gaps, session_call_errors, turn_max_gap_ms_{p50,p99,max},
// retried_turn_max_gap_ms_{p50,p99,max}), ending with a newline. TTFT runs
// from a turn's first attempt to its first token, TBT between consecutive
// tokens of a turn that completed, across its retries.
std::string BenchReportJson(const BenchReport& report);

// Runs the workload against `client`, printing progress to stderr about
// once a second and the report to stdout. Returns the process exit code:
// 0 when every turn completed without a protocol error, 1 when any was lost
// or had one (or an output file could not be written), 2 for bad
// options/trace.
int RunBench(Client& client, const BenchOptions& options);

}  // namespace karat::ctl
