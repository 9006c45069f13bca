// The workload plan of `karatctl bench` (tools/karatctl/workload.h) and its
// JSON report (tools/karatctl/bench.h).
#include <catch2/catch.hpp>
#include <cstdio>
#include <fstream>

#include "tools/karatctl/bench.h"
#include "tools/karatctl/workload.h"

namespace karat::ctl {
namespace {

std::vector<TraceCall> Calls() {
  std::vector<TraceCall> calls;
  for (int t = 0; t < 4; ++t) {
    for (int i = 2; i >= 0; --i) {  // out of order on purpose
      TraceCall c;
      c.trace = "trace_" + std::to_string(t);
      c.agent = "main";
      c.idx = i;
      c.in = 1000 * (i + 1);
      c.out = 2500 * (i + 1);
      c.new_prefill_tokens = 1000 * (i + 1) + t;
      c.think_time = i;
      calls.push_back(c);
    }
    TraceCall sub = calls.back();
    sub.agent = "agent_001";
    calls.push_back(sub);
  }
  calls.pop_back();
  calls.pop_back();  // trace_3 keeps only 2 main calls
  return calls;
}

TEST_CASE("workload: scaling, ordering and eligibility") {
  WorkloadOptions o;
  o.sessions = 3;
  o.turns = 3;
  o.scale = 1000;
  o.max_new_tokens_cap = 5;
  o.think_scale = 0.5;
  o.seed = 9;
  auto plan = PlanWorkload(Calls(), o);
  REQUIRE(plan.ok());
  REQUIRE(plan->size() == 3);
  for (const auto& s : *plan) {
    CHECK(s.trace != "trace_3");  // too few main calls
    REQUIRE(s.turns.size() == 3);
    CHECK(s.turns[0].prompt.size() == 1);  // round(1000.x / 1000)
    CHECK(s.turns[2].prompt.size() == 3);
    CHECK(s.turns[0].max_new_tokens == 3);  // round(2.5) away from zero
    CHECK(s.turns[2].max_new_tokens == 5);  // min(cap, round(7.5))
    CHECK(s.turns[1].think_seconds == 0.5);
    for (char ch : s.turns[2].prompt) CHECK((ch >= 32 && ch < 127));
  }
  auto again = PlanWorkload(Calls(), o);
  REQUIRE(again.ok());
  for (size_t i = 0; i < plan->size(); ++i) {
    CHECK((*again)[i].trace == (*plan)[i].trace);
    CHECK((*again)[i].turns[2].prompt == (*plan)[i].turns[2].prompt);
  }
  // Outputs scaled on their own: out 2500 / 1000 -> 3 tokens, / 500 -> 5.
  o.output_scale = 500;
  o.max_new_tokens_cap = 100;
  auto longer = PlanWorkload(Calls(), o);
  REQUIRE(longer.ok());
  CHECK((*longer)[0].turns[0].max_new_tokens == 5);
  CHECK((*longer)[0].turns[2].max_new_tokens == 15);
  CHECK((*longer)[0].turns[0].prompt.size() == 1);  // prompts keep `scale`
  o.output_scale = -1;
  CHECK(PlanWorkload(Calls(), o).status().code() ==
        absl::StatusCode::kInvalidArgument);
  o.output_scale = 0;
  o.sessions = 4;
  CHECK(PlanWorkload(Calls(), o).status().code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("workload: reading the trace CSV") {
  std::string path = "karatctl_workload_test.csv";
  {
    std::ofstream out(path);
    out << "trace,agent,idx,t,in,out,cached_prefix_tokens,new_prefill_tokens,"
           "think_time,api_time,stop,model\n"
        << "trace_0001,main,0,0.0,71175,169,0,71175,,7.34,tool_use,m\n"
        << "trace_0001,main,1,19.0,72762,296,71168,1594,12.0,9.19,tool_use,m\n";
  }
  auto calls = ReadTrace(path);
  REQUIRE(calls.ok());
  REQUIRE(calls->size() == 2);
  CHECK((*calls)[0].think_time == 0);
  CHECK((*calls)[1].new_prefill_tokens == 1594);
  CHECK((*calls)[1].think_time == 12.0);
  {
    std::ofstream out(path, std::ios::app);
    out << "trace_0001,main,x,1,2,3,4,5,6,7,stop,m\n";
  }
  auto bad = ReadTrace(path);
  REQUIRE_FALSE(bad.ok());
  CHECK(std::string(bad.status().message()) == path + ":4: malformed row");
  std::remove(path.c_str());
}

TEST_CASE("workload: percentiles by nearest rank") {
  CHECK(Percentile({}, 50) == 0);
  CHECK(Percentile({5, 1, 3, 2, 4}, 50) == 3);
  CHECK(Percentile({5, 1, 3, 2, 4}, 99) == 5);
  CHECK(Percentile({7}, 1) == 7);
}

TEST_CASE("bench: the JSON report") {
  BenchReport r;
  r.sessions = 4;
  r.concurrency = 2;
  r.turns = 8;
  r.turns_ok = 7;
  r.turns_failed = 1;
  r.sessions_ok = 3;
  r.prompt_tokens = 120;
  r.generated_tokens = 50;
  r.wall_s = 2.5;
  r.ttft_ms_p50 = 10;
  r.ttft_ms_p90 = 20;
  r.ttft_ms_p99 = 30;
  r.ttft_ms_mean = 12.5;
  r.tbt_ms_p50 = 1;
  r.tbt_ms_p90 = 2;
  r.tbt_ms_p99 = 3;
  r.tbt_ms_mean = 1.25;
  r.errors_by_code["RESOURCE_EXHAUSTED"] = 1;
  r.error_samples.push_back("session 1 \"x\"\tturn 0\n");
  r.retry = true;
  r.turns_retried = 2;
  r.attempts = 11;
  r.attempt_errors_by_code["UNAVAILABLE"] = 2;
  r.attempt_errors_by_code["RESOURCE_EXHAUSTED"] = 1;
  r.duplicate_tokens = 3;
  r.position_gaps = 1;
  r.session_call_errors = 4;
  r.turn_max_gap_ms_p50 = 5;
  r.turn_max_gap_ms_p99 = 900;
  r.turn_max_gap_ms_max = 1000;
  r.retried_turn_max_gap_ms_p50 = 800;
  r.retried_turn_max_gap_ms_p99 = 1000;
  r.retried_turn_max_gap_ms_max = 1000.5;
  const std::string json = BenchReportJson(r);
  CHECK(json ==
        "{\"sessions\": 4, \"concurrency\": 2, \"turns\": 8, \"turns_ok\": 7, "
        "\"turns_failed\": 1, \"sessions_ok\": 3, \"prompt_tokens\": 120, "
        "\"generated_tokens\": 50, \"wall_s\": 2.500, "
        "\"throughput_tokens_per_s\": 20.000, \"ttft_ms_p50\": 10.000, "
        "\"ttft_ms_p90\": 20.000, \"ttft_ms_p99\": 30.000, "
        "\"ttft_ms_mean\": 12.500, \"tbt_ms_p50\": 1.000, "
        "\"tbt_ms_p90\": 2.000, \"tbt_ms_p99\": 3.000, \"tbt_ms_mean\": 1.250, "
        "\"errors\": 1, \"errors_by_code\": {\"RESOURCE_EXHAUSTED\": 1}, "
        "\"error_samples\": [\"session 1 \\\"x\\\"\\tturn 0\\n\"], "
        "\"retry\": true, \"turns_completed\": 7, \"turns_retried\": 2, "
        "\"turns_lost\": 1, \"attempts\": 11, \"attempt_errors_by_code\": "
        "{\"RESOURCE_EXHAUSTED\": 1, \"UNAVAILABLE\": 2}, "
        "\"duplicate_tokens\": 3, \"position_gaps\": 1, "
        "\"session_call_errors\": 4, \"turn_max_gap_ms_p50\": 5.000, "
        "\"turn_max_gap_ms_p99\": 900.000, \"turn_max_gap_ms_max\": "
        "1000.000, \"retried_turn_max_gap_ms_p50\": 800.000, "
        "\"retried_turn_max_gap_ms_p99\": 1000.000, "
        "\"retried_turn_max_gap_ms_max\": 1000.500}\n");

  // The TBT target's figures appear only when one was set; a zero wall
  // time gives a zero throughput, not a division by zero.
  CHECK(json.find("tbt_slo_ms") == std::string::npos);
  r.tbt_slo_ms = 50;
  r.sessions_within_tbt_slo = 2;
  r.tbt_within_slo_fraction = 0.75;
  r.wall_s = 0;
  const std::string with_slo = BenchReportJson(r);
  CHECK(with_slo.find("\"throughput_tokens_per_s\": 0.000") !=
        std::string::npos);
  CHECK(with_slo.find("\"tbt_slo_ms\": 50.000, \"sessions_within_tbt_slo\": 2, "
                      "\"tbt_within_slo_fraction\": 0.750") !=
        std::string::npos);

  // Raw bytes in an error message stay valid JSON.
  r.error_samples = {std::string("bad \x01\xff")};
  CHECK(BenchReportJson(r).find("\"bad \\u0001\\u00ff\"") != std::string::npos);
}

}  // namespace
}  // namespace karat::ctl
