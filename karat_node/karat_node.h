// The KARAT-node daemon (DESIGN.md §1, §3): emulated KARAT devices holding
// session KV in host memory, the libfabric data plane that runs attention
// for GPU nodes, and the control plane:
//   karat.cluster.KaratNode (Reserve, FreeSession, GetStats),
//   grpc.health.v1.Health and server reflection.
// The node registers with the coordinator (role "karat") and sends
// heartbeats with its devices' occupancy; it logs "ready" once registered.
// GetStats and the heartbeat stats carry per-device metrics as
// "device.<i>.<name>" (busy_seconds, frames, frame_errors, kernel_bytes,
// cross_device_bytes, used_bytes, capacity_bytes, spilled_bytes,
// hosted_bytes, metadata_bytes, sessions; karat_device.h DeviceMetrics).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/transport.h"
#include "karat_node/data_plane.h"
#include "security/tls.h"

namespace karat {

struct KaratNodeOptions {
  // Coordinator address; empty runs the node without registration.
  std::string coordinator;
  // gRPC listen address; port 0 picks a free port.
  std::string listen = "127.0.0.1:0";
  std::string name = "karat-node";
  // Model directory; only config.json is read.
  std::string model_dir;
  // Data plane: libfabric provider and, for tcp, the address to bind.
  std::string provider = "shm";
  std::string fabric_node;
  // A data-plane send fails with UNAVAILABLE after this long.
  int send_timeout_ms = 10000;
  // The data plane polls without sleeping this long after traffic
  // (FabricOptions::spin_us; 0: never).
  int spin_us = kDefaultSpinUs;
  int devices = 1;
  size_t device_capacity_bytes = size_t(1) << 30;
  int cores = 1;
  // Device timing model (DeviceOptions): bandwidth in GB/s and FLOP rate in
  // TFLOP/s; 0 leaves the term out, both 0 (the default) turn it off.
  double device_bandwidth_gbps = 0;
  double device_tflops = 0;
  int tokens_per_page = 64;
  // Decode frames of contexts up to this many tokens run on the data
  // plane's receive thread when their device is idle, instead of waking the
  // device's worker (DataPlaneOptions::inline_max_context; 0: never).
  int inline_max_context = kDefaultInlineMaxContext;
  // Whether a session's pages spill to the node's other devices when its
  // home device is full (DESIGN.md §3); off, a full home device refuses.
  bool spill = true;
  // When set, the bound gRPC address is written here once listening.
  std::string port_file;
  // TLS of the gRPC server (calls from the coordinator's certificate only)
  // and of the channel to the coordinator (docs/security.md). Plaintext by
  // default (in-process tests); the daemon's flags require one or the other.
  security::TlsOptions tls = security::TlsOptions{.plaintext = true};
  absl::Duration heartbeat_interval = absl::Seconds(1);
};

class KaratNodeDaemon {
 public:
  // Loads the config, opens the transport, creates the devices, starts the
  // gRPC server and the registration. Errors name the failing part.
  static absl::StatusOr<std::unique_ptr<KaratNodeDaemon>> Start(
      const KaratNodeOptions& options);
  ~KaratNodeDaemon();  // Shutdown()s

  // The bound gRPC address (host:port).
  const std::string& grpc_address() const;
  // Graceful stop: gRPC server (with a deadline), registration, device
  // workers, transport. Idempotent.
  void Shutdown();

 private:
  KaratNodeDaemon();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Parses a byte count with an optional binary suffix: "1048576", "512K",
// "512M", "2G", "1T" (case-insensitive, optional trailing "B" or "iB").
absl::StatusOr<size_t> ParseByteSize(const std::string& text);

}  // namespace karat
