// The GPU-node daemon (DESIGN.md §1, §2): holds the model weights, runs the
// decode loop over the batch of turns, and reaches KARAT nodes over the
// libfabric data plane. Control plane:
//   karat.cluster.GpuNode (RunTurn, GetStats), grpc.health.v1.Health and
//   server reflection.
// It registers with the coordinator (role "gpu") and logs "ready" once
// registered.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/transport.h"
#include "common/weights.h"
#include "security/tls.h"

namespace karat {

struct GpuNodeOptions {
  // Coordinator address; empty runs the node without registration.
  std::string coordinator;
  // gRPC listen address; port 0 picks a free port.
  std::string listen = "127.0.0.1:0";
  std::string name = "gpu-node";
  // Model directory (config.json + model.safetensors).
  std::string model_dir;
  // Data plane: libfabric provider and, for tcp, the address to bind.
  std::string provider = "shm";
  std::string fabric_node;
  int max_step_tokens = 256;
  int max_batch = 64;
  // OpenMP threads of the linear layers; 0 keeps the OpenMP default.
  int threads = 0;
  // When set, the bound gRPC address is written here once listening.
  std::string port_file;
  // TLS of the gRPC server (calls from the coordinator's certificate only)
  // and of the channel to the coordinator (docs/security.md). Plaintext by
  // default (in-process tests); the daemon's flags require one or the other.
  security::TlsOptions tls = security::TlsOptions{.plaintext = true};
  absl::Duration attention_timeout = absl::Seconds(30);
  // A data-plane send fails with UNAVAILABLE after this long.
  int send_timeout_ms = 10000;
  // The data plane polls without sleeping this long after traffic
  // (FabricOptions::spin_us; 0: never).
  int spin_us = kDefaultSpinUs;
  absl::Duration heartbeat_interval = absl::Seconds(1);
  // Rank among the GPU nodes (ClusterConfig.gpu_nodes order) and their
  // count: the rank holds the routed experts [rank*E/G, (rank+1)*E/G), plus
  // those of lost ranks that the coordinator gives it (GpuNode.SetPeers
  // expert_owner; loaded from `model_dir`, counted against `hbm_bytes`).
  int rank = 0;
  int ranks = 1;
  // Attention on the rank itself with the KV in its emulated HBM (the
  // GPU-only baseline) instead of on KARAT nodes.
  bool gpu_only = false;
  // Emulated HBM: the rank's weights must fit (with the experts it takes
  // over: SetPeers refuses them with RESOURCE_EXHAUSTED otherwise); in
  // gpu_only mode the rest holds KV. 0: not limited (karat mode only).
  int64_t hbm_bytes = 0;
  // KV page size of the gpu_only store.
  int tokens_per_page = 64;
  int micro_batches = 2;
  std::string schedule = "ofms";
  // Timing model of the emulated GPU (DESIGN.md §4), off when both are 0:
  // every computation of the rank's worker between two transfers completes
  // no earlier than max(bytes / bandwidth, flops / FLOP rate) after it
  // started (GpuTiming, WorkerToken). A zero rate leaves its term out.
  double hbm_bandwidth_gbps = 0;  // 1e9 bytes/s
  double tflops = 0;              // 1e12 floating-point operations/s
};

class GpuNodeDaemon {
 public:
  // Loads the model, opens the transport, starts the decode loop, the gRPC
  // server and the registration. Errors name the failing part.
  static absl::StatusOr<std::unique_ptr<GpuNodeDaemon>> Start(
      const GpuNodeOptions& options);
  ~GpuNodeDaemon();  // Shutdown()s

  // The bound gRPC address (host:port).
  const std::string& grpc_address() const;
  // Graceful stop: ends running turns with UNAVAILABLE, stops the gRPC
  // server (with a deadline), the registration and the transport.
  // Idempotent.
  void Shutdown();

 private:
  GpuNodeDaemon();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Identity of the weights, sent at registration so that the coordinator can
// refuse a node serving other weights: 16 hex digits of FNV-1a 64 over the
// config (ModelConfigToJson) and every tensor's name, shape and fp32 data,
// in name order.
std::string ModelFingerprint(const ModelFiles& files);

}  // namespace karat
