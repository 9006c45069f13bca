// Node membership (DESIGN.md §1, control plane): a node registers with the
// coordinator and then sends heartbeats. NodeRegistrar runs both on one
// background thread:
//
//   register (retry with exponential backoff 100 ms -> 5 s, each failure
//   logged as "cannot reach coordinator at ADDR: <message>; retrying in N ms")
//   -> heartbeat every `interval` (or the interval the coordinator asks for)
//   -> on HeartbeatResponse.known == false (the coordinator restarted, or
//      took the node for lost), register again. Heartbeats that fail (the
//      coordinator down or stopped) are retried at the same interval: the
//      registration stays, so a coordinator that comes back, or a network
//      that heals, finds the node as it was.
//
// Re-registration may yield another node id (a restarted coordinator hands
// out new ones); `on_registered` is called after every successful
// registration with the coordinator's answer: the id in force and the
// cluster's data-plane secret (empty in plaintext mode), which the node's
// data plane keeps until the next registration (docs/security.md "Data
// plane").
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include <grpcpp/security/credentials.h>

#include "cluster.pb.h"

namespace karat {

struct RegistrarOptions {
  // The coordinator's gRPC address (host:port).
  std::string coordinator;
  // The channel's credentials (the node's TLS certificate); null: plaintext.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  // Builds the registration (called before every attempt, so it carries the
  // current device occupancy).
  std::function<cluster::RegisterNodeRequest()> make_request;
  // Fills devices and stats of a heartbeat (node_id is set by the registrar).
  std::function<void(cluster::HeartbeatRequest*)> fill_heartbeat;
  // Called on the registrar's thread after each successful registration.
  std::function<void(const cluster::RegisterNodeResponse& response)>
      on_registered;
  // Heartbeat period unless the coordinator's response names one.
  absl::Duration interval = absl::Seconds(1);
  // Deadline of one RPC.
  absl::Duration rpc_timeout = absl::Seconds(2);
  absl::Duration initial_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(5);
  // Consecutive failed heartbeats after which the node registers again; 0
  // (the default): never, only when the coordinator says it does not know
  // the node. Registering again drops what the node holds, so a coordinator
  // that is only slow or stopped for a while must not cause it.
  int max_heartbeat_failures = 0;
  // Module name for log lines ("gpu_node", "karat_node").
  std::string log_module = "membership";
};

// Thread safety: every method may be called from any thread.
class NodeRegistrar {
 public:
  // Starts the background thread. INVALID_ARGUMENT when the coordinator
  // address or make_request is missing.
  static absl::StatusOr<std::unique_ptr<NodeRegistrar>> Start(
      RegistrarOptions options);
  ~NodeRegistrar();  // Stop()s

  // The id of the current registration; nullopt before the first one and
  // while re-registering.
  std::optional<uint32_t> node_id() const;
  // Blocks until registered or `timeout`; true when registered.
  bool WaitRegistered(absl::Duration timeout) const;
  // Stops the thread promptly (cancels an RPC in flight). Idempotent.
  void Stop();

 private:
  NodeRegistrar();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Writes a node's bound gRPC address ("host:port\n") to `path` through a
// temporary file and a rename, so a launcher polling the file never reads a
// partial address.
absl::Status WritePortFile(const std::string& path, const std::string& address);

}  // namespace karat
