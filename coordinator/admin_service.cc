#include "coordinator/admin_service.h"

#include "absl/strings/str_join.h"
#include "common/link_rules.h"
#include "common/process_fault.h"
#include "coordinator/control_push.h"

namespace karat::coordinator {

grpc::Status AdminService::SetLink(grpc::ServerContext*,
                                   const cl::SetLinkRequest* req,
                                   cl::SetLinkResponse* resp) {
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
                            absl::StrCat("no link rule ", link.source(), " -> ",
                                         link.destination()));
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
      if (absl::Status st = s_->wal_->Append(LinkRulesRecord(next)); !st.ok()) {
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

grpc::Status AdminService::GetLinks(grpc::ServerContext*,
                                    const cl::GetLinksRequest*,
                                    cl::GetLinksResponse* resp) {
  absl::MutexLock lock(&s_->mu_);
  for (const auto& l : s_->links_) *resp->add_links() = l;
  resp->set_seed(s_->options().link_seed);
  return grpc::Status::OK;
}

grpc::Status AdminService::InjectProcessFault(
    grpc::ServerContext*, const cl::ProcessFaultRequest* req,
    cl::ProcessFaultResponse* resp) {
  if (absl::Status valid = ValidateProcessFault(req->action(), req->pause_ms());
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
                      << (st.ok()
                              ? std::string()
                              : absl::StrCat(" failed: ", st.error_message()));
  return st;
}

}  // namespace karat::coordinator
