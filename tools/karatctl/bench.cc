#include "tools/karatctl/bench.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
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
  std::vector<std::string> errors ABSL_GUARDED_BY(mu);
  std::map<std::string, int> errors_by_code ABSL_GUARDED_BY(mu);
  int64_t prompt_tokens ABSL_GUARDED_BY(mu) = 0;
  int sessions_ok ABSL_GUARDED_BY(mu) = 0;
  int sessions_within_slo ABSL_GUARDED_BY(mu) = 0;
  std::atomic<int64_t> generated{0};
  std::atomic<int> turns_done{0};
  std::atomic<int> turns_failed{0};
};

void RunSession(Client& client, const PlannedSession& plan, int index,
                const BenchOptions& o, Totals* totals) {
  bool all_ok = true;
  std::vector<double> session_tbt;
  auto fail = [&](int turn, const absl::Status& st) {
    all_ok = false;
    totals->turns_failed++;
    absl::MutexLock lock(&totals->mu);
    totals->errors_by_code[StatusCodeName(st.code())]++;
    totals->errors.push_back(
        absl::StrFormat("session %d (%s) turn %d: %s: %s", index, plan.trace,
                        turn, StatusCodeName(st.code()), st.message()));
  };
  auto session = client.CreateSession(o.workload.seed + index);
  if (!session.ok()) {
    for (size_t t = 0; t < plan.turns.size(); ++t) fail(t, session.status());
    return;
  }
  for (size_t t = 0; t < plan.turns.size(); ++t) {
    const PlannedTurn& turn = plan.turns[t];
    if (turn.think_seconds > 0 && t > 0)
      std::this_thread::sleep_for(
          std::chrono::duration<double>(turn.think_seconds));
    v1::GenerateRequest req;
    req.set_session_id(session->session_id());
    req.set_prompt(turn.prompt);
    req.set_max_new_tokens(turn.max_new_tokens);
    req.set_temperature(o.temperature);
    auto result = client.Generate(
        req, [&](const v1::GeneratedToken&) { totals->generated++; });
    if (!result.ok()) {
      fail(t, result.status());
      continue;
    }
    totals->turns_done++;
    session_tbt.insert(session_tbt.end(), result->tbt_ms.begin(),
                       result->tbt_ms.end());
    absl::MutexLock lock(&totals->mu);
    totals->prompt_tokens += static_cast<int64_t>(turn.prompt.size());
    if (result->tokens > 0) totals->ttft_ms.push_back(result->ttft_ms);
    totals->tbt_ms.insert(totals->tbt_ms.end(), result->tbt_ms.begin(),
                          result->tbt_ms.end());
  }
  absl::Status closed = client.CloseSession(session->session_id());
  absl::MutexLock lock(&totals->mu);
  if (!closed.ok()) {
    totals->errors.push_back(
        absl::StrFormat("session %d: CloseSession: %s: %s", index,
                        StatusCodeName(closed.code()), closed.message()));
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
                  ", \"errors_by_code\": {");
  bool first = true;
  for (const auto& [code, n] : r.errors_by_code) {
    absl::StrAppend(&out, first ? "" : ", ", JsonQuote(code, /*ascii=*/true),
                    ": ", n);
    first = false;
  }
  absl::StrAppend(&out, "}, \"error_samples\": [");
  for (size_t i = 0; i < r.error_samples.size(); ++i)
    absl::StrAppend(&out, i ? ", " : "",
                    JsonQuote(r.error_samples[i], /*ascii=*/true));
  absl::StrAppend(&out, "]}\n");
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
  auto start = std::chrono::steady_clock::now();
  std::atomic<int> next_session{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < concurrency; ++w) {
    threads.emplace_back([&] {
      for (int i = next_session++; i < sessions; i = next_session++)
        RunSession(client, (*plan)[i], i, o, &totals);
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
          stderr, "bench: turns %d/%d, %lld tokens, %.1f tokens/s, %d errors\n",
          totals.turns_done + totals.turns_failed, total_turns,
          static_cast<long long>(tokens),
          dt > 0 ? (tokens - last_tokens) / dt : 0.0,
          totals.turns_failed.load());
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
  for (size_t i = 0; i < totals.errors.size() && i < kErrorSamples; ++i)
    r.error_samples.push_back(totals.errors[i]);

  std::printf("sessions           %d (%d in flight, %d fully served)\n",
              r.sessions, r.concurrency, r.sessions_ok);
  std::printf("turns              %d ok / %d\n", r.turns_ok, r.turns);
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
  std::printf("errors             %d\n", r.turns_failed);
  for (const auto& [code, n] : r.errors_by_code)
    std::printf("  %-16s %d\n", code.c_str(), n);
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
  return r.turns_failed == 0 && totals.errors.empty() ? 0 : 1;
}

}  // namespace karat::ctl
