// karat.cluster.Coordinator: nodes register (RegisterNode) and send
// heartbeats (Heartbeat); the table of nodes lives in the State.
#pragma once

#include "coordinator/control_push.h"
#include "coordinator/state.h"

namespace karat::coordinator {

class MembershipService final : public cl::Coordinator::Service {
 public:
  explicit MembershipService(State* state) : s_(state) {}

  // Told after every registration (pushes the link table; GPU peers).
  void set_link_pusher(LinkPusher* pusher) { pusher_ = pusher; }
  void set_control_pusher(ControlPusher* pusher) { control_ = pusher; }

  grpc::Status RegisterNode(grpc::ServerContext*,
                            const cl::RegisterNodeRequest* req,
                            cl::RegisterNodeResponse* resp) override;

  grpc::Status Heartbeat(grpc::ServerContext*, const cl::HeartbeatRequest* req,
                         cl::HeartbeatResponse* resp) override;

 private:
  // A node registers under the name of node `id`: that incarnation is
  // retired, and taken for lost if it was still taken for alive.
  void RetireIncarnationLocked(uint32_t id, const Node& old)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu_);

  State* s_;
  LinkPusher* pusher_ = nullptr;
  ControlPusher* control_ = nullptr;
};

}  // namespace karat::coordinator
