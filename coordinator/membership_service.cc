#include "coordinator/membership_service.h"

#include "coordinator/register_request.h"

namespace karat::coordinator {

grpc::Status MembershipService::RegisterNode(grpc::ServerContext* ctx,
                                             const cl::RegisterNodeRequest* req,
                                             cl::RegisterNodeResponse* resp) {
  // Only the daemon the cluster's CA certified under this name registers
  // it (docs/security.md).
  if (absl::Status who = s_->auth_->Daemon(
          *ctx, req->name(), absl::StrCat("RegisterNode of ", req->name()));
      !who.ok())
    return ToGrpc(who);
  absl::StatusOr<NodeRole> checked =
      ValidateRegisterNodeRequest(*req, s_->gpu_only());
  if (!checked.ok()) return ToGrpc(checked.status());
  const NodeRole role = *checked;
  if (role == NodeRole::kGpu && req->model_fingerprint().empty())
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("node ", req->name(),
                     ": a GPU node must send its model_fingerprint"));
  auto channel =
      grpc::CreateChannel(req->grpc_address(), s_->node_credentials_);
  absl::MutexLock lock(&s_->mu_);
  if (role == NodeRole::kGpu) {
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
  }
  s_->NoteStallLocked();
  for (auto it = s_->nodes_.begin(); it != s_->nodes_.end(); ++it) {
    if (it->second.name != req->name()) continue;
    RetireIncarnationLocked(it->first, it->second);
    s_->nodes_.erase(it);
    break;
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
  if (role == NodeRole::kGpu && n.devices.empty() && n.kv_capacity_bytes > 0) {
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
  resp->set_data_plane_secret(s_->data_plane_secret_);
  s_->nodes_.emplace(n.id, std::move(n));
  s_->capacity_epoch_++;
  // Every node learns the new table of node ids, names and roles, rules or
  // not: a KARAT node takes data-plane hellos only from the GPU nodes it
  // names (docs/security.md "Data plane").
  if (pusher_ != nullptr) pusher_->Request();
  if (role == NodeRole::kGpu && control_ != nullptr) {
    State* s = s_;
    control_->Post("peers", [s] { PushPeers(s); });
  }
  return grpc::Status::OK;
}

grpc::Status MembershipService::Heartbeat(grpc::ServerContext* ctx,
                                          const cl::HeartbeatRequest* req,
                                          cl::HeartbeatResponse* resp) {
  if (absl::Status who = s_->auth_->Daemon(
          *ctx, req->name(), absl::StrCat("Heartbeat of ", req->name()));
      !who.ok())
    return ToGrpc(who);
  absl::MutexLock lock(&s_->mu_);
  s_->NoteStallLocked();
  auto it = s_->nodes_.find(req->node_id());
  if (it == s_->nodes_.end() ||
      (!req->name().empty() && it->second.name != req->name())) {
    resp->set_known(false);
    return grpc::Status::OK;
  }
  Node& n = it->second;
  // A node taken for lost (silent past node_timeout_ms, or a probe found it
  // gone) stays lost: its turns resumed elsewhere. It registers again as a
  // new incarnation, dropping what it held.
  if (!s_->AliveLocked(n)) {
    KLOG(Warning, kLog) << "node " << n.name << " (id " << n.id
                        << ") answers again after it was taken for lost; "
                           "it registers again";
    resp->set_known(false);
    return grpc::Status::OK;
  }
  if (req->devices_size() > 0)
    n.devices.assign(req->devices().begin(), req->devices().end());
  for (const auto& [k, v] : req->stats()) n.stats[k] = v;
  n.last_seen = s_->Now();
  resp->set_known(true);
  return grpc::Status::OK;
}

void MembershipService::RetireIncarnationLocked(uint32_t id, const Node& old) {
  if (!s_->AliveLocked(old)) {
    KLOG(Info, kLog) << "node " << old.name << " registered again; id " << id
                     << " retired";
    return;
  }
  // Registering under the name of a node taken for alive: the process was
  // restarted faster than its heartbeats ran out. The old incarnation is
  // lost now, exactly as if they had (its turns resume, its KV is gone).
  KLOG(Warning, kLog) << "node " << old.name << " registered again while id "
                      << id
                      << " was alive: a new incarnation; the old one is lost";
  s_->capacity_epoch_++;
  if (old.role == NodeRole::kGpu) {
    s_->gpu_ranks_lost_++;
    s_->CancelTurnsOnLocked(id);
    return;
  }
  s_->karat_losses_++;
  if (control_ != nullptr) {
    State* s = s_;
    control_->Post(absl::StrCat("karat_lost/", id),
                   [s, id, name = old.name, address = old.fabric_address] {
                     PushKaratNodeLost(s, id, name, address);
                   });
  }
}

}  // namespace karat::coordinator
