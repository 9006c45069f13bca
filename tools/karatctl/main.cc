// karatctl: command-line client of the KARAT coordinator.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "cluster.grpc.pb.h"
#include "common/link_rules.h"
#include "common/link_stats.h"
#include "tools/karatctl/bench.h"
#include "tools/karatctl/client.h"
#include "tools/karatctl/connection.h"
#include "tools/karatctl/plan.h"

namespace karat::ctl {
namespace {

constexpr char kUsage[] =
    R"(usage: karatctl [--coordinator HOST:PORT | --addr-file PATH]
                [--tls-dir DIR | --plaintext] [--admin-addr HOST:PORT]
                COMMAND [flags]

commands:
  generate --prompt TEXT | --prompt-file PATH [--max-new-tokens N]
           [--temperature T] [--seed S] [--session ID] [--ids]
           [--idempotency-key K [--tokens-received N]]
      One turn (in a new session unless --session); prints the text as it
      streams, then a summary (tokens, TTFT, mean TBT) on stderr. A prompt
      file ("-": standard input) is sent as it is, for prompts too long for
      an argument; a long prompt's prefill progress goes to stderr. The
      same key and request again (same --session) continue or replay that
      turn from its token N on.
  chat [--max-new-tokens N] [--temperature T] [--seed S]
      Multi-turn conversation on one session; one line of stdin per turn,
      until EOF or /quit.
  status [--expect-alive NAME,NAME...]
      Nodes, devices and sessions, the admission queue and latencies, each
      rank's batch, and the nodes' busy / stalled time. With --expect-alive,
      exits 3 unless every named node is registered and alive.
  bench --trace FILE --sessions N --turns T --scale F [--output-scale F]
        [--max-new-tokens-cap C] [--think-scale X] [--seed S]
        [--temperature T] [--concurrency N] [--tbt-slo-ms X] [--json FILE]
        [--retry [--retry-timeout-s S]] [--tokens-out FILE]
      Closed-loop workload from the kvcache-tester trace; token counts are
      divided by --scale (outputs by --output-scale if given). --concurrency
      caps the sessions in flight (default: all); --tbt-slo-ms counts the
      sessions served within that TBT target; --json also writes the report
      as one JSON object. --retry retries failed turns with their
      idempotency key for up to S s (default 120); --tokens-out writes one
      JSON line per turn (tokens, their times, attempts, errors).
  link set --from NODE|* --to NODE|* [--latency-us N] [--jitter-us N]
           [--bandwidth-mbps R] [--loss P] [--down | --up]
  link remove --from NODE|* --to NODE|*
  link list
      Link emulation of the data plane (the coordinator pushes it to the
      nodes); `status` shows the rules and per-link counters too. A rule
      naming a node that has not registered is kept, with a warning.
  fault kill --node NAME
  fault pause --node NAME --ms N
      A process fault (DESIGN.md §7): the node dies by SIGKILL, or stops
      (SIGSTOP) for N ms; the coordinator forwards it to the node.
  metrics
      The coordinator's counters (TTFT / TBT histograms, throughput, admission
      queue, micro-batch token imbalance per rank) and every node's counters
      (per-link messages, bytes, drops, failures, send latency) in the
      Prometheus text format.
  plan --config FILE
      Prints the daemons of a cluster config, one per line (used by
      deploy/karat): "model_dir DIR", "provider P", "gpu NAME FLAGS...",
      "karat NAME FLAGS...". GPU nodes get --rank, --ranks, --mode,
      --micro-batches, --schedule and --hbm-bytes from the config, and
      --hbm-bandwidth-gbps / --tflops when set (the rank's timing model).
      With provider tcp every daemon gets --fabric-node: its fabric_node,
      else the host of its listen address, else 127.0.0.1.

Without --coordinator or --addr-file the address is read from
run/coordinator.addr (written by `deploy/karat up`), and the admin API's
(link, fault, and the rules of status) from coordinator-admin.addr beside
it. TLS and credentials (docs/security.md) come from --tls-dir DIR
(default: tls/ beside the address file): DIR/ca.crt verifies the
coordinator, DIR/client.token is sent as the client bearer token and
DIR/admin.token as the admin one. --plaintext: a cluster without TLS.
)";

[[noreturn]] void Usage(const std::string& message) {
  std::fprintf(stderr, "karatctl: %s\n%s", message.c_str(), kUsage);
  std::exit(2);
}

// The coordinator's address, for the hint below.
std::string g_coordinator;

int PrintError(const absl::Status& st) {
  std::fprintf(stderr, "karatctl: %s: %s\n", StatusCodeName(st.code()),
               std::string(st.message()).c_str());
  // gRPC's own words for a refused connection name no cause a user would
  // look for.
  if (st.code() == absl::StatusCode::kUnavailable &&
      (absl::StrContains(st.message(), "Ssl handshake failed") ||
       absl::StrContains(st.message(), "certificate verify failed"))) {
    std::fprintf(stderr,
                 "karatctl: the TLS handshake with %s failed: is --tls-dir "
                 "the cluster's (its ca.crt signed the coordinator's "
                 "certificate)?\n",
                 g_coordinator.c_str());
  } else if (st.code() == absl::StatusCode::kUnavailable &&
             absl::StrContains(st.message(), "Socket closed")) {
    std::fprintf(stderr,
                 "karatctl: %s closed the connection: a cluster with TLS "
                 "does not take --plaintext; or it is restarting\n",
                 g_coordinator.c_str());
  } else if (st.code() == absl::StatusCode::kUnavailable &&
      absl::StrContains(st.message(), "failed to connect")) {
    std::fprintf(stderr,
                 "karatctl: no coordinator answers at %s: is the cluster up "
                 "(deploy/karat up), and is this its address?\n",
                 g_coordinator.c_str());
  }
  return 1;
}

// Flags of one command: "--name value" or "--name=value"; switches in
// `switches` take no value.
class Flags {
 public:
  Flags(const std::vector<std::string>& args,
        const std::set<std::string>& known,
        const std::set<std::string>& switches) {
    for (size_t i = 0; i < args.size(); ++i) {
      std::string a = args[i];
      if (a.rfind("--", 0) != 0) Usage("unexpected argument " + a);
      std::string name = a.substr(2), value;
      bool has_value = false;
      if (auto eq = name.find('='); eq != std::string::npos) {
        value = name.substr(eq + 1);
        name = name.substr(0, eq);
        has_value = true;
      }
      if (switches.count(name)) {
        values_[name] = "1";
        continue;
      }
      if (!known.count(name)) Usage("unknown flag --" + name);
      if (!has_value) {
        if (i + 1 >= args.size()) Usage("--" + name + " needs a value");
        value = args[++i];
      }
      values_[name] = value;
    }
  }
  bool Has(const std::string& n) const { return values_.count(n) > 0; }
  std::string Str(const std::string& n, const std::string& def = "") const {
    auto it = values_.find(n);
    return it == values_.end() ? def : it->second;
  }
  int64_t Int(const std::string& n, int64_t def) const {
    if (!Has(n)) return def;
    int64_t v;
    if (!absl::SimpleAtoi(Str(n), &v)) Usage("--" + n + " must be an integer");
    return v;
  }
  uint64_t Uint(const std::string& n, uint64_t def) const {
    if (!Has(n)) return def;
    uint64_t v;
    if (!absl::SimpleAtoi(Str(n), &v))
      Usage("--" + n + " must be a non-negative integer");
    return v;
  }
  double Double(const std::string& n, double def) const {
    if (!Has(n)) return def;
    double v;
    if (!absl::SimpleAtod(Str(n), &v)) Usage("--" + n + " must be a number");
    return v;
  }

 private:
  std::map<std::string, std::string> values_;
};

void PrintSummary(const TurnResult& r, const std::string& session_id) {
  double mean_tbt = 0;
  for (double t : r.tbt_ms) mean_tbt += t;
  if (!r.tbt_ms.empty()) mean_tbt /= r.tbt_ms.size();
  std::fprintf(
      stderr,
      "[session %s: %d tokens, finish %s, TTFT %.1f ms, mean TBT %.1f ms]\n",
      session_id.c_str(), r.tokens,
      r.finish_reason.empty() ? "?" : r.finish_reason.c_str(), r.ttft_ms,
      mean_tbt);
}

// Prints a long prompt's prefill progress on stderr: the first report, then
// at most one every half second.
class ProgressPrinter {
 public:
  void operator()(const v1::PrefillProgress& p) {
    const auto now = std::chrono::steady_clock::now();
    if (printed_ && now - last_ < std::chrono::milliseconds(500)) return;
    printed_ = true;
    last_ = now;
    std::fprintf(stderr, "[prefill %d / %d tokens]\n", p.fed_tokens(),
                 p.total_tokens());
  }

 private:
  bool printed_ = false;
  std::chrono::steady_clock::time_point last_;
};

int Generate(Client& client, const Flags& f) {
  if (f.Has("prompt") == f.Has("prompt-file")) {
    Usage("generate needs --prompt or --prompt-file (one of them)");
  }
  const int64_t received = f.Int("tokens-received", 0);
  if (received < 0 || (f.Has("tokens-received") && !f.Has("idempotency-key")))
    Usage("--tokens-received needs --idempotency-key and a count >= 0");
  std::string prompt = f.Str("prompt");
  if (f.Has("prompt-file")) {
    // A long prompt does not fit in an argument ("-": standard input).
    const std::string path = f.Str("prompt-file");
    std::ifstream file;
    if (path != "-") {
      file.open(path, std::ios::binary);
      if (!file) {
        return PrintError(absl::NotFoundError(absl::StrCat(
            "cannot read the prompt file ", path, ": ", std::strerror(errno))));
      }
    }
    std::istream& in = path == "-" ? std::cin : file;
    prompt.assign(std::istreambuf_iterator<char>(in),
                  std::istreambuf_iterator<char>());
  }
  std::string session_id = f.Str("session");
  const bool fresh = session_id.empty();
  if (fresh) {
    auto s = client.CreateSession(f.Uint("seed", 0));
    if (!s.ok()) return PrintError(s.status());
    session_id = s->session_id();
  }
  v1::GenerateRequest req;
  req.set_session_id(session_id);
  req.set_prompt(prompt);
  req.set_max_new_tokens(static_cast<int32_t>(f.Int("max-new-tokens", 64)));
  req.set_temperature(static_cast<float>(f.Double("temperature", 0)));
  req.set_idempotency_key(f.Str("idempotency-key"));
  req.set_tokens_received(static_cast<int32_t>(received));
  bool ids = f.Has("ids");
  bool first = true;
  auto r = client.Generate(
      req,
      [&](const v1::GeneratedToken& t) {
        if (ids) {
          std::printf("%s%d", first ? "" : " ", t.token_id());
        } else {
          std::fwrite(t.text().data(), 1, t.text().size(), stdout);
        }
        first = false;
        std::fflush(stdout);
      },
      ProgressPrinter());
  if (!first) std::printf("\n");
  std::fflush(stdout);
  if (!r.ok()) {
    // A session this command opened and could not use is of no further use.
    if (fresh && first) (void)client.CloseSession(session_id);
    PrintError(r.status());
    if (auto kept = TurnTokensKept(r.status()))
      std::fprintf(stderr,
                   "karatctl: session %s kept %lld of the turn's tokens\n",
                   session_id.c_str(), static_cast<long long>(*kept));
    return 1;
  }
  PrintSummary(*r, session_id);
  return 0;
}

int Chat(Client& client, const Flags& f) {
  auto s = client.CreateSession(f.Uint("seed", 0));
  if (!s.ok()) return PrintError(s.status());
  bool tty = isatty(0);
  std::fprintf(stderr, "[session %s; /quit or EOF ends]\n",
               s->session_id().c_str());
  std::string line;
  while (true) {
    if (tty) {
      std::fputs("> ", stdout);
      std::fflush(stdout);
    }
    if (!std::getline(std::cin, line) || line == "/quit") break;
    if (line.empty()) continue;
    v1::GenerateRequest req;
    req.set_session_id(s->session_id());
    req.set_prompt(line + "\n");
    req.set_max_new_tokens(static_cast<int32_t>(f.Int("max-new-tokens", 64)));
    req.set_temperature(static_cast<float>(f.Double("temperature", 0)));
    auto r = client.Generate(
        req,
        [](const v1::GeneratedToken& t) {
          std::fwrite(t.text().data(), 1, t.text().size(), stdout);
          std::fflush(stdout);
        },
        ProgressPrinter());
    std::printf("\n");
    if (!r.ok()) {
      PrintError(r.status());
      continue;
    }
    PrintSummary(*r, s->session_id());
  }
  absl::Status closed = client.CloseSession(s->session_id());
  if (!closed.ok()) return PrintError(closed);
  return 0;
}

void PrintLinks(const std::string& address, const v1::ClusterStatus& st);

// The coordinator's scheduling counters (ClusterStatus.stats) and the
// nodes' busy / stalled time (their stats maps).
void PrintScheduling(const v1::ClusterStatus& st) {
  const auto& m = st.stats();
  auto get = [&](const std::string& k) {
    auto it = m.find(k);
    return it == m.end() ? 0.0 : it->second;
  };
  if (m.empty()) return;
  auto mean = [&](const std::string& h) {
    const double n = get(h + "_count");
    return n > 0 ? get(h + "_sum") / n : 0.0;
  };
  std::printf(
      "queue %.0f waiting; turns admitted %.0f, queued %.0f, timed out %.0f, "
      "cancelled while queued %.0f, refused %.0f\n",
      get("queue_length"), get("turns_admitted"), get("turns_queued"),
      get("turns_timed_out"), get("turns_cancelled_queued"),
      get("turns_refused"));
  std::printf(
      "TTFT mean %.1f ms, TBT mean %.1f ms, throughput %.1f tokens/s, "
      "micro-batch token imbalance %.3f\n",
      mean("ttft_ms"), mean("tbt_ms"), get("throughput_tokens_per_s"),
      get("microbatch_token_imbalance_mean"));
  for (int r = 0;; ++r) {
    const std::string p = absl::StrCat("rank.", r, ".");
    if (!m.contains(p + "active_requests")) break;
    const double steps = get(p + "step_cost_samples");
    const std::string source =
        get(p + "step_cost_learned") > 0
            ? absl::StrFormat("learned from %.0f steps", steps)
            : absl::StrFormat("the prior; %.0f steps measured", steps);
    std::printf(
        "rank %d: %.0f running (micro-batches %.0f / %.0f), token "
        "imbalance %.3f; step time %.2f ms + %.3f ms per request + %.5f ms "
        "per context token (%s)\n",
        r, get(p + "active_requests"), get(p + "micro_batch_0_requests"),
        get(p + "micro_batch_1_requests"),
        get(p + "microbatch_token_imbalance_mean"),
        get(p + "step_cost_fixed_ms"), get(p + "step_cost_per_request_ms"),
        get(p + "step_cost_per_context_token_ms"), source.c_str());
  }
  for (const auto& n : st.nodes()) {
    std::vector<std::string> parts;
    std::map<std::string, double> stats(n.stats().begin(), n.stats().end());
    for (const auto& [k, v] : stats) {
      if (k.ends_with("busy_seconds") || k.ends_with("stalled_seconds"))
        parts.push_back(absl::StrFormat("%s %.2fs", k, v));
    }
    if (!parts.empty())
      std::printf("%s: %s\n", n.name().c_str(),
                  absl::StrJoin(parts, ", ").c_str());
  }
}

int Status(Client& client, const std::string& address, const Flags& f) {
  auto st = client.GetClusterStatus();
  if (!st.ok()) return PrintError(st.status());
  std::printf("%-6s %-12s %-6s %-22s %s\n", "ROLE", "NAME", "ALIVE", "ADDRESS",
              "DEVICES (used / capacity)");
  for (const auto& n : st->nodes()) {
    std::vector<std::string> devices;
    for (const auto& d : n.devices()) {
      double pct = d.capacity_bytes() > 0
                       ? 100.0 * d.used_bytes() / d.capacity_bytes()
                       : 0.0;
      char buf[128];
      std::snprintf(buf, sizeof(buf), "d%d %.1f%% of %.0f MiB (%d sessions)",
                    d.device(), pct, d.capacity_bytes() / 1048576.0,
                    d.sessions());
      devices.push_back(buf);
    }
    std::printf("%-6s %-12s %-6s %-22s %s\n", n.role().c_str(),
                n.name().c_str(), n.alive() ? "yes" : "NO",
                n.grpc_address().c_str(), absl::StrJoin(devices, ", ").c_str());
  }
  std::printf("sessions %d, active generations %d, tokens generated %lld\n",
              st->sessions(), st->active_generations(),
              static_cast<long long>(st->tokens_generated()));
  PrintScheduling(*st);
  PrintLinks(address, *st);
  if (f.Has("expect-alive")) {
    std::vector<std::string> names =
        absl::StrSplit(f.Str("expect-alive"), ',', absl::SkipEmpty());
    for (const std::string& name : names) {
      bool alive = false;
      for (const auto& n : st->nodes())
        if (n.name() == name && n.alive()) alive = true;
      if (!alive) return 3;
    }
  }
  return 0;
}

// One rule per line: "<indent>SOURCE -> DESTINATION SETTINGS".
void PrintLinkRules(
    const google::protobuf::RepeatedPtrField<cluster::LinkConfig>& links,
    const char* indent) {
  for (const auto& l : links) {
    std::printf("%s%-12s -> %-12s %s\n", indent, l.source().c_str(),
                l.destination().c_str(),
                DescribeLink(LinkRuleFromProto(l).settings).c_str());
  }
}

// The admin API: its own port (RUN_DIR/coordinator-admin.addr or
// --admin-addr), with the admin token.
std::string g_admin_address;
std::shared_ptr<grpc::ChannelCredentials> g_admin_credentials;

std::unique_ptr<cluster::Admin::Stub> AdminStub() {
  return cluster::Admin::NewStub(
      grpc::CreateChannel(g_admin_address, g_admin_credentials));
}

absl::Status FromGrpc(const grpc::Status& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      s.error_message());
}

// Link rules and, from the nodes' heartbeat counters, traffic per link.
void PrintLinks(const std::string& address, const v1::ClusterStatus& st) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  cluster::GetLinksResponse links;
  // The rules come from the admin API, when its address is known.
  const grpc::Status gs =
      g_admin_address.empty()
          ? grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "")
          : AdminStub()->GetLinks(&ctx, cluster::GetLinksRequest(), &links);
  if (gs.ok() && links.links_size() > 0) {
    std::printf("link rules:\n");
    PrintLinkRules(links.links(), "  ");
  }
  bool header = false;
  for (const auto& n : st.nodes()) {
    std::map<std::string, std::map<std::string, double>> per_peer;
    for (const auto& [k, v] : n.stats()) {
      if (k.rfind("link.", 0) != 0) continue;
      const size_t dot = k.rfind('.');
      if (dot <= 5) continue;
      per_peer[k.substr(5, dot - 5)][k.substr(dot + 1)] = v;
    }
    for (auto& [peer, c] : per_peer) {
      if (!header) {
        std::printf("%-12s %-12s %10s %12s %9s %9s %8s %7s\n", "LINK FROM",
                    "TO", "MESSAGES", "BYTES", "P50 us", "P99 us", "DROPPED",
                    "FAILED");
        header = true;
      }
      std::printf("%-12s %-12s %10.0f %12.0f %9.0f %9.0f %8.0f %7.0f\n",
                  n.name().c_str(), peer.c_str(), c["messages"], c["bytes"],
                  c["latency_us_p50"], c["latency_us_p99"], c["dropped"],
                  c["failed"]);
    }
  }
}

int Link(const std::string& address, const std::string& action,
         const Flags& f) {
  auto stub = AdminStub();
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  if (action == "list") {
    cluster::GetLinksResponse resp;
    const grpc::Status gs =
        stub->GetLinks(&ctx, cluster::GetLinksRequest(), &resp);
    if (!gs.ok()) return PrintError(FromGrpc(gs));
    PrintLinkRules(resp.links(), "");
    return 0;
  }
  if (!f.Has("from") || !f.Has("to"))
    Usage("link " + action + " needs --from and --to");
  cluster::SetLinkRequest req;
  cluster::LinkConfig* l = req.mutable_link();
  l->set_source(f.Str("from"));
  l->set_destination(f.Str("to"));
  l->set_latency_us(f.Int("latency-us", 0));
  l->set_jitter_us(f.Int("jitter-us", 0));
  l->set_bandwidth_mbps(f.Double("bandwidth-mbps", 0));
  l->set_loss(f.Double("loss", 0));
  if (f.Has("down") && f.Has("up")) Usage("--down and --up exclude each other");
  l->set_down(f.Has("down"));
  req.set_remove(action == "remove");
  cluster::SetLinkResponse resp;
  const grpc::Status gs = stub->SetLink(&ctx, req, &resp);
  if (!gs.ok()) return PrintError(FromGrpc(gs));
  PrintLinkRules(resp.links(), "");
  for (const auto& w : resp.warnings()) {
    std::fprintf(stderr, "karatctl: warning: %s\n", w.c_str());
  }
  for (const auto& n : resp.not_applied()) {
    std::fprintf(stderr, "karatctl: not applied on %s\n", n.c_str());
  }
  return resp.not_applied_size() > 0 ? 1 : 0;
}

int Fault(const std::string& address, const std::string& action,
          const Flags& f) {
  if (!f.Has("node")) Usage("fault " + action + " needs --node");
  if (action == "pause" && !f.Has("ms")) Usage("fault pause needs --ms");
  cluster::ProcessFaultRequest req;
  req.set_node(f.Str("node"));
  req.set_action(action);
  req.set_pause_ms(static_cast<int32_t>(f.Int("ms", 0)));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  cluster::ProcessFaultResponse resp;
  const grpc::Status gs =
      AdminStub()->InjectProcessFault(&ctx, req, &resp);
  if (!gs.ok()) return PrintError(FromGrpc(gs));
  std::printf(
      "%s %s%s\n", action == "kill" ? "killed" : "paused", req.node().c_str(),
      action == "pause" ? absl::StrCat(" for ", req.pause_ms(), " ms").c_str()
                        : "");
  return 0;
}

// The coordinator's stats map in the Prometheus text format:
// "<h>_bucket_le_<b>" / "<h>_count" / "<h>_sum" become the histogram
// karat_coordinator_<h>, "rank.<r>.<name>" the series
// karat_coordinator_<name>{rank="<r>"}, anything else karat_coordinator_<key>.
std::string CoordinatorPrometheus(
    const google::protobuf::Map<std::string, double>& m) {
  std::map<std::string, double> stats(m.begin(), m.end());
  std::map<std::string, std::vector<std::pair<double, std::string>>> buckets;
  std::string out;
  auto number = [](double v) { return absl::StrFormat("%.17g", v); };
  for (const auto& [key, value] : stats) {
    if (auto at = key.find("_bucket_le_"); at != std::string::npos) {
      const std::string bound = key.substr(at + 11);
      double order = 0;
      if (bound == "inf" || !absl::SimpleAtod(bound, &order))
        order = std::numeric_limits<double>::infinity();
      buckets[key.substr(0, at)].emplace_back(
          order, absl::StrCat("karat_coordinator_", key.substr(0, at),
                              "_bucket{le=\"", bound == "inf" ? "+Inf" : bound,
                              "\"} ", number(value), "\n"));
      continue;
    }
    // A histogram's _sum and _count follow its buckets.
    bool histogram_total = false;
    for (const char* suffix : {"_sum", "_count"}) {
      if (key.ends_with(suffix) &&
          stats.contains(key.substr(0, key.size() - std::strlen(suffix)) +
                         "_bucket_le_inf"))
        histogram_total = true;
    }
    if (histogram_total) continue;
    if (key.rfind("rank.", 0) == 0) {
      const size_t dot = key.find('.', 5);
      if (dot != std::string::npos) {
        absl::StrAppend(&out, "karat_coordinator_", key.substr(dot + 1),
                        "{rank=\"", key.substr(5, dot - 5), "\"} ",
                        number(value), "\n");
        continue;
      }
    }
    absl::StrAppend(&out, "karat_coordinator_", key, " ", number(value), "\n");
  }
  std::string hist;
  for (auto& [name, lines] : buckets) {
    std::sort(lines.begin(), lines.end());
    absl::StrAppend(&hist, "# TYPE karat_coordinator_", name, " histogram\n");
    for (const auto& [order, line] : lines) hist += line;
    for (const char* suffix : {"_sum", "_count"}) {
      auto it = stats.find(name + suffix);
      if (it != stats.end())
        absl::StrAppend(&hist, "karat_coordinator_", name, suffix, " ",
                        number(it->second), "\n");
    }
  }
  return hist + out;
}

int Metrics(Client& client) {
  auto st = client.GetClusterStatus();
  if (!st.ok()) return PrintError(st.status());
  std::fputs(CoordinatorPrometheus(st->stats()).c_str(), stdout);
  for (const auto& n : st->nodes()) {
    std::map<std::string, double> stats(n.stats().begin(), n.stats().end());
    std::fputs(PrometheusFromStatsMap(n.name(), stats).c_str(), stdout);
  }
  return 0;
}

int Plan(const Flags& f) {
  if (!f.Has("config")) Usage("plan needs --config");
  absl::StatusOr<std::string> plan = PlanText(f.Str("config"));
  if (!plan.ok()) {
    std::fprintf(stderr, "karatctl: %s\n",
                 std::string(plan.status().message()).c_str());
    return 2;
  }
  std::fputs(plan->c_str(), stdout);
  return 0;
}

int Main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  std::string address, addr_file, tls_dir, admin_address;
  bool plaintext = false;
  size_t i = 0;
  for (; i < args.size() && args[i].rfind("--", 0) == 0; ++i) {
    std::string a = args[i];
    if (a == "--plaintext") {
      plaintext = true;
      continue;
    }
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    std::string value;
    std::string name = a;
    if (auto eq = a.find('='); eq != std::string::npos) {
      name = a.substr(0, eq);
      value = a.substr(eq + 1);
    } else if (i + 1 < args.size()) {
      value = args[++i];
    } else {
      Usage(a + " needs a value");
    }
    if (name == "--coordinator")
      address = value;
    else if (name == "--tls-dir")
      tls_dir = value;
    else if (name == "--admin-addr")
      admin_address = value;
    else if (name == "--addr-file")
      addr_file = value;
    else
      Usage("unknown flag " + name);
  }
  if (i >= args.size()) Usage("no command");
  std::string command = args[i];
  std::vector<std::string> rest(args.begin() + i + 1, args.end());

  if (command == "plan") return Plan(Flags(rest, {"config"}, {}));

  std::set<std::string> known, switches;
  std::string link_action;  // or the fault action
  if (command == "generate") {
    known = {"prompt", "prompt-file", "max-new-tokens",  "temperature",
             "seed",   "session",     "idempotency-key", "tokens-received"};
    switches = {"ids"};
  } else if (command == "chat") {
    known = {"max-new-tokens", "temperature", "seed"};
  } else if (command == "status") {
    known = {"expect-alive"};
  } else if (command == "metrics") {
  } else if (command == "link") {
    if (rest.empty() ||
        (rest[0] != "set" && rest[0] != "remove" && rest[0] != "list"))
      Usage("link needs set, remove or list");
    link_action = rest[0];
    rest.erase(rest.begin());
    known = {"from", "to", "latency-us", "jitter-us", "bandwidth-mbps", "loss"};
    switches = {"down", "up"};
  } else if (command == "fault") {
    if (rest.empty() || (rest[0] != "kill" && rest[0] != "pause"))
      Usage("fault needs kill or pause");
    link_action = rest[0];
    rest.erase(rest.begin());
    known = {"node", "ms"};
  } else if (command == "bench") {
    known = {"trace",           "sessions",           "turns",       "scale",
             "output-scale",    "max-new-tokens-cap", "think-scale", "seed",
             "temperature",     "concurrency",        "tbt-slo-ms",  "json",
             "retry-timeout-s", "tokens-out"};
    switches = {"retry"};
  } else {
    Usage("unknown command " + command);
  }
  Flags flags(rest, known, switches);

  if (address.empty()) {
    if (addr_file.empty()) addr_file = "run/coordinator.addr";
    address = ReadFirstLine(addr_file);
    if (address.empty()) {
      std::fprintf(stderr,
                   "karatctl: no coordinator address: cannot read %s (pass "
                   "--coordinator HOST:PORT or --addr-file PATH)\n",
                   addr_file.c_str());
      return 2;
    }
  }
  g_coordinator = address;
  absl::StatusOr<Connection> conn = ResolveConnection(
      ConnectionFlags{addr_file, tls_dir, admin_address, plaintext});
  if (!conn.ok()) {
    std::fprintf(stderr, "karatctl: %s\n",
                 std::string(conn.status().message()).c_str());
    return 2;
  }
  g_admin_address = conn->admin_address;
  g_admin_credentials = conn->admin;
  if (g_admin_address.empty() && (command == "link" || command == "fault")) {
    std::fprintf(stderr,
                 "karatctl: no admin API address: cannot read "
                 "%s/coordinator-admin.addr (pass --admin-addr HOST:PORT)\n",
                 conn->run_dir.c_str());
    return 2;
  }
  Client client(address, conn->client);
  if (command == "generate") return Generate(client, flags);
  if (command == "chat") return Chat(client, flags);
  if (command == "status") return Status(client, address, flags);
  if (command == "metrics") return Metrics(client);
  if (command == "link") return Link(address, link_action, flags);
  if (command == "fault") return Fault(address, link_action, flags);

  BenchOptions b;
  if (!flags.Has("trace") || !flags.Has("sessions") || !flags.Has("turns") ||
      !flags.Has("scale"))
    Usage("bench needs --trace, --sessions, --turns and --scale");
  b.trace = flags.Str("trace");
  b.workload.sessions = static_cast<int>(flags.Int("sessions", 8));
  b.workload.turns = static_cast<int>(flags.Int("turns", 3));
  b.workload.scale = flags.Double("scale", 1000);
  b.workload.output_scale = flags.Double("output-scale", 0);
  b.workload.max_new_tokens_cap =
      static_cast<int>(flags.Int("max-new-tokens-cap", 4096));
  b.workload.think_scale = flags.Double("think-scale", 0);
  b.workload.seed = flags.Uint("seed", 1);
  b.temperature = static_cast<float>(flags.Double("temperature", 0));
  b.concurrency = static_cast<int>(flags.Int("concurrency", 0));
  if (b.concurrency < 0) Usage("--concurrency must be >= 0");
  b.tbt_slo_ms = flags.Double("tbt-slo-ms", 0);
  if (!(b.tbt_slo_ms >= 0)) Usage("--tbt-slo-ms must be >= 0");
  b.json_path = flags.Str("json");
  b.retry.enabled = flags.Has("retry");
  b.retry.timeout_s = flags.Double("retry-timeout-s", 120);
  b.tokens_out_path = flags.Str("tokens-out");
  return RunBench(client, b);
}

}  // namespace
}  // namespace karat::ctl

int main(int argc, char** argv) { return karat::ctl::Main(argc, argv); }
