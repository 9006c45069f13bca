#include "tools/karatctl/bench.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <numeric>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/json.h"

namespace karat::ctl {
namespace {

// Error messages kept for the report.
constexpr size_t kErrorSamples = 10;

struct Totals {
  absl::Mutex mu;
  std::vector<double> ttft_ms ABSL_GUARDED_BY(mu);
  std::vector<double> tbt_ms ABSL_GUARDED_BY(mu);
  std::vector<double> max_gap_ms ABSL_GUARDED_BY(mu);
  std::vector<double> retried_max_gap_ms ABSL_GUARDED_BY(mu);
  std::vector<std::string> errors ABSL_GUARDED_BY(mu);
  std::map<std::string, int> errors_by_code ABSL_GUARDED_BY(mu);
  std::map<std::string, int> attempt_errors_by_code ABSL_GUARDED_BY(mu);
  int64_t prompt_tokens ABSL_GUARDED_BY(mu) = 0;
  int64_t attempts ABSL_GUARDED_BY(mu) = 0;
  int duplicate_tokens ABSL_GUARDED_BY(mu) = 0;
  int position_gaps ABSL_GUARDED_BY(mu) = 0;
  int session_call_errors ABSL_GUARDED_BY(mu) = 0;
  int sessions_ok ABSL_GUARDED_BY(mu) = 0;
  int sessions_within_slo ABSL_GUARDED_BY(mu) = 0;
  // --tokens-out, one line per turn as it ends.
  std::ofstream tokens_out ABSL_GUARDED_BY(mu);
  std::atomic<int64_t> generated{0};
  std::atomic<int> turns_done{0};
  std::atomic<int> turns_failed{0};
  std::atomic<int> turns_retried{0};
};

std::string Describe(const absl::Status& st) {
  return absl::StrCat(StatusCodeName(st.code()), ": ", st.message());
}

void RunSession(Client& client, const PlannedSession& plan, int index,
                const std::string& run_id, const BenchOptions& o,
                Totals* totals) {
  bool all_ok = true;
  std::vector<double> session_tbt;
  const uint64_t seed = o.workload.seed + index;
  std::vector<absl::Status> session_errors;
  auto session = CreateSessionRetrying(client, seed, o.retry, &session_errors);
  const std::string session_id = session.ok() ? session->session_id() : "";
  for (size_t t = 0; t < plan.turns.size(); ++t) {
    const PlannedTurn& turn = plan.turns[t];
    const std::string key =
        o.retry.enabled ? TurnKey(run_id, index, static_cast<int>(t)) : "";
    TurnRecord rec;
    if (!session.ok()) {
      rec.not_started = absl::Status(
          session.status().code(),
          absl::StrCat("CreateSession: ", session.status().message()));
    } else {
      if (turn.think_seconds > 0 && t > 0)
        std::this_thread::sleep_for(
            std::chrono::duration<double>(turn.think_seconds));
      v1::GenerateRequest req;
      req.set_session_id(session_id);
      req.set_prompt(turn.prompt);
      req.set_max_new_tokens(turn.max_new_tokens);
      req.set_temperature(o.temperature);
      if (o.retry.enabled) req.set_idempotency_key(key);
      rec = RunTurn(client, req, o.retry,
                    [&](const v1::GeneratedToken&) { totals->generated++; });
    }
    if (rec.completed) {
      totals->turns_done++;
    } else {
      totals->turns_failed++;
      all_ok = false;
    }
    if (rec.retried()) totals->turns_retried++;
    const std::vector<double> tbt = rec.tbt_ms();
    if (rec.completed)
      session_tbt.insert(session_tbt.end(), tbt.begin(), tbt.end());
    absl::MutexLock lock(&totals->mu);
    totals->attempts += rec.attempts;
    totals->duplicate_tokens += rec.duplicate_tokens;
    totals->position_gaps += rec.position_gaps;
    for (const absl::Status& st : rec.attempt_errors)
      totals->attempt_errors_by_code[StatusCodeName(st.code())]++;
    if (rec.tokens.size() >= 2) {
      totals->max_gap_ms.push_back(rec.max_gap_ms());
      if (rec.retried()) totals->retried_max_gap_ms.push_back(rec.max_gap_ms());
    }
    if (rec.completed) {
      totals->prompt_tokens += static_cast<int64_t>(turn.prompt.size());
      if (!rec.tokens.empty()) totals->ttft_ms.push_back(rec.ttft_ms());
      totals->tbt_ms.insert(totals->tbt_ms.end(), tbt.begin(), tbt.end());
    } else {
      const absl::Status& last = rec.attempt_errors.empty()
                                     ? rec.not_started
                                     : rec.attempt_errors.back();
      totals->errors_by_code[StatusCodeName(last.code())]++;
      totals->errors.push_back(absl::StrFormat(
          "session %d (%s) turn %d: %s%s", index, plan.trace, t, Describe(last),
          rec.attempts > 1 ? absl::StrCat(" (", rec.attempts, " attempts)")
                           : ""));
    }
    if (rec.duplicate_tokens + rec.position_gaps > 0) {
      totals->errors.push_back(absl::StrFormat(
          "session %d (%s) turn %d: %d tokens at positions already received, "
          "%d position gaps",
          index, plan.trace, t, rec.duplicate_tokens, rec.position_gaps));
    }
    if (totals->tokens_out.is_open())
      totals->tokens_out << TurnRecordJson(index, static_cast<int>(t), seed,
                                           session_id, key, rec)
                         << std::flush;
  }
  absl::Status closed = absl::OkStatus();
  if (session.ok())
    closed = CloseSessionRetrying(client, session_id, o.retry, &session_errors);
  absl::MutexLock lock(&totals->mu);
  totals->session_call_errors += static_cast<int>(session_errors.size());
  if (!closed.ok()) {
    totals->errors.push_back(absl::StrFormat("session %d: CloseSession: %s",
                                             index, Describe(closed)));
  }
  if (all_ok) {
    totals->sessions_ok++;
    if (o.tbt_slo_ms > 0 &&
        Percentile(std::move(session_tbt), 99) <= o.tbt_slo_ms)
      totals->sessions_within_slo++;
  }
}

double Mean(const std::vector<double>& v) {
  if (v.empty()) return 0;
  return std::accumulate(v.begin(), v.end(), 0.0) /
         static_cast<double>(v.size());
}

// A finite number in JSON (NaN and infinities are not JSON).
std::string JsonNumber(double v) {
  if (!std::isfinite(v)) return "null";
  return absl::StrFormat("%.3f", v);
}

// {"CODE": n, ...}
std::string CodeCounts(const std::map<std::string, int>& counts) {
  std::string out = "{";
  for (const auto& [code, n] : counts)
    absl::StrAppend(&out, out.size() > 1 ? ", " : "",
                    JsonQuote(code, /*ascii=*/true), ": ", n);
  return out + "}";
}

double Max(const std::vector<double>& v) {
  return v.empty() ? 0 : *std::max_element(v.begin(), v.end());
}

}  // namespace

std::string BenchReportJson(const BenchReport& r) {
  std::string out = absl::StrFormat(
      "{\"sessions\": %d, \"concurrency\": %d, \"turns\": %d, \"turns_ok\": "
      "%d, "
      "\"turns_failed\": %d, \"sessions_ok\": %d, \"prompt_tokens\": %d, "
      "\"generated_tokens\": %d, \"wall_s\": %s, \"throughput_tokens_per_s\": "
      "%s",
      r.sessions, r.concurrency, r.turns, r.turns_ok, r.turns_failed,
      r.sessions_ok, r.prompt_tokens, r.generated_tokens, JsonNumber(r.wall_s),
      JsonNumber(r.throughput()));
  const std::pair<const char*, double> latencies[] = {
      {"ttft_ms_p50", r.ttft_ms_p50}, {"ttft_ms_p90", r.ttft_ms_p90},
      {"ttft_ms_p99", r.ttft_ms_p99}, {"ttft_ms_mean", r.ttft_ms_mean},
      {"tbt_ms_p50", r.tbt_ms_p50},   {"tbt_ms_p90", r.tbt_ms_p90},
      {"tbt_ms_p99", r.tbt_ms_p99},   {"tbt_ms_mean", r.tbt_ms_mean}};
  for (const auto& [key, value] : latencies)
    absl::StrAppend(&out, ", \"", key, "\": ", JsonNumber(value));
  if (r.tbt_slo_ms > 0) {
    absl::StrAppend(
        &out, ", \"tbt_slo_ms\": ", JsonNumber(r.tbt_slo_ms),
        ", \"sessions_within_tbt_slo\": ", r.sessions_within_tbt_slo,
        ", \"tbt_within_slo_fraction\": ",
        JsonNumber(r.tbt_within_slo_fraction));
  }
  absl::StrAppend(&out, ", \"errors\": ", r.turns_failed,
                  ", \"errors_by_code\": ", CodeCounts(r.errors_by_code));
  absl::StrAppend(&out, ", \"error_samples\": [");
  for (size_t i = 0; i < r.error_samples.size(); ++i)
    absl::StrAppend(&out, i ? ", " : "",
                    JsonQuote(r.error_samples[i], /*ascii=*/true));
  absl::StrAppend(
      &out, "], \"retry\": ", r.retry ? "true" : "false",
      ", \"turns_completed\": ", r.turns_ok,
      ", \"turns_retried\": ", r.turns_retried,
      ", \"turns_lost\": ", r.turns_failed, ", \"attempts\": ", r.attempts,
      ", \"attempt_errors_by_code\": ", CodeCounts(r.attempt_errors_by_code),
      ", \"duplicate_tokens\": ", r.duplicate_tokens,
      ", \"position_gaps\": ", r.position_gaps,
      ", \"session_call_errors\": ", r.session_call_errors);
  const std::pair<const char*, double> gaps[] = {
      {"turn_max_gap_ms_p50", r.turn_max_gap_ms_p50},
      {"turn_max_gap_ms_p99", r.turn_max_gap_ms_p99},
      {"turn_max_gap_ms_max", r.turn_max_gap_ms_max},
      {"retried_turn_max_gap_ms_p50", r.retried_turn_max_gap_ms_p50},
      {"retried_turn_max_gap_ms_p99", r.retried_turn_max_gap_ms_p99},
      {"retried_turn_max_gap_ms_max", r.retried_turn_max_gap_ms_max}};
  for (const auto& [key, value] : gaps)
    absl::StrAppend(&out, ", \"", key, "\": ", JsonNumber(value));
  absl::StrAppend(&out, "}\n");
  return out;
}

int RunBench(Client& client, const BenchOptions& o) {
  if (o.concurrency < 0) {
    std::fprintf(stderr, "karatctl: --concurrency must be >= 0\n");
    return 2;
  }
  if (!(o.tbt_slo_ms >= 0) || !std::isfinite(o.tbt_slo_ms)) {
    std::fprintf(stderr, "karatctl: --tbt-slo-ms must be >= 0\n");
    return 2;
  }
  if (!(o.retry.timeout_s > 0) || !std::isfinite(o.retry.timeout_s)) {
    std::fprintf(stderr, "karatctl: --retry-timeout-s must be > 0\n");
    return 2;
  }
  auto calls = ReadTrace(o.trace);
  if (!calls.ok()) {
    std::fprintf(stderr, "karatctl: %s\n",
                 std::string(calls.status().message()).c_str());
    return 2;
  }
  auto plan = PlanWorkload(*calls, o.workload);
  if (!plan.ok()) {
    std::fprintf(stderr, "karatctl: %s\n",
                 std::string(plan.status().message()).c_str());
    return 2;
  }
  const int sessions = static_cast<int>(plan->size());
  const int concurrency =
      o.concurrency == 0 ? sessions : std::min(o.concurrency, sessions);
  int total_turns = 0;
  for (const auto& s : *plan) total_turns += static_cast<int>(s.turns.size());
  std::fprintf(
      stderr,
      "bench: %d sessions x %d turns from %s (scale %g, cap %d), %d in "
      "flight\n",
      sessions, o.workload.turns, o.trace.c_str(), o.workload.scale,
      o.workload.max_new_tokens_cap, concurrency);

  Totals totals;
  if (!o.tokens_out_path.empty()) {
    absl::MutexLock lock(&totals.mu);
    totals.tokens_out.open(o.tokens_out_path, std::ios::trunc);
    if (!totals.tokens_out) {
      std::fprintf(stderr, "karatctl: cannot write %s: %s\n",
                   o.tokens_out_path.c_str(), std::strerror(errno));
      return 2;
    }
  }
  // Idempotency keys are unique per run: a retry of this run's turn must
  // never match another run's turn of the same session index.
  const std::string run_id = NewRunId();
  if (o.retry.enabled)
    std::fprintf(stderr,
                 "bench: retrying failed turns for up to %g s each (keys "
                 "bench-%s-<session>-<turn>)\n",
                 o.retry.timeout_s, run_id.c_str());
  auto start = std::chrono::steady_clock::now();
  std::atomic<int> next_session{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < concurrency; ++w) {
    threads.emplace_back([&] {
      for (int i = next_session++; i < sessions; i = next_session++)
        RunSession(client, (*plan)[i], i, run_id, o, &totals);
    });
  }
  // Progress about once a second until every session has finished.
  std::atomic<bool> finished{false};
  std::thread progress([&] {
    int64_t last_tokens = 0;
    auto last = std::chrono::steady_clock::now();
    while (!finished) {
      for (int i = 0; i < 10 && !finished; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (finished) break;
      auto now = std::chrono::steady_clock::now();
      int64_t tokens = totals.generated.load();
      double dt = std::chrono::duration<double>(now - last).count();
      std::fprintf(
          stderr,
          "bench: turns %d/%d, %lld tokens, %.1f tokens/s, %d errors%s\n",
          totals.turns_done + totals.turns_failed, total_turns,
          static_cast<long long>(tokens),
          dt > 0 ? (tokens - last_tokens) / dt : 0.0,
          totals.turns_failed.load(),
          o.retry.enabled
              ? absl::StrCat(", ", totals.turns_retried.load(), " retried")
                    .c_str()
              : "");
      last_tokens = tokens;
      last = now;
    }
  });
  for (auto& t : threads) t.join();
  finished = true;
  progress.join();
  double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();

  absl::MutexLock lock(&totals.mu);
  BenchReport r;
  r.sessions = sessions;
  r.concurrency = concurrency;
  r.turns = total_turns;
  r.turns_ok = totals.turns_done.load();
  r.turns_failed = totals.turns_failed.load();
  r.sessions_ok = totals.sessions_ok;
  r.prompt_tokens = totals.prompt_tokens;
  r.generated_tokens = totals.generated.load();
  r.wall_s = wall;
  r.ttft_ms_p50 = Percentile(totals.ttft_ms, 50);
  r.ttft_ms_p90 = Percentile(totals.ttft_ms, 90);
  r.ttft_ms_p99 = Percentile(totals.ttft_ms, 99);
  r.ttft_ms_mean = Mean(totals.ttft_ms);
  r.tbt_ms_p50 = Percentile(totals.tbt_ms, 50);
  r.tbt_ms_p90 = Percentile(totals.tbt_ms, 90);
  r.tbt_ms_p99 = Percentile(totals.tbt_ms, 99);
  r.tbt_ms_mean = Mean(totals.tbt_ms);
  if (o.tbt_slo_ms > 0) {
    r.tbt_slo_ms = o.tbt_slo_ms;
    r.sessions_within_tbt_slo = totals.sessions_within_slo;
    const auto within =
        std::count_if(totals.tbt_ms.begin(), totals.tbt_ms.end(),
                      [&](double v) { return v <= o.tbt_slo_ms; });
    r.tbt_within_slo_fraction =
        totals.tbt_ms.empty()
            ? 0
            : static_cast<double>(within) / totals.tbt_ms.size();
  }
  r.errors_by_code = totals.errors_by_code;
  r.retry = o.retry.enabled;
  r.turns_retried = totals.turns_retried.load();
  r.attempts = totals.attempts;
  r.attempt_errors_by_code = totals.attempt_errors_by_code;
  r.duplicate_tokens = totals.duplicate_tokens;
  r.position_gaps = totals.position_gaps;
  r.session_call_errors = totals.session_call_errors;
  r.turn_max_gap_ms_p50 = Percentile(totals.max_gap_ms, 50);
  r.turn_max_gap_ms_p99 = Percentile(totals.max_gap_ms, 99);
  r.turn_max_gap_ms_max = Max(totals.max_gap_ms);
  r.retried_turn_max_gap_ms_p50 = Percentile(totals.retried_max_gap_ms, 50);
  r.retried_turn_max_gap_ms_p99 = Percentile(totals.retried_max_gap_ms, 99);
  r.retried_turn_max_gap_ms_max = Max(totals.retried_max_gap_ms);
  for (size_t i = 0; i < totals.errors.size() && i < kErrorSamples; ++i)
    r.error_samples.push_back(totals.errors[i]);

  std::printf("sessions           %d (%d in flight, %d fully served)\n",
              r.sessions, r.concurrency, r.sessions_ok);
  std::printf("turns              %d ok / %d\n", r.turns_ok, r.turns);
  if (r.retry) {
    std::printf(
        "retries            %d turns retried, %d lost; %lld attempts; %d "
        "failed session calls\n",
        r.turns_retried, r.turns_failed, static_cast<long long>(r.attempts),
        r.session_call_errors);
  }
  std::printf("prompt tokens      %lld\n",
              static_cast<long long>(r.prompt_tokens));
  std::printf("generated tokens   %lld\n",
              static_cast<long long>(r.generated_tokens));
  std::printf("wall time          %.2f s\n", r.wall_s);
  std::printf("throughput         %.1f generated tokens/s\n", r.throughput());
  std::printf("TTFT p50/p90/p99   %.1f / %.1f / %.1f ms\n", r.ttft_ms_p50,
              r.ttft_ms_p90, r.ttft_ms_p99);
  std::printf("TBT  p50/p90/p99   %.1f / %.1f / %.1f ms\n", r.tbt_ms_p50,
              r.tbt_ms_p90, r.tbt_ms_p99);
  if (o.tbt_slo_ms > 0) {
    std::printf(
        "TBT target         %.1f ms: %d sessions within, %.1f%% of TBTs\n",
        o.tbt_slo_ms, r.sessions_within_tbt_slo,
        100.0 * r.tbt_within_slo_fraction);
  }
  std::printf("longest token gap  per turn p50/p99/max %.1f / %.1f / %.1f ms",
              r.turn_max_gap_ms_p50, r.turn_max_gap_ms_p99,
              r.turn_max_gap_ms_max);
  if (r.turns_retried > 0)
    std::printf("; retried turns %.1f / %.1f / %.1f ms",
                r.retried_turn_max_gap_ms_p50, r.retried_turn_max_gap_ms_p99,
                r.retried_turn_max_gap_ms_max);
  std::printf("\n");
  if (r.duplicate_tokens + r.position_gaps > 0)
    std::printf(
        "protocol errors    %d tokens at positions already received, %d "
        "position gaps\n",
        r.duplicate_tokens, r.position_gaps);
  std::printf("errors             %d\n", r.turns_failed);
  for (const auto& [code, n] : r.errors_by_code)
    std::printf("  %-16s %d\n", code.c_str(), n);
  if (r.retry && !r.attempt_errors_by_code.empty()) {
    std::printf("failed attempts by code\n");
    for (const auto& [code, n] : r.attempt_errors_by_code)
      std::printf("  %-16s %d\n", code.c_str(), n);
  }
  for (const std::string& e : r.error_samples) std::printf("  %s\n", e.c_str());
  std::fflush(stdout);

  if (!o.json_path.empty()) {
    std::ofstream out(o.json_path);
    out << BenchReportJson(r);
    out.close();
    if (!out.good()) {
      std::fprintf(stderr, "karatctl: cannot write %s\n", o.json_path.c_str());
      return 1;
    }
  }
  {
    totals.tokens_out.close();
    if (!o.tokens_out_path.empty() && !totals.tokens_out.good()) {
      std::fprintf(stderr, "karatctl: cannot write %s\n",
                   o.tokens_out_path.c_str());
      return 1;
    }
  }
  return r.turns_failed == 0 && totals.errors.empty() ? 0 : 1;
}

}  // namespace karat::ctl
