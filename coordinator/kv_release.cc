#include "coordinator/kv_release.h"

#include "coordinator/control_push.h"
#include "security/tokens.h"

namespace karat::coordinator {

std::optional<KvHome> KvHomeLocked(const State* s, const Session& session) {
  if (!session.has_home) return std::nullopt;
  auto n = s->nodes_.find(session.home.node_id);
  if (n == s->nodes_.end()) return std::nullopt;
  KvHome home;
  home.key = session.key;
  home.node_name = n->second.name;
  home.role = n->second.role;
  home.channel = n->second.channel;
  return home;
}

std::optional<KvHome> DetachHomeLocked(State* s, Session* session) {
  std::optional<KvHome> home = KvHomeLocked(s, *session);
  session->has_home = false;
  session->home = HomeDevice();
  session->rank = -1;
  session->kv_len = 0;
  s->quotas_.SetKv(session->owner, session->id, 0);
  return home;
}

void FreeKv(const State* s, const std::string& session_id, const KvHome& home,
            const char* why) {
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(s));
  cl::FreeSessionRequest req;
  req.set_session(home.key);
  cl::FreeSessionResponse resp;
  grpc::Status st =
      home.role == NodeRole::kGpu
          ? cl::GpuNode::NewStub(home.channel)->FreeSession(&ctx, req, &resp)
          : cl::KaratNode::NewStub(home.channel)->FreeSession(&ctx, req, &resp);
  if (!st.ok()) {
    KLOG(Warning, kLog) << "session=" << security::ShortId(session_id)
                        << " FreeSession on " << home.node_name << " (" << why
                        << ") failed: " << st.error_message();
  }
}

}  // namespace karat::coordinator
