// The coordinator's shared state (coordinator.h): the nodes, the sessions and
// their token logs, the GPU ranks' batches and the admission queue, the
// link rules and the metrics, all guarded by one mutex. The services
// (client API, membership, admin) and the background pushers share it;
// RPCs to nodes are made without holding the mutex (a session's `busy`
// flag keeps its history stable meanwhile).
#pragma once

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cluster.grpc.pb.h"
#include "common/log.h"
#include "coordinator/admission_policy.h"
#include "coordinator/client_auth.h"
#include "coordinator/coordinator.h"
#include "coordinator/placement.h"
#include "coordinator/quota.h"
#include "coordinator/scheduling.h"
#include "coordinator/wal.h"
#include "karat.grpc.pb.h"

namespace karat::coordinator {

namespace v1 = ::karat::v1;
namespace cl = ::karat::cluster;

inline constexpr char kLog[] = "coordinator";

struct Node {
  uint32_t id = 0;
  std::string name;
  NodeRole role = NodeRole::kKarat;
  std::string grpc_address;
  std::string fabric_address;
  std::string provider;
  std::string fingerprint;
  std::vector<cl::DeviceInfo> devices;
  std::map<std::string, double> stats;
  absl::Time last_seen;
  int active_turns = 0;
  std::shared_ptr<grpc::Channel> channel;
  // GPU nodes: rank and rank count (RegisterNodeRequest; 0 ranks: 1), and
  // in gpu_only mode the KV room of the rank.
  int rank = 0;
  int ranks = 1;
  int64_t kv_capacity_bytes = 0;
  // GPU nodes: the model's routed experts (0: not reported), whether a
  // failed probe found the node gone before its heartbeats ran out, and
  // the expert ownership it acknowledged (State::owners_version_) or why
  // it refused the last one (`owners_refused`: it answered, so a retry
  // would not help).
  int routed_experts = 0;
  bool lost = false;
  // GPU nodes: the running turns' calls to it were cancelled when it
  // stopped being alive (RankWatcher).
  bool calls_cancelled = false;
  uint64_t owners_acked = 0;
  std::string owners_error;
  bool owners_refused = false;
};

struct Session {
  std::string id;
  // The principal that created it (ClientAuth; "" in plaintext mode): no
  // other caller may see or use it.
  std::string owner;
  uint64_t key = 0;  // data-plane session number
  uint64_t seed = 0;
  std::vector<int32_t> history;  // BOS, prompts, generated tokens
  int kv_len = 0;                // positions whose KV is on the home device
  int turns = 0;
  bool has_home = false;
  HomeDevice home;
  bool busy = false;
  // The running turn's call while busy (valid until busy is cleared).
  grpc::ServerContext* turn_ctx = nullptr;
  // Set to end the running turn's call early (a retry with its idempotency
  // key takes the turn over, or CloseSession); the call checks it between
  // events and cancels its GPU call. Valid while busy.
  std::shared_ptr<std::atomic<bool>> stop_turn;
  // The latest turn (idempotency key, request, how far it got), for retries
  // with its key (turn_plan.h); whether the write-ahead log has it as it is.
  std::optional<cl::LastTurn> last_turn;
  bool last_turn_logged = true;
  // CloseSession is under way: new turns are refused (NOT_FOUND).
  bool closing = false;
  // gpu_only: the rank whose memory holds the KV (-1: none yet).
  int rank = -1;
  // Positions where each earlier turn's prefill ended (increasing); sent as
  // RunTurnRequest.prefill_ends when the KV is rebuilt from the token log.
  std::vector<int> prefill_ends;
  // What the write-ahead log holds of the session: its history's first
  // `logged_tokens` tokens and `logged_turns`.
  size_t logged_tokens = 0;
  int logged_turns = 0;
  // When its last turn call ended (idle KV eviction: idle_evict.h), and
  // whether its KV is being freed now (a turn waits in admission meanwhile).
  absl::Time last_turn_end = absl::InfinitePast();
  bool evicting = false;
};

// A turn admitted to a rank and not finished yet.
struct RunningTurn {
  std::string session_id;
  HomeDevice home;
  int64_t context_tokens = 0;
  int micro_batch = 0;
  // The micro-batch the GPU node was last told (RunTurnRequest or
  // SetMicroBatches), and whether its RunTurn call has been made.
  int pushed_micro_batch = 0;
  bool started = false;
};

// One GPU rank's batch as the coordinator schedules it.
struct Rank {
  std::map<uint64_t, RunningTurn> running;  // by session key
  MicroBatchPlan plan;
  double imbalance_sum = 0;
  int64_t imbalance_samples = 0;
  // The rank's decode steps as measured here (created with the first).
  std::optional<StepCostEstimator> step_cost;
};

// A fixed-bucket histogram of milliseconds (Prometheus-style cumulative
// buckets when exported).
class MsHistogram {
 public:
  static constexpr double kBounds[] = {1,   2,   5,    10,   20,   50,   100,
                                       200, 500, 1000, 2000, 5000, 10000};
  void Add(double ms) {
    size_t i = 0;
    while (i < std::size(kBounds) && ms > kBounds[i]) ++i;
    counts_[i]++;
    count_++;
    sum_ += ms;
  }
  void ExportTo(const std::string& name,
                google::protobuf::Map<std::string, double>* stats) const {
    uint64_t cumulative = 0;
    for (size_t i = 0; i < std::size(kBounds); ++i) {
      cumulative += counts_[i];
      (*stats)[absl::StrCat(name, "_bucket_le_", kBounds[i])] =
          double(cumulative);
    }
    (*stats)[name + "_bucket_le_inf"] = double(count_);
    (*stats)[name + "_count"] = double(count_);
    (*stats)[name + "_sum"] = sum_;
  }

 private:
  uint64_t counts_[std::size(kBounds) + 1] = {};
  uint64_t count_ = 0;
  double sum_ = 0;
};

// gpu_only: a GPU rank's KV room, shown as its one device (device 0).
inline cl::DeviceInfo KvDevice(int64_t capacity_bytes) {
  cl::DeviceInfo d;
  d.set_device(0);
  d.set_capacity_bytes(capacity_bytes);
  return d;
}

inline const char* RoleName(NodeRole r) {
  return r == NodeRole::kGpu ? "gpu" : "karat";
}

inline grpc::Status ToGrpc(const absl::Status& s) {
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()),
                      std::string(s.message()));
}

// Shared state of both services. Every field is guarded by mu_; RPCs to
// nodes are made without holding it (a session's `busy` flag keeps its
// history stable meanwhile).
class State {
 public:
  explicit State(const Options& options)
      : next_epoch_(uint64_t(absl::ToUnixMicros(absl::Now()))),
        links_(options.links),
        options_(options),
        started_(Now()) {}

  absl::Time Now() const { return options_.now ? options_.now() : absl::Now(); }
  const Options& options() const { return options_; }
  bool gpu_only() const { return options_.mode == "gpu_only"; }
  int micro_batches() const {
    return options_.scheduling.micro_batches() == 1 ? 1 : 2;
  }
  absl::Duration queue_timeout() const {
    const int ms = options_.scheduling.queue_timeout_ms();
    return absl::Milliseconds(ms > 0 ? ms : 60000);
  }
  absl::Time started() const { return started_; }

  // The rank count the alive GPU nodes claim (1 without any).
  int RankCountLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    int ranks = 1;
    for (const auto& [id, n] : nodes_)
      if (n.role == NodeRole::kGpu && AliveLocked(n))
        ranks = std::max(ranks, n.ranks);
    return ranks;
  }

  // The alive GPU node serving `rank`, or nullptr.
  Node* RankNodeLocked(int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (auto& [id, n] : nodes_)
      if (n.role == NodeRole::kGpu && n.rank == rank && AliveLocked(n))
        return &n;
    return nullptr;
  }

  // The step-time model's prior: ClusterConfig.scheduling.step_cost when
  // set, else Options::step_cost.
  StepCostModel StepCostPrior() const {
    const cluster::StepCost& c = options_.scheduling.step_cost();
    if (c.fixed_ms() == 0 && c.per_request_ms() == 0 &&
        c.per_context_token_ms() == 0)
      return options_.step_cost;
    return StepCostModel{c.fixed_ms(), c.per_request_ms(),
                         c.per_context_token_ms()};
  }
  bool StepCostLearned() const {
    return options_.scheduling.step_cost_mode() != "fixed";
  }
  // The model behind rank `rank`'s TBT cap: its measured steps' fit, or the
  // prior ("fixed", or no step measured yet).
  StepCostModel StepCostLocked(int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto r = ranks_.find(rank);
    if (!StepCostLearned() || r == ranks_.end() || !r->second.step_cost)
      return StepCostPrior();
    return r->second.step_cost->Model();
  }
  // A token of one of `rank`'s turns came with the step that produced it
  // (RunTurnEvent.step_*): each of the step's requests reports it, so each
  // report weighs 1 / requests. Only decode steps teach the model (the cap
  // is about the time between tokens); a step that also fed a prompt chunk
  // costs what the chunk costs, which the batch does not predict.
  void AddStepLocked(Rank& rank, const cl::RunTurnEvent& ev)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!StepCostLearned() || ev.step_us() <= 0 || ev.step_requests() < 1 ||
        ev.step_prefill_tokens() != 0)
      return;
    if (!rank.step_cost) rank.step_cost.emplace(StepCostPrior());
    rank.step_cost->Add(ev.step_requests(), ev.step_context_tokens(),
                        ev.step_us() / 1000.0, 1.0 / ev.step_requests());
  }

  // Most requests `rank` may run at once: min(max_batch, TBT cap), where the
  // TBT cap models a batch whose mean context includes `extra_context` (the
  // turn being admitted). Never below 1: a lone request always runs.
  int RankCapLocked(int rank, int64_t extra_context)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    int cap = kUnboundedBatch;
    if (rank >= 0 &&
        rank < static_cast<int>(options_.max_batch_by_rank.size()) &&
        options_.max_batch_by_rank[rank] > 0)
      cap = options_.max_batch_by_rank[rank];
    const double slo = options_.scheduling.tbt_slo_ms();
    if (slo > 0) {
      int64_t sum = extra_context, n = 1;
      auto r = ranks_.find(rank);
      if (r != ranks_.end()) {
        for (const auto& [key, t] : r->second.running) {
          sum += t.context_tokens;
          ++n;
        }
      }
      absl::StatusOr<int> slo_cap =
          MaxBatchForSlo(slo, StepCostLocked(rank), sum / n);
      if (slo_cap.ok()) {
        cap = std::min(cap, *slo_cap);
      } else {
        KLOG(Warning, "coordinator") << "TBT cap: " << slo_cap.status();
      }
    }
    return std::max(cap, 1);
  }

  // Recomputes `rank`'s micro-batches (CMR or count balancing over its
  // running turns) and records the token imbalance. Returns true when a
  // started turn's micro-batch differs from what its GPU node knows.
  bool RecomputeMicroBatchesLocked(int rank)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Rank& r = ranks_[rank];
    std::vector<RankRequest> requests;
    for (const auto& [key, t] : r.running)
      requests.push_back({key, t.home, t.context_tokens});
    MicroBatchPlan plan;
    if (micro_batches() == 1) {
      for (const auto& q : requests)
        plan.assignments.push_back({q.request_id, MicroBatch::k0});
    } else {
      const MicroBatchMode mode = options_.scheduling.balance() == "count"
                                      ? MicroBatchMode::kRequestCount
                                      : MicroBatchMode::kContextLength;
      absl::StatusOr<MicroBatchPlan> p =
          AssignMicroBatches(mode, requests, r.plan);
      if (!p.ok()) {
        KLOG(Warning, "coordinator")
            << "micro-batches of rank " << rank << ": " << p.status();
        return false;
      }
      plan = *std::move(p);
      absl::StatusOr<MicroBatchImbalance> imb = Imbalance(requests, plan);
      if (imb.ok()) {
        const int64_t total =
            imb->rank_context_tokens[0] + imb->rank_context_tokens[1];
        if (total > 0) {
          const double ratio = double(imb->token_imbalance) / double(total);
          r.imbalance_sum += ratio;
          r.imbalance_samples++;
          imbalance_sum_ += ratio;
          imbalance_samples_++;
          // What Algorithm 1 balances: each device's two shares.
          device_imbalance_sum_ +=
              double(imb->sum_device_imbalance) / double(total);
        }
      }
    }
    r.plan = std::move(plan);
    bool push = false;
    for (auto& [key, t] : r.running) {
      std::optional<MicroBatch> mb = r.plan.Find(key);
      t.micro_batch = mb ? static_cast<int>(*mb) : 0;
      if (t.started && t.micro_batch != t.pushed_micro_batch) push = true;
    }
    return push;
  }

  // Whether a node has registered as `name` (alive or not).
  bool HasNodeNamedLocked(const std::string& name) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return std::any_of(nodes_.begin(), nodes_.end(),
                       [&](const auto& e) { return e.second.name == name; });
  }

  // A node is alive while it sends heartbeats and no probe found it gone.
  // Heartbeats missed while the coordinator itself did not run (stopped,
  // starved: NoteStallLocked) do not count.
  bool AliveLocked(const Node& n) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !n.lost && Now() - std::max(n.last_seen, stall_ended_) <=
                          absl::Milliseconds(options_.node_timeout_ms);
  }
  // Called at least every 100 ms (the rank watcher) and on every heartbeat:
  // a gap of more than a second since the last call means the coordinator
  // did not run meanwhile (SIGSTOP, a starved host), so the nodes' silence
  // in that time is not theirs: their timeouts count from now.
  // (The gap is measured on the real clock; the timeouts on Now().)
  void NoteStallLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const absl::Time now = absl::Now();
    if (last_tick_ != absl::InfinitePast() &&
        now - last_tick_ > absl::Seconds(1)) {
      KLOG(Warning, kLog) << "the coordinator did not run for "
                          << absl::FormatDuration(now - last_tick_)
                          << "; node timeouts count from now";
      stall_ended_ = Now();
      stalls_++;
    }
    last_tick_ = now;
  }
  int64_t stalls_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_tick_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time stall_ended_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();

  // Alive GPU ranks: rank -> node id.
  std::map<int, uint32_t> AliveRanksLocked() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::map<int, uint32_t> alive;
    for (const auto& [id, n] : nodes_)
      if (n.role == NodeRole::kGpu && AliveLocked(n)) alive[n.rank] = id;
    return alive;
  }

  // The routed experts when a lost rank's experts can move to the alive
  // ranks, else 0: more than one rank, every rank registered at least once
  // (a rank that has not started yet is not lost) and the GPU nodes
  // reported the model's routed experts.
  int MovableExpertsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!AllRanksSeenLocked()) return 0;
    for (const auto& [id, n] : nodes_)
      if (n.role == NodeRole::kGpu && AliveLocked(n) && n.routed_experts > 0)
        return n.routed_experts;
    return 0;
  }

  // Whether the alive ranks can serve every turn while some rank is down:
  // more than one rank, every rank registered at least once, and either the
  // experts can move (MovableExpertsLocked) or the model is dense (the GPU
  // nodes report no routed experts: every rank holds every weight and no
  // step needs another rank).
  bool RankLossToleratedLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!AllRanksSeenLocked()) return false;
    for (const auto& [id, n] : nodes_)
      if (n.role == NodeRole::kGpu && AliveLocked(n)) return true;
    return false;
  }

  // More than one rank, and each has registered at least once (a rank that
  // has not started yet is not lost).
  bool AllRanksSeenLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int ranks = RankCountLocked();
    if (ranks < 2) return false;
    for (int r = 0; r < ranks; ++r)
      if (ranks_seen_.count(r) == 0) return false;
    return true;
  }

  ClusterState SnapshotLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ClusterState state;
    for (const auto& [id, n] : nodes_) {
      NodeState ns;
      ns.id = id;
      ns.name = n.name;
      ns.role = n.role;
      ns.alive = AliveLocked(n);
      ns.active_turns = n.active_turns;
      for (const auto& d : n.devices)
        ns.devices.push_back({d.device(), d.capacity_bytes(), d.used_bytes()});
      state.nodes.push_back(std::move(ns));
    }
    return state;
  }

  // The write-ahead log of sessions (null without options.state_dir). Set
  // before the server starts; thread-safe on its own.
  std::unique_ptr<SessionLog> wal_;
  // Who calls (client tokens, admin tokens, daemon certificates). Set
  // before the server starts; immutable, thread-safe.
  std::unique_ptr<ClientAuth> auth_;
  // Credentials of the coordinator's channels to the nodes (its own
  // certificate; insecure in plaintext). Set before the server starts.
  std::shared_ptr<grpc::ChannelCredentials> node_credentials_;
  // The cluster's data-plane secret, handed to every node that registers
  // (coordinator/data_plane_secret.h); empty in plaintext mode. Set before
  // the server starts; immutable.
  std::string data_plane_secret_;

  mutable absl::Mutex mu_;
  std::map<uint32_t, Node> nodes_ ABSL_GUARDED_BY(mu_);
  uint32_t next_node_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::string gpu_fingerprint_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Session> sessions_ ABSL_GUARDED_BY(mu_);
  std::set<uint64_t> session_keys_ ABSL_GUARDED_BY(mu_);
  absl::BitGen rng_ ABSL_GUARDED_BY(mu_);
  // GPU calls of running turns, by the GPU node they go to: cancelled at
  // shutdown, and when that node is taken for lost (its turns resume
  // elsewhere instead of waiting on a node that may hang).
  std::map<grpc::ClientContext*, uint32_t> running_ ABSL_GUARDED_BY(mu_);
  // Cancels the running GPU calls to node `id` (CancelTurnsOnLocked).
  void CancelTurnsOnLocked(uint32_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const auto& [ctx, node] : running_)
      if (node == id) ctx->TryCancel();
  }
  // The next turn epoch (RunTurnRequest.turn_epoch): increasing, from the
  // clock at start so that it keeps increasing across restarts.
  uint64_t next_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t NewEpochLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return ++next_epoch_;
  }
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  int active_generations_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t tokens_generated_ ABSL_GUARDED_BY(mu_) = 0;
  // Link-emulation rules (Admin API), pushed to every node.
  std::vector<cl::LinkConfig> links_ ABSL_GUARDED_BY(mu_);
  // Expert ownership (DESIGN.md §7) last pushed with SetPeers: the table
  // (empty: the block sharding), the alive ranks it was computed for (rank
  // -> node id), its version (bumped when either changes; 0: none pushed
  // yet) and when it was last pushed.
  std::vector<int> owners_ ABSL_GUARDED_BY(mu_);
  std::set<int> ranks_seen_ ABSL_GUARDED_BY(mu_);  // GPU ranks registered
  std::map<int, uint32_t> owners_ranks_ ABSL_GUARDED_BY(mu_);
  uint64_t owners_version_ ABSL_GUARDED_BY(mu_) = 0;
  // Bumped when a table is pushed without a rank the previous one had (or
  // with another node for it): a turn whose GPU call failed since then may
  // have failed because of it (ResumeTurn). Not bumped by the first table
  // or by a rank joining.
  uint64_t rank_removals_ ABSL_GUARDED_BY(mu_) = 0;
  // Bumped when a KARAT node that was alive is taken for lost (its
  // heartbeats ran out, or a probe found it gone): a turn whose GPU call
  // failed since then may have failed because of it (ResumeTurn).
  uint64_t karat_losses_ ABSL_GUARDED_BY(mu_) = 0;
  // KARAT nodes already counted in karat_losses_.
  std::set<uint32_t> karat_lost_noted_ ABSL_GUARDED_BY(mu_);
  absl::Time owners_pushed_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();

  // Scheduling: running turns by rank, the admission queue (turn ids, front
  // first) and the events that wake queued turns.
  std::map<int, Rank> ranks_ ABSL_GUARDED_BY(mu_);
  std::deque<QueuedTurn> queue_ ABSL_GUARDED_BY(mu_);
  uint64_t next_turn_id_ ABSL_GUARDED_BY(mu_) = 1;
  // Bumped when room may have appeared (a turn finished, a session closed,
  // a node registered) and when the queue changed.
  uint64_t capacity_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t queue_epoch_ ABSL_GUARDED_BY(mu_) = 0;

  // Metrics (ClusterStatus.stats).
  MsHistogram ttft_ms_ ABSL_GUARDED_BY(mu_);
  MsHistogram tbt_ms_ ABSL_GUARDED_BY(mu_);
  int64_t turns_admitted_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t turns_queued_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t turns_timed_out_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t turns_cancelled_queued_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t turns_refused_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t turns_resumed_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t gpu_ranks_lost_ ABSL_GUARDED_BY(mu_) = 0;
  // Sessions moved to a new home during a turn, their home KARAT node lost.
  int64_t sessions_rehomed_ ABSL_GUARDED_BY(mu_) = 0;
  // What each principal holds against its limits (quota.h), and the idle
  // sessions whose KV was freed (idle_evict.h).
  QuotaBook quotas_ ABSL_GUARDED_BY(mu_);
  int64_t kv_evictions_ ABSL_GUARDED_BY(mu_) = 0;
  double imbalance_sum_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t imbalance_samples_ ABSL_GUARDED_BY(mu_) = 0;
  double device_imbalance_sum_ ABSL_GUARDED_BY(mu_) = 0;

 private:
  const Options options_;
  const absl::Time started_;
};

}  // namespace karat::coordinator
