#include "coordinator/karat_service.h"

#include <cmath>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/log_ids.h"
#include "common/status_macros.h"
#include "common/tokenizer.h"
#include "coordinator/kv_release.h"
#include "coordinator/client_requests.h"
#include "coordinator/turn_plan.h"
#include "security/tokens.h"

namespace karat::coordinator {

grpc::Status KaratService::CreateSession(grpc::ServerContext* ctx,
                                         const v1::CreateSessionRequest* req,
                                         v1::Session* resp) {
  absl::StatusOr<Caller> caller = Authenticate(*ctx);
  if (!caller.ok()) return ToGrpc(caller.status());
  absl::MutexLock lock(&s_->mu_);
  if (s_->shutting_down_)
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "coordinator is shutting down");
  if (absl::Status quota =
          s_->quotas_.OpenSession(caller->principal, caller->limits, s_->Now());
      !quota.ok()) {
    KLOG(Info, kLog) << "session refused: " << quota.message();
    return ToGrpc(quota);
  }
  Session session;
  do {
    session.id = absl::StrFormat("s-%016x", absl::Uniform<uint64_t>(s_->rng_));
  } while (s_->sessions_.count(session.id));
  do {
    session.key = absl::Uniform<uint64_t>(s_->rng_);
  } while (session.key == 0 || s_->session_keys_.count(session.key));
  session.seed = req->seed();
  session.owner = caller->principal;
  s_->session_keys_.insert(session.key);
  FillSession(session, false, resp);
  if (s_->wal_ != nullptr) {
    // Under the lock: nothing else knows the session yet, and the log's
    // order is the table's. The client hears of it once it is on disk.
    cl::WalRecord record;
    record.mutable_created()->set_id(session.id);
    record.mutable_created()->set_key(session.key);
    record.mutable_created()->set_seed(session.seed);
    record.mutable_created()->set_owner(session.owner);
    if (absl::Status st = s_->wal_->Append(record); !st.ok()) {
      s_->session_keys_.erase(session.key);
      s_->quotas_.CloseSession(session.owner, session.id);
      KLOG(Error, kLog) << "session=" << security::ShortId(session.id)
                        << " not created: " << st.message();
      return grpc::Status(
          grpc::StatusCode::INTERNAL,
          absl::StrCat("cannot log the session: ", st.message()));
    }
  }
  KLOG(Info, kLog) << "session=" << security::ShortId(session.id)
                   << " created seed=" << session.seed
                   << " key=" << ShortKey(session.key)
                   << (session.owner.empty()
                           ? std::string()
                           : absl::StrCat(" owner=", session.owner));
  s_->sessions_.emplace(session.id, std::move(session));
  return grpc::Status::OK;
}

grpc::Status KaratService::GetSession(grpc::ServerContext* ctx,
                                      const v1::GetSessionRequest* req,
                                      v1::Session* resp) {
  absl::StatusOr<Caller> caller = Authenticate(*ctx);
  if (!caller.ok()) return ToGrpc(caller.status());
  if (absl::Status valid = ValidateGetSessionRequest(*req); !valid.ok())
    return ToGrpc(valid);
  {
    absl::MutexLock lock(&s_->mu_);
    if (OwnedLocked(req->session_id(), *caller) == nullptr)
      return NoSession(req->session_id());
  }
  WaitForCancelledTurn(req->session_id(), absl::Milliseconds(50));
  absl::MutexLock lock(&s_->mu_);
  const Session* session = OwnedLocked(req->session_id(), *caller);
  if (session == nullptr) return NoSession(req->session_id());
  FillSession(*session, req->include_tokens(), resp);
  return grpc::Status::OK;
}

grpc::Status KaratService::CloseSession(grpc::ServerContext* ctx,
                                        const v1::CloseSessionRequest* req,
                                        v1::CloseSessionResponse*) {
  absl::StatusOr<Caller> caller = Authenticate(*ctx);
  if (!caller.ok()) return ToGrpc(caller.status());
  if (absl::Status valid = ValidateCloseSessionRequest(*req); !valid.ok())
    return ToGrpc(valid);
  const std::string& sid = req->session_id();
  {
    absl::MutexLock lock(&s_->mu_);
    if (OwnedLocked(sid, *caller) == nullptr) return NoSession(sid);
  }
  WaitForCancelledTurn(sid, absl::Milliseconds(200));
  // A turn still running ends first (its call gets ABORTED); no new one
  // starts meanwhile.
  {
    absl::MutexLock lock(&s_->mu_);
    Session* session = OwnedLocked(sid, *caller);
    if (session == nullptr || session->closing) return NoSession(sid);
    session->closing = true;
  }
  const bool stopped = StopRunningTurn(sid, absl::Seconds(10));
  std::optional<KvHome> home;
  {
    absl::MutexLock lock(&s_->mu_);
    auto it = s_->sessions_.find(sid);
    if (it == s_->sessions_.end()) return NoSession(sid);
    if (!stopped) {
      it->second.closing = false;
      return grpc::Status(
          grpc::StatusCode::FAILED_PRECONDITION,
          absl::StrCat("the turn running on session ", sid,
                       " did not end within 10 s; retry the close"));
    }
    if (s_->wal_ != nullptr) {
      cl::WalRecord record;
      record.mutable_closed()->set_id(sid);
      if (absl::Status st = s_->wal_->Append(record); !st.ok()) {
        KLOG(Error, kLog) << "session=" << security::ShortId(sid)
                          << " not closed: " << st.message();
        it->second.closing = false;
        return grpc::Status(
            grpc::StatusCode::INTERNAL,
            absl::StrCat("cannot log the close: ", st.message()));
      }
    }
    home = DetachHomeLocked(s_, &it->second);
    s_->quotas_.CloseSession(it->second.owner, sid);
    s_->session_keys_.erase(it->second.key);
    s_->sessions_.erase(it);
    // Its pages are about to be freed: queued turns may fit.
    s_->capacity_epoch_++;
  }
  KLOG(Info, kLog) << "session=" << security::ShortId(sid) << " closed";
  if (home.has_value()) {
    // The session is closed either way; the node frees the pages when it
    // restarts or when it learns the session is gone.
    FreeKv(s_, sid, *home, "close");
    absl::MutexLock lock(&s_->mu_);
    s_->capacity_epoch_++;
  }
  return grpc::Status::OK;
}

grpc::Status KaratService::GetClusterStatus(grpc::ServerContext* ctx,
                                            const v1::GetClusterStatusRequest*,
                                            v1::ClusterStatus* resp) {
  absl::StatusOr<Caller> caller = Authenticate(*ctx);
  if (!caller.ok()) return ToGrpc(caller.status());
  absl::MutexLock lock(&s_->mu_);
  absl::Time now = s_->Now();
  for (const auto& [id, n] : s_->nodes_) {
    v1::NodeStatus* ns = resp->add_nodes();
    ns->set_name(n.name);
    ns->set_role(RoleName(n.role));
    ns->set_grpc_address(n.grpc_address);
    ns->set_provider(n.provider);
    ns->set_alive(s_->AliveLocked(n));
    ns->set_last_heartbeat_ms_ago(absl::ToInt64Milliseconds(now - n.last_seen));
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

void KaratService::FillStatsLocked(
    absl::Time now, google::protobuf::Map<std::string, double>* stats) const
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
  m["coordinator_stalls"] = double(s_->stalls_);
  if (s_->wal_ != nullptr) {
    m["wal_bytes"] = double(s_->wal_->bytes());
    m["wal_compactions"] = double(s_->wal_->compactions());
    m["wal_compaction_failures"] = double(s_->wal_->compaction_failures());
  }
  m["gpu_ranks_lost"] = double(s_->gpu_ranks_lost_);
  m["karat_nodes_lost"] = double(s_->karat_losses_);
  m["sessions_rehomed"] = double(s_->sessions_rehomed_);
  m["kv_evictions"] = double(s_->kv_evictions_);
  for (QuotaKind kind : kQuotaKinds)
    m[absl::StrCat("quota_refusals_", QuotaKindName(kind))] =
        double(s_->quotas_.refusals(kind));
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

grpc::Status KaratService::NoSession(const std::string& id) {
  // An id is "s-" and 16 hex digits: a longer one is shown in part (it
  // could be megabytes, too many for a status).
  constexpr size_t kShown = 40;
  const std::string shown =
      id.size() <= kShown
          ? id
          : absl::StrCat(id.substr(0, kShown), "... (", id.size(), " bytes)");
  return grpc::Status(
      grpc::StatusCode::NOT_FOUND,
      absl::StrCat("no session \"", shown, "\" (unknown or closed)"));
}

absl::StatusOr<Caller> KaratService::Authenticate(
    const grpc::ServerContext& ctx) const {
  return s_->auth_->Client(ctx);
}

Session* KaratService::OwnedLocked(const std::string& id,
                                   const Caller& caller) const {
  auto it = s_->sessions_.find(id);
  if (it == s_->sessions_.end() || it->second.owner != caller.principal)
    return nullptr;
  return &it->second;
}

void KaratService::FillSession(const Session& s, bool tokens,
                               v1::Session* out) const
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
        session.logged_turns == session.turns && session.last_turn_logged)
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
    // Always the latest turn as it is now (empty: none a retry can name).
    if (session.last_turn.has_value()) {
      *turn->mutable_last_turn() = *session.last_turn;
    } else {
      turn->mutable_last_turn();
    }
    session.logged_tokens = session.history.size();
    session.logged_turns = session.turns;
    session.last_turn_logged = true;
  }
  absl::Status st = s_->wal_->Append(record);
  if (!st.ok()) {
    // Not on disk: the session's next record carries these tokens too.
    absl::MutexLock lock(&s_->mu_);
    auto it = s_->sessions_.find(sid);
    if (it != s_->sessions_.end()) {
      it->second.logged_tokens = logged_tokens;
      it->second.logged_turns = logged_turns;
      it->second.last_turn_logged = false;
    }
  }
  return st;
}

bool KaratService::StopRunningTurn(const std::string& sid,
                                   absl::Duration timeout) {
  const absl::Time give_up = absl::Now() + timeout;
  absl::MutexLock lock(&s_->mu_);
  for (;;) {
    auto it = s_->sessions_.find(sid);
    if (it == s_->sessions_.end() || !it->second.busy) return true;
    if (it->second.stop_turn != nullptr) it->second.stop_turn->store(true);
    if (absl::Now() >= give_up) return false;
    s_->mu_.AwaitWithTimeout(
        absl::Condition(
            +[](Session* s) { return !s->busy; }, &it->second),
        absl::Milliseconds(20));
  }
}

absl::Status KaratService::LogTurnStart(const std::string& sid,
                                        const cl::LastTurn& turn) {
  if (s_->wal_ == nullptr) return absl::OkStatus();
  cl::WalRecord record;
  record.mutable_started()->set_id(sid);
  *record.mutable_started()->mutable_turn() = turn;
  return s_->wal_->Append(record);
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
    grpc::Status& st = status[&t - targets.data()];
    st = t.role == NodeRole::kGpu
             ? cl::GpuNode::NewStub(t.channel)->GetStats(&ctx, req, &resp)
             : cl::KaratNode::NewStub(t.channel)->GetStats(&ctx, req, &resp);
    // Another process at the same address (restarted, not registered as
    // this incarnation) is not the node: the one known is gone.
    if (st.ok() && resp.node_id() != t.id) {
      st = grpc::Status(
          grpc::StatusCode::UNAVAILABLE,
          absl::StrCat("the process at its address is registered as ",
                       resp.node_id() == 0
                           ? std::string("no node yet")
                           : absl::StrCat("node id ", resp.node_id()),
                       ", not as node id ", t.id, " (restarted)"));
    }
  });
  bool gpu_lost = false;
  absl::MutexLock lock(&s_->mu_);
  for (size_t i = 0; i < targets.size(); ++i) {
    const Target& t = targets[i];
    // A node that answers, even with an error (or too late: it may be
    // busy or stopped; its heartbeats decide), is there.
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

void KaratService::PostMicroBatchPush(int rank) {
  if (control_ == nullptr) return;
  State* s = s_;
  control_->Post(absl::StrCat("micro_batches/", rank),
                 [s, rank] { PushMicroBatches(s, rank); });
}

}  // namespace karat::coordinator
