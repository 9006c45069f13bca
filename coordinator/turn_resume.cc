// Turns that resume after a lost node (DESIGN.md §7): KaratService::ResumeTurn
// and ReplaceHome.
#include "coordinator/karat_service.h"
#include "security/tokens.h"

namespace karat::coordinator {

absl::StatusOr<bool> KaratService::ResumeTurn(grpc::ServerContext* ctx,
                                              const std::string& sid,
                                              int generated, int remaining,
                                              const LossMarks& before,
                                              AdmittedTurn* turn,
                                              cl::RunTurnRequest* run) {
  ProbeNodes();
  bool rank_lost = false, home_lost = false;
  {
    absl::MutexLock lock(&s_->mu_);
    const std::map<int, uint32_t> alive = s_->AliveRanksLocked();
    rank_lost = s_->rank_removals_ != before.rank_removals;
    for (const auto& [rank, id] : before.alive_ranks) {
      auto now = alive.find(rank);
      if (now == alive.end() || now->second != id) rank_lost = true;
    }
    const bool karat_lost = s_->karat_losses_ != before.karat_losses;
    if (!rank_lost && !karat_lost) return false;
    // The node holding the session's KV: a KARAT node, or in gpu_only mode
    // the session's rank.
    const Session& session = s_->sessions_.at(sid);
    auto home = s_->nodes_.find(session.home.node_id);
    home_lost = home == s_->nodes_.end() || !s_->AliveLocked(home->second);
  }
  // Waits for the nodes a turn needs (a rank or KARAT node being restarted,
  // the alive ranks taking over a lost rank's experts) and for a home that
  // can take the session's KV, bounded by the queue timeout.
  const absl::Time give_up = absl::Now() + s_->queue_timeout();
  uint64_t epoch = 0;
  absl::Status last_error;
  for (;;) {
    {
      absl::MutexLock lock(&s_->mu_);
      for (;;) {
        if (s_->shutting_down_)
          return absl::UnavailableError("coordinator is shutting down");
        if (ctx->IsCancelled())
          return absl::CancelledError("cancelled by the client");
        absl::Status nodes = CheckNodesLocked();
        if (nodes.ok()) break;
        if (absl::Now() > give_up)
          return absl::UnavailableError(absl::StrCat(
              "waited ", absl::FormatDuration(s_->queue_timeout()),
              " for the cluster to serve the turn again: ", nodes.message()));
        const uint64_t seen = s_->capacity_epoch_;
        auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu_) {
          return s_->capacity_epoch_ != seen || s_->shutting_down_;
        };
        s_->mu_.AwaitWithTimeout(absl::Condition(&changed),
                                 absl::Milliseconds(50));
      }
      epoch = s_->NewEpochLocked();
      const Session& session = s_->sessions_.at(sid);
      auto home = s_->nodes_.find(session.home.node_id);
      if (home == s_->nodes_.end() || !s_->AliveLocked(home->second))
        home_lost = true;
    }
    // The home is gone: a new one, where the KV is rebuilt from the token
    // log by prefill (DESIGN.md §7). Otherwise the home fences the failed
    // pass off and cuts what it stored beyond the coordinator's count.
    last_error = home_lost ? ReplaceHome(sid, remaining, epoch, turn, run)
                           : FenceHome(sid, remaining, epoch);
    if (last_error.ok()) break;
    if (!absl::IsUnavailable(last_error) || absl::Now() > give_up)
      return last_error;
    absl::SleepFor(absl::Milliseconds(100));
  }
  turn->epoch = epoch;
  run->set_turn_epoch(epoch);
  int rank = -1;
  bool push_old = false, push_new = false;
  const int old_rank = turn->rank;
  {
    absl::MutexLock lock(&s_->mu_);
    Session& session = s_->sessions_.at(sid);
    const std::map<int, uint32_t> alive = s_->AliveRanksLocked();
    if (s_->gpu_only()) {
      // The KV lives on the session's rank (a new one after ReplaceHome).
      auto it = alive.find(session.rank);
      if (it == alive.end() || it->second != session.home.node_id)
        return absl::UnavailableError(
            absl::StrCat("the session's KV was on GPU rank ", session.rank,
                         ", which is not alive"));
      rank = session.rank;
    } else if (!rank_lost && alive.count(old_rank) > 0 &&
               alive.at(old_rank) == turn->gpu_id) {
      rank = old_rank;  // only a KARAT node was lost: the rank stays
    } else {
      // The alive rank with the fewest running turns besides this one.
      size_t best = 0;
      for (const auto& [r, id] : alive) {
        auto it = s_->ranks_.find(r);
        size_t running = it == s_->ranks_.end() ? 0 : it->second.running.size();
        if (r == old_rank && running > 0) --running;
        if (rank < 0 || running < best) {
          rank = r;
          best = running;
        }
      }
    }
    if (rank < 0) return absl::UnavailableError("no alive GPU rank");
    Node& gpu = s_->nodes_.at(alive.at(rank));
    // The turn leaves its old rank's batch and joins the new one.
    RunningTurn moved;
    moved.session_id = sid;
    auto old = s_->ranks_.find(old_rank);
    if (old != s_->ranks_.end()) {
      auto t = old->second.running.find(turn->key);
      if (t != old->second.running.end()) {
        moved = t->second;
        old->second.running.erase(t);
      }
      push_old = s_->RecomputeMicroBatchesLocked(old_rank);
    }
    moved.home = session.home;
    auto old_node = s_->nodes_.find(turn->gpu_id);
    if (old_node != s_->nodes_.end()) old_node->second.active_turns--;
    gpu.active_turns++;
    moved.context_tokens = static_cast<int64_t>(session.history.size());
    moved.started = false;
    s_->ranks_[rank].running[turn->key] = moved;
    push_new = s_->RecomputeMicroBatchesLocked(rank);
    s_->capacity_epoch_++;
    turn->rank = rank;
    turn->gpu_id = gpu.id;
    turn->gpu_name = gpu.name;
    turn->gpu_channel = gpu.channel;
    // The KV up to kv_len is on the home device (0 on a new home); the rest
    // of the token log (the last sampled token, or the whole prompt when the
    // prefill did not finish, or all of it on a new home) is fed again.
    // Sampling is keyed by (seed, position), so the tokens are the ones the
    // turn would have produced.
    const int pos_start = session.kv_len;
    const int feed_end = static_cast<int>(session.history.size());
    run->set_pos_start(pos_start);
    run->mutable_feed_tokens()->Assign(session.history.begin() + pos_start,
                                       session.history.end());
    run->set_max_new_tokens(remaining);
    // After the first token the feed ends with sampled tokens.
    run->set_resumed_decode(generated > 0);
    run->clear_prefill_ends();
    for (int end : session.prefill_ends)
      if (end > pos_start && end < feed_end) run->add_prefill_ends(end);
  }
  if (push_old) PostMicroBatchPush(old_rank);
  if (push_new && rank != old_rank) PostMicroBatchPush(rank);
  return true;
}

absl::Status KaratService::FenceHome(const std::string& sid, int remaining,
                                     uint64_t epoch) {
  std::shared_ptr<grpc::Channel> channel;
  std::string name;
  uint64_t key = 0;
  int tokens = 0, kv_tokens = 0, device = 0;
  {
    absl::MutexLock lock(&s_->mu_);
    const Session& session = s_->sessions_.at(sid);
    auto n = s_->nodes_.find(session.home.node_id);
    if (n == s_->nodes_.end())
      return absl::UnavailableError("the session's home went away");
    channel = n->second.channel;
    name = n->second.name;
    key = session.key;
    tokens = static_cast<int>(session.history.size()) + remaining;
    kv_tokens = session.kv_len;
    device = session.home.device;
  }
  cl::ReserveResponse rresp;
  grpc::Status st =
      ReserveKv(s_, channel, key, device, tokens, epoch, kv_tokens, &rresp);
  if (!st.ok()) {
    return absl::UnavailableError(absl::StrCat(
        "the session's home ", name, "/", device,
        " cannot take the resumed turn: ", st.error_message()));
  }
  absl::MutexLock lock(&s_->mu_);
  Session& session = s_->sessions_.at(sid);
  if (rresp.kv_dropped()) session.kv_len = 0;
  s_->quotas_.SetKv(session.owner, sid, rresp.session_bytes());
  return absl::OkStatus();
}

absl::Status KaratService::ReplaceHome(const std::string& sid, int remaining,
                                       uint64_t epoch, AdmittedTurn* turn,
                                       cl::RunTurnRequest* run) {
  struct Try {
    HomeDevice home;
    int rank = -1;  // gpu_only
    std::string name;
    std::shared_ptr<grpc::Channel> channel;
  };
  std::vector<Try> tries;
  uint64_t key = 0;
  int tokens = 0;
  std::string old_name;
  const bool gpu_only = s_->gpu_only();
  {
    absl::MutexLock lock(&s_->mu_);
    const Session& session = s_->sessions_.at(sid);
    key = session.key;
    tokens = static_cast<int>(session.history.size()) + remaining;
    auto old = s_->nodes_.find(session.home.node_id);
    old_name = old == s_->nodes_.end()
                   ? absl::StrCat("node ", session.home.node_id)
                   : old->second.name;
    if (gpu_only) {
      // The KV moves to an alive rank: fewest running turns first.
      std::vector<std::pair<size_t, int>> ranks;  // (running, rank)
      for (const auto& [r, id] : s_->AliveRanksLocked()) {
        auto it = s_->ranks_.find(r);
        ranks.emplace_back(
            it == s_->ranks_.end() ? 0 : it->second.running.size(), r);
      }
      std::sort(ranks.begin(), ranks.end());
      for (const auto& [running, r] : ranks) {
        const Node* n = s_->RankNodeLocked(r);
        tries.push_back({HomeDevice{n->id, 0}, r, n->name, n->channel});
      }
    } else {
      for (const HomeDevice& h : ChooseHomeDevices(s_->SnapshotLocked())) {
        const Node& n = s_->nodes_.at(h.node_id);
        tries.push_back({h, -1, n.name, n.channel});
      }
    }
  }
  std::string refusals;
  for (const Try& t : tries) {
    cl::ReserveResponse rresp;
    grpc::Status st = ReserveKv(s_, t.channel, key, t.home.device, tokens,
                                epoch, /*kv_tokens=*/0, &rresp);
    if (!st.ok()) {
      absl::StrAppend(&refusals, refusals.empty() ? "" : "; ", t.name, "/",
                      t.home.device, ": ", st.error_message());
      continue;
    }
    absl::MutexLock lock(&s_->mu_);
    auto n = s_->nodes_.find(t.home.node_id);
    if (n == s_->nodes_.end())
      return absl::UnavailableError(absl::StrCat(
          "node ", t.name, " went away while the session moved to it"));
    Session& session = s_->sessions_.at(sid);
    SetHomeLocked(s_, &session, &n->second, t.home, t.rank, rresp.used_bytes());
    session.kv_len = 0;
    // Counted, not checked: the move is the cluster's doing, not the
    // owner's.
    s_->quotas_.SetKv(session.owner, sid, rresp.session_bytes());
    if (!gpu_only) {
      turn->placement.set_node_id(n->second.id);
      turn->placement.set_node_name(n->second.name);
      turn->placement.set_fabric_address(n->second.fabric_address);
      turn->placement.set_device(t.home.device);
      *run->mutable_placement() = turn->placement;
    }
    s_->sessions_rehomed_++;
    KLOG(Warning, kLog) << "session=" << security::ShortId(sid) << " home "
                        << old_name << " is lost; new home " << t.name << "/"
                        << t.home.device << ", the KV of "
                        << session.history.size()
                        << " tokens is rebuilt by prefill";
    return absl::OkStatus();
  }
  return absl::UnavailableError(absl::StrCat(
      "the session's home ", old_name, " is lost and no alive ",
      gpu_only ? "GPU rank" : "device", " can take its ", tokens,
      " tokens of KV",
      refusals.empty() ? std::string() : absl::StrCat(" (", refusals, ")")));
}

}  // namespace karat::coordinator
