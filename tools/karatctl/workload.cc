#include "tools/karatctl/workload.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace karat::ctl {
namespace {

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

absl::StatusOr<std::vector<TraceCall>> ReadTrace(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot read"));
  std::string line;
  if (!std::getline(in, line))
    return absl::InvalidArgumentError(absl::StrCat(path, ": empty file"));
  std::map<std::string, int> column;
  {
    std::vector<std::string> names =
        absl::StrSplit(absl::StripSuffix(line, "\r"), ',');
    for (int i = 0; i < static_cast<int>(names.size()); ++i)
      column[names[i]] = i;
  }
  for (const char* need : {"trace", "agent", "idx", "in", "out",
                           "new_prefill_tokens", "think_time"}) {
    if (!column.count(need))
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":1: no column \"", need, "\""));
  }
  std::vector<TraceCall> calls;
  int lineno = 1;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.empty() || line == "\r") continue;
    std::vector<std::string> f =
        absl::StrSplit(absl::StripSuffix(line, "\r"), ',');
    auto field = [&](const char* name) -> const std::string* {
      int i = column[name];
      return i < static_cast<int>(f.size()) ? &f[i] : nullptr;
    };
    TraceCall c;
    const std::string *trace = field("trace"), *agent = field("agent"),
                      *idx = field("idx"), *inp = field("in"),
                      *out = field("out"),
                      *prefill = field("new_prefill_tokens"),
                      *think = field("think_time");
    if (!trace || !agent || !idx || !inp || !out || !prefill || !think ||
        !absl::SimpleAtoi(*idx, &c.idx) || !absl::SimpleAtoi(*inp, &c.in) ||
        !absl::SimpleAtoi(*out, &c.out) ||
        !absl::SimpleAtoi(*prefill, &c.new_prefill_tokens) ||
        // An empty think_time (a conversation's first call) means none.
        !(think->empty() || absl::SimpleAtod(*think, &c.think_time))) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", lineno, ": malformed row"));
    }
    c.trace = *trace;
    c.agent = *agent;
    calls.push_back(std::move(c));
  }
  return calls;
}

absl::StatusOr<std::vector<PlannedSession>> PlanWorkload(
    const std::vector<TraceCall>& calls, const WorkloadOptions& o) {
  if (o.sessions < 1)
    return absl::InvalidArgumentError("--sessions must be >= 1");
  if (o.turns < 1) return absl::InvalidArgumentError("--turns must be >= 1");
  if (!(o.scale > 0)) return absl::InvalidArgumentError("--scale must be > 0");
  if (!(o.output_scale >= 0))
    return absl::InvalidArgumentError("--output-scale must be >= 0");
  const double output_scale = o.output_scale > 0 ? o.output_scale : o.scale;
  if (o.max_new_tokens_cap < 1)
    return absl::InvalidArgumentError("--max-new-tokens-cap must be >= 1");
  if (!(o.think_scale >= 0))
    return absl::InvalidArgumentError("--think-scale must be >= 0");

  // main-agent conversations, in order of first appearance.
  std::vector<std::string> order;
  std::map<std::string, std::vector<const TraceCall*>> convs;
  for (const TraceCall& c : calls) {
    if (c.agent != "main") continue;
    auto [it, fresh] = convs.try_emplace(c.trace);
    if (fresh) order.push_back(c.trace);
    it->second.push_back(&c);
  }
  std::vector<std::string> eligible;
  for (const std::string& t : order) {
    auto& v = convs[t];
    std::stable_sort(
        v.begin(), v.end(),
        [](const TraceCall* a, const TraceCall* b) { return a->idx < b->idx; });
    if (static_cast<int>(v.size()) >= o.turns) eligible.push_back(t);
  }
  if (static_cast<int>(eligible.size()) < o.sessions) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the trace has ", eligible.size(), " main conversations with at least ",
        o.turns, " calls; ", o.sessions, " sessions asked"));
  }
  uint64_t rng = o.seed;
  for (size_t i = eligible.size() - 1; i > 0; --i) {  // Fisher-Yates
    size_t j = SplitMix64(rng) % (i + 1);
    std::swap(eligible[i], eligible[j]);
  }
  std::vector<PlannedSession> plan;
  for (int s = 0; s < o.sessions; ++s) {
    PlannedSession ps;
    ps.trace = eligible[s];
    const auto& v = convs[ps.trace];
    for (int t = 0; t < o.turns; ++t) {
      const TraceCall& c = *v[t];
      PlannedTurn pt;
      int64_t prompt_len = std::max<int64_t>(
          1, std::llround(static_cast<double>(c.new_prefill_tokens) / o.scale));
      pt.max_new_tokens = static_cast<int>(std::max<int64_t>(
          1, std::min<int64_t>(
                 o.max_new_tokens_cap,
                 std::llround(static_cast<double>(c.out) / output_scale))));
      pt.think_seconds = c.think_time * o.think_scale;
      pt.trace_in = c.in;
      pt.trace_out = c.out;
      uint64_t bytes = o.seed ^ (0xD1B54A32D192ED03ull * (s + 1)) ^
                       (0x8CB92BA72F3D8DD7ull * (t + 1));
      pt.prompt.resize(prompt_len);
      for (auto& ch : pt.prompt)
        ch = static_cast<char>(32 + SplitMix64(bytes) % 95);
      ps.turns.push_back(std::move(pt));
    }
    plan.push_back(std::move(ps));
  }
  return plan;
}

double Percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  size_t rank = static_cast<size_t>(std::ceil(p / 100.0 * values.size()));
  if (rank < 1) rank = 1;
  if (rank > values.size()) rank = values.size();
  return values[rank - 1];
}

}  // namespace karat::ctl
