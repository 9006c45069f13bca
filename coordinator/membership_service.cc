#include "coordinator/membership_service.h"

namespace karat::coordinator {

grpc::Status MembershipService::RegisterNode(grpc::ServerContext*,
                                             const cl::RegisterNodeRequest* req,
                                             cl::RegisterNodeResponse* resp) {
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
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("node ", req->name(), ": grpc_address must not be empty"));
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
  s_->nodes_.emplace(n.id, std::move(n));
  s_->capacity_epoch_++;
  if (pusher_ != nullptr && !s_->links_.empty()) pusher_->Request();
  if (role == NodeRole::kGpu && control_ != nullptr) {
    State* s = s_;
    control_->Post("peers", [s] { PushPeers(s); });
  }
  return grpc::Status::OK;
}

grpc::Status MembershipService::Heartbeat(grpc::ServerContext*,
                                          const cl::HeartbeatRequest* req,
                                          cl::HeartbeatResponse* resp) {
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

}  // namespace karat::coordinator
