#include "coordinator/coordinator.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "cluster.grpc.pb.h"
#include "common/link_rules.h"
#include "common/log.h"
#include "common/process_fault.h"
#include "common/status_macros.h"
#include "common/tokenizer.h"
#include "coordinator/cluster_config.h"
#include "coordinator/placement.h"
#include "coordinator/scheduling.h"
#include "coordinator/wal.h"
#include "karat.grpc.pb.h"

namespace karat::coordinator {
namespace {

namespace v1 = ::karat::v1;
namespace cl = ::karat::cluster;

constexpr char kLog[] = "coordinator";
// Most times one turn moves to another GPU rank after a lost one.
constexpr int kMaxTurnResumes = 3;

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
  uint64_t owners_acked = 0;
  std::string owners_error;
  bool owners_refused = false;
};

struct Session {
  std::string id;
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
  // gpu_only: the rank whose memory holds the KV (-1: none yet).
  int rank = -1;
  // Positions where each earlier turn's prefill ended (increasing); sent as
  // RunTurnRequest.prefill_ends when the KV is rebuilt from the token log.
  std::vector<int> prefill_ends;
  // What the write-ahead log holds of the session: its history's first
  // `logged_tokens` tokens and `logged_turns`.
  size_t logged_tokens = 0;
  int logged_turns = 0;
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
cl::DeviceInfo KvDevice(int64_t capacity_bytes) {
  cl::DeviceInfo d;
  d.set_device(0);
  d.set_capacity_bytes(capacity_bytes);
  return d;
}

const char* RoleName(NodeRole r) {
  return r == NodeRole::kGpu ? "gpu" : "karat";
}

grpc::Status ToGrpc(const absl::Status& s) {
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()),
                      std::string(s.message()));
}

// Shared state of both services. Every field is guarded by mu_; RPCs to
// nodes are made without holding it (a session's `busy` flag keeps its
// history stable meanwhile).
class State {
 public:
  explicit State(const Options& options)
      : links_(options.links), options_(options), started_(Now()) {}

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

  bool AliveLocked(const Node& n) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !n.lost &&
           Now() - n.last_seen <= absl::Milliseconds(options_.node_timeout_ms);
  }

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

  mutable absl::Mutex mu_;
  std::map<uint32_t, Node> nodes_ ABSL_GUARDED_BY(mu_);
  uint32_t next_node_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::string gpu_fingerprint_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Session> sessions_ ABSL_GUARDED_BY(mu_);
  std::set<uint64_t> session_keys_ ABSL_GUARDED_BY(mu_);
  absl::BitGen rng_ ABSL_GUARDED_BY(mu_);
  // GPU calls of running turns, cancelled at shutdown.
  std::set<grpc::ClientContext*> running_ ABSL_GUARDED_BY(mu_);
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
  std::deque<uint64_t> queue_ ABSL_GUARDED_BY(mu_);
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
  double imbalance_sum_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t imbalance_samples_ ABSL_GUARDED_BY(mu_) = 0;
  double device_imbalance_sum_ ABSL_GUARDED_BY(mu_) = 0;

 private:
  const Options options_;
  const absl::Time started_;
};

// ---------------------------------------------------------------------------
// Control pushes made in the background (SetPeers, SetMicroBatches), so that
// no client stream and no lock waits on a node. Tasks are coalesced by key:
// a task posted again before it ran replaces the waiting one.

class ControlPusher {
 public:
  ControlPusher() : thread_([this] { Loop(); }) {}
  ~ControlPusher() { Stop(); }

  void Post(const std::string& key, std::function<void()> task) {
    absl::MutexLock lock(&mu_);
    if (stop_) return;
    tasks_[key] = std::move(task);
  }

  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
      stop_ = true;
    }
    thread_.join();
  }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> task;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return !tasks_.empty() || stop_;
        };
        mu_.Await(absl::Condition(&ready));
        if (stop_) return;
        auto it = tasks_.begin();
        task = std::move(it->second);
        tasks_.erase(it);
      }
      task();
    }
  }

  absl::Mutex mu_;
  std::map<std::string, std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// Calls fn(item) for every item on a thread of its own and waits for all:
// RPCs to several nodes, so that one that hangs holds back none of the
// others.
template <typename T, typename Fn>
void ForEachConcurrently(const std::vector<T>& items, Fn fn) {
  std::vector<std::thread> threads;
  threads.reserve(items.size());
  for (const T& item : items) threads.emplace_back(fn, std::cref(item));
  for (std::thread& thread : threads) thread.join();
}

std::chrono::system_clock::time_point Deadline(const State* s) {
  return std::chrono::system_clock::now() +
         std::chrono::milliseconds(s->options().node_call_timeout_ms);
}

// Pushes every alive GPU rank's address and the expert ownership over the
// alive ranks (GpuNode.SetPeers) to every alive GPU node, and records which
// nodes acknowledged it. A node that cannot take the experts it is given
// (its emulated HBM) refuses, and turns are refused with its message until
// the ranks change (DESIGN.md §7).
void PushPeers(State* s) {
  cl::SetPeersRequest req;
  struct Target {
    uint32_t id;
    std::string name;
    std::shared_ptr<grpc::Channel> channel;
  };
  std::vector<Target> targets;
  uint64_t version = 0;
  {
    absl::MutexLock lock(&s->mu_);
    const std::map<int, uint32_t> alive = s->AliveRanksLocked();
    for (const auto& [rank, id] : alive) {
      const Node& n = s->nodes_.at(id);
      cl::GpuPeer* p = req.add_peers();
      p->set_rank(n.rank);
      p->set_name(n.name);
      p->set_node_id(id);
      p->set_fabric_address(n.fabric_address);
      targets.push_back({id, n.name, n.channel});
    }
    std::vector<int> owners;
    if (const int experts = s->MovableExpertsLocked(); experts > 0) {
      std::vector<int> ranks;
      for (const auto& [rank, id] : alive) ranks.push_back(rank);
      owners = ExpertOwners(experts, s->RankCountLocked(), ranks);
    }
    if (s->owners_version_ == 0 || alive != s->owners_ranks_ ||
        owners != s->owners_) {
      for (const auto& [rank, id] : s->owners_ranks_) {
        auto now = alive.find(rank);
        if (now == alive.end() || now->second != id) {
          s->rank_removals_++;
          break;
        }
      }
      s->owners_version_++;
      s->owners_ranks_ = alive;
      s->owners_ = owners;
      s->capacity_epoch_++;
      if (!owners.empty()) {
        std::vector<int> moved;
        for (size_t e = 0; e < owners.size(); ++e)
          if (size_t(owners[e]) !=
              e * size_t(s->RankCountLocked()) / owners.size())
            moved.push_back(int(e));
        KLOG(Info, kLog) << "expert ownership v" << s->owners_version_
                         << " over " << alive.size() << " alive GPU ranks"
                         << (moved.empty()
                                 ? std::string(": the block sharding")
                                 : absl::StrCat(": experts ",
                                                absl::StrJoin(moved, ","),
                                                " moved off their lost ranks"));
      }
    }
    version = s->owners_version_;
    s->owners_pushed_ = s->Now();
    req.mutable_expert_owner()->Assign(owners.begin(), owners.end());
  }
  // In parallel: a node that takes over experts loads their weights
  // first, and a node that hangs must not hold the table back from the
  // others.
  auto push = [s, &req, version](const Target& t) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(
                         std::max(s->options().node_call_timeout_ms, 60000)));
    cl::SetPeersResponse resp;
    grpc::Status st =
        cl::GpuNode::NewStub(t.channel)->SetPeers(&ctx, req, &resp);
    if (!st.ok()) {
      KLOG(Warning, kLog) << "cannot push GPU peers to " << t.name << ": "
                          << st.error_message();
    }
    absl::MutexLock lock(&s->mu_);
    auto it = s->nodes_.find(t.id);
    if (it == s->nodes_.end() || s->owners_version_ != version) return;
    Node& n = it->second;
    if (st.ok()) {
      n.owners_acked = version;
      n.owners_error.clear();
      n.owners_refused = false;
    } else {
      n.owners_error = st.error_message();
      n.owners_refused = st.error_code() != grpc::StatusCode::UNAVAILABLE &&
                         st.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED;
    }
    s->capacity_epoch_++;
  };
  ForEachConcurrently(targets, push);
}

// Reserves KV room for `tokens` positions of session `key` on a home: a
// KARAT node's `device`, or in gpu_only mode the GPU rank (device 0) whose
// node `channel` reaches.
grpc::Status ReserveKv(const State* s,
                       const std::shared_ptr<grpc::Channel>& channel,
                       uint64_t key, int device, int tokens,
                       cl::ReserveResponse* resp) {
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(s));
  cl::ReserveRequest req;
  req.set_session(key);
  req.set_device(device);
  req.set_tokens(tokens);
  return s->gpu_only()
             ? cl::GpuNode::NewStub(channel)->Reserve(&ctx, req, resp)
             : cl::KaratNode::NewStub(channel)->Reserve(&ctx, req, resp);
}

// Makes `home` on node `n` the session's home (in gpu_only mode with the
// session on `rank`), after a Reserve there answered `used_bytes`.
void SetHomeLocked(State* s, Session* session, Node* n, const HomeDevice& home,
                   int rank, int64_t used_bytes)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) {
  session->has_home = true;
  session->home = home;
  if (s->gpu_only()) {
    session->rank = rank;
    if (n->devices.empty())
      n->devices.push_back(KvDevice(n->kv_capacity_bytes));
    n->devices[0].set_used_bytes(used_bytes);
  } else {
    for (auto& d : n->devices)
      if (d.device() == home.device) d.set_used_bytes(used_bytes);
  }
}

// Tells every alive GPU node that the KARAT node `name` at
// `fabric_address` is lost (GpuNode.KaratNodeLost), so that the attention
// outputs they still await from it fail at once.
void PushKaratNodeLost(State* s, const std::string& name,
                       const std::string& fabric_address) {
  struct Target {
    std::string name;
    std::shared_ptr<grpc::Channel> channel;
  };
  std::vector<Target> targets;
  {
    absl::MutexLock lock(&s->mu_);
    for (const auto& [id, n] : s->nodes_)
      if (n.role == NodeRole::kGpu && s->AliveLocked(n))
        targets.push_back({n.name, n.channel});
  }
  cl::KaratNodeLostRequest req;
  req.set_node_name(name);
  req.set_fabric_address(fabric_address);
  auto push = [&](const Target& t) {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(s));
    cl::KaratNodeLostResponse resp;
    grpc::Status st =
        cl::GpuNode::NewStub(t.channel)->KaratNodeLost(&ctx, req, &resp);
    if (!st.ok()) {
      KLOG(Warning, kLog) << "cannot tell " << t.name << " that KARAT node "
                          << name << " is lost: " << st.error_message();
    }
  };
  ForEachConcurrently(targets, push);
}

// Takes every registered KARAT node that is no longer alive for lost, once:
// counts it (State::karat_losses_) and posts a KaratNodeLost push for it.
void NoteLostKaratNodesLocked(State* s, ControlPusher* pusher)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) {
  for (const auto& [id, n] : s->nodes_) {
    if (n.role != NodeRole::kKarat) continue;
    if (s->AliveLocked(n)) {
      // Its heartbeats came back: a later loss counts again.
      s->karat_lost_noted_.erase(id);
      continue;
    }
    if (!s->karat_lost_noted_.insert(id).second) continue;
    s->karat_losses_++;
    s->capacity_epoch_++;
    KLOG(Warning, kLog) << "KARAT node " << n.name
                        << " is not alive; the turns waiting on it resume on "
                           "other homes";
    if (pusher != nullptr) {
      pusher->Post(absl::StrCat("karat_lost/", id),
                   [s, name = n.name, address = n.fabric_address] {
                     PushKaratNodeLost(s, name, address);
                   });
    }
  }
}

// Keeps the rank table and the expert ownership in step with the alive GPU
// ranks: posts a SetPeers push when a rank stops being alive (heartbeats
// run out, or a probe found it gone) or when a push did not reach an alive
// rank (retried every second). Also notes the KARAT nodes that stop being
// alive (NoteLostKaratNodesLocked).
class RankWatcher {
 public:
  RankWatcher(State* s, ControlPusher* pusher)
      : s_(s), pusher_(pusher), thread_([this] { Loop(); }) {}
  ~RankWatcher() { Stop(); }
  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
      stop_ = true;
    }
    thread_.join();
  }

 private:
  void Loop() {
    absl::MutexLock lock(&mu_);
    while (!stop_) {
      mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(100));
      if (stop_) return;
      bool push = false;
      {
        absl::MutexLock state(&s_->mu_);
        NoteLostKaratNodesLocked(s_, pusher_);
        if (s_->owners_version_ == 0) continue;  // no GPU node yet
        const std::map<int, uint32_t> alive = s_->AliveRanksLocked();
        if (alive == s_->owners_ranks_) posted_.reset();
        if (alive != s_->owners_ranks_ && posted_ != alive) {
          posted_ = alive;
          for (const auto& [rank, id] : s_->owners_ranks_) {
            if (alive.count(rank) > 0 && alive.at(rank) == id) continue;
            auto n = s_->nodes_.find(id);
            KLOG(Warning, kLog)
                << "GPU rank " << rank << " ("
                << (n == s_->nodes_.end() ? std::string("gone")
                                          : n->second.name)
                << ") is not alive; its turns resume on the alive ranks"
                << (s_->MovableExpertsLocked() > 0
                        ? ", which take over its experts"
                        : "");
          }
          push = true;
        } else if (s_->Now() - s_->owners_pushed_ > absl::Seconds(1)) {
          for (const auto& [rank, id] : alive) {
            const Node& n = s_->nodes_.at(id);
            if (n.owners_acked != s_->owners_version_ && !n.owners_refused)
              push = true;
          }
        }
      }
      if (push) {
        State* s = s_;
        pusher_->Post("peers", [s] { PushPeers(s); });
      }
    }
  }

  State* const s_;
  ControlPusher* const pusher_;
  // The alive ranks a push was posted for and not yet made.
  std::optional<std::map<int, uint32_t>> posted_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// Tells `rank`'s GPU node the micro-batches of its started turns that
// changed since it was last told (GpuNode.SetMicroBatches).
void PushMicroBatches(State* s, int rank) {
  cl::SetMicroBatchesRequest req;
  std::shared_ptr<grpc::Channel> channel;
  std::string name;
  {
    absl::MutexLock lock(&s->mu_);
    Node* node = s->RankNodeLocked(rank);
    auto r = s->ranks_.find(rank);
    if (node == nullptr || r == s->ranks_.end()) return;
    for (const auto& [key, t] : r->second.running)
      if (t.started && t.micro_batch != t.pushed_micro_batch)
        (*req.mutable_micro_batch())[key] = t.micro_batch;
    if (req.micro_batch().empty()) return;
    channel = node->channel;
    name = node->name;
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(s));
  cl::SetMicroBatchesResponse resp;
  grpc::Status st =
      cl::GpuNode::NewStub(channel)->SetMicroBatches(&ctx, req, &resp);
  if (!st.ok()) {
    KLOG(Warning, kLog) << "cannot push micro-batches to " << name << " (rank "
                        << rank << "): " << st.error_message();
    return;
  }
  absl::MutexLock lock(&s->mu_);
  auto r = s->ranks_.find(rank);
  if (r == s->ranks_.end()) return;
  for (const auto& [key, mb] : req.micro_batch()) {
    auto t = r->second.running.find(key);
    if (t != r->second.running.end()) t->second.pushed_micro_batch = mb;
  }
}

// ---------------------------------------------------------------------------
// Link emulation: pushes the rule table to nodes (GpuNode/KaratNode
// SetLinks), with each node's name by id so that rules can use names.

struct LinkPushTarget {
  std::string name;
  NodeRole role;
  std::shared_ptr<grpc::Channel> channel;
};

// Builds the request and the alive targets. Requires s->mu_.
cl::SetLinksRequest LinkPushLocked(State* s,
                                   std::vector<LinkPushTarget>* targets)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) {
  cl::SetLinksRequest req;
  for (const auto& l : s->links_) *req.add_links() = l;
  req.set_seed(s->options().link_seed);
  for (const auto& [id, n] : s->nodes_) {
    (*req.mutable_node_names())[id] = n.name;
    if (s->AliveLocked(n)) targets->push_back({n.name, n.role, n.channel});
  }
  return req;
}

// Sends `req` to every target; returns "name: reason" for each failure.
std::vector<std::string> PushLinks(const State* s,
                                   const cl::SetLinksRequest& req,
                                   const std::vector<LinkPushTarget>& targets) {
  std::vector<std::string> failed;
  for (const LinkPushTarget& t : targets) {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(s));
    cl::SetLinksResponse resp;
    grpc::Status st;
    if (t.role == NodeRole::kGpu) {
      st = cl::GpuNode::NewStub(t.channel)->SetLinks(&ctx, req, &resp);
    } else {
      st = cl::KaratNode::NewStub(t.channel)->SetLinks(&ctx, req, &resp);
    }
    if (!st.ok()) {
      KLOG(Warning, kLog) << "cannot push link settings to " << t.name << ": "
                          << st.error_message();
      failed.push_back(absl::StrCat(t.name, ": ", st.error_message()));
    }
  }
  return failed;
}

// Pushes the table in the background after registrations (a node that just
// registered, and the KARAT nodes that must learn its name).
class LinkPusher {
 public:
  explicit LinkPusher(State* s) : s_(s), thread_([this] { Loop(); }) {}
  ~LinkPusher() { Stop(); }

  void Request() {
    absl::MutexLock lock(&mu_);
    pending_ = true;
  }

  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
      stop_ = true;
    }
    thread_.join();
  }

 private:
  void Loop() {
    for (;;) {
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return pending_ || stop_;
        };
        mu_.Await(absl::Condition(&ready));
        if (stop_) return;
        pending_ = false;
      }
      // Give a node that just registered a moment to serve its RPCs.
      absl::SleepFor(absl::Milliseconds(100));
      std::vector<LinkPushTarget> targets;
      cl::SetLinksRequest req;
      {
        absl::MutexLock lock(&s_->mu_);
        if (s_->links_.empty()) continue;
        req = LinkPushLocked(s_, &targets);
      }
      PushLinks(s_, req, targets);
    }
  }

  State* const s_;
  absl::Mutex mu_;
  bool pending_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// karat.cluster.Admin: link emulation at run time.
class AdminService final : public cl::Admin::Service {
 public:
  explicit AdminService(State* state) : s_(state) {}

  grpc::Status SetLink(grpc::ServerContext*, const cl::SetLinkRequest* req,
                       cl::SetLinkResponse* resp) override {
    const absl::Status valid =
        ValidateLinkRule(LinkRuleFromProto(req->link()), "link");
    if (!valid.ok()) return ToGrpc(valid);
    const cl::LinkConfig& link = req->link();
    std::vector<LinkPushTarget> targets;
    cl::SetLinksRequest push;
    {
      absl::MutexLock lock(&s_->mu_);
      // The table after the change; in force once it is logged.
      std::vector<cl::LinkConfig> next = s_->links_;
      auto it = std::find_if(next.begin(), next.end(), [&](const auto& l) {
        return l.source() == link.source() &&
               l.destination() == link.destination();
      });
      if (req->remove()) {
        if (it == next.end()) {
          return grpc::Status(grpc::StatusCode::NOT_FOUND,
                              absl::StrCat("no link rule ", link.source(),
                                           " -> ", link.destination()));
        }
        next.erase(it);
      } else if (it != next.end()) {
        *it = link;
      } else {
        next.push_back(link);
      }
      if (s_->wal_ != nullptr) {
        // On disk before it is in force, so that a restarted coordinator
        // keeps what its clients were told.
        if (absl::Status st = s_->wal_->Append(LinkRulesRecord(next));
            !st.ok()) {
          KLOG(Error, kLog) << "link rule not set: " << st.message();
          return grpc::Status(
              grpc::StatusCode::INTERNAL,
              absl::StrCat("cannot log the link rules: ", st.message()));
        }
      }
      s_->links_ = std::move(next);
      push = LinkPushLocked(s_, &targets);
      for (const auto& l : s_->links_) *resp->add_links() = l;
      std::vector<std::string> names;
      if (!req->remove()) names = {link.source(), link.destination()};
      if (names.size() == 2 && names[1] == names[0]) names.pop_back();
      for (const std::string& name : names) {
        if (name != "*" && !s_->HasNodeNamedLocked(name)) {
          resp->add_warnings(absl::StrCat("no node has registered as '", name,
                                          "'; the rule applies once one does"));
        }
      }
    }
    KLOG(Info, kLog) << (req->remove() ? "link rule removed: "
                                       : "link rule set: ")
                     << link.ShortDebugString();
    for (std::string& f : PushLinks(s_, push, targets)) {
      resp->add_not_applied(std::move(f));
    }
    return grpc::Status::OK;
  }

  grpc::Status GetLinks(grpc::ServerContext*, const cl::GetLinksRequest*,
                        cl::GetLinksResponse* resp) override {
    absl::MutexLock lock(&s_->mu_);
    for (const auto& l : s_->links_) *resp->add_links() = l;
    resp->set_seed(s_->options().link_seed);
    return grpc::Status::OK;
  }

  grpc::Status InjectProcessFault(grpc::ServerContext*,
                                  const cl::ProcessFaultRequest* req,
                                  cl::ProcessFaultResponse* resp) override {
    if (absl::Status valid =
            ValidateProcessFault(req->action(), req->pause_ms());
        !valid.ok())
      return ToGrpc(valid);
    std::shared_ptr<grpc::Channel> channel;
    NodeRole role = NodeRole::kKarat;
    {
      absl::MutexLock lock(&s_->mu_);
      std::vector<std::string> names;
      for (const auto& [id, n] : s_->nodes_) {
        if (n.name != req->node()) {
          names.push_back(n.name);
          continue;
        }
        // A restarted node registers again under the same name: the alive
        // one is meant.
        if (!s_->AliveLocked(n)) continue;
        channel = n.channel;
        role = n.role;
      }
      if (channel == nullptr) {
        if (s_->HasNodeNamedLocked(req->node()))
          return grpc::Status(
              grpc::StatusCode::FAILED_PRECONDITION,
              absl::StrCat("node ", req->node(), " is not alive"));
        std::sort(names.begin(), names.end());
        names.erase(std::unique(names.begin(), names.end()), names.end());
        return grpc::Status(
            grpc::StatusCode::NOT_FOUND,
            absl::StrCat("no node named \"", req->node(), "\" (registered: ",
                         names.empty() ? "none" : absl::StrJoin(names, ", "),
                         ")"));
      }
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(s_));
    cl::ProcessFaultRequest fault = *req;
    grpc::Status st =
        role == NodeRole::kGpu
            ? cl::GpuNode::NewStub(channel)->InjectFault(&ctx, fault, resp)
            : cl::KaratNode::NewStub(channel)->InjectFault(&ctx, fault, resp);
    KLOG(Warning, kLog) << "process fault " << req->action() << " on node "
                        << req->node()
                        << (req->action() == "pause"
                                ? absl::StrCat(" for ", req->pause_ms(), " ms")
                                : std::string())
                        << (st.ok() ? std::string()
                                    : absl::StrCat(" failed: ",
                                                   st.error_message()));
    return st;
  }

 private:
  State* s_;
};

// ---------------------------------------------------------------------------
// Membership (karat.cluster.Coordinator).

class MembershipService final : public cl::Coordinator::Service {
 public:
  explicit MembershipService(State* state) : s_(state) {}

  // Told after every registration (pushes the link table; GPU peers).
  void set_link_pusher(LinkPusher* pusher) { pusher_ = pusher; }
  void set_control_pusher(ControlPusher* pusher) { control_ = pusher; }

  grpc::Status RegisterNode(grpc::ServerContext*,
                            const cl::RegisterNodeRequest* req,
                            cl::RegisterNodeResponse* resp) override {
    NodeRole role;
    if (req->role() == "gpu") {
      role = NodeRole::kGpu;
    } else if (req->role() == "karat") {
      role = NodeRole::kKarat;
    } else {
      return grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          absl::StrCat("role must be \"gpu\" or \"karat\", got \"", req->role(),
                       "\""));
    }
    if (req->name().empty())
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "node name must not be empty");
    if (req->grpc_address().empty())
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("node ", req->name(),
                                       ": grpc_address must not be empty"));
    auto channel = grpc::CreateChannel(req->grpc_address(),
                                       grpc::InsecureChannelCredentials());
    absl::MutexLock lock(&s_->mu_);
    if (role == NodeRole::kGpu && !req->model_fingerprint().empty()) {
      if (s_->gpu_fingerprint_.empty()) {
        s_->gpu_fingerprint_ = req->model_fingerprint();
      } else if (s_->gpu_fingerprint_ != req->model_fingerprint()) {
        return grpc::Status(
            grpc::StatusCode::FAILED_PRECONDITION,
            absl::StrCat("node ", req->name(), " serves model ",
                         req->model_fingerprint(), " but the cluster serves ",
                         s_->gpu_fingerprint_));
      }
    }
    int rank = 0, ranks = 1;
    if (role == NodeRole::kGpu) {
      rank = req->rank();
      ranks = req->ranks() > 0 ? req->ranks() : 1;
      if (req->ranks() < 0 || rank < 0 || rank >= ranks)
        return grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat("node ", req->name(), ": rank ", rank,
                         " is outside [0, ranks) with ranks ", req->ranks()));
      for (const auto& [id, n] : s_->nodes_) {
        if (n.role != NodeRole::kGpu || n.name == req->name() ||
            !s_->AliveLocked(n))
          continue;
        if (n.ranks != ranks)
          return grpc::Status(
              grpc::StatusCode::FAILED_PRECONDITION,
              absl::StrCat("node ", req->name(), " claims ", ranks,
                           " GPU ranks but node ", n.name, " claims ", n.ranks,
                           "; start every GPU node with the same --ranks"));
        if (n.rank == rank)
          return grpc::Status(
              grpc::StatusCode::ALREADY_EXISTS,
              absl::StrCat("node ", req->name(), " claims rank ", rank, " of ",
                           ranks, " but the alive node ", n.name,
                           " serves it; give each GPU node its own --rank"));
      }
      if (s_->gpu_only() && req->kv_capacity_bytes() < 0)
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            absl::StrCat("node ", req->name(),
                                         ": kv_capacity_bytes must be >= 0"));
    }
    for (auto it = s_->nodes_.begin(); it != s_->nodes_.end(); ++it) {
      if (it->second.name == req->name()) {
        KLOG(Info, kLog) << "node " << req->name() << " re-registered; id "
                         << it->first << " retired";
        s_->nodes_.erase(it);
        break;
      }
    }
    Node n;
    n.id = s_->next_node_id_++;
    n.name = req->name();
    n.role = role;
    n.grpc_address = req->grpc_address();
    n.fabric_address = req->fabric_address();
    n.provider = req->provider();
    n.fingerprint = req->model_fingerprint();
    n.devices.assign(req->devices().begin(), req->devices().end());
    n.last_seen = s_->Now();
    n.channel = std::move(channel);
    n.rank = rank;
    n.ranks = ranks;
    n.kv_capacity_bytes = req->kv_capacity_bytes();
    n.routed_experts = role == NodeRole::kGpu ? req->routed_experts() : 0;
    if (role == NodeRole::kGpu) s_->ranks_seen_.insert(rank);
    if (role == NodeRole::kGpu && n.devices.empty() &&
        n.kv_capacity_bytes > 0) {
      n.devices.push_back(KvDevice(n.kv_capacity_bytes));
    }
    KLOG(Info, kLog) << "node " << n.name << " registered: id=" << n.id
                     << " role=" << RoleName(role) << " grpc=" << n.grpc_address
                     << " provider=" << n.provider
                     << " devices=" << n.devices.size()
                     << (role == NodeRole::kGpu
                             ? absl::StrCat(" rank=", rank, "/", ranks)
                             : std::string());
    resp->set_node_id(n.id);
    resp->set_heartbeat_interval_ms(s_->options().heartbeat_interval_ms);
    s_->nodes_.emplace(n.id, std::move(n));
    s_->capacity_epoch_++;
    if (pusher_ != nullptr && !s_->links_.empty()) pusher_->Request();
    if (role == NodeRole::kGpu && control_ != nullptr) {
      State* s = s_;
      control_->Post("peers", [s] { PushPeers(s); });
    }
    return grpc::Status::OK;
  }

  grpc::Status Heartbeat(grpc::ServerContext*, const cl::HeartbeatRequest* req,
                         cl::HeartbeatResponse* resp) override {
    absl::MutexLock lock(&s_->mu_);
    auto it = s_->nodes_.find(req->node_id());
    if (it == s_->nodes_.end() ||
        (!req->name().empty() && it->second.name != req->name())) {
      resp->set_known(false);
      return grpc::Status::OK;
    }
    Node& n = it->second;
    // A node back from silence may make room for queued turns; one a probe
    // took for lost is not.
    if (!s_->AliveLocked(n)) s_->capacity_epoch_++;
    if (n.lost) {
      KLOG(Warning, kLog) << "node " << n.name
                          << " answers heartbeats again after a failed probe";
      n.lost = false;
    }
    if (req->devices_size() > 0)
      n.devices.assign(req->devices().begin(), req->devices().end());
    for (const auto& [k, v] : req->stats()) n.stats[k] = v;
    n.last_seen = s_->Now();
    resp->set_known(true);
    return grpc::Status::OK;
  }

 private:
  State* s_;
  LinkPusher* pusher_ = nullptr;
  ControlPusher* control_ = nullptr;
};

// ---------------------------------------------------------------------------
// Client API (karat.v1.Karat).

// Everything a turn needs once it is admitted, copied out of the state.
struct AdmittedTurn {
  uint64_t key = 0;
  uint64_t seed = 0;
  int rank = 0;
  uint32_t gpu_id = 0;
  std::string gpu_name;
  std::shared_ptr<grpc::Channel> gpu_channel;
  cl::KaratPlacement placement;  // empty in gpu_only mode
  int pos_start = 0;
  std::vector<int32_t> feed;
  std::vector<int32_t> prefill_ends;
};

class KaratService final : public v1::Karat::Service {
 public:
  explicit KaratService(State* state) : s_(state) {}

  // Runs the SetMicroBatches pushes.
  void set_control_pusher(ControlPusher* pusher) { control_ = pusher; }
  // Posts a SetMicroBatches push for `rank`.
  void PostMicroBatchPush(int rank);

  grpc::Status CreateSession(grpc::ServerContext*,
                             const v1::CreateSessionRequest* req,
                             v1::Session* resp) override {
    absl::MutexLock lock(&s_->mu_);
    if (s_->shutting_down_)
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "coordinator is shutting down");
    Session session;
    do {
      session.id =
          absl::StrFormat("s-%016x", absl::Uniform<uint64_t>(s_->rng_));
    } while (s_->sessions_.count(session.id));
    do {
      session.key = absl::Uniform<uint64_t>(s_->rng_);
    } while (session.key == 0 || s_->session_keys_.count(session.key));
    session.seed = req->seed();
    s_->session_keys_.insert(session.key);
    FillSession(session, false, resp);
    if (s_->wal_ != nullptr) {
      // Under the lock: nothing else knows the session yet, and the log's
      // order is the table's. The client hears of it once it is on disk.
      cl::WalRecord record;
      record.mutable_created()->set_id(session.id);
      record.mutable_created()->set_key(session.key);
      record.mutable_created()->set_seed(session.seed);
      if (absl::Status st = s_->wal_->Append(record); !st.ok()) {
        s_->session_keys_.erase(session.key);
        KLOG(Error, kLog) << "session=" << session.id
                          << " not created: " << st.message();
        return grpc::Status(
            grpc::StatusCode::INTERNAL,
            absl::StrCat("cannot log the session: ", st.message()));
      }
    }
    KLOG(Info, kLog) << "session=" << session.id
                     << " created seed=" << session.seed;
    s_->sessions_.emplace(session.id, std::move(session));
    return grpc::Status::OK;
  }

  grpc::Status GetSession(grpc::ServerContext*,
                          const v1::GetSessionRequest* req,
                          v1::Session* resp) override {
    WaitForCancelledTurn(req->session_id(), absl::Milliseconds(50));
    absl::MutexLock lock(&s_->mu_);
    auto it = s_->sessions_.find(req->session_id());
    if (it == s_->sessions_.end()) return NoSession(req->session_id());
    FillSession(it->second, req->include_tokens(), resp);
    return grpc::Status::OK;
  }

  grpc::Status CloseSession(grpc::ServerContext*,
                            const v1::CloseSessionRequest* req,
                            v1::CloseSessionResponse*) override {
    std::shared_ptr<grpc::Channel> home_channel;
    std::string home_name;
    NodeRole home_role = NodeRole::kKarat;
    uint64_t key = 0;
    WaitForCancelledTurn(req->session_id(), absl::Milliseconds(200));
    {
      absl::MutexLock lock(&s_->mu_);
      auto it = s_->sessions_.find(req->session_id());
      if (it == s_->sessions_.end()) return NoSession(req->session_id());
      if (it->second.busy)
        return grpc::Status(
            grpc::StatusCode::FAILED_PRECONDITION,
            absl::StrCat("a generate is running on session ", req->session_id(),
                         "; cancel it before closing the session"));
      key = it->second.key;
      if (it->second.has_home) {
        auto n = s_->nodes_.find(it->second.home.node_id);
        if (n != s_->nodes_.end()) {
          home_channel = n->second.channel;
          home_name = n->second.name;
          home_role = n->second.role;
        }
      }
      if (s_->wal_ != nullptr) {
        cl::WalRecord record;
        record.mutable_closed()->set_id(req->session_id());
        if (absl::Status st = s_->wal_->Append(record); !st.ok()) {
          KLOG(Error, kLog) << "session=" << req->session_id()
                            << " not closed: " << st.message();
          return grpc::Status(
              grpc::StatusCode::INTERNAL,
              absl::StrCat("cannot log the close: ", st.message()));
        }
      }
      s_->session_keys_.erase(key);
      s_->sessions_.erase(it);
      // Its pages are about to be freed: queued turns may fit.
      s_->capacity_epoch_++;
    }
    KLOG(Info, kLog) << "session=" << req->session_id() << " closed";
    if (home_channel) {
      grpc::ClientContext ctx;
      ctx.set_deadline(Deadline(s_));
      cl::FreeSessionRequest freq;
      freq.set_session(key);
      cl::FreeSessionResponse fresp;
      grpc::Status st = home_role == NodeRole::kGpu
                            ? cl::GpuNode::NewStub(home_channel)
                                  ->FreeSession(&ctx, freq, &fresp)
                            : cl::KaratNode::NewStub(home_channel)
                                  ->FreeSession(&ctx, freq, &fresp);
      if (!st.ok()) {
        // The session is closed either way; the node frees the pages when
        // it restarts or when it learns the session is gone.
        KLOG(Warning, kLog)
            << "session=" << req->session_id() << " FreeSession on "
            << home_name << " failed: " << st.error_message();
      }
      absl::MutexLock lock(&s_->mu_);
      s_->capacity_epoch_++;
    }
    return grpc::Status::OK;
  }

  grpc::Status GetClusterStatus(grpc::ServerContext*,
                                const v1::GetClusterStatusRequest*,
                                v1::ClusterStatus* resp) override {
    absl::MutexLock lock(&s_->mu_);
    absl::Time now = s_->Now();
    for (const auto& [id, n] : s_->nodes_) {
      v1::NodeStatus* ns = resp->add_nodes();
      ns->set_name(n.name);
      ns->set_role(RoleName(n.role));
      ns->set_grpc_address(n.grpc_address);
      ns->set_provider(n.provider);
      ns->set_alive(s_->AliveLocked(n));
      ns->set_last_heartbeat_ms_ago(
          absl::ToInt64Milliseconds(now - n.last_seen));
      for (const auto& d : n.devices) {
        v1::DeviceStatus* ds = ns->add_devices();
        ds->set_device(d.device());
        ds->set_capacity_bytes(d.capacity_bytes());
        ds->set_used_bytes(d.used_bytes());
        ds->set_sessions(d.sessions());
        ds->set_cores(d.cores());
      }
      for (const auto& [k, v] : n.stats) (*ns->mutable_stats())[k] = v;
    }
    resp->set_sessions(static_cast<int32_t>(s_->sessions_.size()));
    resp->set_active_generations(s_->active_generations_);
    resp->set_tokens_generated(s_->tokens_generated_);
    FillStatsLocked(now, resp->mutable_stats());
    return grpc::Status::OK;
  }

  grpc::Status Generate(
      grpc::ServerContext* ctx, const v1::GenerateRequest* req,
      grpc::ServerWriter<v1::GenerateResponse>* writer) override;

 private:
  void FillStatsLocked(absl::Time now,
                       google::protobuf::Map<std::string, double>* stats) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu_) {
    auto& m = *stats;
    const double uptime = absl::ToDoubleSeconds(now - s_->started());
    m["uptime_s"] = uptime;
    m["tokens_generated"] = double(s_->tokens_generated_);
    m["throughput_tokens_per_s"] =
        uptime > 0 ? double(s_->tokens_generated_) / uptime : 0.0;
    m["queue_length"] = double(s_->queue_.size());
    m["turns_admitted"] = double(s_->turns_admitted_);
    m["turns_queued"] = double(s_->turns_queued_);
    m["turns_timed_out"] = double(s_->turns_timed_out_);
    m["turns_cancelled_queued"] = double(s_->turns_cancelled_queued_);
    m["turns_refused"] = double(s_->turns_refused_);
    m["turns_resumed"] = double(s_->turns_resumed_);
    m["gpu_ranks_lost"] = double(s_->gpu_ranks_lost_);
    m["karat_nodes_lost"] = double(s_->karat_losses_);
    m["sessions_rehomed"] = double(s_->sessions_rehomed_);
    m["expert_ownership_version"] = double(s_->owners_version_);
    m["microbatch_token_imbalance_mean"] =
        s_->imbalance_samples_ > 0 ? s_->imbalance_sum_ / s_->imbalance_samples_
                                   : 0.0;
    m["microbatch_device_imbalance_mean"] =
        s_->imbalance_samples_ > 0
            ? s_->device_imbalance_sum_ / s_->imbalance_samples_
            : 0;
    m["microbatch_token_imbalance_samples"] = double(s_->imbalance_samples_);
    s_->ttft_ms_.ExportTo("ttft_ms", stats);
    s_->tbt_ms_.ExportTo("tbt_ms", stats);
    const int ranks = s_->RankCountLocked();
    for (int r = 0; r < ranks; ++r) {
      const std::string p = absl::StrCat("rank.", r, ".");
      auto it = s_->ranks_.find(r);
      const Rank* rank = it == s_->ranks_.end() ? nullptr : &it->second;
      m[p + "active_requests"] = rank ? double(rank->running.size()) : 0.0;
      int mb[2] = {0, 0};
      if (rank)
        for (const auto& [key, t] : rank->running) mb[t.micro_batch & 1]++;
      m[p + "micro_batch_0_requests"] = mb[0];
      m[p + "micro_batch_1_requests"] = mb[1];
      m[p + "microbatch_token_imbalance_mean"] =
          rank && rank->imbalance_samples > 0
              ? rank->imbalance_sum / rank->imbalance_samples
              : 0.0;
      // The model behind the rank's TBT cap, and the steps it learned from.
      const StepCostModel cost = s_->StepCostLocked(r);
      m[p + "step_cost_fixed_ms"] = cost.fixed_ms;
      m[p + "step_cost_per_request_ms"] = cost.per_request_ms;
      m[p + "step_cost_per_context_token_ms"] = cost.per_context_token_ms;
      m[p + "step_cost_samples"] =
          rank && rank->step_cost ? double(rank->step_cost->samples()) : 0.0;
      // An estimator exists only in "learned" mode (AddStepLocked).
      m[p + "step_cost_learned"] =
          rank && rank->step_cost && rank->step_cost->learned() ? 1.0 : 0.0;
    }
  }

  static grpc::Status NoSession(const std::string& id) {
    return grpc::Status(
        grpc::StatusCode::NOT_FOUND,
        absl::StrCat("no session \"", id, "\" (unknown or closed)"));
  }

  void FillSession(const Session& s, bool tokens, v1::Session* out) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu_) {
    out->set_session_id(s.id);
    out->set_seed(s.seed);
    out->set_num_tokens(static_cast<int64_t>(s.history.size()));
    out->set_turns(s.turns);
    out->set_state(s.busy ? "generating" : "idle");
    if (s.has_home) {
      auto n = s_->nodes_.find(s.home.node_id);
      out->set_home_node(n != s_->nodes_.end() ? n->second.name : "");
      out->set_home_device(s.home.device);
    }
    if (tokens) {
      out->mutable_tokens()->Assign(s.history.begin(), s.history.end());
    }
  }

  // A client that cancels a Generate sees CANCELLED before the coordinator
  // has noticed and wound the turn down. So that the client's next call
  // sees the session idle with its final history, calls on a busy session
  // first wait up to `grace` for the running turn's cancellation to become
  // visible, and then (bounded) for the turn to end.
  void WaitForCancelledTurn(const std::string& session_id,
                            absl::Duration grace) const;

  absl::Status Validate(const v1::GenerateRequest& req) const;
  // Appends what the session's history, prefill ends and turn count gained
  // since its last record to the write-ahead log (nothing without one, or
  // when nothing changed). Call without the lock, while the session is busy
  // (so that no close comes in between).
  absl::Status LogTurn(const std::string& sid);
  // UNAVAILABLE unless a GPU node (and in karat mode a KARAT node) is alive
  // and every routed expert has an alive owner that acknowledged it: with
  // several ranks whose nodes report the expert count, the alive ranks
  // acknowledged the ownership pushed for them (a lost rank's experts
  // spread over them, DESIGN.md §7); otherwise every rank is alive. While
  // the ownership is being pushed and acknowledged `*settling` (may be
  // null) is set: the caller may wait instead of failing.
  absl::Status CheckNodesLocked(bool* settling = nullptr) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu_);

  // Asks every alive node for its stats; those that cannot be reached are
  // taken for lost at once (not after node_timeout_ms): for a GPU node the
  // rank table is pushed again, for a KARAT node the GPU nodes are told
  // (NoteLostKaratNodesLocked). Makes RPCs: call without the lock.
  void ProbeNodes();
  // What a turn's GPU call started with, to tell afterwards whether a node
  // was lost meanwhile.
  struct LossMarks {
    uint64_t rank_removals = 0;           // State::rank_removals_
    uint64_t karat_losses = 0;            // State::karat_losses_
    std::map<int, uint32_t> alive_ranks;  // rank -> node id
  };
  // After the GPU call of the turn on `turn->rank` failed with UNAVAILABLE:
  // false when no node was lost since the call started (`before`: no table
  // without one of its ranks was pushed, the alive ranks it started with
  // are alive, no KARAT node was taken for lost; the nodes are probed
  // first). Otherwise waits (bounded) for the alive ranks to own every
  // expert, moves the turn to an alive rank if a rank was lost (gpu_only:
  // to the rank holding the session's KV), to a new home if the node
  // holding its KV was lost (ReplaceHome: a KARAT node, in gpu_only mode
  // its rank), and rewrites
  // `run` to continue it: the KV up to the session's kv_len is on its home,
  // the token log's tail is fed again (after `generated` tokens of the turn
  // it holds sampled ones: resumed_decode), `remaining` tokens are left.
  // True once resumed; CANCELLED when the client went away meanwhile, other
  // errors when it cannot be resumed.
  absl::StatusOr<bool> ResumeTurn(grpc::ServerContext* ctx,
                                  const std::string& sid, int generated,
                                  int remaining, const LossMarks& before,
                                  AdmittedTurn* turn, cl::RunTurnRequest* run);
  // For ResumeTurn: the node holding the session's KV is lost (its home
  // KARAT node; in gpu_only mode its rank). Reserves KV for its token log
  // plus `remaining` tokens on the device ChooseHomeDevices prefers (gpu_only:
  // the alive rank with the fewest running turns), the next one when one
  // refuses, makes it the session's home (and rank) with no KV stored
  // (kv_len 0) and points `turn` and `run` there.
  absl::Status ReplaceHome(const std::string& sid, int remaining,
                           AdmittedTurn* turn, cl::RunTurnRequest* run);

  struct Attempt {
    enum Kind { kAdmitted, kWait, kFailed } kind;
    absl::Status status;  // kFailed
  };
  // One admission attempt of the turn at the head of the queue: picks the
  // rank (fewest running; gpu_only: the one holding the KV) if its batch has
  // room, reserves the KV (home device, or the rank in gpu_only mode) and on
  // success appends the prompt and enters the turn into the rank's batch
  // (filling `turn`). kWait: no room now; kFailed: never (RESOURCE_EXHAUSTED
  // when even an empty device or rank refuses) or a node error. The session
  // is left unchanged unless admitted.
  Attempt TryAdmit(const std::string& session_id, int tokens,
                   const std::vector<int32_t>& prompt, AdmittedTurn* turn);
  // Queues the turn and returns once it is admitted, streaming its queue
  // position; fails on timeout (RESOURCE_EXHAUSTED), cancel (CANCELLED),
  // shutdown or lost nodes (UNAVAILABLE).
  absl::StatusOr<AdmittedTurn> WaitForAdmission(
      grpc::ServerContext* ctx,
      grpc::ServerWriter<v1::GenerateResponse>* writer, const std::string& sid,
      int reserve_tokens, const std::vector<int32_t>& prompt);

  State* s_;
  ControlPusher* control_ = nullptr;
};

void KaratService::WaitForCancelledTurn(const std::string& session_id,
                                        absl::Duration grace) const {
  // Real time, not the options' clock: this bounds a wait on threads.
  const absl::Time start = absl::Now();
  while (true) {
    {
      absl::MutexLock lock(&s_->mu_);
      auto it = s_->sessions_.find(session_id);
      if (it == s_->sessions_.end() || !it->second.busy) return;
      bool cancelled =
          it->second.turn_ctx != nullptr && it->second.turn_ctx->IsCancelled();
      absl::Duration waited = absl::Now() - start;
      if (!cancelled && waited >= grace) return;
      if (waited >= grace + absl::Seconds(5)) return;
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
}

absl::Status KaratService::LogTurn(const std::string& sid) {
  if (s_->wal_ == nullptr) return absl::OkStatus();
  cl::WalRecord record;
  size_t logged_tokens = 0;
  int logged_turns = 0;
  {
    absl::MutexLock lock(&s_->mu_);
    auto it = s_->sessions_.find(sid);
    if (it == s_->sessions_.end()) return absl::OkStatus();
    Session& session = it->second;
    if (session.logged_tokens == session.history.size() &&
        session.logged_turns == session.turns)
      return absl::OkStatus();
    logged_tokens = session.logged_tokens;
    logged_turns = session.logged_turns;
    cl::WalRecord::TurnLogged* turn = record.mutable_turn();
    turn->set_id(sid);
    turn->mutable_tokens()->Assign(
        session.history.begin() + session.logged_tokens, session.history.end());
    turn->mutable_prefill_ends()->Assign(session.prefill_ends.begin(),
                                         session.prefill_ends.end());
    turn->set_turns(session.turns);
    session.logged_tokens = session.history.size();
    session.logged_turns = session.turns;
  }
  absl::Status st = s_->wal_->Append(record);
  if (!st.ok()) {
    // Not on disk: the session's next record carries these tokens too.
    absl::MutexLock lock(&s_->mu_);
    auto it = s_->sessions_.find(sid);
    if (it != s_->sessions_.end()) {
      it->second.logged_tokens = logged_tokens;
      it->second.logged_turns = logged_turns;
    }
  }
  return st;
}

absl::Status KaratService::Validate(const v1::GenerateRequest& req) const {
  int limit = s_->options().max_new_tokens_limit;
  if (req.max_new_tokens() < 1 || req.max_new_tokens() > limit) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens must be in [1, ", limit, "], got ",
                     req.max_new_tokens()));
  }
  if (req.prompt().empty() && req.prompt_tokens().empty())
    return absl::InvalidArgumentError(
        "the prompt is empty (set prompt or prompt_tokens)");
  if (!req.prompt().empty() && !req.prompt_tokens().empty())
    return absl::InvalidArgumentError("set prompt or prompt_tokens, not both");
  for (int i = 0; i < req.prompt_tokens_size(); ++i) {
    int32_t t = req.prompt_tokens(i);
    if (t < 0 || t >= kVocabSize)
      return absl::InvalidArgumentError(
          absl::StrCat("prompt_tokens[", i, "] = ", t, " is outside [0, ",
                       kVocabSize - 1, "]"));
  }
  if (!std::isfinite(req.temperature()) || req.temperature() < 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "temperature must be finite and >= 0, got ", req.temperature()));
  return absl::OkStatus();
}

absl::Status KaratService::CheckNodesLocked(bool* settling) const {
  if (settling != nullptr) *settling = false;
  bool gpu = false, karat = false;
  for (const auto& [id, n] : s_->nodes_) {
    if (!s_->AliveLocked(n)) continue;
    (n.role == NodeRole::kGpu ? gpu : karat) = true;
  }
  if (!gpu)
    return absl::UnavailableError(
        "no alive GPU node is registered; start one and retry");
  if (!karat && !s_->gpu_only())
    return absl::UnavailableError(
        "no alive KARAT node is registered; start one and retry");
  const int ranks = s_->RankCountLocked();
  auto node_of = [&](int r) {
    std::string who;
    for (const auto& [id, n] : s_->nodes_)
      if (n.role == NodeRole::kGpu && n.rank == r)
        who = " (node " + n.name + ")";
    return who;
  };
  if (!s_->RankLossToleratedLocked()) {
    // One rank, or not every rank has registered yet: every rank is needed.
    for (int r = 0; r < ranks; ++r) {
      if (s_->RankNodeLocked(r) != nullptr) continue;
      return absl::UnavailableError(absl::StrCat(
          "GPU rank ", r, " of ", ranks, node_of(r), " is not alive",
          ranks > 1 ? " and not every rank has registered since the "
                      "coordinator started (from then on a lost rank's turns "
                      "move to the alive ranks)"
                    : "",
          "; no turn can run until it is ",
          s_->ranks_seen_.count(r) > 0 ? "restarted" : "started",
          " with --rank ", r, " --ranks ", ranks));
    }
    return absl::OkStatus();
  }
  // Every expert needs an alive owner that acknowledged it; a dense model
  // (no experts to move) needs the alive ranks to have taken the new table.
  const std::map<int, uint32_t> alive = s_->AliveRanksLocked();
  const bool experts = s_->MovableExpertsLocked() > 0;
  std::vector<std::string> down;
  std::vector<int> down_ranks;
  for (int r = 0; r < ranks; ++r) {
    if (alive.count(r) > 0) continue;
    down.push_back(absl::StrCat(r, node_of(r)));
    down_ranks.push_back(r);
  }
  const std::string lost =
      down.empty()
          ? std::string()
          : absl::StrCat(" while GPU rank", down.size() > 1 ? "s " : " ",
                         absl::StrJoin(down, ", "),
                         down.size() > 1 ? " are" : " is", " down");
  if (s_->owners_version_ == 0 || s_->owners_ranks_ != alive) {
    if (settling != nullptr) *settling = true;
    return absl::UnavailableError(
        absl::StrCat("the GPU ranks changed", lost,
                     experts ? "; the expert ownership is being moved to the "
                               "alive ranks"
                             : "; the rank table is being pushed to the alive "
                               "ranks"));
  }
  for (const auto& [r, id] : alive) {
    const Node& n = s_->nodes_.at(id);
    if (n.owners_acked == s_->owners_version_) continue;
    if (n.owners_refused) {
      return absl::UnavailableError(absl::StrCat(
          "GPU rank ", r, " (node ", n.name,
          ") cannot take the experts it was given", lost, ": ", n.owners_error,
          down.empty()
              ? std::string()
              : absl::StrCat("; no turn can run until GPU rank ",
                             absl::StrJoin(down_ranks, ", "),
                             " is restarted (--rank R --ranks ", ranks, ")")));
    }
    if (settling != nullptr) *settling = true;
    return absl::UnavailableError(absl::StrCat(
        "GPU rank ", r, " (node ", n.name, ") has not acknowledged ",
        experts ? "its experts" : "the rank table", " yet", lost,
        n.owners_error.empty() ? std::string()
                               : absl::StrCat(" (", n.owners_error, ")")));
  }
  return absl::OkStatus();
}

void KaratService::ProbeNodes() {
  struct Target {
    uint32_t id;
    std::string name;
    NodeRole role;
    std::shared_ptr<grpc::Channel> channel;
  };
  std::vector<Target> targets;
  {
    absl::MutexLock lock(&s_->mu_);
    for (const auto& [id, n] : s_->nodes_)
      if (s_->AliveLocked(n))
        targets.push_back({id, n.name, n.role, n.channel});
  }
  // In parallel: each probe may wait out its deadline.
  std::vector<grpc::Status> status(targets.size());
  ForEachConcurrently(targets, [&](const Target& t) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(2));
    cl::StatsRequest req;
    cl::StatsResponse resp;
    status[&t - targets.data()] =
        t.role == NodeRole::kGpu
            ? cl::GpuNode::NewStub(t.channel)->GetStats(&ctx, req, &resp)
            : cl::KaratNode::NewStub(t.channel)->GetStats(&ctx, req, &resp);
  });
  bool gpu_lost = false;
  absl::MutexLock lock(&s_->mu_);
  for (size_t i = 0; i < targets.size(); ++i) {
    const Target& t = targets[i];
    // A node that answers, even with an error, is there.
    if (status[i].error_code() != grpc::StatusCode::UNAVAILABLE) continue;
    auto it = s_->nodes_.find(t.id);
    if (it == s_->nodes_.end() || it->second.lost) continue;
    it->second.lost = true;
    s_->capacity_epoch_++;
    if (t.role == NodeRole::kGpu) {
      s_->gpu_ranks_lost_++;
      gpu_lost = true;
      KLOG(Warning, kLog) << "GPU node " << t.name << " (rank "
                          << it->second.rank
                          << ") does not answer: " << status[i].error_message()
                          << "; taking it for lost";
    } else {
      KLOG(Warning, kLog) << "KARAT node " << t.name
                          << " does not answer: " << status[i].error_message()
                          << "; taking it for lost";
    }
  }
  NoteLostKaratNodesLocked(s_, control_);
  if (gpu_lost && control_ != nullptr) {
    State* s = s_;
    control_->Post("peers", [s] { PushPeers(s); });
  }
}

absl::StatusOr<bool> KaratService::ResumeTurn(grpc::ServerContext* ctx,
                                              const std::string& sid,
                                              int generated, int remaining,
                                              const LossMarks& before,
                                              AdmittedTurn* turn,
                                              cl::RunTurnRequest* run) {
  ProbeNodes();
  bool rank_lost = false, home_lost = false;
  {
    absl::MutexLock lock(&s_->mu_);
    const std::map<int, uint32_t> alive = s_->AliveRanksLocked();
    rank_lost = s_->rank_removals_ != before.rank_removals;
    for (const auto& [rank, id] : before.alive_ranks) {
      auto now = alive.find(rank);
      if (now == alive.end() || now->second != id) rank_lost = true;
    }
    const bool karat_lost = s_->karat_losses_ != before.karat_losses;
    if (!rank_lost && !karat_lost) return false;
    // The node holding the session's KV: a KARAT node, or in gpu_only mode
    // the session's rank.
    const Session& session = s_->sessions_.at(sid);
    auto home = s_->nodes_.find(session.home.node_id);
    home_lost = home == s_->nodes_.end() || !s_->AliveLocked(home->second);
  }
  // Wait for the alive ranks to own every expert.
  const absl::Time give_up = absl::Now() + s_->queue_timeout();
  {
    absl::MutexLock lock(&s_->mu_);
    for (;;) {
      if (s_->shutting_down_)
        return absl::UnavailableError("coordinator is shutting down");
      bool settling = false;
      absl::Status nodes = CheckNodesLocked(&settling);
      if (nodes.ok()) break;
      if (!settling) return nodes;
      if (ctx->IsCancelled())
        return absl::CancelledError("cancelled by the client");
      if (absl::Now() > give_up)
        return absl::UnavailableError(
            absl::StrCat("waited ", absl::FormatDuration(s_->queue_timeout()),
                         " for the alive GPU ranks to take over the experts: ",
                         nodes.message()));
      const uint64_t seen = s_->capacity_epoch_;
      auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu_) {
        return s_->capacity_epoch_ != seen || s_->shutting_down_;
      };
      s_->mu_.AwaitWithTimeout(absl::Condition(&changed),
                               absl::Milliseconds(50));
    }
  }
  // The home is gone: a new one, where the KV is rebuilt from the token log
  // by prefill (DESIGN.md §7).
  if (home_lost) {
    absl::Status moved = ReplaceHome(sid, remaining, turn, run);
    if (!moved.ok()) return moved;
  }
  int rank = -1;
  bool push_old = false, push_new = false;
  const int old_rank = turn->rank;
  {
    absl::MutexLock lock(&s_->mu_);
    Session& session = s_->sessions_.at(sid);
    const std::map<int, uint32_t> alive = s_->AliveRanksLocked();
    if (s_->gpu_only()) {
      // The KV lives on the session's rank (a new one after ReplaceHome).
      auto it = alive.find(session.rank);
      if (it == alive.end() || it->second != session.home.node_id)
        return absl::UnavailableError(
            absl::StrCat("the session's KV was on GPU rank ", session.rank,
                         ", which is not alive"));
      rank = session.rank;
    } else if (!rank_lost && alive.count(old_rank) > 0 &&
               alive.at(old_rank) == turn->gpu_id) {
      rank = old_rank;  // only a KARAT node was lost: the rank stays
    } else {
      // The alive rank with the fewest running turns besides this one.
      size_t best = 0;
      for (const auto& [r, id] : alive) {
        auto it = s_->ranks_.find(r);
        size_t running = it == s_->ranks_.end() ? 0 : it->second.running.size();
        if (r == old_rank && running > 0) --running;
        if (rank < 0 || running < best) {
          rank = r;
          best = running;
        }
      }
    }
    if (rank < 0) return absl::UnavailableError("no alive GPU rank");
    Node& gpu = s_->nodes_.at(alive.at(rank));
    // The turn leaves its old rank's batch and joins the new one.
    RunningTurn moved;
    moved.session_id = sid;
    auto old = s_->ranks_.find(old_rank);
    if (old != s_->ranks_.end()) {
      auto t = old->second.running.find(turn->key);
      if (t != old->second.running.end()) {
        moved = t->second;
        old->second.running.erase(t);
      }
      push_old = s_->RecomputeMicroBatchesLocked(old_rank);
    }
    moved.home = session.home;
    auto old_node = s_->nodes_.find(turn->gpu_id);
    if (old_node != s_->nodes_.end()) old_node->second.active_turns--;
    gpu.active_turns++;
    moved.context_tokens = static_cast<int64_t>(session.history.size());
    moved.started = false;
    s_->ranks_[rank].running[turn->key] = moved;
    push_new = s_->RecomputeMicroBatchesLocked(rank);
    s_->capacity_epoch_++;
    turn->rank = rank;
    turn->gpu_id = gpu.id;
    turn->gpu_name = gpu.name;
    turn->gpu_channel = gpu.channel;
    // The KV up to kv_len is on the home device (0 on a new home); the rest
    // of the token log (the last sampled token, or the whole prompt when the
    // prefill did not finish, or all of it on a new home) is fed again.
    // Sampling is keyed by (seed, position), so the tokens are the ones the
    // turn would have produced.
    const int pos_start = session.kv_len;
    const int feed_end = static_cast<int>(session.history.size());
    run->set_pos_start(pos_start);
    run->mutable_feed_tokens()->Assign(session.history.begin() + pos_start,
                                       session.history.end());
    run->set_max_new_tokens(remaining);
    // After the first token the feed ends with sampled tokens.
    run->set_resumed_decode(generated > 0);
    run->clear_prefill_ends();
    for (int end : session.prefill_ends)
      if (end > pos_start && end < feed_end) run->add_prefill_ends(end);
  }
  if (push_old) PostMicroBatchPush(old_rank);
  if (push_new && rank != old_rank) PostMicroBatchPush(rank);
  return true;
}

absl::Status KaratService::ReplaceHome(const std::string& sid, int remaining,
                                       AdmittedTurn* turn,
                                       cl::RunTurnRequest* run) {
  struct Try {
    HomeDevice home;
    int rank = -1;  // gpu_only
    std::string name;
    std::shared_ptr<grpc::Channel> channel;
  };
  std::vector<Try> tries;
  uint64_t key = 0;
  int tokens = 0;
  std::string old_name;
  const bool gpu_only = s_->gpu_only();
  {
    absl::MutexLock lock(&s_->mu_);
    const Session& session = s_->sessions_.at(sid);
    key = session.key;
    tokens = static_cast<int>(session.history.size()) + remaining;
    auto old = s_->nodes_.find(session.home.node_id);
    old_name = old == s_->nodes_.end()
                   ? absl::StrCat("node ", session.home.node_id)
                   : old->second.name;
    if (gpu_only) {
      // The KV moves to an alive rank: fewest running turns first.
      std::vector<std::pair<size_t, int>> ranks;  // (running, rank)
      for (const auto& [r, id] : s_->AliveRanksLocked()) {
        auto it = s_->ranks_.find(r);
        ranks.emplace_back(
            it == s_->ranks_.end() ? 0 : it->second.running.size(), r);
      }
      std::sort(ranks.begin(), ranks.end());
      for (const auto& [running, r] : ranks) {
        const Node* n = s_->RankNodeLocked(r);
        tries.push_back({HomeDevice{n->id, 0}, r, n->name, n->channel});
      }
    } else {
      for (const HomeDevice& h : ChooseHomeDevices(s_->SnapshotLocked())) {
        const Node& n = s_->nodes_.at(h.node_id);
        tries.push_back({h, -1, n.name, n.channel});
      }
    }
  }
  std::string refusals;
  for (const Try& t : tries) {
    cl::ReserveResponse rresp;
    grpc::Status st =
        ReserveKv(s_, t.channel, key, t.home.device, tokens, &rresp);
    if (!st.ok()) {
      absl::StrAppend(&refusals, refusals.empty() ? "" : "; ", t.name, "/",
                      t.home.device, ": ", st.error_message());
      continue;
    }
    absl::MutexLock lock(&s_->mu_);
    auto n = s_->nodes_.find(t.home.node_id);
    if (n == s_->nodes_.end())
      return absl::UnavailableError(absl::StrCat(
          "node ", t.name, " went away while the session moved to it"));
    Session& session = s_->sessions_.at(sid);
    SetHomeLocked(s_, &session, &n->second, t.home, t.rank, rresp.used_bytes());
    session.kv_len = 0;
    if (!gpu_only) {
      turn->placement.set_node_id(n->second.id);
      turn->placement.set_node_name(n->second.name);
      turn->placement.set_fabric_address(n->second.fabric_address);
      turn->placement.set_device(t.home.device);
      *run->mutable_placement() = turn->placement;
    }
    s_->sessions_rehomed_++;
    KLOG(Warning, kLog) << "session=" << sid << " home " << old_name
                        << " is lost; new home " << t.name << "/"
                        << t.home.device << ", the KV of "
                        << session.history.size()
                        << " tokens is rebuilt by prefill";
    return absl::OkStatus();
  }
  return absl::UnavailableError(absl::StrCat(
      "the session's home ", old_name, " is lost and no alive ",
      gpu_only ? "GPU rank" : "device", " can take its ", tokens,
      " tokens of KV",
      refusals.empty() ? std::string() : absl::StrCat(" (", refusals, ")")));
}

KaratService::Attempt KaratService::TryAdmit(const std::string& session_id,
                                             int tokens,
                                             const std::vector<int32_t>& prompt,
                                             AdmittedTurn* turn) {
  struct Try {
    HomeDevice home;
    int rank = 0;
    std::string name;
    std::shared_ptr<grpc::Channel> channel;
    bool occupied = false;  // another session's KV lives there
  };
  std::vector<Try> tries;
  uint64_t key = 0;
  bool replacing = false;
  const bool gpu_only = s_->gpu_only();
  int karat_rank = -1;
  {
    absl::MutexLock lock(&s_->mu_);
    bool settling = false;
    if (absl::Status nodes = CheckNodesLocked(&settling); !nodes.ok())
      return {settling ? Attempt::kWait : Attempt::kFailed, nodes};
    Session& session = s_->sessions_.at(session_id);
    key = session.key;
    const int64_t context =
        static_cast<int64_t>(session.history.size() + prompt.size()) +
        (session.history.empty() ? 1 : 0);
    // Ranks with room, fewest running requests first (ties: lower rank).
    std::vector<std::pair<int, int>> ranks;  // (running, rank)
    const int rank_count = s_->RankCountLocked();
    for (int r = 0; r < rank_count; ++r) {
      if (s_->RankNodeLocked(r) == nullptr) continue;  // lost
      auto it = s_->ranks_.find(r);
      const int running =
          it == s_->ranks_.end() ? 0 : it->second.running.size();
      ranks.emplace_back(running, r);
    }
    if (ranks.empty()) return {Attempt::kWait, absl::OkStatus()};
    std::sort(ranks.begin(), ranks.end());
    auto has_room = [&](int r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu_) {
      auto it = s_->ranks_.find(r);
      const int running =
          it == s_->ranks_.end() ? 0 : it->second.running.size();
      return running < s_->RankCapLocked(r, context);
    };
    auto occupied =
        [&](const HomeDevice& h) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu_) {
          for (const auto& [id, other] : s_->sessions_)
            if (id != session_id && other.has_home && other.home == h)
              return true;
          return false;
        };
    if (gpu_only) {
      // The KV lives on the rank: a session sticks to it.
      std::vector<int> candidates;
      if (session.has_home && session.rank >= 0) {
        Node* n = s_->RankNodeLocked(session.rank);
        if (n != nullptr && n->id == session.home.node_id) {
          candidates.push_back(session.rank);
        } else {
          replacing = true;
          KLOG(Warning, kLog)
              << "session=" << session_id << " rank " << session.rank
              << " lost its KV; placing the session again";
        }
      }
      if (candidates.empty())
        for (const auto& [running, r] : ranks) candidates.push_back(r);
      for (int r : candidates) {
        if (!has_room(r)) continue;
        Node* n = s_->RankNodeLocked(r);
        HomeDevice h{n->id, 0};
        tries.push_back({h, r, n->name, n->channel, occupied(h)});
      }
      if (tries.empty()) return {Attempt::kWait, absl::OkStatus()};
    } else {
      if (!has_room(ranks.front().second))
        return {Attempt::kWait, absl::OkStatus()};
      karat_rank = ranks.front().second;
      if (session.has_home) {
        auto n = s_->nodes_.find(session.home.node_id);
        if (n != s_->nodes_.end() && s_->AliveLocked(n->second)) {
          tries.push_back({session.home, karat_rank, n->second.name,
                           n->second.channel, occupied(session.home)});
        } else {
          // The home node is gone: place again and rebuild the KV from the
          // token log by prefill (DESIGN.md §7).
          replacing = true;
          KLOG(Warning, kLog) << "session=" << session_id << " home node "
                              << session.home.node_id
                              << " is not alive; placing the session again";
        }
      }
      if (tries.empty()) {
        for (const HomeDevice& h : ChooseHomeDevices(s_->SnapshotLocked())) {
          const Node& n = s_->nodes_.at(h.node_id);
          tries.push_back({h, karat_rank, n.name, n.channel, occupied(h)});
        }
      }
    }
  }
  absl::Status other_error;
  bool busy_refusal = false;
  for (const Try& t : tries) {
    cl::ReserveResponse rresp;
    grpc::Status st =
        ReserveKv(s_, t.channel, key, t.home.device, tokens, &rresp);
    if (st.ok()) {
      absl::MutexLock lock(&s_->mu_);
      auto sit = s_->sessions_.find(session_id);
      auto n = s_->nodes_.find(t.home.node_id);
      Node* gpu = s_->RankNodeLocked(t.rank);
      if (sit == s_->sessions_.end() || n == s_->nodes_.end() || gpu == nullptr)
        return {Attempt::kFailed, absl::UnavailableError(absl::StrCat(
                                      "node ", t.name, " or GPU rank ", t.rank,
                                      " went away during admission; retry"))};
      Session& session = sit->second;
      if (!session.has_home || replacing) {
        KLOG(Info, kLog) << "session=" << session_id << " home " << t.name
                         << "/" << t.home.device;
      }
      if (replacing) session.kv_len = 0;
      SetHomeLocked(s_, &session, &n->second, t.home, t.rank,
                    rresp.used_bytes());
      // Admitted: the turn joins its rank's batch.
      gpu->active_turns++;
      s_->active_generations_++;
      s_->turns_admitted_++;
      turn->key = session.key;
      turn->seed = session.seed;
      turn->rank = t.rank;
      turn->gpu_id = gpu->id;
      turn->gpu_name = gpu->name;
      turn->gpu_channel = gpu->channel;
      if (!gpu_only) {
        turn->placement.set_node_id(n->second.id);
        turn->placement.set_node_name(n->second.name);
        turn->placement.set_fabric_address(n->second.fabric_address);
        turn->placement.set_device(t.home.device);
      }
      if (session.history.empty()) session.history.push_back(kBosToken);
      session.history.insert(session.history.end(), prompt.begin(),
                             prompt.end());
      turn->pos_start = session.kv_len;
      turn->feed.assign(session.history.begin() + session.kv_len,
                        session.history.end());
      const int feed_end = static_cast<int>(session.history.size());
      for (int end : session.prefill_ends)
        if (end > turn->pos_start && end < feed_end)
          turn->prefill_ends.push_back(end);
      session.turns++;
      RunningTurn running;
      running.session_id = session_id;
      running.home = t.home;
      running.context_tokens = feed_end;
      Rank& rank = s_->ranks_[t.rank];
      rank.running[session.key] = running;
      if (s_->RecomputeMicroBatchesLocked(t.rank)) PostMicroBatchPush(t.rank);
      return {Attempt::kAdmitted, absl::OkStatus()};
    }
    if (st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      if (t.occupied) busy_refusal = true;
      continue;
    }
    KLOG(Warning, kLog) << "session=" << session_id << " Reserve on " << t.name
                        << "/" << t.home.device
                        << " failed: " << st.error_message();
    other_error = absl::UnavailableError(
        absl::StrCat(gpu_only ? "GPU node " : "KARAT node ", t.name, ": ",
                     st.error_message()));
  }
  // Room may appear only where other sessions' KV lives; a turn refused by
  // every empty candidate can never fit.
  if (busy_refusal) return {Attempt::kWait, absl::OkStatus()};
  if (!other_error.ok()) return {Attempt::kFailed, other_error};
  if (tries.empty())
    return {Attempt::kFailed,
            absl::UnavailableError("no alive KARAT node has a device")};
  return {Attempt::kFailed,
          absl::ResourceExhaustedError(absl::StrCat(
              "turn needs ", tokens, " tokens of KV; no ",
              gpu_only ? "GPU rank" : "device", " has room, even empty"))};
}

void KaratService::PostMicroBatchPush(int rank) {
  if (control_ == nullptr) return;
  State* s = s_;
  control_->Post(absl::StrCat("micro_batches/", rank),
                 [s, rank] { PushMicroBatches(s, rank); });
}

absl::StatusOr<AdmittedTurn> KaratService::WaitForAdmission(
    grpc::ServerContext* ctx, grpc::ServerWriter<v1::GenerateResponse>* writer,
    const std::string& sid, int reserve_tokens,
    const std::vector<int32_t>& prompt) {
  uint64_t turn_id = 0;
  {
    absl::MutexLock lock(&s_->mu_);
    turn_id = s_->next_turn_id_++;
    s_->queue_.push_back(turn_id);
    s_->queue_epoch_++;
  }
  struct QueueGuard {
    State* s;
    uint64_t id;
    ~QueueGuard() {
      absl::MutexLock lock(&s->mu_);
      auto it = std::find(s->queue_.begin(), s->queue_.end(), id);
      if (it != s->queue_.end()) {
        s->queue_.erase(it);
        s->queue_epoch_++;
      }
    }
  } queue_guard{s_, turn_id};
  const absl::Time enqueued = s_->Now();
  const absl::Duration timeout = s_->queue_timeout();
  bool was_head = false, waiting = false;
  uint64_t tried_capacity = 0;
  int shown = -1;
  auto show = [&](int position) -> bool {
    if (position == shown) return true;
    shown = position;
    v1::GenerateResponse out;
    out.mutable_queued()->set_position(position);
    return writer->Write(out);
  };
  for (;;) {
    bool attempt = false;
    int position = 0;
    uint64_t seen_queue = 0, seen_capacity = 0;
    {
      absl::MutexLock lock(&s_->mu_);
      if (s_->shutting_down_)
        return absl::UnavailableError("coordinator is shutting down");
      position = static_cast<int>(
          std::find(s_->queue_.begin(), s_->queue_.end(), turn_id) -
          s_->queue_.begin());
      const bool head = position == 0;
      if (head && (!was_head || s_->capacity_epoch_ != tried_capacity)) {
        attempt = true;
        tried_capacity = s_->capacity_epoch_;
      }
      was_head = head;
      seen_queue = s_->queue_epoch_;
      seen_capacity = s_->capacity_epoch_;
    }
    bool client_gone = waiting && !show(position);
    if (attempt && !client_gone) {
      AdmittedTurn turn;
      Attempt a = TryAdmit(sid, reserve_tokens, prompt, &turn);
      if (a.kind == Attempt::kAdmitted) return turn;
      if (a.kind == Attempt::kFailed) {
        if (a.status.code() == absl::StatusCode::kResourceExhausted) {
          absl::MutexLock lock(&s_->mu_);
          s_->turns_refused_++;
        }
        return a.status;
      }
    }
    // The turn waits: show its position, then sleep until the queue or the
    // room changes (bounded, to notice a cancel and the timeout).
    if (!waiting) {
      waiting = true;
      {
        absl::MutexLock lock(&s_->mu_);
        s_->turns_queued_++;
      }
      KLOG(Info, kLog) << "session=" << sid << " turn queued at position "
                       << position;
      client_gone = !show(position);
    }
    if (client_gone || ctx->IsCancelled()) {
      absl::MutexLock lock(&s_->mu_);
      s_->turns_cancelled_queued_++;
      KLOG(Info, kLog) << "session=" << sid << " turn cancelled while queued";
      return absl::CancelledError("cancelled by the client while queued");
    }
    const absl::Duration waited = s_->Now() - enqueued;
    if (waited >= timeout) {
      absl::MutexLock lock(&s_->mu_);
      s_->turns_timed_out_++;
      KLOG(Info, kLog) << "session=" << sid << " turn timed out in the queue";
      return absl::ResourceExhaustedError(absl::StrCat(
          "the turn waited ", absl::ToInt64Milliseconds(waited),
          " ms in the admission queue without fitting (queue_timeout_ms ",
          absl::ToInt64Milliseconds(timeout),
          "): the devices or the rank's batch stayed full; retry later"));
    }
    absl::MutexLock lock(&s_->mu_);
    auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu_) {
      return s_->queue_epoch_ != seen_queue ||
             s_->capacity_epoch_ != seen_capacity || s_->shutting_down_;
    };
    s_->mu_.AwaitWithTimeout(absl::Condition(&changed), absl::Milliseconds(50));
  }
}

grpc::Status KaratService::Generate(
    grpc::ServerContext* ctx, const v1::GenerateRequest* req,
    grpc::ServerWriter<v1::GenerateResponse>* writer) {
  const absl::Time arrived = s_->Now();
  const std::string& sid = req->session_id();
  WaitForCancelledTurn(sid, absl::Milliseconds(200));
  std::vector<int32_t> prompt =
      req->prompt_tokens().empty()
          ? EncodeText(req->prompt())
          : std::vector<int32_t>(req->prompt_tokens().begin(),
                                 req->prompt_tokens().end());
  int reserve_tokens = 0;
  {
    absl::MutexLock lock(&s_->mu_);
    auto it = s_->sessions_.find(sid);
    if (it == s_->sessions_.end()) return NoSession(sid);
    absl::Status valid = Validate(*req);
    if (!valid.ok()) return ToGrpc(valid);
    Session& session = it->second;
    if (session.busy)
      return grpc::Status(
          grpc::StatusCode::FAILED_PRECONDITION,
          absl::StrCat("a generate is already running on session ", sid));
    if (s_->shutting_down_)
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "coordinator is shutting down");
    bool settling = false;  // then the turn waits in the queue
    if (absl::Status nodes = CheckNodesLocked(&settling);
        !nodes.ok() && !settling)
      return ToGrpc(nodes);
    session.busy = true;
    session.turn_ctx = ctx;
    reserve_tokens = static_cast<int>(session.history.size()) +
                     (session.history.empty() ? 1 : 0) +
                     static_cast<int>(prompt.size()) + req->max_new_tokens();
  }
  // Clears the busy flag however the handler ends.
  struct BusyGuard {
    State* s;
    std::string id;
    ~BusyGuard() {
      absl::MutexLock lock(&s->mu_);
      auto it = s->sessions_.find(id);
      if (it != s->sessions_.end()) {
        it->second.busy = false;
        it->second.turn_ctx = nullptr;
      }
    }
  } busy_guard{s_, sid};

  absl::StatusOr<AdmittedTurn> admitted =
      WaitForAdmission(ctx, writer, sid, reserve_tokens, prompt);
  if (!admitted.ok()) {
    KLOG(Info, kLog) << "session=" << sid
                     << " turn refused: " << admitted.status();
    return ToGrpc(admitted.status());
  }
  AdmittedTurn& turn = *admitted;
  // Leaves the rank's batch however the turn ends, and wakes queued turns.
  // Reads the turn's rank and GPU node at the end: a resumed turn moves.
  struct ActiveGuard {
    KaratService* service;
    State* s;
    const AdmittedTurn* turn;
    ~ActiveGuard() {
      bool push = false;
      const int rank = turn->rank;
      {
        absl::MutexLock lock(&s->mu_);
        s->active_generations_--;
        auto n = s->nodes_.find(turn->gpu_id);
        if (n != s->nodes_.end()) n->second.active_turns--;
        auto r = s->ranks_.find(rank);
        if (r != s->ranks_.end()) {
          r->second.running.erase(turn->key);
          push = s->RecomputeMicroBatchesLocked(rank);
        }
        s->capacity_epoch_++;
      }
      if (push) service->PostMicroBatchPush(rank);
    }
  } active_guard{this, s_, &turn};
  // Logs what the session gained however the turn ends (failed, cancelled),
  // before the client hears of it and before the session is idle again. A
  // finished turn is logged before its TurnDone instead.
  struct TurnLogGuard {
    KaratService* service;
    std::string sid;
    bool logged = false;
    ~TurnLogGuard() {
      if (logged) return;
      if (absl::Status st = service->LogTurn(sid); !st.ok()) {
        KLOG(Error, kLog) << "session=" << sid << " " << st.message();
      }
    }
  } log_guard{this, sid};

  cl::RunTurnRequest run;
  run.set_session(turn.key);
  run.set_seed(turn.seed);
  run.set_temperature(req->temperature());
  run.set_pos_start(turn.pos_start);
  run.mutable_feed_tokens()->Assign(turn.feed.begin(), turn.feed.end());
  run.set_max_new_tokens(req->max_new_tokens());
  if (!s_->gpu_only()) *run.mutable_placement() = turn.placement;
  run.mutable_prefill_ends()->Assign(turn.prefill_ends.begin(),
                                     turn.prefill_ends.end());

  int generated = 0;
  bool eos = false;
  int64_t ttft_us = 0;
  absl::Time previous = arrived;
  const int prefill_end = turn.pos_start + static_cast<int>(turn.feed.size());
  std::atomic<bool> client_cancelled{false};
  bool shutdown_cancel = false;
  grpc::Status gpu_status;
  int resumes = 0;
  // One RunTurn call per pass: the first, then one per resume on another
  // rank after a GPU rank was lost (DESIGN.md §7).
  for (;;) {
    grpc::ClientContext gpu_ctx;
    LossMarks at_start;
    {
      absl::MutexLock lock(&s_->mu_);
      if (s_->shutting_down_) gpu_ctx.TryCancel();
      s_->running_.insert(&gpu_ctx);
      // From here on SetMicroBatches pushes cover this turn; until now its
      // micro-batch travels in the request.
      auto r = s_->ranks_.find(turn.rank);
      if (r != s_->ranks_.end()) {
        auto t = r->second.running.find(turn.key);
        if (t != r->second.running.end()) {
          run.set_micro_batch(t->second.micro_batch);
          t->second.pushed_micro_batch = t->second.micro_batch;
          t->second.started = true;
        }
      }
      at_start.rank_removals = s_->rank_removals_;
      at_start.karat_losses = s_->karat_losses_;
      at_start.alive_ranks = s_->AliveRanksLocked();
    }
    KLOG(Info, kLog) << "session=" << sid
                     << (resumes > 0 ? " turn resumed on " : " turn on ")
                     << turn.gpu_name << " (rank " << turn.rank
                     << ", micro-batch " << run.micro_batch() << ")"
                     << (s_->gpu_only()
                             ? std::string(" gpu_only")
                             : absl::StrCat(
                                   " home=", turn.placement.node_name(), "/",
                                   turn.placement.device()))
                     << " pos_start=" << run.pos_start()
                     << " feed=" << run.feed_tokens_size()
                     << " max_new_tokens=" << run.max_new_tokens();

    // Watches for the client going away and cancels the GPU call.
    absl::Mutex watch_mu;
    bool turn_over = false;
    std::thread watcher([&] {
      absl::MutexLock lock(&watch_mu);
      while (!turn_over) {
        watch_mu.AwaitWithTimeout(absl::Condition(&turn_over),
                                  absl::Milliseconds(20));
        if (!turn_over && ctx->IsCancelled()) {
          client_cancelled = true;
          gpu_ctx.TryCancel();
          return;
        }
      }
    });

    auto stub = cl::GpuNode::NewStub(turn.gpu_channel);
    std::unique_ptr<grpc::ClientReader<cl::RunTurnEvent>> reader =
        stub->RunTurn(&gpu_ctx, run);
    cl::RunTurnEvent ev;
    // Sends `out` to the client; a client that went away cancels the GPU
    // node's turn (its remaining events are drained).
    auto relay = [&](const v1::GenerateResponse& out) {
      if (writer->Write(out)) return true;
      client_cancelled = true;
      gpu_ctx.TryCancel();
      while (reader->Read(&ev)) {
      }
      return false;
    };
    while (reader->Read(&ev)) {
      if (ev.progress()) {
        // A long feed is part way through: no token, nothing to record.
        v1::GenerateResponse out;
        v1::PrefillProgress* p = out.mutable_prefill();
        p->set_fed_tokens(ev.prefill_fed());
        p->set_total_tokens(ev.prefill_total());
        if (!relay(out)) break;
        continue;
      }
      generated++;
      absl::Time now = s_->Now();
      int64_t latency = absl::ToInt64Microseconds(now - previous);
      {
        absl::MutexLock lock(&s_->mu_);
        Session& session = s_->sessions_.at(sid);
        session.history.push_back(ev.token_id());
        session.kv_len = ev.kv_len();
        // The first token exists once the prefill is done.
        if (generated == 1 && (session.prefill_ends.empty() ||
                               session.prefill_ends.back() < prefill_end))
          session.prefill_ends.push_back(prefill_end);
        s_->tokens_generated_++;
        (generated == 1 ? s_->ttft_ms_ : s_->tbt_ms_).Add(latency / 1000.0);
        auto r = s_->ranks_.find(turn.rank);
        if (r != s_->ranks_.end()) {
          auto t = r->second.running.find(turn.key);
          if (t != r->second.running.end())
            t->second.context_tokens =
                static_cast<int64_t>(session.history.size());
          s_->AddStepLocked(r->second, ev);
        }
      }
      if (generated == 1) ttft_us = latency;
      previous = now;
      if (ev.token_id() == kEosToken) eos = true;
      v1::GenerateResponse out;
      v1::GeneratedToken* tok = out.mutable_token();
      tok->set_token_id(ev.token_id());
      tok->set_text(TokenText(ev.token_id()));
      tok->set_position(ev.position());
      tok->set_latency_us(latency);
      if (!relay(out)) break;
    }
    gpu_status = reader->Finish();
    {
      absl::MutexLock lock(&watch_mu);
      turn_over = true;
    }
    watcher.join();
    {
      absl::MutexLock lock(&s_->mu_);
      s_->running_.erase(&gpu_ctx);
      shutdown_cancel = s_->shutting_down_;
    }
    if (client_cancelled || ctx->IsCancelled()) {
      KLOG(Info, kLog) << "session=" << sid
                       << " turn cancelled by the client after " << generated
                       << " tokens";
      return grpc::Status(grpc::StatusCode::CANCELLED,
                          "cancelled by the client");
    }
    if (gpu_status.ok() || shutdown_cancel) break;
    // Every token arrived before the call broke: the turn is complete.
    if (eos || generated >= req->max_new_tokens()) {
      gpu_status = grpc::Status::OK;
      break;
    }
    KLOG(Warning, kLog) << "session=" << sid << " GPU node " << turn.gpu_name
                        << " (rank " << turn.rank << ") failed after "
                        << generated
                        << " tokens: " << gpu_status.error_message();
    grpc::StatusCode code = gpu_status.error_code();
    switch (code) {
      case grpc::StatusCode::INVALID_ARGUMENT:
      case grpc::StatusCode::RESOURCE_EXHAUSTED:
      case grpc::StatusCode::FAILED_PRECONDITION:
        break;
      default:
        code = grpc::StatusCode::UNAVAILABLE;
    }
    std::string why;
    if (code == grpc::StatusCode::UNAVAILABLE) {
      if (resumes >= kMaxTurnResumes) {
        why = absl::StrCat(" (resumed ", resumes, " times already, the most)");
      } else {
        const std::string failed_on =
            absl::StrCat(turn.gpu_name, " (rank ", turn.rank, ")");
        absl::StatusOr<bool> resumed =
            ResumeTurn(ctx, sid, generated, req->max_new_tokens() - generated,
                       at_start, &turn, &run);
        if (resumed.ok() && *resumed) {
          ++resumes;
          absl::MutexLock lock(&s_->mu_);
          s_->turns_resumed_++;
          KLOG(Info, kLog) << "session=" << sid << " resuming after "
                           << generated << " tokens: " << failed_on
                           << " failed, " << turn.gpu_name << " (rank "
                           << turn.rank << ") continues";
          continue;
        }
        if (!resumed.ok()) {
          if (resumed.status().code() == absl::StatusCode::kCancelled) {
            return grpc::Status(grpc::StatusCode::CANCELLED,
                                "cancelled by the client");
          }
          why = absl::StrCat(" (cannot resume: ", resumed.status().message(),
                             ")");
        }
      }
    }
    return grpc::Status(
        code, absl::StrCat("GPU node ", turn.gpu_name, " (rank ", turn.rank,
                           ") failed during the turn after ", generated,
                           " tokens: ", gpu_status.error_message(), why));
  }
  log_guard.logged = true;
  if (absl::Status st = LogTurn(sid); !st.ok()) {
    KLOG(Error, kLog) << "session=" << sid << " " << st.message();
    return grpc::Status(
        grpc::StatusCode::INTERNAL,
        absl::StrCat("the turn's tokens could not be logged: ", st.message()));
  }
  const int64_t total_us = absl::ToInt64Microseconds(s_->Now() - arrived);
  const std::string reason =
      !gpu_status.ok() ? "cancelled" : (eos ? "eos" : "length");
  v1::GenerateResponse done;
  v1::TurnDone* d = done.mutable_done();
  d->set_finish_reason(reason);
  d->set_prompt_tokens(static_cast<int32_t>(prompt.size()));
  d->set_generated_tokens(generated);
  d->set_ttft_us(ttft_us);
  d->set_total_us(total_us);
  writer->Write(done);
  KLOG(Info, kLog) << "session=" << sid << " turn done: " << reason << " "
                   << generated << " tokens, ttft_us=" << ttft_us
                   << " total_us=" << total_us
                   << (resumes > 0
                           ? absl::StrCat(", resumed ", resumes, " times")
                           : std::string());
  return grpc::Status::OK;
}

// ---------------------------------------------------------------------------

class CoordinatorImpl final : public Coordinator {
 public:
  explicit CoordinatorImpl(const Options& options)
      : state_(options),
        karat_(&state_),
        membership_(&state_),
        admin_(&state_),
        link_pusher_(&state_) {
    membership_.set_link_pusher(&link_pusher_);
    membership_.set_control_pusher(&control_pusher_);
    karat_.set_control_pusher(&control_pusher_);
  }
  ~CoordinatorImpl() override { Shutdown(absl::Seconds(5)); }

  absl::Status Init() {
    if (!state_.options().state_dir.empty()) {
      std::vector<LoggedSession> logged;
      std::optional<std::vector<cl::LinkConfig>> links;
      absl::StatusOr<std::unique_ptr<SessionLog>> wal =
          SessionLog::Open(state_.options().state_dir, &logged, &links);
      if (!wal.ok()) return wal.status();
      state_.wal_ = std::move(*wal);
      absl::MutexLock lock(&state_.mu_);
      if (links.has_value()) {
        // Set through the admin API before the restart: they replace the
        // config's, as they did then.
        KLOG(Info, kLog) << "state dir " << state_.options().state_dir << ": "
                         << links->size()
                         << " link rules restored (they replace the config's "
                         << state_.links_.size() << ")";
        state_.links_ = std::move(*links);
      }
      for (LoggedSession& l : logged) {
        // No home and no KV: the next turn places the session and rebuilds
        // its KV from the token log by prefill (TryAdmit).
        Session session;
        session.id = l.id;
        session.key = l.key;
        session.seed = l.seed;
        session.history = std::move(l.history);
        session.prefill_ends = std::move(l.prefill_ends);
        session.turns = l.turns;
        session.logged_tokens = session.history.size();
        session.logged_turns = session.turns;
        state_.session_keys_.insert(session.key);
        state_.sessions_.emplace(session.id, std::move(session));
      }
      KLOG(Info, kLog) << "state dir " << state_.options().state_dir << ": "
                       << logged.size() << " sessions restored";
    }
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort(state_.options().listen,
                             grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&karat_);
    builder.RegisterService(&membership_);
    builder.RegisterService(&admin_);
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || port == 0) {
      return absl::UnavailableError(
          absl::StrCat("cannot listen on ", state_.options().listen));
    }
    const std::string& listen = state_.options().listen;
    std::string host = listen.substr(0, listen.rfind(':'));
    address_ = absl::StrCat(host, ":", port);
    KLOG(Info, kLog) << "listening on " << address_;
    return absl::OkStatus();
  }

  std::string address() const override { return address_; }

  void Shutdown(absl::Duration deadline) override {
    {
      absl::MutexLock lock(&shutdown_mu_);
      if (shut_down_) return;
      shut_down_ = true;
    }
    {
      absl::MutexLock lock(&state_.mu_);
      state_.shutting_down_ = true;
      for (grpc::ClientContext* c : state_.running_) c->TryCancel();
    }
    if (server_) {
      server_->Shutdown(absl::ToChronoTime(absl::Now() + deadline));
      server_->Wait();
    }
    link_pusher_.Stop();
    rank_watcher_.Stop();
    control_pusher_.Stop();
    KLOG(Info, kLog) << "shut down";
  }

  void Wait() override {
    if (server_) server_->Wait();
  }

 private:
  State state_;
  KaratService karat_;
  MembershipService membership_;
  AdminService admin_;
  LinkPusher link_pusher_;
  ControlPusher control_pusher_;
  RankWatcher rank_watcher_{&state_, &control_pusher_};
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Start(
    const Options& options) {
  if (options.max_new_tokens_limit < 1)
    return absl::InvalidArgumentError("max_new_tokens_limit must be >= 1");
  if (options.node_timeout_ms < 1)
    return absl::InvalidArgumentError("node_timeout_ms must be >= 1");
  if (options.mode != "karat" && options.mode != "gpu_only")
    return absl::InvalidArgumentError(absl::StrCat(
        "mode must be \"karat\" or \"gpu_only\", got \"", options.mode, "\""));
  RETURN_IF_ERROR(ValidateSchedulingConfig(options.scheduling));
  for (const double v :
       {options.step_cost.fixed_ms, options.step_cost.per_request_ms,
        options.step_cost.per_context_token_ms}) {
    if (!(v >= 0) || std::isinf(v))
      return absl::InvalidArgumentError(
          "step_cost: every cost must be >= 0 and finite");
  }
  auto impl = std::make_unique<CoordinatorImpl>(options);
  absl::Status st = impl->Init();
  if (!st.ok()) return st;
  return std::unique_ptr<Coordinator>(std::move(impl));
}

}  // namespace karat::coordinator
