// One turn end to end (KaratService::Generate): validation, admission, the
// GPU node's stream relayed to the client, resumption after a lost node,
// and the write-ahead log.
#include "common/tokenizer.h"
#include "coordinator/karat_service.h"

namespace karat::coordinator {
namespace {

// Most times one turn moves to another GPU rank after a lost one.
constexpr int kMaxTurnResumes = 3;

}  // namespace

grpc::Status KaratService::Generate(
    grpc::ServerContext* ctx, const v1::GenerateRequest* req,
    grpc::ServerWriter<v1::GenerateResponse>* writer) {
  const absl::Time arrived = s_->Now();
  const std::string& sid = req->session_id();
  WaitForCancelledTurn(sid, absl::Milliseconds(200));
  std::vector<int32_t> prompt =
      req->prompt_tokens().empty()
          ? EncodeText(req->prompt())
          : std::vector<int32_t>(req->prompt_tokens().begin(),
                                 req->prompt_tokens().end());
  int reserve_tokens = 0;
  {
    absl::MutexLock lock(&s_->mu_);
    auto it = s_->sessions_.find(sid);
    if (it == s_->sessions_.end()) return NoSession(sid);
    absl::Status valid = Validate(*req);
    if (!valid.ok()) return ToGrpc(valid);
    Session& session = it->second;
    if (session.busy)
      return grpc::Status(
          grpc::StatusCode::FAILED_PRECONDITION,
          absl::StrCat("a generate is already running on session ", sid));
    if (s_->shutting_down_)
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "coordinator is shutting down");
    bool settling = false;  // then the turn waits in the queue
    if (absl::Status nodes = CheckNodesLocked(&settling);
        !nodes.ok() && !settling)
      return ToGrpc(nodes);
    session.busy = true;
    session.turn_ctx = ctx;
    reserve_tokens = static_cast<int>(session.history.size()) +
                     (session.history.empty() ? 1 : 0) +
                     static_cast<int>(prompt.size()) + req->max_new_tokens();
  }
  // Clears the busy flag however the handler ends.
  struct BusyGuard {
    State* s;
    std::string id;
    ~BusyGuard() {
      absl::MutexLock lock(&s->mu_);
      auto it = s->sessions_.find(id);
      if (it != s->sessions_.end()) {
        it->second.busy = false;
        it->second.turn_ctx = nullptr;
      }
    }
  } busy_guard{s_, sid};

  absl::StatusOr<AdmittedTurn> admitted =
      WaitForAdmission(ctx, writer, sid, reserve_tokens, prompt);
  if (!admitted.ok()) {
    KLOG(Info, kLog) << "session=" << sid
                     << " turn refused: " << admitted.status();
    return ToGrpc(admitted.status());
  }
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
  } active_guard{this, s_, &turn};
  // Logs what the session gained however the turn ends (failed, cancelled),
  // before the client hears of it and before the session is idle again. A
  // finished turn is logged before its TurnDone instead.
  struct TurnLogGuard {
    KaratService* service;
    std::string sid;
    bool logged = false;
    ~TurnLogGuard() {
      if (logged) return;
      if (absl::Status st = service->LogTurn(sid); !st.ok()) {
        KLOG(Error, kLog) << "session=" << sid << " " << st.message();
      }
    }
  } log_guard{this, sid};

  cl::RunTurnRequest run;
  run.set_session(turn.key);
  run.set_seed(turn.seed);
  run.set_temperature(req->temperature());
  run.set_pos_start(turn.pos_start);
  run.mutable_feed_tokens()->Assign(turn.feed.begin(), turn.feed.end());
  run.set_max_new_tokens(req->max_new_tokens());
  if (!s_->gpu_only()) *run.mutable_placement() = turn.placement;
  run.mutable_prefill_ends()->Assign(turn.prefill_ends.begin(),
                                     turn.prefill_ends.end());

  int generated = 0;
  bool eos = false;
  int64_t ttft_us = 0;
  absl::Time previous = arrived;
  const int prefill_end = turn.pos_start + static_cast<int>(turn.feed.size());
  std::atomic<bool> client_cancelled{false};
  bool shutdown_cancel = false;
  grpc::Status gpu_status;
  int resumes = 0;
  // One RunTurn call per pass: the first, then one per resume on another
  // rank after a GPU rank was lost (DESIGN.md §7).
  for (;;) {
    grpc::ClientContext gpu_ctx;
    LossMarks at_start;
    {
      absl::MutexLock lock(&s_->mu_);
      if (s_->shutting_down_) gpu_ctx.TryCancel();
      s_->running_.insert(&gpu_ctx);
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
      at_start.rank_removals = s_->rank_removals_;
      at_start.karat_losses = s_->karat_losses_;
      at_start.alive_ranks = s_->AliveRanksLocked();
    }
    KLOG(Info, kLog) << "session=" << sid
                     << (resumes > 0 ? " turn resumed on " : " turn on ")
                     << turn.gpu_name << " (rank " << turn.rank
                     << ", micro-batch " << run.micro_batch() << ")"
                     << (s_->gpu_only()
                             ? std::string(" gpu_only")
                             : absl::StrCat(
                                   " home=", turn.placement.node_name(), "/",
                                   turn.placement.device()))
                     << " pos_start=" << run.pos_start()
                     << " feed=" << run.feed_tokens_size()
                     << " max_new_tokens=" << run.max_new_tokens();

    // Watches for the client going away and cancels the GPU call.
    absl::Mutex watch_mu;
    bool turn_over = false;
    std::thread watcher([&] {
      absl::MutexLock lock(&watch_mu);
      while (!turn_over) {
        watch_mu.AwaitWithTimeout(absl::Condition(&turn_over),
                                  absl::Milliseconds(20));
        if (!turn_over && ctx->IsCancelled()) {
          client_cancelled = true;
          gpu_ctx.TryCancel();
          return;
        }
      }
    });

    auto stub = cl::GpuNode::NewStub(turn.gpu_channel);
    std::unique_ptr<grpc::ClientReader<cl::RunTurnEvent>> reader =
        stub->RunTurn(&gpu_ctx, run);
    cl::RunTurnEvent ev;
    // Sends `out` to the client; a client that went away cancels the GPU
    // node's turn (its remaining events are drained).
    auto relay = [&](const v1::GenerateResponse& out) {
      if (writer->Write(out)) return true;
      client_cancelled = true;
      gpu_ctx.TryCancel();
      while (reader->Read(&ev)) {
      }
      return false;
    };
    while (reader->Read(&ev)) {
      if (ev.progress()) {
        // A long feed is part way through: no token, nothing to record.
        v1::GenerateResponse out;
        v1::PrefillProgress* p = out.mutable_prefill();
        p->set_fed_tokens(ev.prefill_fed());
        p->set_total_tokens(ev.prefill_total());
        if (!relay(out)) break;
        continue;
      }
      generated++;
      absl::Time now = s_->Now();
      int64_t latency = absl::ToInt64Microseconds(now - previous);
      {
        absl::MutexLock lock(&s_->mu_);
        Session& session = s_->sessions_.at(sid);
        session.history.push_back(ev.token_id());
        session.kv_len = ev.kv_len();
        // The first token exists once the prefill is done.
        if (generated == 1 && (session.prefill_ends.empty() ||
                               session.prefill_ends.back() < prefill_end))
          session.prefill_ends.push_back(prefill_end);
        s_->tokens_generated_++;
        (generated == 1 ? s_->ttft_ms_ : s_->tbt_ms_).Add(latency / 1000.0);
        auto r = s_->ranks_.find(turn.rank);
        if (r != s_->ranks_.end()) {
          auto t = r->second.running.find(turn.key);
          if (t != r->second.running.end())
            t->second.context_tokens =
                static_cast<int64_t>(session.history.size());
          s_->AddStepLocked(r->second, ev);
        }
      }
      if (generated == 1) ttft_us = latency;
      previous = now;
      if (ev.token_id() == kEosToken) eos = true;
      v1::GenerateResponse out;
      v1::GeneratedToken* tok = out.mutable_token();
      tok->set_token_id(ev.token_id());
      tok->set_text(TokenText(ev.token_id()));
      tok->set_position(ev.position());
      tok->set_latency_us(latency);
      if (!relay(out)) break;
    }
    gpu_status = reader->Finish();
    {
      absl::MutexLock lock(&watch_mu);
      turn_over = true;
    }
    watcher.join();
    {
      absl::MutexLock lock(&s_->mu_);
      s_->running_.erase(&gpu_ctx);
      shutdown_cancel = s_->shutting_down_;
    }
    if (client_cancelled || ctx->IsCancelled()) {
      KLOG(Info, kLog) << "session=" << sid
                       << " turn cancelled by the client after " << generated
                       << " tokens";
      return grpc::Status(grpc::StatusCode::CANCELLED,
                          "cancelled by the client");
    }
    if (gpu_status.ok() || shutdown_cancel) break;
    // Every token arrived before the call broke: the turn is complete.
    if (eos || generated >= req->max_new_tokens()) {
      gpu_status = grpc::Status::OK;
      break;
    }
    KLOG(Warning, kLog) << "session=" << sid << " GPU node " << turn.gpu_name
                        << " (rank " << turn.rank << ") failed after "
                        << generated
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
      if (resumes >= kMaxTurnResumes) {
        why = absl::StrCat(" (resumed ", resumes, " times already, the most)");
      } else {
        const std::string failed_on =
            absl::StrCat(turn.gpu_name, " (rank ", turn.rank, ")");
        absl::StatusOr<bool> resumed =
            ResumeTurn(ctx, sid, generated, req->max_new_tokens() - generated,
                       at_start, &turn, &run);
        if (resumed.ok() && *resumed) {
          ++resumes;
          absl::MutexLock lock(&s_->mu_);
          s_->turns_resumed_++;
          KLOG(Info, kLog) << "session=" << sid << " resuming after "
                           << generated << " tokens: " << failed_on
                           << " failed, " << turn.gpu_name << " (rank "
                           << turn.rank << ") continues";
          continue;
        }
        if (!resumed.ok()) {
          if (resumed.status().code() == absl::StatusCode::kCancelled) {
            return grpc::Status(grpc::StatusCode::CANCELLED,
                                "cancelled by the client");
          }
          why = absl::StrCat(" (cannot resume: ", resumed.status().message(),
                             ")");
        }
      }
    }
    return grpc::Status(
        code, absl::StrCat("GPU node ", turn.gpu_name, " (rank ", turn.rank,
                           ") failed during the turn after ", generated,
                           " tokens: ", gpu_status.error_message(), why));
  }
  log_guard.logged = true;
  if (absl::Status st = LogTurn(sid); !st.ok()) {
    KLOG(Error, kLog) << "session=" << sid << " " << st.message();
    return grpc::Status(
        grpc::StatusCode::INTERNAL,
        absl::StrCat("the turn's tokens could not be logged: ", st.message()));
  }
  const int64_t total_us = absl::ToInt64Microseconds(s_->Now() - arrived);
  const std::string reason =
      !gpu_status.ok() ? "cancelled" : (eos ? "eos" : "length");
  v1::GenerateResponse done;
  v1::TurnDone* d = done.mutable_done();
  d->set_finish_reason(reason);
  d->set_prompt_tokens(static_cast<int32_t>(prompt.size()));
  d->set_generated_tokens(generated);
  d->set_ttft_us(ttft_us);
  d->set_total_us(total_us);
  writer->Write(done);
  KLOG(Info, kLog) << "session=" << sid << " turn done: " << reason << " "
                   << generated << " tokens, ttft_us=" << ttft_us
                   << " total_us=" << total_us
                   << (resumes > 0
                           ? absl::StrCat(", resumed ", resumes, " times")
                           : std::string());
  return grpc::Status::OK;
}
}  // namespace karat::coordinator
