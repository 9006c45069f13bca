// karat.cluster.Admin on the coordinator's port: link emulation at run
// time (SetLink, GetLinks) and process faults forwarded to nodes
// (InjectProcessFault).
#pragma once

#include "coordinator/state.h"

namespace karat::coordinator {

class AdminService final : public cl::Admin::Service {
 public:
  explicit AdminService(State* state) : s_(state) {}

  grpc::Status SetLink(grpc::ServerContext*, const cl::SetLinkRequest* req,
                       cl::SetLinkResponse* resp) override;

  grpc::Status GetLinks(grpc::ServerContext*, const cl::GetLinksRequest*,
                        cl::GetLinksResponse* resp) override;

  grpc::Status InjectProcessFault(grpc::ServerContext*,
                                  const cl::ProcessFaultRequest* req,
                                  cl::ProcessFaultResponse* resp) override;

 private:
  State* s_;
};

}  // namespace karat::coordinator
