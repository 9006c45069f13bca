// The data plane between hosts, and link emulation through the admin API.
//
// "two network namespaces": the test creates two network namespaces joined
// by a veth pair with a private /30 (192.168.231.1 and .2, assigned inside
// the namespaces, so the traffic never leaves them), runs the coordinator and
// the KARAT node in one and the GPU node in the other over tcp;ofi_rxm, and
// checks that the streamed tokens equal the reference engine. Without the
// privilege to create namespaces it prints SKIPPED and says why. Namespaces
// and processes are removed on every path (NetnsGuard).
//
// "link emulation": on one host (shm), a rule set through
// karat.cluster.Admin reaches the nodes, delays the link (lower bound only),
// shows up in the per-link counters, and a link marked down makes the turn
// fail with UNAVAILABLE instead of hanging.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "cluster.grpc.pb.h"
#include "common/reference_engine.h"
#include "common/tokenizer.h"
#include "common/weights.h"
#include "karat.grpc.pb.h"
#include "tests/integration/cluster_harness.h"

extern char** environ;

namespace karat::testing {
namespace {


std::string Trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

// The reference engine's tokens for one greedy turn of a fresh session.
std::vector<int32_t> ReferenceTokens(const std::string& model_dir,
                                     const std::string& prompt,
                                     int max_new_tokens) {
  auto files = LoadModel(model_dir);
  REQUIRE(files.ok());
  auto engine = ReferenceEngine::Create(*files);
  REQUIRE(engine.ok());
  ReferenceSession ref;
  ref.key = 1;
  ref.seed = 0;
  auto want = (*engine)->RunTurn(&ref, EncodeText(prompt), max_new_tokens, 0.0f);
  REQUIRE(want.ok());
  return *want;
}

// Owns two network namespaces, the veth pair between them and the
// processes started in them; the destructor stops the processes (SIGTERM,
// then SIGKILL) and deletes the namespaces (which deletes the veth pair).
class NetnsGuard {
 public:
  NetnsGuard() {
    const std::string tag = std::to_string(getpid() % 100000);
    ns_a_ = "karat-t" + tag + "a";
    ns_b_ = "karat-t" + tag + "b";
    veth_a_ = "kv" + tag + "a";  // interface names: at most 15 characters
    veth_b_ = "kv" + tag + "b";
    char tmpl[] = "/tmp/karat-netns-XXXXXX";
    if (mkdtemp(tmpl) != nullptr) dir_ = tmpl;
  }
  ~NetnsGuard() {
    for (auto& [name, pid] : pids_) kill(pid, SIGTERM);
    for (auto& [name, pid] : pids_) {
      int status;
      bool exited = false;
      for (int i = 0; i < 100 && !exited; ++i) {
        exited = waitpid(pid, &status, WNOHANG) == pid;
        if (!exited) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      if (!exited) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
      }
    }
    if (!dir_.empty()) CheckNoSanitizerReports(dir_);
    std::string out;
    if (created_a_) RunCommand({IpPath(), "netns", "del", ns_a_}, &out);
    if (created_b_) RunCommand({IpPath(), "netns", "del", ns_b_}, &out);
    std::error_code ec;
    if (!dir_.empty() && getenv("KARAT_KEEP_TEST_DIRS") == nullptr) {
      std::filesystem::remove_all(dir_, ec);
    }
  }

  static std::string IpPath() {
    for (const char* p : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
      if (access(p, X_OK) == 0) return p;
    }
    return "";
  }

  // Creates the namespaces and the link; on failure returns why (the caller
  // skips), and whatever was created is removed by the destructor.
  std::string Setup() {
    if (dir_.empty()) return "cannot create a temporary directory";
    const std::string ip = IpPath();
    if (ip.empty()) return "the ip tool (iproute2) is not installed";
    std::string out;
    if (RunCommand({ip, "netns", "add", ns_a_}, &out) != 0) {
      return "cannot create a network namespace (needs root or "
             "CAP_SYS_ADMIN): " + Trim(out);
    }
    created_a_ = true;
    if (RunCommand({ip, "netns", "add", ns_b_}, &out) != 0) {
      return "cannot create a second network namespace: " + Trim(out);
    }
    created_b_ = true;
    const std::vector<std::vector<std::string>> steps = {
        {ip, "link", "add", veth_a_, "netns", ns_a_, "type", "veth", "peer",
         "name", veth_b_, "netns", ns_b_},
        {ip, "-n", ns_a_, "addr", "add", std::string(kAddrA) + "/30", "dev",
         veth_a_},
        {ip, "-n", ns_b_, "addr", "add", std::string(kAddrB) + "/30", "dev",
         veth_b_},
        {ip, "-n", ns_a_, "link", "set", "lo", "up"},
        {ip, "-n", ns_b_, "link", "set", "lo", "up"},
        {ip, "-n", ns_a_, "link", "set", veth_a_, "up"},
        {ip, "-n", ns_b_, "link", "set", veth_b_, "up"},
    };
    for (const auto& step : steps) {
      if (RunCommand(step, &out) != 0) {
        std::string cmd;
        for (const auto& a : step) cmd += a + " ";
        return "cannot set up the veth pair (" + cmd + "): " + Trim(out);
      }
    }
    return "";
  }

  // Starts `argv` inside namespace `ns` with its output in DIR/NAME.log.
  pid_t Start(const std::string& name, const std::string& ns,
              const std::vector<std::string>& argv) {
    std::vector<std::string> full = {IpPath(), "netns", "exec", ns};
    full.insert(full.end(), argv.begin(), argv.end());
    const std::string log = dir_ + "/" + name + ".log";
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    std::vector<char*> args;
    for (const auto& a : full) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    pid_t pid = -1;
    const int rc =
        posix_spawn(&pid, args[0], &fa, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    REQUIRE(rc == 0);
    pids_[name] = pid;
    return pid;
  }

  // Runs `argv` to completion inside `ns`.
  int Run(const std::string& ns, const std::vector<std::string>& argv,
          std::string* output) {
    std::vector<std::string> full = {IpPath(), "netns", "exec", ns};
    full.insert(full.end(), argv.begin(), argv.end());
    return RunCommand(full, output);
  }

  std::string WaitForPortFile(const std::string& path, const std::string& name) {
    for (int i = 0; i < 300; ++i) {
      std::string addr = Trim(ReadFile(path));
      if (!addr.empty()) return addr;
      int status;
      if (waitpid(pids_[name], &status, WNOHANG) == pids_[name]) {
        pids_.erase(name);
        FAIL(name << " exited before listening; log:\n" << Log(name));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    FAIL("no address in " << path << " after 30 s; log:\n" << Log(name));
    return "";
  }

  std::string Log(const std::string& name) const {
    return ReadFile(dir_ + "/" + name + ".log");
  }

  static constexpr const char* kAddrA = "192.168.231.1";
  static constexpr const char* kAddrB = "192.168.231.2";
  const std::string& ns_a() const { return ns_a_; }
  const std::string& ns_b() const { return ns_b_; }
  const std::string& dir() const { return dir_; }

 private:
  std::string ns_a_, ns_b_, veth_a_, veth_b_, dir_;
  bool created_a_ = false, created_b_ = false;
  std::map<std::string, pid_t> pids_;
};

TEST_CASE("two network namespaces: GPU node and KARAT node over tcp",
          "[integration][netns][sanitized]") {
  NetnsGuard guard;
  const std::string why = guard.Setup();
  if (!why.empty()) {
    std::printf("SKIPPED: two network namespaces: %s\n", why.c_str());
    WARN("SKIPPED: " << why);
    return;
  }
  const std::string model = guard.dir() + "/model";
  std::string out;
  REQUIRE(RunCommand({BinPath("karat-weights"), "--preset", "dsa-tiny",
                      "--seed", "1", "--out", model},
                     &out) == 0);

  const std::string b = NetnsGuard::kAddrB, a = NetnsGuard::kAddrA;
  // Mutual TLS across the hosts: certificates valid for both addresses.
  const std::string tls = guard.dir() + "/tls";
  REQUIRE(RunCommand({KARAT_CERTS_SCRIPT, tls, "coordinator", "karat0", "gpu0",
                      "--host", a, "--host", b},
                     &out) == 0);
  const std::vector<std::string> node_tls = {"--tls-ca", tls + "/ca.crt",
                                             "--tls-cert-dir", tls};
  auto with = [](std::vector<std::string> argv,
                 const std::vector<std::string>& more) {
    argv.insert(argv.end(), more.begin(), more.end());
    return argv;
  };
  guard.Start("coordinator", guard.ns_b(),
              {BinPath("karat-coordinator"), "--listen", b + ":0",
               "--port-file", guard.dir() + "/coordinator.addr", "--tls-dir",
               tls});
  const std::string coord =
      guard.WaitForPortFile(guard.dir() + "/coordinator.addr", "coordinator");
  guard.Start("karat0", guard.ns_b(),
              with({BinPath("karat-node"), "--coordinator", coord, "--listen",
                    b + ":0", "--name", "karat0", "--model", model,
                    "--provider", "tcp", "--fabric-node", b, "--devices", "1",
                    "--device-capacity", "256M", "--cores", "1",
                    "--tokens-per-page", "16", "--port-file",
                    guard.dir() + "/karat0.addr"},
                   node_tls));
  guard.Start("gpu0", guard.ns_a(),
              with({BinPath("karat-gpu-node"), "--coordinator", coord,
                    "--listen", a + ":0", "--name", "gpu0", "--model", model,
                    "--provider", "tcp", "--fabric-node", a,
                    "--max-step-tokens", "64", "--threads", "1",
                    "--attention-timeout-ms", "20000", "--send-timeout-ms",
                    "5000", "--port-file", guard.dir() + "/gpu0.addr"},
                   node_tls));

  // The client runs in the coordinator's namespace.
  bool alive = false;
  for (int i = 0; i < 600 && !alive; ++i) {
    alive = guard.Run(guard.ns_b(),
                      {BinPath("karatctl"), "--coordinator", coord,
                       "--tls-dir", tls, "status", "--expect-alive",
                       "gpu0,karat0"},
                      &out) == 0;
    if (!alive) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  INFO("gpu0 log:\n" << guard.Log("gpu0") << "\nkarat0 log:\n"
                     << guard.Log("karat0"));
  REQUIRE(alive);

  const std::string prompt = "Two hosts, one conversation: ";
  constexpr int kMaxNew = 20;
  const int rc = guard.Run(
      guard.ns_b(),
      {BinPath("karatctl"), "--coordinator", coord, "--tls-dir", tls,
       "generate", "--prompt", prompt, "--max-new-tokens",
       std::to_string(kMaxNew), "--ids"},
      &out);
  INFO("karatctl generate:\n" << out);
  REQUIRE(rc == 0);
  std::vector<int32_t> got;
  // The first line holds the ids; the summary follows on stderr.
  const std::string first_line = out.substr(0, out.find('\n'));
  for (absl::string_view t : absl::StrSplit(first_line, ' ', absl::SkipEmpty())) {
    int32_t id;
    if (absl::SimpleAtoi(t, &id)) got.push_back(id);
  }
  CHECK(got == ReferenceTokens(model, prompt, kMaxNew));
  // The data plane really used tcp between the namespaces.
  CHECK(guard.Log("gpu0").find("tcp;ofi_rxm") != std::string::npos);
}

// ---------------------------------------------------------------------------

std::vector<int32_t> GenerateIds(karat::v1::Karat::Stub* stub,
                                 const std::string& prompt, int max_new,
                                 grpc::Status* status) {
  grpc::ClientContext sctx;
  karat::v1::CreateSessionRequest sreq;
  karat::v1::Session session;
  *status = stub->CreateSession(&sctx, sreq, &session);
  if (!status->ok()) return {};
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(3));
  karat::v1::GenerateRequest req;
  req.set_session_id(session.session_id());
  req.set_prompt(prompt);
  req.set_max_new_tokens(max_new);
  auto reader = stub->Generate(&ctx, req);
  std::vector<int32_t> tokens;
  karat::v1::GenerateResponse ev;
  while (reader->Read(&ev)) {
    if (ev.has_token()) tokens.push_back(ev.token().token_id());
  }
  *status = reader->Finish();
  return tokens;
}

std::map<std::string, double> NodeStats(karat::v1::Karat::Stub* stub,
                                        const std::string& node) {
  grpc::ClientContext ctx;
  karat::v1::ClusterStatus st;
  REQUIRE(stub->GetClusterStatus(&ctx, karat::v1::GetClusterStatusRequest(),
                                 &st)
              .ok());
  for (const auto& n : st.nodes()) {
    if (n.name() == node) return {n.stats().begin(), n.stats().end()};
  }
  return {};
}

TEST_CASE("link emulation: set through the admin API, counted, and down fails",
          "[integration][links]") {
  ClusterSpec spec;
  Cluster cluster(spec);
  auto stub = cluster.NewStub();
  auto admin = cluster.NewAdminStub();

  // Invalid settings are refused and change nothing.
  cluster::LinkConfig bad;
  bad.set_source("gpu0");
  bad.set_destination("karat0");
  bad.set_loss(2);
  cluster::SetLinkResponse resp;
  CHECK(SetLink(admin.get(), bad, &resp).error_code() ==
        grpc::StatusCode::INVALID_ARGUMENT);

  constexpr int64_t kLatencyUs = 3000;
  cluster::LinkConfig slow;
  slow.set_source("gpu0");
  slow.set_destination("karat0");
  slow.set_latency_us(kLatencyUs);
  grpc::Status st = SetLink(admin.get(), slow, &resp);
  REQUIRE(st.ok());
  CHECK(resp.links_size() == 1);
  CHECK(resp.not_applied_size() == 0);
  // The reverse direction by the KARAT node's view of the GPU node's name.
  cluster::LinkConfig back = slow;
  back.set_source("karat0");
  back.set_destination("gpu0");
  REQUIRE(SetLink(admin.get(), back, &resp).ok());
  CHECK(resp.links_size() == 2);

  const std::string prompt = "A slow link still gives the same tokens: ";
  constexpr int kMaxNew = 12;
  const auto want = ReferenceTokens(cluster.model_dir(), prompt, kMaxNew);
  auto got = GenerateIds(stub.get(), prompt, kMaxNew, &st);
  INFO(st.error_message());
  REQUIRE(st.ok());
  CHECK(got == want);

  // Counters arrive with the next heartbeat.
  std::map<std::string, double> gpu, karat;
  for (int i = 0; i < 100; ++i) {
    gpu = NodeStats(stub.get(), "gpu0");
    karat = NodeStats(stub.get(), "karat0");
    if (gpu["link.karat0.messages"] > 0 && karat["link.gpu0.messages"] > 0) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  CHECK(gpu["link.karat0.messages"] > 0);
  CHECK(gpu["link.karat0.bytes"] > 0);
  CHECK(karat["link.gpu0.messages"] > 0);
  // Every message waited at least the added latency (bucket bounds: the
  // median's bucket lies at or above it).
  CHECK(gpu["link.karat0.latency_us_p50"] >= double(kLatencyUs));
  CHECK(karat["link.gpu0.latency_us_p50"] >= double(kLatencyUs));

  // karatctl shows the rules and prints Prometheus text.
  std::string out;
  REQUIRE(RunCommand({BinPath("karatctl"), "--coordinator",
                      cluster.coordinator_address(), "--admin-addr",
                      cluster.admin_address(), "--tls-dir", cluster.tls_dir(),
                      "status"},
                     &out) == 0);
  CHECK(out.find("latency 3000us") != std::string::npos);
  REQUIRE(RunCommand({BinPath("karatctl"), "--coordinator",
                      cluster.coordinator_address(), "--tls-dir",
                      cluster.tls_dir(), "metrics"},
                     &out) == 0);
  CHECK(out.find("karat_link_messages_total{node=\"gpu0\",peer=\"karat0\"}") !=
        std::string::npos);

  // A link that is down fails the turn with UNAVAILABLE (no hang).
  cluster::LinkConfig down;
  down.set_source("gpu0");
  down.set_destination("karat0");
  down.set_down(true);
  REQUIRE(SetLink(admin.get(), down, &resp).ok());
  GenerateIds(stub.get(), "this turn cannot reach its KV", 4, &st);
  CHECK(st.error_code() == grpc::StatusCode::UNAVAILABLE);

  // Up again: turns work again.
  cluster::LinkConfig plain;
  plain.set_source("gpu0");
  plain.set_destination("karat0");
  REQUIRE(SetLink(admin.get(), plain, &resp).ok());
  got = GenerateIds(stub.get(), prompt, kMaxNew, &st);
  INFO(st.error_message());
  REQUIRE(st.ok());
  CHECK(got == want);
}

}  // namespace
}  // namespace karat::testing
