// FabricTransport progress thread: waiting for work, the progress loop,
// reading the completion queue, queueing and delivering received messages
// to the handler, HoldMessage() and re-posting receive buffers, and CQ
// errors.
#include "common/fabric_transport_internal.h"

namespace karat {
namespace fabric_internal {

void FabricTransport::SetPeerReceiveHandler(PeerReceiveHandler handler) {
  auto shared = std::make_shared<PeerReceiveHandler>(std::move(handler));
  absl::MutexLock lock(&handler_mu_);
  handler_ = std::move(shared);
  handler_generation_.fetch_add(1, std::memory_order_release);
}

void FabricTransport::Wake() {
  const uint64_t one = 1;
  // EAGAIN means the counter is already non-zero: a wake-up is pending.
  [[maybe_unused]] ssize_t n = write(wake_fd_.get(), &one, sizeof(one));
}

void FabricTransport::WaitForWork(absl::Duration poll_backoff) {
  pollfd fds[2];
  int nfds = 0;
  fds[nfds++] = pollfd{wake_fd_.get(), POLLIN, 0};
  absl::Duration wait = poll_backoff;
  if (cq_fd_ >= 0) {
    fds[nfds++] = pollfd{cq_fd_, POLLIN, 0};
    wait = absl::Milliseconds(kWaitTimeoutMs);
  }
  if (async_in_flight_.load(std::memory_order_relaxed) > 0) {
    const int64_t until =
        next_async_deadline_ns_.load(std::memory_order_relaxed) - NowNs();
    wait = std::min(wait, absl::Nanoseconds(std::max<int64_t>(until, 0)));
  }
  const timespec timeout = absl::ToTimespec(wait);
  const int rc = ppoll(fds, nfds, &timeout, nullptr);
  if (rc > 0 && (fds[0].revents & POLLIN)) {
    uint64_t value;
    [[maybe_unused]] ssize_t n = read(wake_fd_.get(), &value, sizeof(value));
  }
}

void FabricTransport::ProgressLoop() {
  progress_thread_id_.store(std::this_thread::get_id(),
                            std::memory_order_release);
  absl::Duration backoff = kMinPollBackoff;
  // When the last completion was handled: read from the clock only before
  // a sleep (not per message), so it may lag by the spin time.
  absl::Time last_completion = WallNow();
  bool completed = false;  // since last_completion was read
  const int64_t spin_ns = SpinNs(0);
  int64_t last_activity_ns = 0;  // as of the last clock read while spinning
  int64_t last_yield_ns = 0;
  std::vector<Received> direct;  // see DrainCompletions()
  direct.reserve(kCqBatch);
  uint32_t idle_spins = 0;
  while (!stop_.load(std::memory_order_acquire)) {
    RepostReleased();
    RetryPendingReceives();
    ExpireAsyncSends();
    RunReadyCallbacks();
    if (DeliverOne()) {
      backoff = kMinPollBackoff;
      completed = true;
      continue;
    }
    if (DrainCompletions(/*try_only=*/false, &direct) > 0) {
      // In CQ order; a handler that shuts the transport down ends it.
      for (const Received& r : direct) {
        if (stop_.load(std::memory_order_acquire)) break;
        Dispatch(r);
      }
      direct.clear();
      backoff = kMinPollBackoff;
      completed = true;
      continue;
    }
    // Recent traffic and no sender polling: keep polling without sleeping,
    // letting other runnable threads of the host go first now and then.
    // The clock is read every kSpinsPerClock polls only (a read costs
    // about as much as the rest of an empty poll), and the activity since
    // the last read is dated then.
    if (spin_ns > 0 && polling_senders_.load(std::memory_order_relaxed) == 0) {
      if ((++idle_spins & (kSpinsPerClock - 1)) != 0) {
        CpuRelax();
        continue;
      }
      const int64_t now = NowNs();
      if (activity_.exchange(false, std::memory_order_relaxed)) {
        last_activity_ns = now;
      }
      if (now - last_activity_ns < spin_ns) {
        if (now - last_yield_ns >= kYieldEveryNs) {
          sched_yield();
          last_yield_ns = now;
        }
        continue;
      }
    }
    // About to sleep: return the landing-zone space delivered meanwhile.
    if (completed) {
      last_completion = WallNow();
      completed = false;
    }
    FlushCredits();
    if (cq_fd_ >= 0) {
      fid* fids[1] = {&cq_->fid};
      int rc;
      {
        FidLock lock(this);
        if (closed_) return;
        rc = fi_trywait(fabric_.get(), fids, 1);
      }
      if (rc == -FI_EAGAIN) continue;  // completions pending or progress needed
      if (rc != 0) {
        KLOG(Warning, kLogModule) << "fi_trywait failed: " << FiError(rc)
                                  << "; polling the completion queue instead";
        cq_fd_ = -1;
      }
    }
    // A sender that queues a receive from now on sees the flag and wakes us;
    // one queued before is seen here.
    progress_sleeping_.store(true, std::memory_order_seq_cst);
    bool queued = ready_count_.load() > 0 ||
                  released_->count.load(std::memory_order_seq_cst) > 0;
    if (!queued) {
      absl::MutexLock lock(&recv_mu_);
      queued = !received_.empty();
    }
    if (!queued) WaitForWork(backoff);
    progress_sleeping_.store(false, std::memory_order_relaxed);
    const absl::Duration cap = WallNow() - last_completion > kIdleAfter
                                   ? kIdlePollBackoff
                                   : kMaxPollBackoff;
    backoff = std::min(backoff * 2, cap);
  }
}

void FabricTransport::RetryPendingReceives() {
  while (!pending_recvs_.empty()) {
    RecvSlot* slot = pending_recvs_.back();
    ssize_t rc;
    {
      FidLock lock(this);
      if (closed_) return;
      rc = fi_recv(ep_.get(), slot->buffer.get(), options_.max_message_size,
                   nullptr, FI_ADDR_UNSPEC, &slot->op.context);
    }
    if (rc == -FI_EAGAIN) return;
    pending_recvs_.pop_back();
    if (rc != 0) {
      KLOG(Error, kLogModule)
          << "re-posting a receive buffer failed: " << FiError(rc) << "; "
          << recv_slots_.size() - pending_recvs_.size() << " buffers remain";
    }
  }
}

int FabricTransport::DrainCompletions(bool try_only,
                                      std::vector<Received>* direct) {
  if (try_only) {
    if (!cq_mu_.TryLock()) return 0;
  } else {
    cq_mu_.Lock();
  }
  int handled = 0;
  for (;;) {
    fi_cq_data_entry entries[kCqBatch];
    fi_addr_t sources[kCqBatch];
    ssize_t n;
    {
      FidLock lock(this);
      if (closed_) {
        n = -FI_EAGAIN;
      } else if (source_) {
        n = fi_cq_readfrom(cq_.get(), entries, kCqBatch, sources);
      } else {
        n = fi_cq_read(cq_.get(), entries, kCqBatch);
      }
    }
    if (n == -FI_EAGAIN) break;
    if (n == -FI_EAVAIL) {
      HandleError();
      ++handled;
      continue;
    }
    if (n < 0) {
      KLOG(Error, kLogModule) << "fi_cq_read failed: " << FiError(n);
      break;
    }
    for (ssize_t i = 0; i < n; ++i) {
      HandleCompletion(entries[i], source_ ? sources[i] : FI_ADDR_NOTAVAIL,
                       direct);
    }
    handled += static_cast<int>(n);
    // A short batch emptied the queue: return what was read rather than
    // poll the provider once more (every caller polls again while this
    // returns completions, so none is left behind before a sleep). In a
    // ping-pong that second poll sat between a message and its handler.
    if (n < kCqBatch) break;
  }
  cq_mu_.Unlock();
  if (handled > 0) NoteActivity();
  // Callbacks run on the progress thread, at the top of its loop.
  if (!OnProgressThread() && ready_count_.load() > 0 &&
      progress_sleeping_.load(std::memory_order_seq_cst)) {
    Wake();
  }
  return handled;
}

void FabricTransport::QueueReceived(const Received& r, bool wake,
                                    std::vector<Received>* direct) {
  // Every queuing holds cq_mu_ and only the progress thread (the one caller
  // with `direct`) dequeues, so the count is exact here.
  if (direct != nullptr &&
      received_count_.load(std::memory_order_relaxed) == 0) {
    direct->push_back(r);
    return;
  }
  {
    absl::MutexLock lock(&recv_mu_);
    received_.push_back(r);
    received_count_.fetch_add(1, std::memory_order_release);
  }
  if (wake && !OnProgressThread() &&
      progress_sleeping_.load(std::memory_order_seq_cst)) {
    Wake();
  }
}

bool FabricTransport::DeliverOne() {
  if (received_count_.load(std::memory_order_acquire) == 0) return false;
  Received r;
  {
    absl::MutexLock lock(&recv_mu_);
    if (received_.empty()) return false;
    r = received_.front();
    received_.pop_front();
    received_count_.fetch_sub(1, std::memory_order_release);
  }
  Dispatch(r);
  return true;
}

void FabricTransport::Dispatch(const Received& r) {
  if (r.deliver && r.data != 0) {
    HandleControl(r.slot, r.len, r.src, r.data);
  } else if (r.deliver) {
    DeliverReceived(r.slot, r.len, r.src, r.source_tag);
  } else {
    RepostRecv(r.slot);
  }
}

void FabricTransport::HandleCompletion(const fi_cq_data_entry& entry,
                                       fi_addr_t src,
                                       std::vector<Received>* direct) {
  if (entry.op_context == nullptr) return;
  const OpContext* op = static_cast<const OpContext*>(entry.op_context);
  if (op->kind == OpKind::kSend) {
    CompleteSend(static_cast<SendOp*>(op->owner), absl::OkStatus());
    return;
  }
  uint64_t data = 0;
  uint64_t source_tag = 0;
  if ((entry.flags & FI_REMOTE_CQ_DATA) != 0 &&
      (entry.data & kControlTagMask) == kControlTag) {
    data = entry.data;
  } else if ((entry.flags & FI_REMOTE_CQ_DATA) != 0 &&
             (entry.data & kSourceTagMask) == kSourceTag) {
    // From a peer's send endpoint: the source is the peer whose main
    // address hashes to the data, looked up at delivery.
    source_tag = entry.data;
    src = FI_ADDR_NOTAVAIL;
  }
  RecvSlot* slot = static_cast<RecvSlot*>(op->owner);
  if (data == (kControlTag | static_cast<uint64_t>(ControlKind::kCredit))) {
    // Applied by whichever thread reads the CQ (order does not matter for
    // credits); only the buffer goes back to the progress thread, without
    // waking it: a waiting sender need not hand each credit over.
    ApplyCredit(std::string_view(slot->buffer.get(), entry.len), src);
    QueueReceived(Received{slot}, /*wake=*/false, direct);
    return;
  }
  QueueReceived(
      Received{slot, entry.len, /*deliver=*/true, src, data, source_tag},
      /*wake=*/true, direct);
}

void FabricTransport::CallHandler(PeerId from, std::string_view message) {
  const uint64_t generation =
      handler_generation_.load(std::memory_order_acquire);
  if (generation != progress_handler_generation_) {
    absl::MutexLock lock(&handler_mu_);
    progress_handler_ = handler_;
    progress_handler_generation_ =
        handler_generation_.load(std::memory_order_relaxed);
  }
  // progress_handler_ changes only above, and deliveries do not nest: a
  // handler that replaces itself keeps running.
  const PeerReceiveHandler* handler = progress_handler_.get();
  if (handler != nullptr && *handler) {
    (*handler)(from, message);
  } else {
    KLOG(Warning, kLogModule) << "dropped a " << message.size()
                              << "-byte message: no receive handler";
  }
}

void FabricTransport::DeliverReceived(RecvSlot* slot, size_t len, fi_addr_t src,
                                      uint64_t source_tag) {
  const PeerId from =
      source_tag != 0 ? PeerBySourceTag(source_tag) : PeerByFiAddr(src);
  if (from == kUnknownPeer && source_) {
    messages_unknown_source_.fetch_add(1, std::memory_order_relaxed);
  }
  delivering_ = slot;
  delivering_held_ = false;
  CallHandler(from, std::string_view(slot->buffer.get(), len));
  delivering_ = nullptr;
  if (!delivering_held_) {
    RepostRecv(slot);
  } else if (!spare_.empty()) {
    RepostRecv(spare_.back());
    spare_.pop_back();
  } else {
    ++unreplaced_;
  }
}

std::shared_ptr<const void> FabricTransport::HoldMessage() {
  if (!OnProgressThread() || delivering_ == nullptr || delivering_held_ ||
      2 * (held_ + 1) > static_cast<int>(recv_slots_.size())) {
    return nullptr;
  }
  delivering_held_ = true;
  ++held_;
  messages_held_.fetch_add(1, std::memory_order_relaxed);
  RecvSlot* slot = delivering_;
  std::shared_ptr<char[]> buffer = slot->buffer;
  const char* bytes = buffer.get();
  return std::shared_ptr<const void>(bytes, [released = released_, slot,
                                             buffer](const void*) {
    absl::MutexLock lock(&released->mu);
    if (released->closed) return;
    released->slots.push_back(slot);
    released->count.fetch_add(1, std::memory_order_seq_cst);
    if (!released->progress_sleeping.load(std::memory_order_seq_cst)) return;
    const uint64_t one = 1;
    // EAGAIN: a wake-up is already pending.
    [[maybe_unused]] ssize_t n = write(released->wake_fd, &one, sizeof(one));
  });
}

void FabricTransport::RepostReleased() {
  if (released_->count.load(std::memory_order_acquire) == 0) return;
  std::vector<RecvSlot*> slots;
  {
    absl::MutexLock lock(&released_->mu);
    slots.swap(released_->slots);
    released_->count.store(0, std::memory_order_release);
  }
  for (RecvSlot* slot : slots) {
    --held_;
    if (unreplaced_ > 0) {
      --unreplaced_;
      RepostRecv(slot);
    } else {
      spare_.push_back(slot);
    }
  }
  holds_returned_.fetch_add(slots.size(), std::memory_order_relaxed);
}

void FabricTransport::HandleError() {
  fi_cq_err_entry err{};
  ssize_t rc;
  char prov_text[256] = "";
  {
    FidLock lock(this);
    if (closed_) return;
    rc = fi_cq_readerr(cq_.get(), &err, 0);
    if (rc == 1 && err.prov_errno != 0) {
      const char* text = fi_cq_strerror(cq_.get(), err.prov_errno, err.err_data,
                                        prov_text, sizeof(prov_text));
      if (text != nullptr && text != prov_text) {
        std::snprintf(prov_text, sizeof(prov_text), "%s", text);
      }
    }
  }
  if (rc != 1) {
    KLOG(Error, kLogModule) << "fi_cq_readerr failed: " << FiError(rc);
    return;
  }
  const std::string detail = absl::StrCat(
      fi_strerror(err.err), prov_text[0] != '\0' ? " / " : "", prov_text);
  if (err.op_context == nullptr) {
    KLOG(Error, kLogModule) << "completion error without context: " << detail;
    return;
  }
  const OpContext* context = static_cast<const OpContext*>(err.op_context);
  if (context->kind == OpKind::kSend) {
    SendOp* op = static_cast<SendOp*>(context->owner);
    const std::string peer = PeerName(op->peer);
    KLOG(Error, kLogModule)
        << "send to peer '" << peer << "' failed: " << detail;
    CompleteSend(op, absl::UnavailableError(absl::StrCat(
                         "send to peer '", peer, "' failed: ", detail)));
    return;
  }
  RecvSlot* slot = static_cast<RecvSlot*>(context->owner);
  if (err.err == FI_ECANCELED) return;  // endpoint closing
  if (err.err == FI_ETRUNC) {
    KLOG(Error, kLogModule)
        << "dropped a message longer than the " << options_.max_message_size
        << "-byte receive buffer (" << err.olen << " bytes cut)";
  } else {
    KLOG(Error, kLogModule) << "receive failed: " << detail;
  }
  QueueReceived(Received{slot}, /*wake=*/true);
}

}  // namespace fabric_internal
}  // namespace karat
