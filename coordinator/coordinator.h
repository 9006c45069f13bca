// The KARAT coordinator (DESIGN.md §1, §4, §5): serves the client API
// (karat.v1.Karat) and node membership (karat.cluster.Coordinator) on one
// gRPC server, keeps every session's token log, places each session's KV on
// a home device and drives turns through GPU nodes.
//
// Usage:
//   Options options;  options.listen = "127.0.0.1:0";
//   ASSIGN_OR_RETURN(auto coordinator, Coordinator::Start(options));
//   std::cout << coordinator->address();   // "127.0.0.1:41234"
//   ...
//   coordinator->Shutdown(absl::Seconds(5));
//
// The server also offers grpc.health.v1.Health and server reflection.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cluster.pb.h"

namespace karat::coordinator {

struct Options {
  // gRPC listen address; port 0 picks a free port.
  std::string listen = "127.0.0.1:0";
  // Upper bound for GenerateRequest.max_new_tokens.
  int max_new_tokens_limit = 4096;
  // Interval handed to nodes at registration.
  int heartbeat_interval_ms = 1000;
  // A node whose last heartbeat is older than this is not alive: it is shown
  // as such and gets no new placements.
  int node_timeout_ms = 5000;
  // Deadline of each control call to a node (Reserve, FreeSession).
  int node_call_timeout_ms = 10000;
  // Link emulation in force from the start (ClusterConfig.links) and the seed
  // of its draws; changed at run time through karat.cluster.Admin, which the
  // same server offers. The table is pushed to every node (SetLinks) when it
  // changes and when a node registers, as long as it is not empty.
  std::vector<cluster::LinkConfig> links;
  uint64_t link_seed = 1;
  // The clock (a seam for tests). Defaults to absl::Now.
  std::function<absl::Time()> now;
};

// A running coordinator. Thread-safe. Destroying it shuts it down.
class Coordinator {
 public:
  // Binds the listen address and starts serving; fails (UNAVAILABLE) when the
  // address cannot be bound, INVALID_ARGUMENT for nonsensical options.
  static absl::StatusOr<std::unique_ptr<Coordinator>> Start(
      const Options& options);
  virtual ~Coordinator() = default;

  // The bound "host:port" (the real port when options.listen had port 0).
  virtual std::string address() const = 0;

  // Stops accepting calls, cancels running turns (their clients get
  // TurnDone{finish_reason: "cancelled"}) and waits up to `deadline` for
  // handlers to finish. Idempotent.
  virtual void Shutdown(absl::Duration deadline) = 0;

  // Blocks until Shutdown() has completed.
  virtual void Wait() = 0;
};

}  // namespace karat::coordinator
