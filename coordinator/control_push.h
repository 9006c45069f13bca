// The coordinator's pushes to its nodes, made in the background so that no
// client stream and no lock waits on a node: the rank table and expert
// ownership (GpuNode.SetPeers), micro-batches (SetMicroBatches), lost KARAT
// nodes (KaratNodeLost) and link rules (SetLinks); the watcher that keeps
// the rank table in step with the alive ranks; and the KV reservation and
// home bookkeeping shared by admission and resumption.
#pragma once

#include <chrono>

#include "coordinator/state.h"

namespace karat::coordinator {

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

// The deadline of a control call to a node (Options::node_call_timeout_ms).
std::chrono::system_clock::time_point Deadline(const State* s);

// Pushes every alive GPU rank's address and the expert ownership over the
// alive ranks (GpuNode.SetPeers) to every alive GPU node, and records which
// nodes acknowledged it. A node that cannot take the experts it is given
// (its emulated HBM) refuses, and turns are refused with its message until
// the ranks change (DESIGN.md §7).
void PushPeers(State* s);

// Reserves KV room for `tokens` positions of session `key` on a home: a
// KARAT node's `device`, or in gpu_only mode the GPU rank (device 0) whose
// node `channel` reaches.
// `turn_epoch` fences the session's older turns off on that home;
// `kv_tokens` are the positions the coordinator counts as stored there
// (anything beyond is cut: ReserveResponse.kv_dropped says when all of it
// had to go).
grpc::Status ReserveKv(const State* s,
                       const std::shared_ptr<grpc::Channel>& channel,
                       uint64_t key, int device, int tokens,
                       uint64_t turn_epoch, int kv_tokens,
                       cl::ReserveResponse* resp);

// Makes `home` on node `n` the session's home (in gpu_only mode with the
// session on `rank`), after a Reserve there answered `used_bytes`.
void SetHomeLocked(State* s, Session* session, Node* n, const HomeDevice& home,
                   int rank, int64_t used_bytes)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_);

// Tells every alive GPU node that the KARAT node `name` at
// `fabric_address` is lost (GpuNode.KaratNodeLost), so that the attention
// outputs they still await from it fail at once.
void PushKaratNodeLost(State* s, uint32_t node_id, const std::string& name,
                       const std::string& fabric_address);

// Takes every registered KARAT node that is no longer alive for lost, once:
// counts it (State::karat_losses_) and posts a KaratNodeLost push for it.
void NoteLostKaratNodesLocked(State* s, ControlPusher* pusher)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_);

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
        s_->NoteStallLocked();
        NoteLostKaratNodesLocked(s_, pusher_);
        // A GPU node that stopped being alive may hang (stopped, not dead):
        // its turns' calls end now, so that they resume on the alive ranks.
        for (auto& [id, n] : s_->nodes_) {
          if (n.role != NodeRole::kGpu) continue;
          const bool alive = s_->AliveLocked(n);
          if (!alive && !n.calls_cancelled) s_->CancelTurnsOnLocked(id);
          n.calls_cancelled = !alive;
        }
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
void PushMicroBatches(State* s, int rank);

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
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_);

// Sends `req` to every target, all at once; returns "name: reason" for each
// failure (in the order of `targets`), and in `*unreachable` (optional)
// whether a target could not be reached (UNAVAILABLE, DEADLINE_EXCEEDED).
std::vector<std::string> PushLinks(const State* s,
                                   const cl::SetLinksRequest& req,
                                   const std::vector<LinkPushTarget>& targets,
                                   bool* unreachable = nullptr);

// Pushes the table in the background after every registration (a node that
// just registered, and the KARAT nodes that must learn its id, name and
// role before they take its data-plane hello), rules or not. A push that
// could not reach an alive node is made again, after 1 s doubling up to
// 30 s, until one reaches every alive node.
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
    absl::Duration retry = kFirstRetry;
    bool retrying = false;
    for (;;) {
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return pending_ || stop_;
        };
        if (retrying) {
          mu_.AwaitWithTimeout(absl::Condition(&ready), retry);
        } else {
          mu_.Await(absl::Condition(&ready));
        }
        if (stop_) return;
        if (pending_) retry = kFirstRetry;
        pending_ = false;
      }
      // Give a node that just registered a moment to serve its RPCs.
      absl::SleepFor(absl::Milliseconds(100));
      std::vector<LinkPushTarget> targets;
      cl::SetLinksRequest req;
      {
        absl::MutexLock lock(&s_->mu_);
        req = LinkPushLocked(s_, &targets);
      }
      bool unreachable = false;
      PushLinks(s_, req, targets, &unreachable);
      retrying = unreachable;
      if (retrying) retry = std::min(retry * 2, kLastRetry);
    }
  }

  static constexpr absl::Duration kFirstRetry = absl::Milliseconds(500);
  static constexpr absl::Duration kLastRetry = absl::Seconds(30);

  State* const s_;
  absl::Mutex mu_;
  bool pending_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace karat::coordinator
