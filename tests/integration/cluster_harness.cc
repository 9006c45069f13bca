#include "tests/integration/cluster_harness.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/reference_engine.h"
#include "common/tokenizer.h"
#include "common/weights.h"
#include "security/tls.h"

extern char** environ;

namespace karat::testing {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string BinPath(const std::string& name) {
  return std::string(KARAT_BIN_DIR) + "/" + name;
}

int RunCommand(const std::vector<std::string>& argv, std::string* output) {
  char tmpl[] = "/tmp/karat-cmd-XXXXXX";
  int fd = mkstemp(tmpl);
  if (fd < 0) return -1;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fd, 1);
  posix_spawn_file_actions_adddup2(&fa, fd, 2);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid;
  int rc = posix_spawn(&pid, args[0], &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  close(fd);
  int status = -1;
  if (rc == 0) waitpid(pid, &status, 0);
  if (output != nullptr) *output = ReadFile(tmpl);
  unlink(tmpl);
  if (rc != 0) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string SanitizerReport(const std::string& log) {
  // AddressSanitizer and LeakSanitizer: "==PID==ERROR: AddressSanitizer: ...",
  // ThreadSanitizer: "WARNING: ThreadSanitizer: data race ...", each report
  // ending in "SUMMARY: ...Sanitizer: ..."; UndefinedBehaviorSanitizer:
  // "file:line:col: runtime error: ...".
  size_t at = std::string::npos;
  for (const char* marker :
       {"ERROR: AddressSanitizer", "ERROR: LeakSanitizer",
        "WARNING: ThreadSanitizer", "ERROR: ThreadSanitizer",
        ": runtime error: ", "SUMMARY: UndefinedBehaviorSanitizer"}) {
    at = std::min(at, log.find(marker));
  }
  if (at == std::string::npos) return "";
  const size_t line = log.rfind('\n', at);
  const size_t begin = line == std::string::npos ? 0 : line + 1;
  constexpr size_t kMaxReport = 16384;
  return log.substr(begin, kMaxReport);
}

void CheckNoSanitizerReports(const std::string& dir) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (entry.path().extension() != ".log") continue;
    const std::string report = SanitizerReport(ReadFile(entry.path()));
    INFO(entry.path().filename().string() << " holds a sanitizer report:\n"
                                          << report);
    CHECK(report.empty());
  }
}

double ProcessCpuSeconds(pid_t pid) {
  std::string stat = ReadFile("/proc/" + std::to_string(pid) + "/stat");
  // Fields after the command name (which is in parentheses).
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream in(stat.substr(close + 2));
  std::string f;
  std::vector<std::string> fields;
  while (in >> f) fields.push_back(f);
  // utime and stime are fields 14 and 15 (1-based) = index 11, 12 here.
  if (fields.size() < 13) return -1;
  const double ticks = double(sysconf(_SC_CLK_TCK));
  return (std::stod(fields[11]) + std::stod(fields[12])) / ticks;
}

Cluster::Cluster(const ClusterSpec& spec) : spec_(spec) {
  // A failed start-up throws out of the constructor, so the destructor
  // would not stop the daemons already started.
  try {
    StartAll();
  } catch (...) {
    StopAll();
    throw;
  }
}

void Cluster::StartAll() {
  const ClusterSpec& spec = spec_;
  // Daemons share two cores: OpenMP workers must sleep, not spin, between
  // parallel regions.
  setenv("OMP_WAIT_POLICY", "passive", /*overwrite=*/0);
  char tmpl[] = "/tmp/karat-cluster-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  dir_ = tmpl;
  model_dir_ = dir_ + "/model";
  std::string out;
  const int rc =
      RunCommand({BinPath("karat-weights"), "--preset", spec.preset, "--seed",
                  std::to_string(spec.weights_seed), "--out", model_dir_},
                 &out);
  INFO(out);
  REQUIRE(rc == 0);

  // TLS: a CA, a certificate for every daemon, client and admin tokens.
  std::vector<std::string> coordinator_tls = {"--plaintext"};
  std::vector<std::string> node_tls = {"--plaintext"};
  if (!spec.plaintext) {
    std::vector<std::string> certs = {KARAT_CERTS_SCRIPT, tls_dir(),
                                      "coordinator"};
    for (int k = 0; k < spec.karat_nodes; ++k)
      certs.push_back("karat" + std::to_string(k));
    for (int g = 0; g < spec.gpu_nodes; ++g)
      certs.push_back("gpu" + std::to_string(g));
    const int certs_rc = RunCommand(certs, &out);
    INFO(out);
    REQUIRE(certs_rc == 0);
    coordinator_tls = {"--tls-dir", tls_dir()};
    node_tls = {"--tls-ca", tls_dir() + "/ca.crt", "--tls-cert-dir",
                tls_dir()};
  }
  const bool scale_out = spec.gpu_nodes != 1 || spec.karat_nodes != 1 ||
                         !spec.mode.empty() || spec.micro_batches != 0 ||
                         !spec.schedule.empty() || !spec.balance.empty() ||
                         spec.gpu_hbm_bytes != 0 || spec.tbt_slo_ms != 0 ||
                         spec.gpu_bandwidth_gbps != 0 || spec.gpu_tflops != 0 ||
                         !spec.extra_config.empty();
  std::vector<std::string> coordinator = {
      BinPath("karat-coordinator"),
      "--listen",
      "127.0.0.1:0",
      "--port-file",
      dir_ + "/coordinator.addr",
      "--max-new-tokens-limit",
      std::to_string(spec.max_new_tokens_limit),
      "--admin-port-file",
      dir_ + "/coordinator-admin.addr"};
  coordinator.insert(coordinator.end(), coordinator_tls.begin(),
                     coordinator_tls.end());
  if (scale_out) {
    const std::string config = dir_ + "/cluster.textproto";
    std::ofstream(config) << ClusterConfigText();
    coordinator.push_back("--config");
    coordinator.push_back(config);
  }
  if (spec.coordinator_state) {
    coordinator.push_back("--state-dir");
    coordinator.push_back(dir_ + "/state");
  }
  pid_t c = Start("coordinator", coordinator);
  coord_addr_ = WaitForPortFile(dir_ + "/coordinator.addr", c);
  admin_addr_ = WaitForPortFile(dir_ + "/coordinator-admin.addr", c);
  // A restarted coordinator listens where the nodes look for it.
  for (size_t i = 0; i + 1 < argv_["coordinator"].size(); ++i)
    if (argv_["coordinator"][i] == "--listen")
      argv_["coordinator"][i + 1] = coord_addr_;
  argv_["coordinator"].push_back("--admin-listen");
  argv_["coordinator"].push_back(admin_addr_);
  for (int k = 0; k < spec.karat_nodes; ++k) {
    const std::string name = "karat" + std::to_string(k);
    std::vector<std::string> argv = {BinPath("karat-node"),
                 "--coordinator",
                 coord_addr_,
                 "--listen",
                 "127.0.0.1:0",
                 "--name",
                 name,
                 "--model",
                 model_dir_,
                 "--provider",
                 spec.provider,
                 "--devices",
                 std::to_string(spec.devices),
                 "--device-capacity",
                 spec.device_capacity,
                 "--cores",
                 "1",
                 "--tokens-per-page",
                 std::to_string(spec.tokens_per_page),
                 "--port-file",
                 dir_ + "/" + name + ".addr"};
    argv.insert(argv.end(), node_tls.begin(), node_tls.end());
    Start(name, argv);
  }
  for (int g = 0; g < spec.gpu_nodes; ++g) {
    const std::string name = "gpu" + std::to_string(g);
    std::vector<std::string> argv = {BinPath("karat-gpu-node"),
                                     "--coordinator",
                                     coord_addr_,
                                     "--listen",
                                     "127.0.0.1:0",
                                     "--name",
                                     name,
                                     "--model",
                                     model_dir_,
                                     "--provider",
                                     spec.provider,
                                     "--max-step-tokens",
                                     std::to_string(spec.max_step_tokens),
                                     "--threads",
                                     "1",
                                     "--port-file",
                                     dir_ + "/" + name + ".addr"};
    argv.insert(argv.end(), node_tls.begin(), node_tls.end());
    if (scale_out) {
      for (const std::string& a :
           {std::string("--rank"), std::to_string(g), std::string("--ranks"),
            std::to_string(spec.gpu_nodes), std::string("--mode"),
            spec.mode.empty() ? std::string("karat") : spec.mode,
            std::string("--micro-batches"),
            std::to_string(spec.micro_batches == 0 ? 2 : spec.micro_batches),
            std::string("--schedule"),
            spec.schedule.empty() ? std::string("ofms") : spec.schedule,
            std::string("--hbm-bytes"), std::to_string(spec.gpu_hbm_bytes)}) {
        argv.push_back(a);
      }
      if (spec.gpu_bandwidth_gbps != 0) {
        argv.push_back("--hbm-bandwidth-gbps");
        argv.push_back(absl::StrCat(spec.gpu_bandwidth_gbps));
      }
      if (spec.gpu_tflops != 0) {
        argv.push_back("--tflops");
        argv.push_back(absl::StrCat(spec.gpu_tflops));
      }
    }
    Start(name, argv);
  }
  WaitForNodes(spec.gpu_nodes +
               (spec.mode == "gpu_only" ? 0 : spec.karat_nodes));
}

std::string Cluster::ClusterConfigText() const {
  const ClusterSpec& spec = spec_;
  int64_t capacity = std::stoll(spec.device_capacity);
  switch (spec.device_capacity.back()) {
    case 'G':
      capacity <<= 30;
      break;
    case 'M':
      capacity <<= 20;
      break;
    case 'K':
      capacity <<= 10;
      break;
    default:
      break;
  }
  std::ostringstream c;
  c << "model_dir: \"" << model_dir_ << "\"\n"
    << "provider: \"" << spec.provider << "\"\n"
    << "coordinator { listen: \"127.0.0.1:0\" max_new_tokens_limit: "
    << spec.max_new_tokens_limit
    << " heartbeat_interval_ms: 200 node_timeout_ms: 1500 }\n";
  if (!spec.mode.empty()) c << "mode: \"" << spec.mode << "\"\n";
  c << "scheduling {";
  if (spec.micro_batches != 0) c << " micro_batches: " << spec.micro_batches;
  if (!spec.schedule.empty()) c << " schedule: \"" << spec.schedule << "\"";
  if (!spec.balance.empty()) c << " balance: \"" << spec.balance << "\"";
  if (spec.tbt_slo_ms != 0) c << " tbt_slo_ms: " << spec.tbt_slo_ms;
  c << " }\n";
  for (int g = 0; g < spec.gpu_nodes; ++g) {
    c << "gpu_nodes { name: \"gpu" << g
      << "\" listen: \"127.0.0.1:0\" max_step_tokens: " << spec.max_step_tokens
      << " max_batch: 64 threads: 1";
    if (spec.gpu_hbm_bytes != 0) c << " hbm_bytes: " << spec.gpu_hbm_bytes;
    if (spec.gpu_bandwidth_gbps != 0)
      c << " hbm_bandwidth_gbps: " << spec.gpu_bandwidth_gbps;
    if (spec.gpu_tflops != 0) c << " tflops: " << spec.gpu_tflops;
    c << " }\n";
  }
  for (int k = 0; k < spec.karat_nodes; ++k) {
    c << "karat_nodes { name: \"karat" << k
      << "\" listen: \"127.0.0.1:0\" tokens_per_page: " << spec.tokens_per_page;
    for (int d = 0; d < spec.devices; ++d) {
      c << " devices { capacity_bytes: " << capacity << " cores: 1 }";
    }
    c << " }\n";
  }
  c << spec.extra_config;
  return c.str();
}

Cluster::~Cluster() { StopAll(); }

void Cluster::StopAll() {
  for (auto& [name, pid] : pids_) kill(pid, SIGTERM);
  for (auto& [name, pid] : pids_) {
    int status;
    bool exited = false;
    for (int i = 0; i < 100 && !exited; ++i) {
      exited = waitpid(pid, &status, WNOHANG) == pid;
      if (!exited) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (!exited) {
      WARN(name << " did not exit within 5 s of SIGTERM; killing it");
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
    }
  }
  pids_.clear();
  // A daemon's sanitizer finding (a sanitized build's) is this test's.
  if (!dir_.empty()) CheckNoSanitizerReports(dir_);
  std::error_code ec;
  if (getenv("KARAT_KEEP_TEST_DIRS") == nullptr && !dir_.empty()) {
    std::filesystem::remove_all(dir_, ec);
  }
}

pid_t Cluster::Start(const std::string& name,
                     const std::vector<std::string>& argv) {
  const std::string log = dir_ + "/" + name + ".log";
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(),
                                   O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid;
  const int rc = posix_spawn(&pid, args[0], &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  INFO("starting " << argv[0]);
  REQUIRE(rc == 0);
  pids_[name] = pid;
  argv_[name] = argv;
  return pid;
}

void Cluster::Kill(const std::string& name) {
  auto it = pids_.find(name);
  REQUIRE(it != pids_.end());
  const pid_t pid = it->second;
  REQUIRE(kill(pid, SIGKILL) == 0);
  int status;
  waitpid(pid, &status, 0);
  pids_.erase(it);
  // The shm provider names each endpoint's segment after the pid
  // ("<pid>:<endpoint>:0"; one per peer besides the receiving one); a later
  // process with the same pid could not open its endpoints while they are
  // there.
  const std::string prefix = std::to_string(pid) + ":";
  std::error_code ec;
  std::vector<std::filesystem::path> stale;
  for (const auto& entry :
       std::filesystem::directory_iterator("/dev/shm", ec)) {
    if (entry.path().filename().string().rfind(prefix, 0) == 0)
      stale.push_back(entry.path());
  }
  for (const auto& path : stale) std::filesystem::remove(path, ec);
}

pid_t Cluster::Restart(const std::string& name) {
  auto it = argv_.find(name);
  REQUIRE(it != argv_.end());
  REQUIRE(pids_.count(name) == 0);
  // A restarted daemon writes its address again.
  for (size_t i = 0; i + 1 < it->second.size(); ++i) {
    if (it->second[i] == "--port-file") {
      std::error_code ec;
      std::filesystem::remove(it->second[i + 1], ec);
    }
  }
  const std::vector<std::string> argv = it->second;
  return Start(name, argv);
}

void Cluster::RestartCoordinator() {
  Kill("coordinator");
  const pid_t pid = Restart("coordinator");
  const std::string addr = WaitForPortFile(dir_ + "/coordinator.addr", pid);
  REQUIRE(addr == coord_addr_);
  REQUIRE(WaitForPortFile(dir_ + "/coordinator-admin.addr", pid) ==
          admin_addr_);
  // Each node learns from a heartbeat that its id is unknown and registers
  // again.
  WaitForNodes(spec_.gpu_nodes +
               (spec_.mode == "gpu_only" ? 0 : spec_.karat_nodes));
}

std::string Cluster::WaitForPortFile(const std::string& path, pid_t pid) {
  for (int i = 0; i < 300; ++i) {
    std::string addr = ReadFile(path);
    while (!addr.empty() && (addr.back() == '\n' || addr.back() == ' ')) {
      addr.pop_back();
    }
    if (!addr.empty()) return addr;
    int status;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      FAIL("daemon exited before listening; log:\n" << ReadLog("coordinator"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  FAIL("no address in " << path << " after 30 s");
  return "";
}

void Cluster::WaitForNodes(int expected) {
  auto stub = NewStub();
  for (int i = 0; i < 600; ++i) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(2));
    karat::v1::GetClusterStatusRequest req;
    karat::v1::ClusterStatus st;
    if (stub->GetClusterStatus(&ctx, req, &st).ok()) {
      int alive = 0;
      for (const auto& n : st.nodes()) alive += n.alive() ? 1 : 0;
      if (alive >= expected) return;
    }
    for (auto& [name, pid] : pids_) {
      int status;
      if (waitpid(pid, &status, WNOHANG) == pid) {
        FAIL(name << " exited during start-up; log:\n" << ReadLog(name));
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  FAIL("nodes did not register within 60 s");
}

namespace {

// Credentials from the cluster's TLS folder: `token_file` ("" for none) sent
// as a bearer token, `cert` ("" for none) presented as the certificate.
std::shared_ptr<grpc::ChannelCredentials> TestCredentials(
    const Cluster& c, const std::string& token_file, const std::string& cert) {
  if (c.plaintext()) return grpc::InsecureChannelCredentials();
  karat::security::TlsOptions tls;
  tls.ca_file = c.tls_dir() + "/ca.crt";
  if (!cert.empty()) {
    tls.cert_file = c.tls_dir() + "/" + cert + ".crt";
    tls.key_file = c.tls_dir() + "/" + cert + ".key";
  }
  std::string token;
  if (!token_file.empty()) {
    token = ReadFile(c.tls_dir() + "/" + token_file);
    while (!token.empty() && (token.back() == '\n' || token.back() == ' '))
      token.pop_back();
  }
  auto creds = karat::security::ClientCredentials(tls, token);
  REQUIRE(creds.ok());
  return *creds;
}

}  // namespace

std::shared_ptr<grpc::Channel> Cluster::ClientChannel() const {
  return grpc::CreateChannel(coord_addr_,
                             TestCredentials(*this, "client.token", ""));
}

std::unique_ptr<karat::v1::Karat::Stub> Cluster::NewStub() const {
  return karat::v1::Karat::NewStub(ClientChannel());
}

std::unique_ptr<karat::cluster::Admin::Stub> Cluster::NewAdminStub() const {
  return karat::cluster::Admin::NewStub(grpc::CreateChannel(
      admin_addr_, TestCredentials(*this, "admin.token", "")));
}

std::shared_ptr<grpc::Channel> Cluster::NodeChannel(
    const std::string& name) const {
  std::string addr = ReadFile(dir_ + "/" + name + ".addr");
  while (!addr.empty() && (addr.back() == '\n' || addr.back() == ' '))
    addr.pop_back();
  return grpc::CreateChannel(addr,
                             TestCredentials(*this, "", "coordinator"));
}

std::string Cluster::ReadLog(const std::string& name) const {
  return ReadFile(dir_ + "/" + name + ".log");
}

// --- Client side ------------------------------------------------------------

grpc::Status SetLink(karat::cluster::Admin::Stub* admin,
                     karat::cluster::LinkConfig link,
                     karat::cluster::SetLinkResponse* resp) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  karat::cluster::SetLinkRequest req;
  *req.mutable_link() = std::move(link);
  return admin->SetLink(&ctx, req, resp);
}

Turn Generate(karat::v1::Karat::Stub* stub, const std::string& session,
              const std::string& prompt, int max_new_tokens, float temperature,
              int cancel_after) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(3));
  karat::v1::GenerateRequest req;
  req.set_session_id(session);
  req.set_prompt(prompt);
  req.set_max_new_tokens(max_new_tokens);
  req.set_temperature(temperature);
  auto reader = stub->Generate(&ctx, req);
  Turn r;
  karat::v1::GenerateResponse ev;
  while (reader->Read(&ev)) {
    if (ev.has_token()) {
      r.tokens.push_back(ev.token().token_id());
      if (int(r.tokens.size()) == cancel_after) ctx.TryCancel();
    }
    if (ev.has_queued()) ++r.queued_updates;
    if (ev.has_done()) r.finish_reason = ev.done().finish_reason();
  }
  r.status = reader->Finish();
  return r;
}

std::string NewSession(karat::v1::Karat::Stub* stub, uint64_t seed) {
  grpc::ClientContext ctx;
  karat::v1::CreateSessionRequest req;
  req.set_seed(seed);
  karat::v1::Session sess;
  const grpc::Status st = stub->CreateSession(&ctx, req, &sess);
  INFO(st.error_message());
  REQUIRE(st.ok());
  return sess.session_id();
}

std::vector<std::vector<Turn>> RunConversations(const Cluster& cluster,
                                                int sessions, int turns,
                                                const Conversations& conv) {
  std::vector<std::vector<Turn>> got(sessions);
  std::vector<std::thread> threads;
  for (int s = 0; s < sessions; ++s) {
    threads.emplace_back([&, s] {
      // Not NewSession: Catch2's assertions belong to the test's thread.
      auto stub = cluster.NewStub();
      grpc::ClientContext ctx;
      karat::v1::CreateSessionRequest req;
      req.set_seed(conv.seed(s));
      karat::v1::Session sess;
      if (!stub->CreateSession(&ctx, req, &sess).ok()) return;
      for (int t = 0; t < turns; ++t) {
        got[s].push_back(Generate(stub.get(), sess.session_id(),
                                  conv.prompt(s, t), conv.max_new(t),
                                  conv.temperature(s)));
      }
    });
  }
  for (auto& th : threads) th.join();
  return got;
}

void CheckAgainstReference(const std::string& model_dir,
                           const std::vector<std::vector<Turn>>& got,
                           const Conversations& conv, int turns) {
  auto files = LoadModel(model_dir);
  INFO(files.status().ToString());
  REQUIRE(files.ok());
  auto engine = ReferenceEngine::Create(*files);
  REQUIRE(engine.ok());
  for (int s = 0; s < int(got.size()); ++s) {
    INFO("session " << s);
    if (turns >= 0) REQUIRE(int(got[s].size()) == turns);
    ReferenceSession ref;
    ref.key = uint64_t(s + 1);
    ref.seed = conv.seed(s);
    for (int t = 0; t < int(got[s].size()); ++t) {
      INFO("turn " << t);
      INFO(got[s][t].status.error_message());
      REQUIRE(got[s][t].status.ok());
      auto want = (*engine)->RunTurn(&ref, EncodeText(conv.prompt(s, t)),
                                     conv.max_new(t), conv.temperature(s));
      REQUIRE(want.ok());
      CHECK(got[s][t].tokens == *want);
    }
  }
}

}  // namespace karat::testing
