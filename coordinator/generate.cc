// One turn end to end (KaratService::Generate): validation and the plan for
// a retried turn (turn_plan.h), admission, the GPU node's stream relayed to
// the client, resumption after a lost node, and what the session keeps when
// the turn ends early: the tokens the client was sent, or nothing at all.
#include <atomic>

#include "common/tokenizer.h"
#include "coordinator/client_requests.h"
#include "coordinator/karat_service.h"
#include "coordinator/turn_plan.h"
#include "security/tokens.h"

namespace karat::coordinator {
namespace {

// Most times one turn moves to another GPU rank after a lost one.
constexpr int kMaxTurnResumes = 3;
// How long a call waits for a turn it takes over to end.
constexpr absl::Duration kTakeOverWait = absl::Seconds(10);

}  // namespace

// One Generate call. Its session is busy from Begin() until the call ends.
class TurnCall {
 public:
  TurnCall(KaratService* service, grpc::ServerContext* ctx,
           const v1::GenerateRequest* req,
           grpc::ServerWriter<v1::GenerateResponse>* writer, Caller caller)
      : service_(service),
        s_(service->s_),
        ctx_(ctx),
        req_(req),
        writer_(writer),
        caller_(std::move(caller)),
        sid_(req->session_id()),
        log_id_(security::ShortId(sid_)),
        arrived_(s_->Now()),
        prompt_(req->prompt_tokens().empty()
                    ? EncodeText(req->prompt())
                    : std::vector<int32_t>(req->prompt_tokens().begin(),
                                           req->prompt_tokens().end())) {}

  grpc::Status Run();

 private:
  enum class PassEnd { kDone, kClientGone, kStopped, kBroken };

  // Checks that the caller owns the session, validates, takes over a call
  // still running the same turn, plans the turn, counts it against the
  // caller's max_concurrent_turns and marks the session busy. `*busy` is
  // set once it is.
  grpc::Status Begin(bool* busy);
  // Streams the turn's tokens [from, to) from the history.
  bool Replay(int from, int to);
  // The turns' RunTurn calls: the first, then one per resumption.
  grpc::Status RunPasses(AdmittedTurn* turn);
  // One RunTurn call, relayed to the client.
  PassEnd RunPass(const AdmittedTurn& turn, const cl::RunTurnRequest& run,
                  grpc::Status* gpu_status);
  // Keeps one token of the turn, sending it first when the client lacks it;
  // false when the client is gone (the token is then not kept).
  bool TakeToken(const AdmittedTurn& turn, const cl::RunTurnEvent& ev);
  // Ends a turn that did not finish: the session keeps the tokens the
  // client was sent (none: it is as before the call), the log says so and
  // the status carries how many (trailer karat-turn-tokens).
  grpc::Status EndEarly(grpc::Status status);
  grpc::Status Finish(const std::string& reason);
  // Updates the session's latest turn after the call (under the lock).
  void SettleLastTurnLocked(Session& session, const std::string& finish)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu_);
  // For a turn that did not finish: the session keeps the turn's tokens the
  // client was sent, or is left as before the call when there are none.
  void KeepOrRollBackLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu_);

  KaratService* const service_;
  State* const s_;
  grpc::ServerContext* const ctx_;
  const v1::GenerateRequest* const req_;
  grpc::ServerWriter<v1::GenerateResponse>* const writer_;
  const Caller caller_;
  const std::string sid_;
  const std::string log_id_;  // sid_ as logs print it
  const absl::Time arrived_;
  const std::vector<int32_t> prompt_;
  const std::string& key() const { return req_->idempotency_key(); }

  TurnPlan plan_;
  // The session before the call, to leave it so when the call keeps none.
  size_t history_before_ = 0;
  std::vector<int> prefill_ends_before_;
  int turns_before_ = 0;
  // The history index of the turn's first token; the turn's tokens in the
  // history; those this call added; how many the client has.
  int turn_start_ = 0;
  int turn_tokens_ = 0;
  int call_tokens_ = 0;
  int client_has_ = 0;
  bool eos_ = false;
  int64_t ttft_us_ = 0;
  absl::Time previous_;
  int resumes_ = 0;
  std::shared_ptr<std::atomic<bool>> stop_;
};

grpc::Status KaratService::Generate(
    grpc::ServerContext* ctx, const v1::GenerateRequest* req,
    grpc::ServerWriter<v1::GenerateResponse>* writer) {
  absl::StatusOr<Caller> caller = Authenticate(*ctx);
  if (!caller.ok()) return ToGrpc(caller.status());
  TurnCall call(this, ctx, req, writer, *std::move(caller));
  return call.Run();
}

grpc::Status TurnCall::Run() {
  bool busy = false;
  grpc::Status begun = Begin(&busy);
  // Clears the busy flag however the call ends, and the turn's count
  // against the caller's max_concurrent_turns.
  struct BusyGuard {
    State* s;
    const std::string& id;
    const std::string& principal;
    bool armed;
    ~BusyGuard() {
      if (!armed) return;
      absl::MutexLock lock(&s->mu_);
      s->quotas_.EndTurn(principal);
      auto it = s->sessions_.find(id);
      if (it != s->sessions_.end()) {
        it->second.busy = false;
        it->second.turn_ctx = nullptr;
        it->second.stop_turn.reset();
        it->second.last_turn_end = s->Now();
      }
    }
  } busy_guard{s_, sid_, caller_.principal, busy};
  if (!begun.ok()) return begun;
  previous_ = arrived_;

  if (plan_.kind == TurnPlan::kReplay) {
    if (!Replay(req_->tokens_received(), plan_.kept))
      return grpc::Status(grpc::StatusCode::CANCELLED, "the client went away");
    std::string reason;
    {
      absl::MutexLock lock(&s_->mu_);
      reason = s_->sessions_.at(sid_).last_turn->finish_reason();
    }
    turn_tokens_ = plan_.kept;
    return Finish(reason);
  }
  if (plan_.kind == TurnPlan::kContinue &&
      !Replay(req_->tokens_received(), plan_.kept))
    return grpc::Status(grpc::StatusCode::CANCELLED, "the client went away");

  // A turn of its own with a key is logged before it can stream anything,
  // so that a retry after a restart can run it again.
  if (plan_.kind == TurnPlan::kNew && !key().empty()) {
    cl::LastTurn started;
    {
      absl::MutexLock lock(&s_->mu_);
      started = *s_->sessions_.at(sid_).last_turn;
    }
    if (absl::Status st = service_->LogTurnStart(sid_, started); !st.ok()) {
      KLOG(Error, kLog) << "session=" << log_id_ << " " << st.message();
      return EndEarly(grpc::Status(
          grpc::StatusCode::INTERNAL,
          absl::StrCat("cannot log the turn's start: ", st.message())));
    }
  }

  int reserve_tokens = 0;
  {
    absl::MutexLock lock(&s_->mu_);
    const Session& session = s_->sessions_.at(sid_);
    reserve_tokens = static_cast<int>(session.history.size()) +
                     (session.history.empty() ? 1 : 0) +
                     (plan_.kind == TurnPlan::kNew ? int(prompt_.size()) : 0) +
                     req_->max_new_tokens() - plan_.kept;
  }
  const bool new_turn = plan_.kind == TurnPlan::kNew;
  absl::StatusOr<AdmittedTurn> admitted = service_->WaitForAdmission(
      ctx_, writer_, sid_, caller_.limits, reserve_tokens,
      new_turn ? prompt_ : std::vector<int32_t>(), new_turn);
  if (!admitted.ok()) {
    KLOG(Info, kLog) << "session=" << log_id_
                     << " turn refused: " << admitted.status();
    return EndEarly(ToGrpc(admitted.status()));
  }
  if (new_turn) {
    absl::MutexLock lock(&s_->mu_);
    turn_start_ = static_cast<int>(s_->sessions_.at(sid_).history.size());
  }
  return RunPasses(&*admitted);
}

grpc::Status TurnCall::Begin(bool* busy) {
  if (absl::Status id = ValidateSessionId(sid_); !id.ok()) return ToGrpc(id);
  {
    absl::MutexLock lock(&s_->mu_);
    if (service_->OwnedLocked(sid_, caller_) == nullptr)
      return KaratService::NoSession(sid_);
  }
  service_->WaitForCancelledTurn(sid_, absl::Milliseconds(200));
  {
    absl::MutexLock lock(&s_->mu_);
    if (service_->OwnedLocked(sid_, caller_) == nullptr)
      return KaratService::NoSession(sid_);
    if (absl::Status valid =
            ValidateGenerateRequest(*req_, s_->options().max_new_tokens_limit);
        !valid.ok())
      return ToGrpc(valid);
  }
  // A retry of the turn a call is still running (its client went away
  // unnoticed, or a new connection raced the old one) takes it over.
  bool take_over = false;
  if (!key().empty()) {
    absl::MutexLock lock(&s_->mu_);
    const Session* session = service_->OwnedLocked(sid_, caller_);
    if (session == nullptr) return KaratService::NoSession(sid_);
    take_over = session->busy && session->last_turn.has_value() &&
                session->last_turn->idempotency_key() == key();
  }
  if (take_over && !service_->StopRunningTurn(sid_, kTakeOverWait)) {
    return grpc::Status(
        grpc::StatusCode::FAILED_PRECONDITION,
        absl::StrCat("the call running this turn on session ", sid_,
                     " did not end within ",
                     absl::FormatDuration(kTakeOverWait), "; retry"));
  }
  absl::MutexLock lock(&s_->mu_);
  Session* owned = service_->OwnedLocked(sid_, caller_);
  if (owned == nullptr || owned->closing) return KaratService::NoSession(sid_);
  Session& session = *owned;
  if (session.busy)
    return grpc::Status(
        grpc::StatusCode::FAILED_PRECONDITION,
        absl::StrCat("a generate is already running on session ", sid_,
                     " (a retry of the same turn takes it over: send its "
                     "idempotency_key)"));
  if (s_->shutting_down_)
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "coordinator is shutting down");
  absl::StatusOr<TurnPlan> plan =
      PlanTurn(session.last_turn, key(), prompt_, req_->max_new_tokens(),
               req_->temperature(), req_->tokens_received());
  if (!plan.ok()) return ToGrpc(plan.status());
  plan_ = *plan;
  if (plan_.kind != TurnPlan::kReplay) {
    bool settling = false;  // then the turn waits in the queue
    if (absl::Status nodes = service_->CheckNodesLocked(&settling);
        !nodes.ok() && !settling)
      return ToGrpc(nodes);
  }
  // Refused at once rather than queued: the caller's other turns hold its
  // share.
  if (absl::Status quota =
          s_->quotas_.StartTurn(caller_.principal, caller_.limits);
      !quota.ok()) {
    KLOG(Info, kLog) << "session=" << log_id_
                     << " turn refused: " << quota.message();
    return ToGrpc(quota);
  }
  history_before_ = session.history.size();
  prefill_ends_before_ = session.prefill_ends;
  turns_before_ = session.turns;
  turn_tokens_ = plan_.kept;
  client_has_ = std::max(req_->tokens_received(), plan_.kept);
  if (plan_.kind == TurnPlan::kNew) {
    if (key().empty()) {
      session.last_turn.reset();
    } else {
      cl::LastTurn t;
      t.set_idempotency_key(key());
      t.mutable_prompt()->Assign(prompt_.begin(), prompt_.end());
      t.set_max_new_tokens(req_->max_new_tokens());
      t.set_temperature(req_->temperature());
      t.set_base_tokens(static_cast<int>(session.history.size()));
      session.last_turn = std::move(t);
    }
    session.last_turn_logged = false;
  } else {
    turn_start_ = TurnStart(*session.last_turn);
  }
  session.busy = true;
  session.turn_ctx = ctx_;
  stop_ = std::make_shared<std::atomic<bool>>(false);
  session.stop_turn = stop_;
  *busy = true;
  return grpc::Status::OK;
}

bool TurnCall::Replay(int from, int to) {
  std::vector<int32_t> tokens;
  {
    absl::MutexLock lock(&s_->mu_);
    const Session& session = s_->sessions_.at(sid_);
    for (int i = from; i < to; ++i) tokens.push_back(session.history[turn_start_ + i]);
  }
  for (int i = from; i < to; ++i) {
    v1::GenerateResponse out;
    v1::GeneratedToken* tok = out.mutable_token();
    tok->set_token_id(tokens[i - from]);
    tok->set_text(TokenText(tokens[i - from]));
    tok->set_position(turn_start_ + i);
    tok->set_latency_us(0);
    if (!writer_->Write(out)) return false;
  }
  return true;
}

grpc::Status TurnCall::RunPasses(AdmittedTurn* admitted) {
  AdmittedTurn& turn = *admitted;
  // Leaves the rank's batch however the turn ends, and wakes queued turns.
  // Reads the turn's rank and GPU node at the end: a resumed turn moves.
  struct ActiveGuard {
    KaratService* service;
    State* s;
    const AdmittedTurn* turn;
    ~ActiveGuard() {
      bool push = false;
      const int rank = turn->rank;
      {
        absl::MutexLock lock(&s->mu_);
        s->active_generations_--;
        auto n = s->nodes_.find(turn->gpu_id);
        if (n != s->nodes_.end()) n->second.active_turns--;
        auto r = s->ranks_.find(rank);
        if (r != s->ranks_.end()) {
          r->second.running.erase(turn->key);
          push = s->RecomputeMicroBatchesLocked(rank);
        }
        s->capacity_epoch_++;
      }
      if (push) service->PostMicroBatchPush(rank);
    }
  } active_guard{service_, s_, &turn};

  cl::RunTurnRequest run;
  run.set_session(turn.key);
  run.set_seed(turn.seed);
  run.set_temperature(req_->temperature());
  run.set_pos_start(turn.pos_start);
  run.mutable_feed_tokens()->Assign(turn.feed.begin(), turn.feed.end());
  run.set_max_new_tokens(req_->max_new_tokens() - turn_tokens_);
  if (!s_->gpu_only()) *run.mutable_placement() = turn.placement;
  run.mutable_prefill_ends()->Assign(turn.prefill_ends.begin(),
                                     turn.prefill_ends.end());
  run.set_turn_epoch(turn.epoch);
  // A continued turn's feed ends with a token it sampled.
  run.set_resumed_decode(turn_tokens_ > 0);

  for (;;) {
    KaratService::LossMarks at_start;
    {
      absl::MutexLock lock(&s_->mu_);
      at_start.rank_removals = s_->rank_removals_;
      at_start.karat_losses = s_->karat_losses_;
      at_start.alive_ranks = s_->AliveRanksLocked();
    }
    grpc::Status gpu_status;
    const PassEnd end = RunPass(turn, run, &gpu_status);
    if (end == PassEnd::kClientGone) {
      KLOG(Info, kLog) << "session=" << log_id_
                       << " turn cancelled by the client after " << turn_tokens_
                       << " tokens";
      return EndEarly(
          grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client"));
    }
    if (end == PassEnd::kStopped) {
      return EndEarly(grpc::Status(
          grpc::StatusCode::ABORTED,
          "another call took the turn over (a retry with the same "
          "idempotency_key, or CloseSession)"));
    }
    bool shutting_down = false;
    {
      absl::MutexLock lock(&s_->mu_);
      shutting_down = s_->shutting_down_;
    }
    if (end == PassEnd::kDone) return Finish(eos_ ? "eos" : "length");
    if (shutting_down) {
      // The turn ends as cancelled (a retry with its key continues it).
      {
        absl::MutexLock lock(&s_->mu_);
        KeepOrRollBackLocked();
      }
      return Finish("cancelled");
    }
    KLOG(Warning, kLog) << "session=" << log_id_ << " GPU node "
                        << turn.gpu_name << " (rank " << turn.rank
                        << ") failed after " << turn_tokens_
                        << " tokens: " << gpu_status.error_message();
    grpc::StatusCode code = gpu_status.error_code();
    switch (code) {
      case grpc::StatusCode::INVALID_ARGUMENT:
      case grpc::StatusCode::RESOURCE_EXHAUSTED:
      case grpc::StatusCode::FAILED_PRECONDITION:
        break;
      default:
        code = grpc::StatusCode::UNAVAILABLE;
    }
    std::string why;
    if (code == grpc::StatusCode::UNAVAILABLE) {
      if (resumes_ >= kMaxTurnResumes) {
        why = absl::StrCat(" (resumed ", resumes_, " times already, the most)");
      } else {
        const std::string failed_on =
            absl::StrCat(turn.gpu_name, " (rank ", turn.rank, ")");
        absl::StatusOr<bool> resumed = service_->ResumeTurn(
            ctx_, sid_, turn_tokens_, req_->max_new_tokens() - turn_tokens_,
            at_start, &turn, &run);
        if (resumed.ok() && *resumed) {
          ++resumes_;
          absl::MutexLock lock(&s_->mu_);
          s_->turns_resumed_++;
          KLOG(Info, kLog) << "session=" << log_id_ << " resuming after "
                           << turn_tokens_ << " tokens: " << failed_on
                           << " failed, " << turn.gpu_name << " (rank "
                           << turn.rank << ") continues";
          continue;
        }
        if (!resumed.ok()) {
          if (resumed.status().code() == absl::StatusCode::kCancelled) {
            return EndEarly(grpc::Status(grpc::StatusCode::CANCELLED,
                                         "cancelled by the client"));
          }
          why = absl::StrCat(" (cannot resume: ", resumed.status().message(),
                             ")");
        }
      }
    }
    return EndEarly(grpc::Status(
        code, absl::StrCat("GPU node ", turn.gpu_name, " (rank ", turn.rank,
                           ") failed during the turn after ", turn_tokens_,
                           " tokens: ", gpu_status.error_message(), why)));
  }
}

TurnCall::PassEnd TurnCall::RunPass(const AdmittedTurn& turn,
                                    const cl::RunTurnRequest& request,
                                    grpc::Status* gpu_status) {
  cl::RunTurnRequest run = request;
  grpc::ClientContext gpu_ctx;
  {
    absl::MutexLock lock(&s_->mu_);
    if (s_->shutting_down_) gpu_ctx.TryCancel();
    s_->running_[&gpu_ctx] = turn.gpu_id;
    // From here on SetMicroBatches pushes cover this turn; until now its
    // micro-batch travels in the request.
    auto r = s_->ranks_.find(turn.rank);
    if (r != s_->ranks_.end()) {
      auto t = r->second.running.find(turn.key);
      if (t != r->second.running.end()) {
        run.set_micro_batch(t->second.micro_batch);
        t->second.pushed_micro_batch = t->second.micro_batch;
        t->second.started = true;
      }
    }
  }
  KLOG(Info, kLog) << "session=" << log_id_
                   << (resumes_ > 0 ? " turn resumed on " : " turn on ")
                   << turn.gpu_name << " (rank " << turn.rank
                   << ", micro-batch " << run.micro_batch() << ")"
                   << (s_->gpu_only()
                           ? std::string(" gpu_only")
                           : absl::StrCat(" home=", turn.placement.node_name(),
                                          "/", turn.placement.device()))
                   << " pos_start=" << run.pos_start()
                   << " feed=" << run.feed_tokens_size()
                   << " max_new_tokens=" << run.max_new_tokens()
                   << " epoch=" << run.turn_epoch();

  // Watches for the client going away and for a take-over, and cancels the
  // GPU call.
  std::atomic<bool> client_gone{false}, stopped{false};
  absl::Mutex watch_mu;
  bool over = false;
  std::thread watcher([&] {
    absl::MutexLock lock(&watch_mu);
    while (!over) {
      watch_mu.AwaitWithTimeout(absl::Condition(&over), absl::Milliseconds(20));
      if (over) return;
      if (ctx_->IsCancelled()) client_gone = true;
      if (stop_->load()) stopped = true;
      if (client_gone || stopped) {
        gpu_ctx.TryCancel();
        return;
      }
    }
  });

  auto stub = cl::GpuNode::NewStub(turn.gpu_channel);
  std::unique_ptr<grpc::ClientReader<cl::RunTurnEvent>> reader =
      stub->RunTurn(&gpu_ctx, run);
  cl::RunTurnEvent ev;
  bool writer_failed = false;
  while (reader->Read(&ev)) {
    if (ev.progress()) {
      // A long feed is part way through: no token, nothing to record.
      v1::GenerateResponse out;
      v1::PrefillProgress* p = out.mutable_prefill();
      p->set_fed_tokens(ev.prefill_fed());
      p->set_total_tokens(ev.prefill_total());
      if (!writer_->Write(out)) {
        writer_failed = true;
        break;
      }
      continue;
    }
    if (!TakeToken(turn, ev)) {
      writer_failed = true;
      break;
    }
  }
  if (writer_failed) {
    client_gone = true;
    gpu_ctx.TryCancel();
    while (reader->Read(&ev)) {
    }
  }
  *gpu_status = reader->Finish();
  {
    absl::MutexLock lock(&watch_mu);
    over = true;
  }
  watcher.join();
  {
    absl::MutexLock lock(&s_->mu_);
    s_->running_.erase(&gpu_ctx);
  }
  if (client_gone || ctx_->IsCancelled()) return PassEnd::kClientGone;
  if (stopped) return PassEnd::kStopped;
  // Every token arrived before the call broke: the turn is complete.
  if (gpu_status->ok() || eos_ || turn_tokens_ >= req_->max_new_tokens())
    return PassEnd::kDone;
  return PassEnd::kBroken;
}

bool TurnCall::TakeToken(const AdmittedTurn& turn, const cl::RunTurnEvent& ev) {
  const absl::Time now = s_->Now();
  const int64_t latency = absl::ToInt64Microseconds(now - previous_);
  // Sent before it is kept: a token the client did not get is not kept.
  if (turn_tokens_ >= client_has_) {
    v1::GenerateResponse out;
    v1::GeneratedToken* tok = out.mutable_token();
    tok->set_token_id(ev.token_id());
    tok->set_text(TokenText(ev.token_id()));
    tok->set_position(ev.position());
    tok->set_latency_us(latency);
    if (!writer_->Write(out)) return false;
    client_has_ = turn_tokens_ + 1;
  }
  {
    absl::MutexLock lock(&s_->mu_);
    Session& session = s_->sessions_.at(sid_);
    session.history.push_back(ev.token_id());
    session.kv_len = ev.kv_len();
    // The turn's prefill ends where its first token is sampled.
    if (turn_tokens_ == 0 && (session.prefill_ends.empty() ||
                              session.prefill_ends.back() < turn_start_))
      session.prefill_ends.push_back(turn_start_);
    s_->tokens_generated_++;
    (call_tokens_ == 0 ? s_->ttft_ms_ : s_->tbt_ms_).Add(latency / 1000.0);
    auto r = s_->ranks_.find(turn.rank);
    if (r != s_->ranks_.end()) {
      auto t = r->second.running.find(turn.key);
      if (t != r->second.running.end())
        t->second.context_tokens =
            static_cast<int64_t>(session.history.size());
      s_->AddStepLocked(r->second, ev);
    }
  }
  if (call_tokens_ == 0) ttft_us_ = latency;
  ++turn_tokens_;
  ++call_tokens_;
  previous_ = now;
  if (ev.token_id() == kEosToken) eos_ = true;
  return true;
}

void TurnCall::SettleLastTurnLocked(Session& session,
                                    const std::string& finish) {
  if (!session.last_turn.has_value()) return;
  cl::LastTurn& t = *session.last_turn;
  t.set_generated(turn_tokens_);
  t.set_finish_reason(finish);
  t.set_prompt_in_history(turn_tokens_ > 0);
  session.last_turn_logged = false;
}

void TurnCall::KeepOrRollBackLocked() {
  auto it = s_->sessions_.find(sid_);
  if (it == s_->sessions_.end()) return;
  Session& session = it->second;
  if (turn_tokens_ == 0 && plan_.kind == TurnPlan::kNew) {
    // Nothing reached the client: the session is as before the call (KV
    // stored beyond kv_len is cut by the next Reserve).
    session.history.resize(history_before_);
    session.prefill_ends = prefill_ends_before_;
    session.turns = turns_before_;
    session.kv_len = std::min(session.kv_len, int(history_before_));
  }
  SettleLastTurnLocked(session, "");
}

grpc::Status TurnCall::EndEarly(grpc::Status status) {
  {
    absl::MutexLock lock(&s_->mu_);
    KeepOrRollBackLocked();
  }
  if (absl::Status st = service_->LogTurn(sid_); !st.ok()) {
    KLOG(Error, kLog) << "session=" << log_id_ << " " << st.message();
  }
  ctx_->AddTrailingMetadata("karat-turn-tokens", std::to_string(turn_tokens_));
  if (turn_tokens_ == 0) return status;
  return grpc::Status(
      status.error_code(),
      absl::StrCat(status.error_message(), "; the session kept the ",
                   turn_tokens_, " tokens of the turn the client was sent",
                   key().empty() ? std::string()
                                 : " (a retry with the same idempotency_key "
                                   "continues the turn)"));
}

grpc::Status TurnCall::Finish(const std::string& reason) {
  if (reason != "cancelled") {
    absl::MutexLock lock(&s_->mu_);
    SettleLastTurnLocked(s_->sessions_.at(sid_), reason);
  }
  if (absl::Status st = service_->LogTurn(sid_); !st.ok()) {
    KLOG(Error, kLog) << "session=" << log_id_ << " " << st.message();
    return grpc::Status(
        grpc::StatusCode::INTERNAL,
        absl::StrCat("the turn's tokens could not be logged: ", st.message()));
  }
  const int64_t total_us = absl::ToInt64Microseconds(s_->Now() - arrived_);
  v1::GenerateResponse done;
  v1::TurnDone* d = done.mutable_done();
  d->set_finish_reason(reason);
  d->set_prompt_tokens(static_cast<int32_t>(prompt_.size()));
  d->set_generated_tokens(turn_tokens_);
  d->set_ttft_us(ttft_us_);
  d->set_total_us(total_us);
  writer_->Write(done);
  KLOG(Info, kLog) << "session=" << log_id_ << " turn done: " << reason << " "
                   << turn_tokens_ << " tokens, ttft_us=" << ttft_us_
                   << " total_us=" << total_us
                   << (resumes_ > 0
                           ? absl::StrCat(", resumed ", resumes_, " times")
                           : std::string())
                   << (plan_.kind == TurnPlan::kNew
                           ? std::string()
                           : absl::StrCat(", a retry with its key (",
                                          plan_.kept, " tokens kept before)"));
  return grpc::Status::OK;
}

}  // namespace karat::coordinator
