#include "tools/karatctl/bench.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"

namespace karat::ctl {
namespace {

struct Totals {
  absl::Mutex mu;
  std::vector<double> ttft_ms ABSL_GUARDED_BY(mu);
  std::vector<double> tbt_ms ABSL_GUARDED_BY(mu);
  std::vector<std::string> errors ABSL_GUARDED_BY(mu);
  int64_t prompt_tokens ABSL_GUARDED_BY(mu) = 0;
  std::atomic<int64_t> generated{0};
  std::atomic<int> turns_done{0};
  std::atomic<int> turns_failed{0};
};

void RunSession(Client& client, const PlannedSession& plan, int index,
                const BenchOptions& o, Totals* totals) {
  auto fail = [&](int turn, const absl::Status& st) {
    totals->turns_failed++;
    absl::MutexLock lock(&totals->mu);
    totals->errors.push_back(absl::StrFormat(
        "session %d (%s) turn %d: %s: %s", index, plan.trace, turn,
        StatusCodeName(st.code()), st.message()));
  };
  auto session = client.CreateSession(o.workload.seed + index);
  if (!session.ok()) {
    for (size_t t = 0; t < plan.turns.size(); ++t) fail(t, session.status());
    return;
  }
  for (size_t t = 0; t < plan.turns.size(); ++t) {
    const PlannedTurn& turn = plan.turns[t];
    if (turn.think_seconds > 0 && t > 0)
      std::this_thread::sleep_for(std::chrono::duration<double>(turn.think_seconds));
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
    absl::MutexLock lock(&totals->mu);
    totals->prompt_tokens += static_cast<int64_t>(turn.prompt.size());
    if (result->tokens > 0) totals->ttft_ms.push_back(result->ttft_ms);
    totals->tbt_ms.insert(totals->tbt_ms.end(), result->tbt_ms.begin(),
                          result->tbt_ms.end());
  }
  absl::Status closed = client.CloseSession(session->session_id());
  if (!closed.ok()) {
    absl::MutexLock lock(&totals->mu);
    totals->errors.push_back(absl::StrFormat(
        "session %d: CloseSession: %s: %s", index, StatusCodeName(closed.code()),
        closed.message()));
  }
}

}  // namespace

int RunBench(Client& client, const BenchOptions& o) {
  auto calls = ReadTrace(o.trace);
  if (!calls.ok()) {
    std::fprintf(stderr, "karatctl: %s\n", std::string(calls.status().message()).c_str());
    return 2;
  }
  auto plan = PlanWorkload(*calls, o.workload);
  if (!plan.ok()) {
    std::fprintf(stderr, "karatctl: %s\n", std::string(plan.status().message()).c_str());
    return 2;
  }
  int total_turns = 0;
  for (const auto& s : *plan) total_turns += static_cast<int>(s.turns.size());
  std::fprintf(stderr, "bench: %zu sessions x %d turns from %s (scale %g, cap %d)\n",
               plan->size(), o.workload.turns, o.trace.c_str(), o.workload.scale,
               o.workload.max_new_tokens_cap);

  Totals totals;
  auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (size_t i = 0; i < plan->size(); ++i) {
    threads.emplace_back([&, i] {
      RunSession(client, (*plan)[i], static_cast<int>(i), o, &totals);
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
      std::fprintf(stderr, "bench: turns %d/%d, %lld tokens, %.1f tokens/s, %d errors\n",
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
  double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  absl::MutexLock lock(&totals.mu);
  int64_t generated = totals.generated.load();
  double throughput = wall > 0 ? generated / wall : 0;
  double ttft50 = Percentile(totals.ttft_ms, 50), ttft99 = Percentile(totals.ttft_ms, 99);
  double tbt50 = Percentile(totals.tbt_ms, 50), tbt99 = Percentile(totals.tbt_ms, 99);
  int errors = totals.turns_failed.load();
  std::printf("sessions           %zu\n", plan->size());
  std::printf("turns              %d ok / %d\n", totals.turns_done.load(), total_turns);
  std::printf("prompt tokens      %lld\n", static_cast<long long>(totals.prompt_tokens));
  std::printf("generated tokens   %lld\n", static_cast<long long>(generated));
  std::printf("wall time          %.2f s\n", wall);
  std::printf("throughput         %.1f generated tokens/s\n", throughput);
  std::printf("TTFT p50 / p99     %.1f / %.1f ms\n", ttft50, ttft99);
  std::printf("TBT  p50 / p99     %.1f / %.1f ms\n", tbt50, tbt99);
  std::printf("errors             %d\n", errors);
  for (size_t i = 0; i < totals.errors.size() && i < 10; ++i)
    std::printf("  %s\n", totals.errors[i].c_str());
  std::fflush(stdout);

  if (!o.json_path.empty()) {
    std::ofstream out(o.json_path);
    out << absl::StrFormat(
        "{\"sessions\": %d, \"turns\": %d, \"turns_ok\": %d, \"prompt_tokens\": %d, "
        "\"generated_tokens\": %d, \"wall_s\": %.3f, \"throughput_tokens_per_s\": %.3f, "
        "\"ttft_ms_p50\": %.3f, \"ttft_ms_p99\": %.3f, \"tbt_ms_p50\": %.3f, "
        "\"tbt_ms_p99\": %.3f, \"errors\": %d}\n",
        static_cast<int>(plan->size()), total_turns, totals.turns_done.load(),
        totals.prompt_tokens, generated, wall, throughput, ttft50, ttft99, tbt50,
        tbt99, errors);
    if (!out.good()) {
      std::fprintf(stderr, "karatctl: cannot write %s\n", o.json_path.c_str());
      return 1;
    }
  }
  return errors == 0 && totals.errors.empty() ? 0 : 1;
}

}  // namespace karat::ctl
