#include "gpu_node/decode_loop.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/log.h"
#include "common/log_ids.h"

namespace karat {

// ---------------------------------------------------------------------------
// TurnStream

TurnStream::Next TurnStream::Pop(absl::Duration timeout,
                                 cluster::RunTurnEvent* event) {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return finished_ || !events_.empty();
  };
  mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  if (!events_.empty()) {
    *event = std::move(events_.front());
    events_.pop_front();
    return Next::kEvent;
  }
  return finished_ ? Next::kFinished : Next::kTimeout;
}

absl::Status TurnStream::status() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

void TurnStream::Push(cluster::RunTurnEvent event) {
  absl::MutexLock lock(&mu_);
  if (finished_) return;
  events_.push_back(std::move(event));
}

void TurnStream::Finish(absl::Status status) {
  absl::MutexLock lock(&mu_);
  if (finished_) return;
  finished_ = true;
  status_ = std::move(status);
}

// ---------------------------------------------------------------------------
// DecodeLoop

struct DecodeLoop::Request {
  TurnRequest turn;
  std::shared_ptr<TurnStream> stream;
  RequestState state = RequestState::kPrefill;
  size_t fed = 0;           // feed tokens already run
  int next_pos = 0;         // position of the next token to feed
  int32_t next_token = -1;  // the decode feed (last sampled token)
  int generated = 0;
};

// A thread that runs one job at a time for the loop thread: the second
// micro-batch's step.
class DecodeLoop::MicroBatchThread {
 public:
  explicit MicroBatchThread(int threads) {
    thread_ = std::thread([this, threads] {
      if (threads > 0) omp_set_num_threads(threads);
      for (;;) {
        std::function<void()> job;
        {
          absl::MutexLock lock(&mu_);
          auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
            return stop_ || job_ != nullptr;
          };
          mu_.Await(absl::Condition(&ready));
          if (job_ == nullptr) return;
          job = std::move(job_);
          job_ = nullptr;
        }
        job();
        absl::MutexLock lock(&mu_);
        done_ = true;
      }
    });
  }
  ~MicroBatchThread() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }
  void Run(std::function<void()> job) {
    absl::MutexLock lock(&mu_);
    done_ = false;
    job_ = std::move(job);
  }
  void Wait() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&done_));
  }

 private:
  absl::Mutex mu_;
  std::function<void()> job_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = true;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

DecodeLoop::DecodeLoop(const ModelRunner* runner, StepBackend* backend,
                       const DecodeLoopOptions& options, ExpertSource experts)
    : runner_(runner),
      backend_(backend),
      options_(options),
      experts_(std::move(experts)),
      token_(options.schedule, options.timing),
      hooks_{TokenWaitHooks(&token_, 0), TokenWaitHooks(&token_, 1)} {
  if (options_.micro_batches > 1) {
    second_ = std::make_unique<MicroBatchThread>(options_.threads);
  }
}

DecodeLoop::~DecodeLoop() {
  Stop();
  second_.reset();
}

void DecodeLoop::SetMicroBatches(
    const absl::flat_hash_map<uint64_t, int>& assignment) {
  absl::MutexLock lock(&mu_);
  // Only sessions running here: a session whose turn has not arrived yet
  // takes the micro-batch its RunTurn names.
  for (const auto& [session, mb] : assignment) {
    auto it = micro_batch_of_.find(session);
    if (it == micro_batch_of_.end()) continue;
    it->second = (mb == 1 && options_.micro_batches > 1) ? 1 : 0;
  }
}

void DecodeLoop::Start() {
  absl::MutexLock lock(&mu_);
  if (thread_.joinable() || stopping_) return;
  thread_ = std::thread([this] { Run(); });
}

absl::StatusOr<std::shared_ptr<TurnStream>> DecodeLoop::Submit(
    TurnRequest turn) {
  auto request = std::make_shared<Request>();
  request->next_pos = turn.pos_start;
  request->turn = std::move(turn);
  request->stream = std::make_shared<TurnStream>();
  absl::MutexLock lock(&mu_);
  if (stopping_) {
    return absl::UnavailableError("the GPU node is shutting down");
  }
  pending_.push_back(request);
  return request->stream;
}

void DecodeLoop::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
  // Turns queued when the loop never ran.
  absl::MutexLock lock(&mu_);
  for (auto& r : pending_) {
    r->stream->Finish(absl::UnavailableError("the GPU node is shutting down"));
  }
  pending_.clear();
}

DecodeStats DecodeLoop::stats() const {
  absl::MutexLock lock(&mu_);
  DecodeStats s = stats_;
  s.queued_requests = pending_.size();
  if (s.steps > 0) {
    s.mean_batch_size = double(segments_total_) / double(s.steps);
    s.mean_step_tokens = double(step_tokens_total_) / double(s.steps);
  }
  s.busy_seconds = token_.busy_seconds();
  s.stalled_seconds = token_.stalled_seconds();
  s.switches = token_.switches();
  s.model_wait_seconds = token_.model_wait_seconds();
  s.model_seconds = token_.model_seconds();
  return s;
}

void DecodeLoop::Retire(Request* request) {
  request->state = RequestState::kDone;
  backend_->ClearPlacement(request->turn.session);
  absl::MutexLock lock(&mu_);
  micro_batch_of_.erase(request->turn.session);
}

void DecodeLoop::Run() {
  if (options_.threads > 0) omp_set_num_threads(options_.threads);
  std::vector<std::shared_ptr<Request>> active;
  for (;;) {
    std::vector<std::shared_ptr<Request>> admitted;
    {
      absl::MutexLock lock(&mu_);
      if (active.empty()) {
        auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
          return stopping_ || !pending_.empty();
        };
        mu_.Await(absl::Condition(&ready));
      }
      if (stopping_) {
        const absl::Status down =
            absl::UnavailableError("the GPU node is shutting down");
        for (auto& r : active) r->stream->Finish(down);
        for (auto& r : pending_) r->stream->Finish(down);
        pending_.clear();
        stats_.active_requests = 0;
        return;
      }
    }

    // Cancelled turns leave at the step boundary.
    for (auto& r : active) {
      if (r->stream->cancelled()) {
        KLOG(Info, "gpu_node")
            << "session=" << ShortKey(r->turn.session)
            << " turn cancelled after " << r->generated << " tokens";
        r->stream->Finish(absl::CancelledError("turn cancelled"));
        Retire(r.get());
      }
    }
    active.erase(std::remove_if(active.begin(), active.end(),
                                [](const std::shared_ptr<Request>& r) {
                                  return r->state == RequestState::kDone;
                                }),
                 active.end());

    // Admission: up to max_batch, one turn per session at a time.
    {
      absl::MutexLock lock(&mu_);
      for (auto it = pending_.begin(); it != pending_.end();) {
        const auto& r = *it;
        if (r->stream->cancelled()) {
          r->stream->Finish(absl::CancelledError("turn cancelled"));
          it = pending_.erase(it);
          continue;
        }
        if (int(active.size() + admitted.size()) >=
            std::max(1, options_.max_batch)) {
          break;
        }
        auto same = [&](const std::shared_ptr<Request>& o) {
          return o->turn.session == r->turn.session;
        };
        if (std::any_of(active.begin(), active.end(), same) ||
            std::any_of(admitted.begin(), admitted.end(), same)) {
          ++it;
          continue;
        }
        admitted.push_back(r);
        it = pending_.erase(it);
      }
    }
    for (auto& r : admitted) {
      backend_->SetPlacement(r->turn.session, r->turn.placement,
                             r->turn.turn_epoch);
      KLOG(Debug, "gpu_node")
          << "session=" << ShortKey(r->turn.session)
          << " turn admitted: " << r->turn.feed_tokens.size()
          << " feed tokens from position " << r->turn.pos_start << ", up to "
          << r->turn.max_new_tokens << " new";
      active.push_back(r);
    }
    {
      absl::MutexLock lock(&mu_);
      for (auto& r : admitted) {
        micro_batch_of_[r->turn.session] =
            options_.micro_batches > 1 ? r->turn.micro_batch : 0;
      }
    }
    if (active.empty()) continue;
    RunStep(&active);
    absl::MutexLock lock(&mu_);
    stats_.active_requests = active.size();
  }
}

void DecodeLoop::RunStep(std::vector<std::shared_ptr<Request>>* active) {
  const absl::Time step_start = absl::Now();
  // Token budget: decode tokens first (they bound the time between tokens),
  // then prefill chunks with what is left.
  int budget = std::max(1, options_.max_step_tokens);
  std::vector<int> chunk(active->size(), 0);
  for (size_t i = 0; i < active->size() && budget > 0; ++i) {
    if ((*active)[i]->state == RequestState::kDecode) {
      chunk[i] = 1;
      --budget;
    }
  }
  for (size_t i = 0; i < active->size() && budget > 0; ++i) {
    Request& r = *(*active)[i];
    if (r.state != RequestState::kPrefill) continue;
    // A chunk ends at the next turn boundary of the feed at the latest.
    int until = int(r.turn.feed_tokens.size());
    for (int end : r.turn.prefill_ends) {
      if (end > int(r.fed)) {
        until = std::min(until, end);
        break;
      }
    }
    const int remaining = until - int(r.fed);
    chunk[i] = std::min(remaining, budget);
    budget -= chunk[i];
  }

  std::vector<Segment> segs;
  std::vector<size_t> owner;
  int32_t step_prefill = 0;  // prompt tokens this step feeds
  for (size_t i = 0; i < active->size(); ++i) {
    if (chunk[i] == 0) continue;
    Request& r = *(*active)[i];
    Segment seg;
    seg.session = r.turn.session;
    seg.pos_start = r.next_pos;
    if (r.state == RequestState::kPrefill) {
      seg.tokens.assign(r.turn.feed_tokens.begin() + r.fed,
                        r.turn.feed_tokens.begin() + r.fed + chunk[i]);
      step_prefill += chunk[i];
      const size_t end = r.fed + chunk[i];
      seg.ends_prefill =
          (end == r.turn.feed_tokens.size() && r.turn.feed_ends_prefill) ||
          std::find(r.turn.prefill_ends.begin(), r.turn.prefill_ends.end(),
                    int(end)) != r.turn.prefill_ends.end();
    } else {
      seg.tokens.push_back(r.next_token);
    }
    segs.push_back(std::move(seg));
    owner.push_back(i);
  }

  // Micro-batches: each runs its own step over its segments; with two, the
  // second runs on its own thread and the worker token decides who computes.
  std::vector<int> mb_of(segs.size(), 0);
  {
    absl::MutexLock lock(&mu_);
    for (size_t k = 0; k < segs.size(); ++k) {
      auto it = micro_batch_of_.find(segs[k].session);
      if (it != micro_batch_of_.end()) mb_of[k] = it->second;
    }
  }
  uint64_t mb_tokens[2] = {0, 0};
  for (size_t k = 0; k < segs.size(); ++k) {
    mb_tokens[mb_of[k]] += segs[k].tokens.size();
  }
  const bool two = second_ != nullptr && mb_tokens[0] > 0 && mb_tokens[1] > 0;
  backend_->BeginStep();
  // Segments whose attention failed on their own (their session freed, a
  // KARAT node lost, their turn superseded): they leave the step, the
  // others go on (ModelRunner::Step).
  std::vector<absl::Status> seg_failed(segs.size());
  auto run = [&](int slot, int mb, const std::vector<Segment>& part,
                 std::vector<absl::Status>* failed) {
    token_.Begin(slot);
    AttentionBackend* attention = backend_->ForMicroBatch(mb, &hooks_[slot]);
    ExpertBackend* experts = experts_ ? experts_(mb, &hooks_[slot]) : nullptr;
    auto result = runner_->Step(part, attention, experts, failed);
    token_.End(slot);
    return result;
  };
  absl::StatusOr<std::vector<std::vector<float>>> logits;
  if (two) {
    // Each micro-batch's segments, and where their logits go.
    std::vector<Segment> part[2];
    std::vector<size_t> index[2];
    for (size_t k = 0; k < segs.size(); ++k) {
      part[mb_of[k]].push_back(segs[k]);
      index[mb_of[k]].push_back(k);
    }
    absl::StatusOr<std::vector<std::vector<float>>> second;
    std::vector<absl::Status> failed[2];
    token_.BeginStep(2);
    second_->Run([&] { second = run(1, 1, part[1], &failed[1]); });
    absl::StatusOr<std::vector<std::vector<float>>> first =
        run(0, 0, part[0], &failed[0]);
    second_->Wait();
    // One status and the logits in segment order.
    if (!first.ok()) {
      logits = first.status();
    } else if (!second.ok()) {
      logits = second.status();
    } else {
      logits = std::vector<std::vector<float>>(segs.size());
      for (int mb = 0; mb < 2; ++mb) {
        auto& result = mb == 0 ? *first : *second;
        for (size_t i = 0; i < index[mb].size(); ++i) {
          (*logits)[index[mb][i]] = std::move(result[i]);
          if (i < failed[mb].size())
            seg_failed[index[mb][i]] = std::move(failed[mb][i]);
        }
      }
    }
  } else {
    // Every segment in one micro-batch: the step runs on this thread.
    token_.BeginStep(1);
    logits = run(0, mb_tokens[0] > 0 ? 0 : 1, segs, &seg_failed);
    seg_failed.resize(segs.size());
  }

  // Outcomes are published after the statistics, so that a caller who saw
  // its turn end also sees the steps that produced it counted.
  struct Outcome {
    Request* request;
    cluster::RunTurnEvent event;
    bool has_event = false;
    absl::Status failure;  // without an event: why the request failed
  };
  std::vector<Outcome> outcomes;
  uint64_t prefilled = 0, decoded = 0, generated = 0, step_tokens = 0;
  uint64_t failed_requests = 0;
  // The step as every event reports it (RunTurnEvent.step_*), the context
  // counted before this step's tokens.
  const int64_t step_us = absl::ToInt64Microseconds(absl::Now() - step_start);
  int64_t step_context = 0;
  for (const auto& r : *active) step_context += r->next_pos;
  if (logits.ok()) {
    const int eos = runner_->config().eos_token_id;
    for (size_t k = 0; k < segs.size(); ++k) {
      Request* r = (*active)[owner[k]].get();
      const int n = int(segs[k].tokens.size());
      if (!seg_failed[k].ok()) {
        // This request alone fails; the step's others go on.
        ++failed_requests;
        outcomes.push_back(Outcome{r, {}, false, seg_failed[k]});
        continue;
      }
      step_tokens += n;
      r->next_pos += n;
      if (r->state == RequestState::kPrefill) {
        r->fed += n;
        prefilled += n;
        if (r->fed < r->turn.feed_tokens.size()) {
          // Part of a long feed: tell the caller how far it got.
          Outcome o{r, {}, true, absl::OkStatus()};
          o.event.set_progress(true);
          o.event.set_prefill_fed(static_cast<int32_t>(r->fed));
          o.event.set_prefill_total(
              static_cast<int32_t>(r->turn.feed_tokens.size()));
          outcomes.push_back(std::move(o));
          continue;
        }
      } else {
        decoded += n;
      }
      // The new token's position is the segment's end: pos_start + n.
      const int32_t token = SampleToken((*logits)[k], r->turn.temperature,
                                        r->turn.seed, r->next_pos);
      ++r->generated;
      ++generated;
      const bool last = token == eos || r->generated >= r->turn.max_new_tokens;
      Outcome o{r, {}, true, absl::OkStatus()};
      o.event.set_token_id(token);
      o.event.set_position(r->next_pos);
      o.event.set_kv_len(r->next_pos);
      o.event.set_last(last);
      o.event.set_step_us(std::max<int64_t>(step_us, 1));
      o.event.set_step_requests(static_cast<int32_t>(active->size()));
      o.event.set_step_context_tokens(step_context);
      o.event.set_step_prefill_tokens(step_prefill);
      outcomes.push_back(std::move(o));
      if (!last) {
        r->state = RequestState::kDecode;
        r->next_token = token;
      }
    }
  } else {
    std::string sessions;
    for (const Segment& s : segs)
      absl::StrAppend(&sessions, " ", ShortKey(s.session));
    KLOG(Error, "gpu_node") << "step over " << segs.size()
                            << " requests failed: " << logits.status()
                            << "; failing session=" << sessions;
    for (size_t k = 0; k < segs.size(); ++k) {
      outcomes.push_back(
          Outcome{(*active)[owner[k]].get(), {}, false, logits.status()});
    }
  }
  {
    absl::MutexLock lock(&mu_);
    ++stats_.steps;
    if (!logits.ok()) ++stats_.failed_steps;
    stats_.failed_requests +=
        logits.ok() ? failed_requests : uint64_t(segs.size());
    stats_.tokens_prefilled += prefilled;
    stats_.tokens_decoded += decoded;
    stats_.tokens_generated += generated;
    segments_total_ += segs.size();
    step_tokens_total_ += step_tokens;
    if (two) ++stats_.two_micro_batch_steps;
    stats_.micro_batch_tokens[0] += mb_tokens[0];
    stats_.micro_batch_tokens[1] += mb_tokens[1];
  }

  for (Outcome& o : outcomes) {
    Request* r = o.request;
    if (!o.has_event) {
      if (logits.ok()) {
        KLOG(Warning, "gpu_node") << "session=" << ShortKey(r->turn.session)
                                  << " turn failed alone after " << r->generated
                                  << " tokens: " << o.failure;
      }
      r->stream->Finish(o.failure);
      Retire(r);
      continue;
    }
    const bool last = o.event.last();
    r->stream->Push(std::move(o.event));
    if (last) {
      KLOG(Debug, "gpu_node") << "session=" << ShortKey(r->turn.session)
                              << " turn done: " << r->generated
                              << " tokens, kv_len " << r->next_pos;
      r->stream->Finish(absl::OkStatus());
      Retire(r);
    }
  }
  active->erase(std::remove_if(active->begin(), active->end(),
                               [](const std::shared_ptr<Request>& r) {
                                 return r->state == RequestState::kDone;
                               }),
                active->end());
}

}  // namespace karat
