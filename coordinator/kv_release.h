// Freeing a session's KV on its home (KaratNode.FreeSession, in gpu_only
// mode GpuNode.FreeSession): when the session closes, when it stays idle
// past Options::idle_kv_evict (idle_evict.h), and when a turn would take
// its owner past max_kv_bytes (admission.cc). A session whose home is
// detached has no KV anywhere as far as the coordinator knows: its next
// turn places it again and rebuilds its KV from the token log by prefill,
// as after a coordinator restart.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <optional>
#include <string>

#include "coordinator/state.h"

namespace karat::coordinator {

// Where a session's KV lives, for the FreeSession call.
struct KvHome {
  uint64_t key = 0;  // the session's data-plane key
  std::string node_name;
  NodeRole role = NodeRole::kKarat;
  std::shared_ptr<grpc::Channel> channel;
};

// Forgets the session's home: no home, no KV stored (kv_len 0), no rank,
// none of its owner's KV bytes counted. Returns the node to free its KV
// on (nullopt when it had no home, or the node is no longer known).
std::optional<KvHome> DetachHomeLocked(State* s, Session* session)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_);

// The node holding the session's KV (nullopt without a home, or when the
// node is no longer known).
std::optional<KvHome> KvHomeLocked(const State* s, const Session& session)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_);

// FreeSession on `home` (a control call with Options::node_call_timeout_ms;
// makes an RPC: call without the lock). A failure is logged as a warning
// naming `why`, the node frees the pages when it restarts; the caller goes
// on either way.
void FreeKv(const State* s, const std::string& session_id, const KvHome& home,
            const char* why);

}  // namespace karat::coordinator
