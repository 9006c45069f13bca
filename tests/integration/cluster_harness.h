// Starts a real local cluster (karat-coordinator, karat-node, karat-gpu-node
// as separate processes on loopback, libfabric between the nodes) for
// multi-process tests, and stops it again. Every daemon listens on a free
// port (port 0) and reports its address through a port file.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cluster.grpc.pb.h"
#include "karat.grpc.pb.h"

namespace karat::testing {

struct ClusterSpec {
  std::string preset = "dsa-tiny";
  uint64_t weights_seed = 1;
  std::string provider = "shm";
  int devices = 2;
  std::string device_capacity = "256M";
  int tokens_per_page = 16;
  int max_step_tokens = 64;
  int max_new_tokens_limit = 256;
  // Scale-out (issue 5): GPU ranks and KARAT nodes, and the scheduling
  // settings. When any of these differs from its default the coordinator
  // gets a cluster config file (--config) with them, and each GPU node its
  // rank and the matching flags.
  int gpu_nodes = 1;
  int karat_nodes = 1;
  std::string mode;       // "karat" / "gpu_only"; "" = karat
  int micro_batches = 0;  // 1 or 2; 0 = the default
  std::string schedule;   // "ofms" / "scms"
  std::string balance;    // "cmr" / "count"
  int64_t gpu_hbm_bytes = 0;
  // The GPU ranks' timing model (GpuNodeConfig.hbm_bandwidth_gbps, tflops).
  double gpu_bandwidth_gbps = 0;
  double gpu_tflops = 0;
  double tbt_slo_ms = 0;
  // Appended to the cluster config as is (links { ... }, ...).
  std::string extra_config;
  // The coordinator keeps its write-ahead log of sessions in DIR/state
  // (--state-dir), for RestartCoordinator.
  bool coordinator_state = false;
  // No TLS and no credentials (--plaintext everywhere). Off: the cluster's
  // CA, certificates and tokens are made in DIR/tls (deploy/karat-certs)
  // and every daemon and channel uses them.
  bool plaintext = false;
};

class Cluster {
 public:
  // Generates the model into a fresh temporary directory and starts the
  // daemons; FAILs the current test when they do not come up.
  explicit Cluster(const ClusterSpec& spec);
  ~Cluster();  // SIGTERM, then SIGKILL after a grace period; removes files

  const std::string& model_dir() const { return model_dir_; }
  const std::string& coordinator_address() const { return coord_addr_; }
  const std::string& admin_address() const { return admin_addr_; }
  // A channel to the client API with the client token (TLS) or plaintext.
  std::shared_ptr<grpc::Channel> ClientChannel() const;
  std::unique_ptr<karat::v1::Karat::Stub> NewStub() const;
  // The admin API (its own port) with the admin token.
  std::unique_ptr<karat::cluster::Admin::Stub> NewAdminStub() const;
  // A channel to the gRPC address of node `name` with the coordinator's
  // certificate (the only caller the nodes take).
  std::shared_ptr<grpc::Channel> NodeChannel(const std::string& name) const;
  // DIR/tls: ca.crt, NAME.crt/.key, client.token, admin.token (not with
  // spec.plaintext).
  std::string tls_dir() const { return dir_ + "/tls"; }
  bool plaintext() const { return spec_.plaintext; }
  // pids of the running daemons, by name.
  const std::map<std::string, pid_t>& pids() const { return pids_; }
  // SIGKILLs daemon `name` and reaps it (a fault; the shared-memory
  // segment its data plane leaves behind is removed).
  void Kill(const std::string& name);
  // Starts daemon `name` again with the flags it was first started with
  // (after Kill); returns its pid.
  pid_t Restart(const std::string& name);
  // SIGKILLs the coordinator (a crash), starts it again with the same flags
  // on the address it had, and waits until the nodes have registered with
  // it again. FAILs the current test when it does not come back.
  void RestartCoordinator();
  std::string ReadLog(const std::string& name) const;
  const std::string& dir() const { return dir_; }

 private:
  void StartAll();  // the constructor's work
  void StopAll();   // SIGTERM, then SIGKILL; removes the files
  pid_t Start(const std::string& name, const std::vector<std::string>& argv);
  std::string WaitForPortFile(const std::string& path, pid_t pid);
  void WaitForNodes(int expected);
  // The ClusterConfig (text format) of a scale-out spec.
  std::string ClusterConfigText() const;

  ClusterSpec spec_;
  std::string dir_, model_dir_, coord_addr_, admin_addr_;
  std::map<std::string, pid_t> pids_;
  std::map<std::string, std::vector<std::string>> argv_;
};

// --- Client side: conversations through the coordinator's API ---------------

// One Generate call as the client saw it.
struct Turn {
  grpc::Status status;
  std::vector<int32_t> tokens;
  std::string finish_reason;  // of the done event, if one came
  int queued_updates = 0;     // queued events before the first token
};

// Streams one turn (a 3-minute deadline); with cancel_after >= 0 the call
// is cancelled once that many tokens have arrived.
Turn Generate(karat::v1::Karat::Stub* stub, const std::string& session,
              const std::string& prompt, int max_new_tokens, float temperature,
              int cancel_after = -1);
// A new session with `seed`; FAILs the current test when it is refused.
std::string NewSession(karat::v1::Karat::Stub* stub, uint64_t seed);

// How a test's conversations go: turn t of session s sends prompt(s, t)
// for max_new(t) tokens at temperature(s); session s has seed(s).
struct Conversations {
  std::function<std::string(int, int)> prompt;
  std::function<int(int)> max_new;
  std::function<uint64_t(int)> seed;
  std::function<float(int)> temperature;
};
// Runs `sessions` concurrent sessions of `turns` turns each, one client
// thread per session; a session that cannot be created has no turns.
std::vector<std::vector<Turn>> RunConversations(const Cluster& cluster,
                                                int sessions, int turns,
                                                const Conversations& conv);
// Checks every turn of got[s] (session s: data-plane key s + 1) against the
// reference engine on the model in `model_dir`; with turns >= 0 each
// session must also have exactly that many.
void CheckAgainstReference(const std::string& model_dir,
                           const std::vector<std::vector<Turn>>& got,
                           const Conversations& conv, int turns = -1);

// Admin.SetLink with `link` (30 s deadline); the reply in *resp.
grpc::Status SetLink(karat::cluster::Admin::Stub* admin,
                     karat::cluster::LinkConfig link,
                     karat::cluster::SetLinkResponse* resp);

// Runs `argv` to completion; returns its exit status and combined output.
int RunCommand(const std::vector<std::string>& argv, std::string* output);
// Path of a built executable (build/bin/NAME).
std::string BinPath(const std::string& name);
// The first sanitizer report in a program's output (from the line it starts
// on, at most 16 KiB), or "" when there is none.
std::string SanitizerReport(const std::string& log);
// CHECKs that no *.log file in `dir` (the daemons' output) holds a sanitizer
// report; a sanitized build's daemons print theirs there.
void CheckNoSanitizerReports(const std::string& dir);
// The whole content of a file ("" when it cannot be read).
std::string ReadFile(const std::string& path);
// CPU seconds (user + system) a process has used so far.
double ProcessCpuSeconds(pid_t pid);

}  // namespace karat::testing
