// The KARAT coordinator (DESIGN.md §1, §4, §5): serves the client API
// (karat.v1.Karat) and node membership (karat.cluster.Coordinator) on one
// gRPC server, keeps every session's token log, places each session's KV on
// a home device and drives turns through GPU nodes.
//
// Scale-out (DESIGN.md §4): GPU nodes register as ranks 0..G-1 of G; every
// turn runs on one rank (fewest running requests; in gpu_only mode the rank
// holding the session's KV). Experts are sharded: the coordinator pushes the
// owner of each routed expert with the rank table (GpuNode.SetPeers); when a
// rank is lost (DESIGN.md §7: its RunTurn breaks and a probe cannot reach it,
// or its heartbeats stop) its experts move to the alive ranks, and turns that
// failed because of it resume on an alive rank in the same client stream
// (at most 3 times per turn). A turn needs every expert to have an alive
// owner that acknowledged it (before every rank has registered once: every
// rank alive).
// A turn waits in one FIFO admission queue (its position streamed to the
// client as GenerateResponse.queued) until its KV reservation succeeds and
// its rank's batch is below min(max_batch, TBT cap). On every admission and
// finish the rank's micro-batches are recomputed (CMR or count balancing)
// and pushed to the rank (GpuNode.SetMicroBatches). GetClusterStatus.stats
// carries the coordinator's counters and histograms (TTFT, TBT, queue,
// micro-batch token imbalance).
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
#include "coordinator/scheduling.h"

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
  // changes and when a node registers (then even when it is empty: it
  // carries the table of registered nodes the KARAT nodes' data planes
  // admit GPU nodes by).
  std::vector<cluster::LinkConfig> links;
  uint64_t link_seed = 1;
  // "karat" (attention on KARAT nodes) or "gpu_only" (ClusterConfig.mode):
  // in gpu_only mode a session's KV lives on its GPU rank (GpuNode.Reserve),
  // the session sticks to that rank and KARAT nodes are not needed.
  std::string mode = "karat";
  // ClusterConfig.scheduling: micro_batches (0: 2), balance ("cmr" or
  // "count"; "" is cmr), tbt_slo_ms (0: no cap), queue_timeout_ms
  // (0: 60000) and the step-time model (step_cost, step_cost_mode). Start
  // checks it with ValidateSchedulingConfig. `schedule` is the GPU nodes'
  // business.
  cluster::SchedulingConfig scheduling;
  // GpuNodeConfig.max_batch by rank (index = rank); a missing entry or 0:
  // no limit beyond the TBT cap.
  std::vector<int> max_batch_by_rank;
  // Step-time model behind the TBT cap (MaxBatchForSlo with tbt_slo_ms and
  // the mean context of the rank's batch): the prior when
  // scheduling.step_cost is unset. With scheduling.step_cost_mode "learned"
  // (the default) each rank's model is then fitted to its measured decode
  // steps (StepCostEstimator).
  StepCostModel step_cost = {2.0, 0.5, 0.0005};
  // The clock (a seam for tests). Defaults to absl::Now.
  std::function<absl::Time()> now;
  // Directory of the write-ahead log of sessions (coordinator/wal.h,
  // DESIGN.md §7 "Coordinator restarted"); empty: none, sessions live in
  // memory only. With one, CreateSession, CloseSession and the end of every
  // turn (done, failed or cancelled) are on disk before the client hears of
  // them, and a coordinator started on the same directory serves the same
  // sessions: their ids, keys, seeds, token logs, turns and prefill ends,
  // with the link rules as last set through Admin.SetLink (they replace
  // `links`).
  // Their KV is not kept: each is placed again at its next turn and its KV
  // rebuilt from the token log by prefill. Created when missing; one that
  // cannot be read or written fails Start (FAILED_PRECONDITION).
  std::string state_dir;
  // Who may call what (docs/security.md): ClusterConfig.security with its
  // paths resolved. Default: plaintext (in-process tests). Without
  // plaintext, Start reads the coordinator's certificate
  // (cert_dir/coordinator.crt and .key, ca_cert) and the token files, and
  // fails (NOT_FOUND / INVALID_ARGUMENT naming the file) without them.
  cluster::SecurityConfig security = PlaintextSecurity();
  // A session whose last turn ended this long ago has its KV freed on its
  // home (ClusterConfig.security.idle_kv_evict_s); its next turn places it
  // again and rebuilds the KV from the token log by prefill. Zero: never.
  absl::Duration idle_kv_evict = absl::ZeroDuration();
  // Largest request the gRPC server takes (ClusterConfig.coordinator.
  // max_message_bytes); a larger one is refused with RESOURCE_EXHAUSTED
  // before it reaches a handler.
  int max_message_bytes = kDefaultMaxMessageBytes;
  static constexpr int kDefaultMaxMessageBytes = 4 << 20;

  static cluster::SecurityConfig PlaintextSecurity() {
    cluster::SecurityConfig s;
    s.set_plaintext(true);
    return s;
  }
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
  // Where the admin API (karat.cluster.Admin) listens: a port of its own
  // (security.admin_listen, default 127.0.0.1:0), for admin tokens only.
  virtual std::string admin_address() const = 0;

  // Stops accepting calls, cancels running turns (their clients get
  // TurnDone{finish_reason: "cancelled"}) and waits up to `deadline` for
  // handlers to finish. Idempotent.
  virtual void Shutdown(absl::Duration deadline) = 0;

  // Blocks until Shutdown() has completed.
  virtual void Wait() = 0;
};

}  // namespace karat::coordinator
