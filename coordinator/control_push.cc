#include "coordinator/control_push.h"

#include "absl/strings/str_join.h"

namespace karat::coordinator {

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
// `turn_epoch` fences the session's older turns off on that home;
// `kv_tokens` are the positions the coordinator counts as stored there
// (anything beyond is cut: ReserveResponse.kv_dropped says when all of it
// had to go).
grpc::Status ReserveKv(const State* s,
                       const std::shared_ptr<grpc::Channel>& channel,
                       uint64_t key, int device, int tokens,
                       uint64_t turn_epoch, int kv_tokens,
                       cl::ReserveResponse* resp) {
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(s));
  cl::ReserveRequest req;
  req.set_session(key);
  req.set_device(device);
  req.set_tokens(tokens);
  req.set_turn_epoch(turn_epoch);
  req.set_kv_tokens(kv_tokens);
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
void PushKaratNodeLost(State* s, uint32_t node_id, const std::string& name,
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
  req.set_node_id(node_id);
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
                   [s, id, name = n.name, address = n.fabric_address] {
                     PushKaratNodeLost(s, id, name, address);
                   });
    }
  }
}

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

// Builds the request and the alive targets. Requires s->mu_.
cl::SetLinksRequest LinkPushLocked(State* s,
                                   std::vector<LinkPushTarget>* targets)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) {
  cl::SetLinksRequest req;
  for (const auto& l : s->links_) *req.add_links() = l;
  req.set_seed(s->options().link_seed);
  for (const auto& [id, n] : s->nodes_) {
    (*req.mutable_node_names())[id] = n.name;
    (*req.mutable_node_roles())[id] = RoleName(n.role);
    if (s->AliveLocked(n)) targets->push_back({n.name, n.role, n.channel});
  }
  return req;
}

// Sends `req` to every target; returns "name: reason" for each failure.
std::vector<std::string> PushLinks(const State* s,
                                   const cl::SetLinksRequest& req,
                                   const std::vector<LinkPushTarget>& targets,
                                   bool* unreachable) {
  // In parallel, so that a node that hangs holds back none of the others
  // (a KARAT node takes a new GPU node's hello only once it has the table).
  std::vector<grpc::Status> outcome(targets.size());
  std::vector<size_t> index(targets.size());
  for (size_t i = 0; i < index.size(); ++i) index[i] = i;
  ForEachConcurrently(index, [&](size_t i) {
    const LinkPushTarget& t = targets[i];
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(s));
    cl::SetLinksResponse resp;
    if (t.role == NodeRole::kGpu) {
      outcome[i] = cl::GpuNode::NewStub(t.channel)->SetLinks(&ctx, req, &resp);
    } else {
      outcome[i] =
          cl::KaratNode::NewStub(t.channel)->SetLinks(&ctx, req, &resp);
    }
  });
  std::vector<std::string> failed;
  if (unreachable != nullptr) *unreachable = false;
  for (size_t i = 0; i < targets.size(); ++i) {
    const grpc::Status& st = outcome[i];
    if (st.ok()) continue;
    KLOG(Warning, kLog) << "cannot push link settings to " << targets[i].name
                        << ": " << st.error_message();
    failed.push_back(absl::StrCat(targets[i].name, ": ", st.error_message()));
    if (unreachable != nullptr &&
        (st.error_code() == grpc::StatusCode::UNAVAILABLE ||
         st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED))
      *unreachable = true;
  }
  return failed;
}

}  // namespace karat::coordinator
