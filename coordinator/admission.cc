// Admission of a turn (KaratService::TryAdmit, WaitForAdmission): the queue,
// the rank's batch cap and the KV reservation on the session's home.
#include "common/tokenizer.h"
#include "coordinator/karat_service.h"
#include "coordinator/kv_release.h"
#include "security/tokens.h"

namespace karat::coordinator {

KaratService::Attempt KaratService::TryAdmit(
    const std::string& session_id, const cluster::ClientLimits& limits,
    int tokens, const std::vector<int32_t>& prompt, bool new_turn,
    AdmittedTurn* turn) {
  const std::string log_id = security::ShortId(session_id);
  struct Try {
    HomeDevice home;
    int rank = 0;
    std::string name;
    std::shared_ptr<grpc::Channel> channel;
  };
  std::vector<Try> tries;
  uint64_t key = 0;
  bool replacing = false;
  const bool gpu_only = s_->gpu_only();
  int karat_rank = -1;
  int kv_tokens = 0;
  uint64_t epoch = 0;
  {
    absl::MutexLock lock(&s_->mu_);
    epoch = s_->NewEpochLocked();
    bool settling = false;
    if (absl::Status nodes = CheckNodesLocked(&settling); !nodes.ok())
      return {settling ? Attempt::kWait : Attempt::kFailed, nodes};
    Session& session = s_->sessions_.at(session_id);
    // Its KV is being freed (idle eviction): it is placed again once that
    // is done.
    if (session.evicting) return {Attempt::kWait, absl::OkStatus()};
    key = session.key;
    kv_tokens = session.kv_len;
    const int64_t context =
        static_cast<int64_t>(session.history.size() + prompt.size()) +
        (session.history.empty() ? 1 : 0);
    // Ranks with room, fewest running requests first (ties: lower rank).
    std::vector<std::pair<int, int>> ranks;  // (running, rank)
    const int rank_count = s_->RankCountLocked();
    for (int r = 0; r < rank_count; ++r) {
      if (s_->RankNodeLocked(r) == nullptr) continue;  // lost
      auto it = s_->ranks_.find(r);
      const int running =
          it == s_->ranks_.end() ? 0 : it->second.running.size();
      ranks.emplace_back(running, r);
    }
    if (ranks.empty()) return {Attempt::kWait, absl::OkStatus()};
    std::sort(ranks.begin(), ranks.end());
    auto has_room = [&](int r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu_) {
      auto it = s_->ranks_.find(r);
      const int running =
          it == s_->ranks_.end() ? 0 : it->second.running.size();
      return running < s_->RankCapLocked(r, context);
    };
    if (gpu_only) {
      // The KV lives on the rank: a session sticks to it.
      std::vector<int> candidates;
      if (session.has_home && session.rank >= 0) {
        Node* n = s_->RankNodeLocked(session.rank);
        if (n != nullptr && n->id == session.home.node_id) {
          candidates.push_back(session.rank);
        } else {
          replacing = true;
          kv_tokens = 0;
          KLOG(Warning, kLog)
              << "session=" << log_id << " rank " << session.rank
              << " lost its KV; placing the session again";
        }
      }
      if (candidates.empty())
        for (const auto& [running, r] : ranks) candidates.push_back(r);
      for (int r : candidates) {
        if (!has_room(r)) continue;
        Node* n = s_->RankNodeLocked(r);
        HomeDevice h{n->id, 0};
        tries.push_back({h, r, n->name, n->channel});
      }
      if (tries.empty()) return {Attempt::kWait, absl::OkStatus()};
    } else {
      if (!has_room(ranks.front().second))
        return {Attempt::kWait, absl::OkStatus()};
      karat_rank = ranks.front().second;
      if (session.has_home) {
        auto n = s_->nodes_.find(session.home.node_id);
        if (n != s_->nodes_.end() && s_->AliveLocked(n->second)) {
          tries.push_back(
              {session.home, karat_rank, n->second.name, n->second.channel});
        } else {
          // The home node is gone: place again and rebuild the KV from the
          // token log by prefill (DESIGN.md §7).
          replacing = true;
          kv_tokens = 0;
          KLOG(Warning, kLog)
              << "session=" << log_id << " home node " << session.home.node_id
              << " is not alive; placing the session again";
        }
      }
      if (tries.empty()) {
        for (const HomeDevice& h : ChooseHomeDevices(s_->SnapshotLocked())) {
          const Node& n = s_->nodes_.at(h.node_id);
          tries.push_back({h, karat_rank, n.name, n.channel});
        }
      }
    }
  }
  absl::Status other_error;
  bool not_now = false;  // a refusal that room appearing later may lift
  for (const Try& t : tries) {
    cl::ReserveResponse rresp;
    grpc::Status st = ReserveKv(s_, t.channel, key, t.home.device, tokens,
                                epoch, kv_tokens, &rresp);
    if (st.ok()) {
      absl::Status quota;
      {
        absl::MutexLock lock(&s_->mu_);
        auto sit = s_->sessions_.find(session_id);
        if (sit != s_->sessions_.end()) {
          quota = s_->quotas_.CheckKv(sit->second.owner, limits, session_id,
                                      rresp.session_bytes());
          // The reservation took the owner past max_kv_bytes: the
          // session's KV is freed (its next turn rebuilds it).
          if (!quota.ok()) DetachHomeLocked(s_, &sit->second);
        }
      }
      if (!quota.ok()) {
        FreeKv(s_, session_id,
               KvHome{key, t.name, gpu_only ? NodeRole::kGpu : NodeRole::kKarat,
                      t.channel},
               "over max_kv_bytes");
        absl::MutexLock lock(&s_->mu_);
        s_->capacity_epoch_++;
        return {Attempt::kFailed, quota, /*quota=*/true};
      }
      absl::MutexLock lock(&s_->mu_);
      auto sit = s_->sessions_.find(session_id);
      auto n = s_->nodes_.find(t.home.node_id);
      Node* gpu = s_->RankNodeLocked(t.rank);
      if (sit == s_->sessions_.end() || n == s_->nodes_.end() || gpu == nullptr)
        return {Attempt::kFailed, absl::UnavailableError(absl::StrCat(
                                      "node ", t.name, " or GPU rank ", t.rank,
                                      " went away during admission; retry"))};
      Session& session = sit->second;
      s_->quotas_.SetKv(session.owner, session_id, rresp.session_bytes());
      if (!session.has_home || replacing) {
        KLOG(Info, kLog) << "session=" << log_id << " home " << t.name << "/"
                         << t.home.device;
      }
      if (replacing || rresp.kv_dropped()) session.kv_len = 0;
      SetHomeLocked(s_, &session, &n->second, t.home, t.rank,
                    rresp.used_bytes());
      // Admitted: the turn joins its rank's batch.
      gpu->active_turns++;
      s_->active_generations_++;
      s_->turns_admitted_++;
      turn->key = session.key;
      turn->seed = session.seed;
      turn->rank = t.rank;
      turn->gpu_id = gpu->id;
      turn->gpu_name = gpu->name;
      turn->gpu_channel = gpu->channel;
      if (!gpu_only) {
        turn->placement.set_node_id(n->second.id);
        turn->placement.set_node_name(n->second.name);
        turn->placement.set_fabric_address(n->second.fabric_address);
        turn->placement.set_device(t.home.device);
      }
      if (new_turn) {
        if (session.history.empty()) session.history.push_back(kBosToken);
        session.history.insert(session.history.end(), prompt.begin(),
                               prompt.end());
        session.turns++;
      }
      turn->epoch = epoch;
      turn->pos_start = session.kv_len;
      turn->feed.assign(session.history.begin() + session.kv_len,
                        session.history.end());
      const int feed_end = static_cast<int>(session.history.size());
      for (int end : session.prefill_ends)
        if (end > turn->pos_start && end < feed_end)
          turn->prefill_ends.push_back(end);
      RunningTurn running;
      running.session_id = session_id;
      running.home = t.home;
      running.context_tokens = feed_end;
      Rank& rank = s_->ranks_[t.rank];
      rank.running[session.key] = running;
      if (s_->RecomputeMicroBatchesLocked(t.rank)) PostMicroBatchPush(t.rank);
      return {Attempt::kAdmitted, absl::OkStatus()};
    }
    // No room now: it may appear (sessions close, other devices' spilled
    // pages go). OUT_OF_RANGE: not even on an empty node.
    if (st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      not_now = true;
      continue;
    }
    if (st.error_code() == grpc::StatusCode::OUT_OF_RANGE) continue;
    KLOG(Warning, kLog) << "session=" << log_id << " Reserve on " << t.name
                        << "/" << t.home.device
                        << " failed: " << st.error_message();
    other_error = absl::UnavailableError(
        absl::StrCat(gpu_only ? "GPU node " : "KARAT node ", t.name, ": ",
                     st.error_message()));
  }
  if (not_now) return {Attempt::kWait, absl::OkStatus()};
  if (!other_error.ok()) return {Attempt::kFailed, other_error};
  if (tries.empty())
    return {Attempt::kFailed,
            absl::UnavailableError("no alive KARAT node has a device")};
  return {Attempt::kFailed,
          absl::ResourceExhaustedError(absl::StrCat(
              "the turn needs ", tokens, " positions of KV (the session's ",
              "history, the prompt and max_new_tokens); no ",
              gpu_only ? "GPU rank" : "device",
              " could hold them even empty: shorten the prompt or lower "
              "max_new_tokens"))};
}

absl::StatusOr<AdmittedTurn> KaratService::WaitForAdmission(
    grpc::ServerContext* ctx, grpc::ServerWriter<v1::GenerateResponse>* writer,
    const std::string& sid, const cluster::ClientLimits& limits,
    int reserve_tokens, const std::vector<int32_t>& prompt, bool new_turn) {
  const std::string log_id = security::ShortId(sid);
  uint64_t turn_id = 0;
  const absl::Time enqueued = s_->Now();
  {
    absl::MutexLock lock(&s_->mu_);
    turn_id = s_->next_turn_id_++;
    s_->queue_.push_back(QueuedTurn{turn_id, enqueued, 0});
    s_->queue_epoch_++;
  }
  struct QueueGuard {
    State* s;
    uint64_t id;
    ~QueueGuard() {
      absl::MutexLock lock(&s->mu_);
      auto it = std::find_if(s->queue_.begin(), s->queue_.end(),
                             [&](const QueuedTurn& q) { return q.id == id; });
      if (it != s->queue_.end()) {
        s->queue_.erase(it);
        s->queue_epoch_++;
      }
    }
  } queue_guard{s_, turn_id};
  const absl::Duration timeout = s_->queue_timeout();
  const absl::Duration bypass =
      QueueBypass(s_->options().scheduling.queue_bypass_ms());
  bool waiting = false;
  int shown = -1;
  auto show = [&](int position) -> bool {
    if (position == shown) return true;
    shown = position;
    v1::GenerateResponse out;
    out.mutable_queued()->set_position(position);
    return writer->Write(out);
  };
  for (;;) {
    bool attempt = false;
    int position = 0;
    uint64_t seen_queue = 0, seen_capacity = 0;
    {
      absl::MutexLock lock(&s_->mu_);
      if (s_->shutting_down_)
        return absl::UnavailableError("coordinator is shutting down");
      // Epoch 0 means "not tried": the capacity epoch a turn tries at is
      // never 0.
      if (s_->capacity_epoch_ == 0) s_->capacity_epoch_ = 1;
      auto it = std::find_if(
          s_->queue_.begin(), s_->queue_.end(),
          [&](const QueuedTurn& q) { return q.id == turn_id; });
      position = static_cast<int>(it - s_->queue_.begin());
      attempt = MayTryAdmission(s_->queue_, size_t(position),
                                s_->capacity_epoch_, s_->Now(), bypass);
      seen_queue = s_->queue_epoch_;
      seen_capacity = s_->capacity_epoch_;
    }
    bool client_gone = waiting && !show(position);
    if (attempt && !client_gone) {
      AdmittedTurn turn;
      Attempt a =
          TryAdmit(sid, limits, reserve_tokens, prompt, new_turn, &turn);
      if (a.kind == Attempt::kAdmitted) return turn;
      if (a.kind == Attempt::kFailed) {
        if (a.status.code() == absl::StatusCode::kResourceExhausted &&
            !a.quota) {
          absl::MutexLock lock(&s_->mu_);
          s_->turns_refused_++;
        }
        return a.status;
      }
      // No room at the epoch it tried at: the turns behind may try now
      // (admission_policy.h); it tries again when room changes.
      absl::MutexLock lock(&s_->mu_);
      auto it = std::find_if(
          s_->queue_.begin(), s_->queue_.end(),
          [&](const QueuedTurn& q) { return q.id == turn_id; });
      if (it != s_->queue_.end()) it->waited_at = seen_capacity;
      s_->queue_epoch_++;
      seen_queue = s_->queue_epoch_;
    }
    // The turn waits: show its position, then sleep until the queue or the
    // room changes (bounded, to notice a cancel and the timeout).
    if (!waiting) {
      waiting = true;
      {
        absl::MutexLock lock(&s_->mu_);
        s_->turns_queued_++;
      }
      KLOG(Info, kLog) << "session=" << log_id << " turn queued at position "
                       << position;
      client_gone = !show(position);
    }
    if (client_gone || ctx->IsCancelled()) {
      absl::MutexLock lock(&s_->mu_);
      s_->turns_cancelled_queued_++;
      KLOG(Info, kLog) << "session=" << log_id
                       << " turn cancelled while queued";
      return absl::CancelledError("cancelled by the client while queued");
    }
    const absl::Duration waited = s_->Now() - enqueued;
    if (waited >= timeout) {
      absl::MutexLock lock(&s_->mu_);
      s_->turns_timed_out_++;
      KLOG(Info, kLog) << "session=" << log_id
                       << " turn timed out in the queue";
      return absl::ResourceExhaustedError(absl::StrCat(
          "the turn waited ", absl::ToInt64Milliseconds(waited),
          " ms in the admission queue without fitting (queue_timeout_ms ",
          absl::ToInt64Milliseconds(timeout),
          "): the devices or the rank's batch stayed full; retry later"));
    }
    absl::MutexLock lock(&s_->mu_);
    auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu_) {
      return s_->queue_epoch_ != seen_queue ||
             s_->capacity_epoch_ != seen_capacity || s_->shutting_down_;
    };
    s_->mu_.AwaitWithTimeout(absl::Condition(&changed), absl::Milliseconds(50));
  }
}

}  // namespace karat::coordinator
