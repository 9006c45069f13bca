// FabricTransport sends: send ops, Send()/SendShared()/SendSharedAsync(),
// posting with retries on a full transmit queue, inject, waiting for a
// completion (spinning or on the progress thread) and send timeouts, the
// outcome of send ops and their callbacks, asynchronous send deadlines and
// FailPeer().
#include "common/fabric_transport_internal.h"

namespace karat {
namespace fabric_internal {

SendOp* FabricTransport::AcquireSendOp(size_t len) {
  std::unique_ptr<SendOp> op;
  {
    absl::MutexLock lock(&send_mu_);
    if (!free_ops_.empty()) {
      op = std::move(free_ops_.back());
      free_ops_.pop_back();
    }
  }
  if (op == nullptr) op = std::make_unique<SendOp>();
  if (op->capacity < len || op->buffer == nullptr) {
    op->capacity = std::max<size_t>(len, 4096);
    op->buffer.reset(new char[op->capacity]);
  }
  op->done = false;
  op->done_flag.store(false, std::memory_order_relaxed);
  op->completed = false;
  op->released = false;
  op->status = absl::OkStatus();
  op->len = 0;
  op->deadline_ns = 0;
  op->generation = next_generation_.fetch_add(1, std::memory_order_relaxed);
  return op.release();
}

void FabricTransport::RecycleSendOp(SendOp* op) {
  in_flight_.erase(op);
  op->owned.reset();
  op->callback = nullptr;
  if (free_ops_.size() < kMaxCachedSendOps) {
    free_ops_.emplace_back(op);
  } else {
    delete op;
  }
}

absl::Status FabricTransport::Send(PeerId peer, const void* data, size_t len) {
  return SendMessage(peer, static_cast<const char*>(data), len, nullptr);
}

absl::Status FabricTransport::SendShared(
    PeerId peer, std::shared_ptr<const std::string> message) {
  if (message == nullptr) {
    return absl::InvalidArgumentError("SendShared: null message");
  }
  const char* data = message->data();
  const size_t len = message->size();
  if (options_.zero_copy_threshold == 0 || len < options_.zero_copy_threshold) {
    return SendMessage(peer, data, len, nullptr);
  }
  return SendMessage(peer, data, len, std::move(message));
}

absl::Status FabricTransport::SendSharedAsync(
    PeerId peer, std::shared_ptr<const std::string> message, SendDone done) {
  if (absl::Status args = CheckAsyncArgs(message, done); !args.ok())
    return args;
  const char* data = message->data();
  const size_t len = message->size();
  // Small messages are copied into the op's buffer before SendMessage()
  // returns; `message` keeps the bytes alive until then.
  std::shared_ptr<const std::string> owned;
  if (options_.zero_copy_threshold > 0 && len >= options_.zero_copy_threshold) {
    owned = message;
  }
  if (rma_ && !send_after_write_ && len >= options_.rma_threshold &&
      len <= options_.max_message_size) {
    // The notice may only follow the write once it completed: waiting for
    // that is the send, so this one is synchronous.
    RETURN_IF_ERROR(SendMessage(peer, data, len, std::move(owned)));
    async_sent_.fetch_add(1, std::memory_order_relaxed);
    done(absl::OkStatus());
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(SendMessage(peer, data, len, std::move(owned), &done));
  async_sent_.fetch_add(1, std::memory_order_relaxed);
  if (done) done(absl::OkStatus());  // complete already (inject)
  return absl::OkStatus();
}

absl::Status FabricTransport::SendMessage(
    PeerId peer, const char* data, size_t len,
    std::shared_ptr<const std::string> owned, SendDone* async) {
  if (rma_ && len >= options_.rma_threshold &&
      len <= options_.max_message_size) {
    // A failed peer gets no zone request either.
    RETURN_IF_ERROR(PeerFailure(peer));
    std::optional<absl::Status> sent =
        TrySendRma(peer, data, len, &owned, async);
    if (sent.has_value()) return *std::move(sent);
  }
  return SendImpl(peer, data, len, std::move(owned), WireOp(), nullptr, async);
}

absl::Status FabricTransport::PeerFailure(PeerId peer) const {
  absl::MutexLock lock(&peers_mu_);
  if (peer < 0 || static_cast<size_t>(peer) >= peers_.size()) {
    return absl::OkStatus();  // reported as an unknown id by the caller
  }
  return peers_[peer].failed;
}

absl::Status FabricTransport::PostRetrying(PeerId peer, const char* what,
                                           absl::Time deadline,
                                           absl::FunctionRef<ssize_t()> post,
                                           bool* post_failed) {
  absl::Duration backoff = kMinPollBackoff;
  for (;;) {
    ssize_t rc = 0;
    bool closed;
    {
      FidLock lock(this);
      closed = closed_;
      if (!closed) rc = post();
    }
    // Errors name the peer with PeerName(), never under fid_lock_
    // (AddPeer() takes peers_mu_ before it).
    if (closed) {
      return absl::UnavailableError(absl::StrCat(
          "send to peer '", PeerName(peer), "': transport is shut down"));
    }
    if (rc == 0) return absl::OkStatus();
    if (rc != -FI_EAGAIN) {
      if (post_failed != nullptr) *post_failed = true;
      return absl::UnavailableError(absl::StrCat("send to peer '",
                                                 PeerName(peer), "': ", what,
                                                 " failed: ", FiError(rc)));
    }
    if (deadline == absl::InfiniteFuture()) {
      deadline = WallNow() + absl::Milliseconds(options_.send_timeout_ms);
    }
    if (absl::Status failed = PeerFailure(peer); !failed.ok()) return failed;
    // The transmit queue is full: reap completions to free it.
    const uint64_t seen = SendsCompleted();
    if (DrainCompletions(/*try_only=*/!OnProgressThread()) > 0) {
      backoff = kMinPollBackoff;
      continue;
    }
    if (!OnProgressThread()) Wake();
    if (WallNow() >= deadline) {
      return absl::UnavailableError(
          absl::StrCat("send to peer '", PeerName(peer),
                       "': transmit queue stayed full for ",
                       options_.send_timeout_ms, " ms"));
    }
    backoff = WaitForTransmitSlot(seen, backoff);
  }
}

absl::Status FabricTransport::InjectSend(PeerId peer, fid_ep* send_ep,
                                         fi_addr_t fi_addr, const char* data,
                                         size_t len, const WireOp& wire) {
  // User messages from a peer's send endpoint carry the source data.
  const bool tagged = send_ep != nullptr && !wire.has_data;
  RETURN_IF_ERROR(
      PostRetrying(peer, "fi_inject", absl::InfiniteFuture(), [&]() -> ssize_t {
        if (tagged) {
          return fi_injectdata(send_ep, data, len, source_data_, fi_addr);
        }
        if (wire.has_data) {
          return fi_injectdata(ep_.get(), data, len, wire.data, fi_addr);
        }
        return fi_inject(ep_.get(), data, len, fi_addr);
      }));
  // Manual-progress providers may still have to move the bytes: make sure
  // the progress thread polls.
  NoteActivity();
  if (!OnProgressThread() &&
      progress_sleeping_.load(std::memory_order_seq_cst)) {
    Wake();
  }
  return absl::OkStatus();
}

absl::Status FabricTransport::SendImpl(PeerId peer, const char* data,
                                       size_t len,
                                       std::shared_ptr<const std::string> owned,
                                       const WireOp& wire, bool* post_failed,
                                       SendDone* async) {
  if (len > options_.max_message_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("message of ", len, " bytes exceeds the maximum of ",
                     options_.max_message_size));
  }
  fi_addr_t fi_addr;
  // Used under fid_lock_ only (Shutdown() closes it).
  fid_ep* send_ep;
  {
    absl::MutexLock lock(&peers_mu_);
    if (peer < 0 || static_cast<size_t>(peer) >= peers_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown peer id ", peer));
    }
    if (!peers_[peer].failed.ok()) return peers_[peer].failed;
    fi_addr = peers_[peer].fi_addr;
    send_ep = peers_[peer].send_ep.get();
  }
  if (len > 0 && len <= inject_size_ && !wire.write) {
    return InjectSend(peer, send_ep, fi_addr, data, len, wire);
  }
  const bool tagged = send_ep != nullptr && !wire.has_data && !wire.write;
  const absl::Time deadline =
      WallNow() + absl::Milliseconds(options_.send_timeout_ms);

  SendOp* op = AcquireSendOp(owned != nullptr ? 0 : len);
  op->peer = peer;
  op->len = len;
  const char* payload = op->buffer.get();
  if (owned != nullptr) {
    op->owned = std::move(owned);
    payload = data;
  } else if (len > 0) {
    std::memcpy(op->buffer.get(), data, len);
  }
  {
    absl::MutexLock lock(&send_mu_);
    op->queued_ns = NowNs();
    in_flight_.insert(op);
  }

  const absl::Status post_status = PostRetrying(
      peer, wire.write ? "fi_writemsg" : "fi_send", deadline,
      [&]() -> ssize_t {
        if (wire.write) {
          iovec iov{const_cast<char*>(payload), len};
          fi_rma_iov rma_iov{wire.remote_addr, len, wire.key};
          fi_msg_rma msg{};
          msg.msg_iov = &iov;
          msg.iov_count = 1;
          msg.addr = fi_addr;
          msg.rma_iov = &rma_iov;
          msg.rma_iov_count = 1;
          msg.context = &op->op.context;
          // Complete only once the bytes are in the target's memory: the
          // notice that follows must not overtake them (shm does not order
          // sends after writes).
          return fi_writemsg(ep_.get(), &msg,
                             FI_COMPLETION | FI_DELIVERY_COMPLETE);
        }
        if (tagged) {
          return fi_senddata(send_ep, payload, len, nullptr, source_data_,
                             fi_addr, &op->op.context);
        }
        if (wire.has_data) {
          return fi_senddata(ep_.get(), payload, len, nullptr, wire.data,
                             fi_addr, &op->op.context);
        }
        return fi_send(ep_.get(), payload, len, nullptr, fi_addr,
                       &op->op.context);
      },
      post_failed);
  if (!post_status.ok()) {
    absl::MutexLock lock(&send_mu_);
    RecycleSendOp(op);  // never posted: nothing else refers to it
    return post_status;
  }
  NoteActivity();
  absl::Status notice_status;
  if (wire.write && !wire.notice.empty()) {
    // Ordered after the write by the provider (FI_ORDER_SAW).
    WireOp control;
    control.has_data = true;
    control.data = kControlTag | static_cast<uint64_t>(ControlKind::kRmaNotice);
    notice_status = wire.notice.size() <= inject_size_
                        ? InjectSend(peer, nullptr, fi_addr, wire.notice.data(),
                                     wire.notice.size(), control)
                        : SendImpl(peer, wire.notice.data(), wire.notice.size(),
                                   nullptr, control);
  }
  if (async != nullptr) {
    // Asynchronous: the callback goes with the op; whoever decides the
    // outcome calls it (the deadline is the progress thread's to enforce).
    {
      absl::MutexLock lock(&send_mu_);
      if (op->done) {
        // Completed, failed (FailPeer) or ended by Shutdown() already: the
        // caller learns it now. An error returns with the callback left to
        // the caller; a completion leaves it in place, for the caller to
        // call (no lock held there).
        absl::Status early = op->status;
        op->released = true;
        if (op->completed) RecycleSendOp(op);
        if (early.ok()) early = notice_status;
        return early;
      }
      op->callback = std::move(*async);
      *async = nullptr;
      op->deadline_ns = absl::ToUnixNanos(deadline);
      async_in_flight_.fetch_add(1, std::memory_order_relaxed);
      if (op->deadline_ns <
          next_async_deadline_ns_.load(std::memory_order_relaxed)) {
        next_async_deadline_ns_.store(op->deadline_ns,
                                      std::memory_order_relaxed);
      }
      if (!notice_status.ok()) FinishOp(op, notice_status);
    }
    // Manual-progress providers move data only when the CQ is read, and the
    // deadline is checked by the progress thread: make sure it runs.
    if (!OnProgressThread() &&
        progress_sleeping_.load(std::memory_order_seq_cst)) {
      Wake();
    }
    return absl::OkStatus();
  }
  if (OnProgressThread()) {
    AwaitSendOnProgressThread(op, len, deadline);
  } else if (!SpinForSend(op, len, deadline)) {
    // Manual-progress providers move data only when the CQ is read: the
    // progress thread takes over.
    Wake();
  }

  PeerId blocker = kUnknownPeer;
  {
    absl::MutexLock lock(&send_mu_);
    send_mu_.AwaitWithDeadline(absl::Condition(&op->done), deadline);
    // From now on the op is the provider's only: it is recycled when its
    // completion arrives, or when Shutdown() closes the endpoint.
    op->released = true;
    if (op->done) {
      absl::Status status = std::move(op->status);
      if (op->completed) RecycleSendOp(op);
      if (status.ok()) status = notice_status;
      return status;
    }
    op->done = true;  // timed out; FailPeer() and Shutdown() skip it
    blocker = OldestOtherSend(op);
  }
  return absl::UnavailableError(TimeoutMessage(peer, len, blocker));
}

std::string FabricTransport::TimeoutMessage(PeerId peer, size_t len,
                                            PeerId blocker) const {
  std::string cause;
  if (blocker != kUnknownPeer) {
    cause = absl::StrCat("; an earlier send to peer '", PeerName(blocker),
                         "' is not completed either");
    if (provider_ == "shm") {
      absl::StrAppend(
          &cause,
          ": the shm provider completes sends over its inject size in order, "
          "so one left in the queue of a peer that died blocks every later "
          "one from this endpoint");
    }
  }
  return absl::StrCat("send of ", len, " bytes to peer '", PeerName(peer),
                      "' not completed within ", options_.send_timeout_ms,
                      " ms", cause);
}

PeerId FabricTransport::OldestOtherSend(const SendOp* op) const {
  const SendOp* oldest = nullptr;
  for (const SendOp* other : in_flight_) {
    if (other == op || other->completed || other->peer == op->peer ||
        other->queued_ns > op->queued_ns) {
      continue;
    }
    if (oldest == nullptr || other->queued_ns < oldest->queued_ns) {
      oldest = other;
    }
  }
  return oldest == nullptr ? kUnknownPeer : oldest->peer;
}

bool FabricTransport::SpinForSend(SendOp* op, size_t len, absl::Time deadline) {
  const int64_t spin_ns = SpinNs(len);
  if (spin_ns <= 0) return false;
  const int64_t deadline_ns = absl::ToUnixNanos(deadline);
  polling_senders_.fetch_add(1, std::memory_order_seq_cst);
  int64_t spin_until = NowNs() + spin_ns;
  bool done = false;
  for (;;) {
    if (op->done_flag.load(std::memory_order_acquire)) {
      done = true;
      break;
    }
    if (DrainCompletions(/*try_only=*/true) > 0) {
      spin_until = NowNs() + spin_ns;
      continue;
    }
    const int64_t now = NowNs();
    if (now >= spin_until || now >= deadline_ns) break;
    CpuRelax();
  }
  polling_senders_.fetch_sub(1, std::memory_order_seq_cst);
  return done;
}

void FabricTransport::AwaitSendOnProgressThread(SendOp* op, size_t len,
                                                absl::Time deadline) {
  absl::Duration backoff = kMinPollBackoff;
  const int64_t spin_ns = SpinNs(len);
  int64_t spin_until = NowNs() + spin_ns;
  for (;;) {
    if (op->done_flag.load(std::memory_order_acquire)) return;
    if (WallNow() >= deadline) return;
    if (DrainCompletions(/*try_only=*/false) > 0) {
      backoff = kMinPollBackoff;
      spin_until = NowNs() + spin_ns;
    } else if (NowNs() < spin_until) {
      CpuRelax();
    } else {
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, kMaxPollBackoff);
    }
  }
}

absl::Duration FabricTransport::WaitForTransmitSlot(uint64_t seen,
                                                    absl::Duration backoff) {
  const absl::Duration next = std::min(backoff * 2, kMaxPollBackoff);
  if (OnProgressThread()) {
    absl::SleepFor(backoff);
    return next;
  }
  absl::MutexLock lock(&send_mu_);
  auto freed = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(send_mu_) {
    return sends_completed_ != seen;
  };
  return send_mu_.AwaitWithTimeout(absl::Condition(&freed), backoff)
             ? kMinPollBackoff
             : next;
}

void FabricTransport::CompleteSend(SendOp* op, absl::Status status) {
  absl::MutexLock lock(&send_mu_);
  ++sends_completed_;
  op->completed = true;
  if (!op->done) {
    FinishOp(op, std::move(status));
  } else if (op->released) {
    RecycleSendOp(op);
  }
}

void FabricTransport::FinishOp(SendOp* op, absl::Status status) {
  op->status = std::move(status);
  op->done = true;
  op->done_flag.store(true, std::memory_order_release);
  if (op->callback) {
    ready_callbacks_.emplace_back(std::move(op->callback), op->status);
    ready_count_.fetch_add(1);
    op->callback = nullptr;
    op->released = true;
    async_in_flight_.fetch_sub(1, std::memory_order_relaxed);
  }
  if (op->released && op->completed) RecycleSendOp(op);
}

void FabricTransport::RunReadyCallbacks() {
  while (ready_count_.load() > 0) {
    std::vector<std::pair<SendDone, absl::Status>> ready;
    {
      absl::MutexLock lock(&send_mu_);
      ready.swap(ready_callbacks_);
      ready_count_.store(0);
    }
    for (auto& [done, status] : ready) done(std::move(status));
  }
}

void FabricTransport::ExpireAsyncSends() {
  if (async_in_flight_.load(std::memory_order_relaxed) == 0) return;
  const int64_t now = NowNs();
  if (now < next_async_deadline_ns_.load(std::memory_order_relaxed)) return;
  struct Expired {
    SendOp* op;
    uint64_t generation;
    PeerId peer;
    size_t len;
    PeerId blocker;
  };
  std::vector<Expired> expired;
  {
    absl::MutexLock lock(&send_mu_);
    int64_t next = INT64_MAX;
    for (SendOp* op : in_flight_) {
      if (!op->callback || op->done) continue;
      if (op->deadline_ns <= now) {
        expired.push_back(Expired{op, op->generation, op->peer, op->len,
                                  OldestOtherSend(op)});
      } else {
        next = std::min(next, op->deadline_ns);
      }
    }
    next_async_deadline_ns_.store(next, std::memory_order_relaxed);
  }
  if (expired.empty()) return;
  // Messages name peers with PeerName(), not under send_mu_.
  std::vector<absl::Status> statuses;
  statuses.reserve(expired.size());
  for (const Expired& e : expired) {
    statuses.push_back(
        absl::UnavailableError(TimeoutMessage(e.peer, e.len, e.blocker)));
  }
  {
    absl::MutexLock lock(&send_mu_);
    for (size_t i = 0; i < expired.size(); ++i) {
      SendOp* op = expired[i].op;
      // Still the same send (an op is recycled only once it is done), and
      // not completed meanwhile.
      if (!in_flight_.contains(op) || op->generation != expired[i].generation ||
          op->done) {
        continue;
      }
      async_expired_.fetch_add(1, std::memory_order_relaxed);
      FinishOp(op, statuses[i]);
    }
  }
  for (const absl::Status& status : statuses) {
    KLOG(Warning, kLogModule) << status.message();
  }
}

absl::Status FabricTransport::FailPeer(PeerId peer,
                                       const absl::Status& reason) {
  absl::Status failure;
  std::string name;
  {
    absl::MutexLock lock(&peers_mu_);
    if (peer < 0 || static_cast<size_t>(peer) >= peers_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown peer id ", peer));
    }
    name = peers_[peer].name;
    failure = absl::UnavailableError(absl::StrCat(
        "send to peer '", name, "': peer failed: ", reason.message()));
    peers_[peer].failed = failure;
  }
  int ended = 0;
  {
    absl::MutexLock lock(&send_mu_);
    std::vector<SendOp*> ops;
    for (SendOp* op : in_flight_) {
      if (op->peer == peer && !op->done) ops.push_back(op);
    }
    for (SendOp* op : ops) {
      FinishOp(op, failure);
      ++ended;
    }
  }
  sends_failed_peer_.fetch_add(ended, std::memory_order_relaxed);
  KLOG(Info, kLogModule) << "peer '" << name << "' failed (" << reason.message()
                         << "): " << ended << " sends in progress ended";
  // The callbacks of the asynchronous ones run on the progress thread.
  if (!OnProgressThread()) Wake();
  return absl::OkStatus();
}

}  // namespace fabric_internal
}  // namespace karat
