// Starts a real local cluster (karat-coordinator, karat-node, karat-gpu-node
// as separate processes on loopback, libfabric between the nodes) for
// multi-process tests, and stops it again. Every daemon listens on a free
// port (port 0) and reports its address through a port file.
#pragma once

#include <sys/types.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

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
};

class Cluster {
 public:
  // Generates the model into a fresh temporary directory and starts the
  // daemons; FAILs the current test when they do not come up.
  explicit Cluster(const ClusterSpec& spec);
  ~Cluster();  // SIGTERM, then SIGKILL after a grace period; removes files

  const std::string& model_dir() const { return model_dir_; }
  const std::string& coordinator_address() const { return coord_addr_; }
  std::unique_ptr<karat::v1::Karat::Stub> NewStub() const;
  // pids of the running daemons, by name.
  const std::map<std::string, pid_t>& pids() const { return pids_; }
  std::string ReadLog(const std::string& name) const;
  const std::string& dir() const { return dir_; }

 private:
  pid_t Start(const std::string& name, const std::vector<std::string>& argv);
  std::string WaitForPortFile(const std::string& path, pid_t pid);
  void WaitForNodes(int expected);

  ClusterSpec spec_;
  std::string dir_, model_dir_, coord_addr_;
  std::map<std::string, pid_t> pids_;
};

// Runs `argv` to completion; returns its exit status and combined output.
int RunCommand(const std::vector<std::string>& argv, std::string* output);
// Path of a built executable (build/bin/NAME).
std::string BinPath(const std::string& name);
// The whole content of a file ("" when it cannot be read).
std::string ReadFile(const std::string& path);
// CPU seconds (user + system) a process has used so far.
double ProcessCpuSeconds(pid_t pid);

}  // namespace karat::testing
