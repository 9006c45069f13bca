// End to end through the real daemons: every streamed token equals the
// single-process reference engine on the same conversation (DESIGN.md §6),
// and bad input gets a clear answer without losing the session.
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include "cluster.grpc.pb.h"
#include "common/model_config.h"
#include "common/reference_engine.h"
#include "common/tokenizer.h"
#include "common/weights.h"
#include "karat.grpc.pb.h"
#include "tests/integration/cluster_harness.h"

namespace karat::testing {
namespace {

using karat::v1::GenerateRequest;
using karat::v1::GenerateResponse;

// The harness fails a test whose daemons printed a sanitizer report (in the
// sanitized builds of `deploy/karat test`): it must find each kind of report
// in a log, from the line it starts on, and nothing in an ordinary log.
TEST_CASE("sanitizer reports in a daemon's log are found", "[harness][sanitized]") {
  const std::string ordinary =
      "I coordinator listening on 127.0.0.1:4242\n"
      "W node gpu0: runtime 3 ms over budget\n";
  CHECK(SanitizerReport(ordinary).empty());
  CHECK(SanitizerReport("").empty());
  for (const std::string report :
       {"==123==ERROR: AddressSanitizer: heap-use-after-free on address 0x1",
        "==123==ERROR: LeakSanitizer: detected memory leaks",
        "WARNING: ThreadSanitizer: data race (pid=123)",
        "common/attention.cc:12:3: runtime error: load of misaligned address"}) {
    INFO(report);
    CHECK(SanitizerReport(ordinary + report + "\n    #0 0x1 in f\n") ==
          report + "\n    #0 0x1 in f\n");
  }
}

std::string PromptText(int session, int turn) {
  std::string s = "session " + std::to_string(session) + " turn " +
                  std::to_string(turn) + ": ";
  const int len = 40 + 23 * ((session + turn) % 4);
  for (int i = 0; i < len; ++i) {
    s += char('a' + (session * 7 + turn * 13 + i * 5) % 26);
  }
  return s;
}

ModelFiles LoadOrFail(const std::string& dir) {
  auto files = LoadModel(dir);
  REQUIRE(files.ok());
  return std::move(*files);
}

// The conversations of the tests below: PromptText(s, t), max_new tokens a
// turn, seed(s) and temperature(s) as given.
Conversations TextConversations(int max_new,
                                const std::function<uint64_t(int)>& seed,
                                const std::function<float(int)>& temperature) {
  return {PromptText, [max_new](int) { return max_new; }, seed, temperature};
}

TEST_CASE("cluster tokens equal the reference engine, greedy and sampled",
          "[integration][sanitized]") {
  ClusterSpec spec;
  Cluster cluster(spec);
  constexpr int kSessions = 8, kTurns = 3, kMaxNew = 24;
  // Sessions 0-3 greedy, 4-7 with a temperature and their own seed.
  auto temperature = [](int s) { return s < 4 ? 0.0f : 0.9f; };
  auto seed = [](int s) { return uint64_t(1000 + 17 * s); };

  const Conversations conv = TextConversations(kMaxNew, seed, temperature);
  const auto got = RunConversations(cluster, kSessions, kTurns, conv);
  CheckAgainstReference(cluster.model_dir(), got, conv, kTurns);

  // Idle daemons: no busy polling. Not a speed figure: a spinning thread
  // would use a whole core (100%); idle means a few percent at most.
  std::map<std::string, double> before;
  for (const auto& [name, pid] : cluster.pids()) {
    before[name] = ProcessCpuSeconds(pid);
  }
  std::this_thread::sleep_for(std::chrono::seconds(3));
  for (const auto& [name, pid] : cluster.pids()) {
    const double share = (ProcessCpuSeconds(pid) - before[name]) / 3.0;
    INFO(name << " used " << share * 100 << "% of a core while idle");
    CHECK(share < 0.10);
  }
}

// Every attention form of MODEL.md on both paths: for each small preset, two
// concurrent sessions (one greedy, one sampled) of two turns whose contexts
// exceed the sparse methods' budgets, so that they drop tokens; the prefill
// is cut into max_step_tokens chunks that the reference engine does not cut.
TEST_CASE("every attention form: cluster tokens equal the reference engine",
          "[integration]") {
  constexpr int kSessions = 2, kTurns = 2, kMaxNew = 16;
  auto temperature = [](int s) { return s == 0 ? 0.0f : 0.8f; };
  auto prompt = [](int s, int t) {
    std::string p = "attention form check, session " + std::to_string(s) +
                    " turn " + std::to_string(t) + ": ";
    for (int i = 0; i < 70 + 25 * s; ++i) {
      p += char('a' + (s * 11 + t * 5 + i * 7) % 26);
    }
    return p;
  };
  for (const char* preset :
       {"minimax-small", "llama-small", "llama-small-quest",
        "llama-small-magicpig", "llama-small-clusterkv", "glm-small"}) {
    INFO("preset " << preset);
    ClusterSpec spec;
    spec.preset = preset;
    spec.max_step_tokens = 48;
    Cluster cluster(spec);
    const Conversations conv{prompt, [](int) { return kMaxNew; },
                             [](int s) { return uint64_t(500 + s); },
                             temperature};
    const auto got = RunConversations(cluster, kSessions, kTurns, conv);
    CheckAgainstReference(cluster.model_dir(), got, conv, kTurns);
  }
}

TEST_CASE("bad requests get clear statuses and sessions survive",
          "[integration][sanitized]") {
  ClusterSpec spec;
  spec.device_capacity = "2M";  // room for a few hundred tokens per device
  spec.max_new_tokens_limit = 4096;
  Cluster cluster(spec);
  auto stub = cluster.NewStub();
  ModelFiles files = LoadOrFail(cluster.model_dir());
  auto engine = ReferenceEngine::Create(files);
  REQUIRE(engine.ok());

  SECTION("unknown and closed sessions are NOT_FOUND") {
    Turn r = Generate(stub.get(), "s-does-not-exist", "hi", 4, 0);
    CHECK(r.status.error_code() == grpc::StatusCode::NOT_FOUND);
    const std::string id = NewSession(stub.get(), 1);
    grpc::ClientContext ctx;
    karat::v1::CloseSessionRequest req;
    req.set_session_id(id);
    karat::v1::CloseSessionResponse resp;
    REQUIRE(stub->CloseSession(&ctx, req, &resp).ok());
    r = Generate(stub.get(), id, "hi", 4, 0);
    CHECK(r.status.error_code() == grpc::StatusCode::NOT_FOUND);
  }

  SECTION("max_new_tokens out of range is INVALID_ARGUMENT") {
    const std::string id = NewSession(stub.get(), 1);
    CHECK(Generate(stub.get(), id, "hi", 0, 0).status.error_code() ==
          grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(Generate(stub.get(), id, "hi", -3, 0).status.error_code() ==
          grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(Generate(stub.get(), id, "hi", 5000, 0).status.error_code() ==
          grpc::StatusCode::INVALID_ARGUMENT);
  }

  SECTION("a turn that fits no device is RESOURCE_EXHAUSTED, session intact") {
    const std::string id = NewSession(stub.get(), 3);
    ReferenceSession ref;
    ref.seed = 3;
    Turn r = Generate(stub.get(), id, "first turn", 8, 0);
    REQUIRE(r.status.ok());
    auto want = (*engine)->RunTurn(&ref, EncodeText("first turn"), 8, 0);
    REQUIRE(want.ok());
    CHECK(r.tokens == *want);
    r = Generate(stub.get(), id, "too much", 4000, 0);
    CHECK(r.status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
    CHECK(r.tokens.empty());
    r = Generate(stub.get(), id, "second turn", 8, 0);
    REQUIRE(r.status.ok());
    want = (*engine)->RunTurn(&ref, EncodeText("second turn"), 8, 0);
    REQUIRE(want.ok());
    CHECK(r.tokens == *want);
  }

  SECTION("a second concurrent generate is FAILED_PRECONDITION") {
    // A call on a busy session first waits up to 200 ms in case the running
    // turn was cancelled (WaitForCancelledTurn), and a turn that ends
    // meanwhile serves it. A 5 ms one-way delay from the GPU node to the
    // KARAT node makes every decode step take longer than 30 ms (six
    // layers), so the first turn outlasts that wait on any machine.
    auto admin = cluster.NewAdminStub();
    cluster::LinkConfig slow;
    slow.set_source("gpu0");
    slow.set_destination("karat0");
    slow.set_latency_us(5000);
    cluster::SetLinkResponse lresp;
    REQUIRE(SetLink(admin.get(), slow, &lresp).ok());
    REQUIRE(lresp.not_applied_size() == 0);
    constexpr int kFirstTokens = 40;
    const std::string id = NewSession(stub.get(), 4);
    std::atomic<bool> started{false};
    Turn first;
    std::thread t([&] {
      auto s2 = cluster.NewStub();
      grpc::ClientContext ctx;
      GenerateRequest req;
      req.set_session_id(id);
      req.set_prompt("a long generation");
      req.set_max_new_tokens(kFirstTokens);
      auto reader = s2->Generate(&ctx, req);
      GenerateResponse ev;
      while (reader->Read(&ev)) {
        if (ev.has_token()) {
          first.tokens.push_back(ev.token().token_id());
          started = true;
        }
      }
      first.status = reader->Finish();
      started = true;
    });
    while (!started) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    Turn second = Generate(stub.get(), id, "again", 4, 0);
    t.join();
    if (!first.tokens.empty() && int(first.tokens.size()) < kFirstTokens &&
        first.tokens.back() == kEosToken) {
      WARN("the first generation ended before the second call was made");
    } else {
      CHECK(second.status.error_code() ==
            grpc::StatusCode::FAILED_PRECONDITION);
    }
    CHECK(first.status.ok());
  }

  SECTION("a cancelled stream leaves the session usable") {
    const std::string id = NewSession(stub.get(), 5);
    Turn r = Generate(stub.get(), id, "cancel me", 200, 0,
                      /*cancel_after=*/3);
    CHECK(r.status.error_code() == grpc::StatusCode::CANCELLED);
    CHECK(r.tokens.size() >= 3);
    // The session keeps what was streamed; the next turn continues from it.
    grpc::ClientContext ctx;
    karat::v1::GetSessionRequest greq;
    greq.set_session_id(id);
    greq.set_include_tokens(true);
    karat::v1::Session sess;
    REQUIRE(stub->GetSession(&ctx, greq, &sess).ok());
    std::vector<int32_t> history(sess.tokens().begin(), sess.tokens().end());
    REQUIRE(history.size() >= 2);
    CHECK(history[0] == kBosToken);
    Turn next = Generate(stub.get(), id, "and now?", 8, 0);
    REQUIRE(next.status.ok());
    // Reference: the same history fed in one turn.
    ReferenceSession ref;
    ref.seed = 5;
    std::vector<int32_t> prompt(history.begin() + 1, history.end());
    auto tail = EncodeText("and now?");
    prompt.insert(prompt.end(), tail.begin(), tail.end());
    auto want = (*engine)->RunTurn(&ref, prompt, 8, 0);
    REQUIRE(want.ok());
    CHECK(next.tokens == *want);
  }
}

TEST_CASE("KV ingestion per turn is proportional to the new tokens",
          "[integration]") {
  ClusterSpec spec;
  Cluster cluster(spec);
  auto stub = cluster.NewStub();
  std::ifstream in(cluster.dir() + "/karat0.addr");
  std::string addr;
  in >> addr;
  REQUIRE(!addr.empty());
  auto node = karat::cluster::KaratNode::NewStub(cluster.NodeChannel("karat0"));
  auto ingested = [&] {
    grpc::ClientContext ctx;
    karat::cluster::StatsRequest req;
    karat::cluster::StatsResponse resp;
    REQUIRE(node->GetStats(&ctx, req, &resp).ok());
    REQUIRE(resp.stats().count("kv_bytes_ingested") == 1);
    return resp.stats().at("kv_bytes_ingested");
  };
  const std::string id = NewSession(stub.get(), 9);
  // Turn 1 fixes the history; turns 2 and 3 feed 1 + prompt + generated - 1
  // new positions each: the last sampled token plus the new prompt, then
  // each decoded token but the last.
  REQUIRE(Generate(stub.get(), id, std::string(150, 'x'), 6, 0).status.ok());
  double prev = ingested();
  std::vector<double> per_token;
  for (int len : {20, 80}) {
    Turn r = Generate(stub.get(), id, std::string(len, 'y'), 6, 0);
    REQUIRE(r.status.ok());
    const double now = ingested();
    const double fed = 1 + len + double(r.tokens.size()) - 1;
    per_token.push_back((now - prev) / fed);
    prev = now;
  }
  CHECK(per_token[0] > 0);
  CHECK(per_token[0] == Approx(per_token[1]));
}

TEST_CASE("malformed model files and configs are refused with the field",
          "[integration]") {
  char tmpl[] = "/tmp/karat-bad-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  const std::string dir = tmpl;
  std::string out;
  REQUIRE(RunCommand({BinPath("karat-weights"), "--preset", "dsa-small",
                      "--seed", "1", "--out", dir + "/m"},
                     &out) == 0);
  // Truncated safetensors.
  std::filesystem::resize_file(dir + "/m/model.safetensors", 1000);
  int rc = RunCommand(
      {BinPath("karat-reference"), "--model", dir + "/m", "--prompt", "x"},
      &out);
  CHECK(rc != 0);
  CHECK(out.find("model.safetensors") != std::string::npos);
  rc = RunCommand({BinPath("karat-gpu-node"), "--model", dir + "/m",
                   "--coordinator", "127.0.0.1:1", "--plaintext"},
                  &out);
  CHECK(rc != 0);
  CHECK(out.find("model.safetensors") != std::string::npos);
  // A config whose shapes disagree with the weights.
  REQUIRE(RunCommand({BinPath("karat-weights"), "--preset", "dsa-small",
                      "--seed", "1", "--out", dir + "/m2"},
                     &out) == 0);
  {
    std::ifstream cin(dir + "/m2/config.json");
    std::stringstream ss;
    ss << cin.rdbuf();
    std::string cfg = ss.str();
    const size_t p = cfg.find("\"hidden_size\"");
    REQUIRE(p != std::string::npos);
    const size_t colon = cfg.find(':', p);
    const size_t end = cfg.find_first_of(",}", colon);
    cfg.replace(colon + 1, end - colon - 1, " 96");
    std::ofstream cout(dir + "/m2/config.json");
    cout << cfg;
  }
  rc = RunCommand(
      {BinPath("karat-reference"), "--model", dir + "/m2", "--prompt", "x"},
      &out);
  CHECK(rc != 0);
  CHECK(out.find("model.safetensors") != std::string::npos);
  // A malformed cluster config.
  {
    std::ofstream bad(dir + "/bad.textproto");
    bad << "model_dir: \"x\"\ngpu_nodes { name: \"g\" max_step_tokens: "
           "\"many\" }\n";
  }
  rc = RunCommand(
      {BinPath("karat-coordinator"), "--config", dir + "/bad.textproto"}, &out);
  CHECK(rc != 0);
  CHECK(out.find("bad.textproto") != std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a node that cannot reach the coordinator retries and says so",
          "[integration]") {
  char tmpl[] = "/tmp/karat-retry-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  const std::string dir = tmpl;
  std::string out;
  REQUIRE(RunCommand({BinPath("karat-weights"), "--preset", "dsa-small",
                      "--seed", "1", "--out", dir + "/m"},
                     &out) == 0);
  // Port 9 (discard) on loopback: nothing listens there.
  const std::string log = dir + "/node.log";
  const std::string cmd =
      BinPath("karat-node") + " --coordinator 127.0.0.1:9 --model " + dir +
      "/m --devices 1 --device-capacity 16M --plaintext > " + log +
      " 2>&1 & echo $!";
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  int pid = 0;
  REQUIRE(fscanf(p, "%d", &pid) == 1);
  pclose(p);
  std::string text;
  for (int i = 0; i < 50; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::ifstream in(log);
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str();
    if (text.find("retrying") != std::string::npos) break;
  }
  kill(pid, SIGTERM);
  for (int i = 0; i < 50 && kill(pid, 0) == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  kill(pid, SIGKILL);
  INFO(text);
  CHECK(text.find("retrying") != std::string::npos);
  std::filesystem::remove_all(dir);
}

// DESIGN.md §7 "Coordinator restarted": the sessions and their token logs
// come back from the coordinator's write-ahead log; the nodes register
// again and drop the KV they held; each session's next turn rebuilds its
// KV from the token log, and the conversation's tokens stay the reference
// engine's. In karat mode the KV lives on the KARAT node, in gpu_only mode on
// the GPU rank.
TEST_CASE("a restarted coordinator: cluster tokens equal the reference engine",
          "[integration][sanitized]") {
  ClusterSpec spec;
  spec.coordinator_state = true;
  std::string kv_node = "karat0";
  SECTION("karat") {}
  SECTION("gpu_only") {
    spec.mode = "gpu_only";
    spec.karat_nodes = 0;
    auto config = PresetConfig(spec.preset);
    REQUIRE(config.ok());
    spec.gpu_hbm_bytes = RankWeightBytes(*config, 0, 1) + (int64_t(16) << 20);
    kv_node = "gpu0";
  }
  Cluster cluster(spec);
  constexpr int kSessions = 2, kTurns = 3, kMaxNew = 16;
  auto temperature = [](int s) { return s == 0 ? 0.0f : 0.9f; };
  auto seed = [](int s) { return uint64_t(700 + s); };
  std::vector<std::string> ids;
  std::vector<std::vector<Turn>> got(kSessions);
  std::vector<int64_t> tokens_before(kSessions);
  {
    auto stub = cluster.NewStub();
    for (int s = 0; s < kSessions; ++s) {
      ids.push_back(NewSession(stub.get(), seed(s)));
      got[s].push_back(Generate(stub.get(), ids[s], PromptText(s, 0), kMaxNew,
                                temperature(s)));
      INFO(got[s][0].status.error_message());
      REQUIRE(got[s][0].status.ok());
    }
    // A closed session stays closed.
    const std::string closed = NewSession(stub.get(), 5);
    REQUIRE(Generate(stub.get(), closed, "short", 2, 0).status.ok());
    grpc::ClientContext ctx;
    karat::v1::CloseSessionRequest req;
    req.set_session_id(closed);
    karat::v1::CloseSessionResponse resp;
    REQUIRE(stub->CloseSession(&ctx, req, &resp).ok());
    ids.push_back(closed);
    for (int s = 0; s < kSessions; ++s) {
      grpc::ClientContext gctx;
      karat::v1::GetSessionRequest greq;
      greq.set_session_id(ids[s]);
      karat::v1::Session sess;
      REQUIRE(stub->GetSession(&gctx, greq, &sess).ok());
      tokens_before[s] = sess.num_tokens();
    }
  }

  cluster.RestartCoordinator();
  INFO(cluster.ReadLog("coordinator"));
  CHECK(cluster.ReadLog(kv_node).find(
            "registering again: freed the KV of 2 sessions") !=
        std::string::npos);
  auto stub = cluster.NewStub();
  for (int s = 0; s <= kSessions; ++s) {
    grpc::ClientContext ctx;
    karat::v1::GetSessionRequest req;
    req.set_session_id(ids[s]);
    karat::v1::Session sess;
    grpc::Status st = stub->GetSession(&ctx, req, &sess);
    if (s == kSessions) {
      CHECK(st.error_code() == grpc::StatusCode::NOT_FOUND);
      continue;
    }
    REQUIRE(st.ok());
    CHECK(sess.num_tokens() == tokens_before[s]);
    CHECK(sess.turns() == 1);
    CHECK(sess.seed() == seed(s));
  }
  for (int t = 1; t < kTurns; ++t)
    for (int s = 0; s < kSessions; ++s)
      got[s].push_back(Generate(stub.get(), ids[s], PromptText(s, t), kMaxNew,
                                temperature(s)));

  CheckAgainstReference(cluster.model_dir(), got,
                        TextConversations(kMaxNew, seed, temperature), kTurns);
}

// Idle KV eviction (security.idle_kv_evict_s): a session idle for a second
// has its KV freed on the KARAT node; its next turn rebuilds it from the
// token log, and the conversation's tokens stay the reference engine's.
TEST_CASE("idle KV eviction: cluster tokens equal the reference engine",
          "[integration][sanitized]") {
  ClusterSpec spec;
  spec.extra_config = "security { idle_kv_evict_s: 1 }\n";
  Cluster cluster(spec);
  constexpr int kSessions = 2, kTurns = 3, kMaxNew = 12;
  auto temperature = [](int s) { return s == 0 ? 0.0f : 0.9f; };
  auto seed = [](int s) { return uint64_t(900 + s); };
  auto stub = cluster.NewStub();
  std::vector<std::string> ids;
  std::vector<std::vector<Turn>> got(kSessions);
  auto evictions = [&] {
    grpc::ClientContext ctx;
    karat::v1::ClusterStatus status;
    REQUIRE(stub->GetClusterStatus(&ctx, {}, &status).ok());
    return status.stats().at("kv_evictions");
  };
  for (int s = 0; s < kSessions; ++s)
    ids.push_back(NewSession(stub.get(), seed(s)));
  for (int t = 0; t < kTurns; ++t) {
    const double before = evictions();
    for (int s = 0; s < kSessions; ++s) {
      got[s].push_back(Generate(stub.get(), ids[s], PromptText(s, t), kMaxNew,
                                temperature(s)));
      INFO(got[s].back().status.error_message());
      REQUIRE(got[s].back().status.ok());
    }
    // Both sessions' KV is freed before their next turn.
    for (int i = 0; i < 600 && evictions() < before + kSessions; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    REQUIRE(evictions() >= before + kSessions);
  }
  CHECK(cluster.ReadLog("karat0").find(" freed") != std::string::npos);
  CheckAgainstReference(cluster.model_dir(), got,
                        TextConversations(kMaxNew, seed, temperature), kTurns);
}

}  // namespace
}  // namespace karat::testing
