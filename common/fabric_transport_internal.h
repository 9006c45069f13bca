// Internal to the libfabric transport: the FabricTransport class (libfabric
// RDM implementation of Transport), whose members are defined in
// fabric_transport.cc (endpoints, peers and address vector, lifecycle),
// fabric_transport_send.cc (sends with retries and timeouts, send op
// outcomes), fabric_transport_progress.cc (the progress thread, completions
// and delivery) and fabric_transport_rma.cc (RMA landing zones and control
// messages).
//
//
// Threads. One progress thread runs the receive handler and re-posts receive
// buffers. The completion queue is read by one thread at a time (cq_mu_):
// by the progress thread, or by a sender waiting for its own completion,
// which saves two thread hand-offs per message. Whoever reads it marks sends
// complete and appends received messages to one queue (received_) that only
// the progress thread delivers from, in order; a sender that queued a
// message wakes the progress thread if it sleeps. The progress thread's own
// polls hand what they read straight to delivery while that queue is empty
// (a ping-pong's message then skips the queue and its lock). A Send() from
// inside the receive handler runs on the progress thread itself, so it reads
// the CQ on its own while waiting; what it reads is queued and delivered
// after the handler returns: handlers never nest and order is kept.
//
// Spinning. After a completion, and while a sender waits, the CQ is polled
// without sleeping for FabricOptions::spin_us (a sender adds the expected
// transfer time of its message, at 1 GB/s); only then do the sleeps below
// start. A waiting sender polls instead of the progress thread, which sleeps
// meanwhile, so one waiting side costs one core.
//
// Inject. Messages up to the provider's inject size go out with fi_inject():
// the provider copies them before returning and reports no completion, so
// such a Send() neither copies nor waits.
//
// Zero copy. SendShared() posts large messages from the caller's string and
// keeps a reference to it until the completion arrives, even when the call
// times out, so the provider never reads freed memory.
//
// Asynchronous sends. SendSharedAsync() posts like SendShared() and returns;
// the callback travels with the SendOp. Whoever decides the outcome (the
// thread that reads the completion, the progress thread when the deadline
// passes, FailPeer(), Shutdown()) queues the callback, and the progress
// thread calls it at the top of its loop, with no lock held (never inside a
// receive handler or a send, whose caller may hold locks the callback
// takes); Shutdown() calls what is left once the progress thread stopped.
// The deadlines are checked by the progress thread only while asynchronous
// sends are in flight (its sleeps end by the earliest one), so an idle
// endpoint stays idle. An RMA message is written and its notice posted at
// once where the provider orders sends after writes; elsewhere the notice
// must wait for the write's completion, and such a send is synchronous.
//
// Send ops. An op is recycled once the provider is done with it (its
// completion, or the endpoint closed) and its owner (the waiting sender or
// the callback) let go of it; an op whose outcome was decided early (a
// timeout, FailPeer()) keeps its buffer and message reference until then.
//
// Failed peers. FailPeer() marks the peer (later sends fail at once, until
// AddPeer() adds it again), decides the outcome of every op to it that is
// not decided yet (a waiting sender wakes at once; a sender blocked on a
// full transmit queue sees the mark at its next retry), and leaves the
// buffers to the provider.
//
// Waiting. When the provider gives the CQ an FI_WAIT_FD wait object (tcp and
// verbs through ofi_rxm), the progress thread sleeps in poll() on that fd and
// on an eventfd used to wake it, after fi_trywait() says sleeping is safe. The
// shm provider of libfabric 1.17 refuses FI_WAIT_FD and FI_WAIT_MUTEX_COND,
// and its FI_WAIT_UNSPEC / FI_WAIT_YIELD CQs spin inside fi_cq_sread at 100%
// of a core regardless of the timeout, so for such providers the CQ is opened
// without a wait object and polled with fi_cq_read, sleeping on the eventfd
// with an exponential backoff capped at kMaxPollBackoff between empty polls.
//
// RMA. Where the provider offers FI_RMA and remote CQ data, a message of at
// least FabricOptions::rma_threshold bytes is written with fi_writemsg
// (FI_DELIVERY_COMPLETE) into a landing zone the receiver registered for this
// sender, and once the write is complete (at once where the provider orders
// sends after writes, FI_ORDER_SAW: tcp through ofi_rxm; shm does not) a
// small notice follows as an ordinary message, so it keeps its place among
// the sender's other messages (FI_ORDER_SAS); the receiver hands the zone's
// bytes to the handler in place and then returns the space with a credit.
// Control messages (zone request, grant, refusal, notice, credit) carry remote
// CQ data with kControlTag; user messages carry none. The zone is a ring per
// (sender, receiver) pair: the sender allocates in it (head), credits are the
// cumulative end of what the receiver has delivered (tail), so a lost or late
// credit only delays reuse. Credits are batched: one per quarter zone
// delivered, and whatever is left when the receiver's progress thread runs out
// of work; whichever thread reads a credit from the CQ applies it (it only
// moves the tail forward). RMA sends to one peer are serialised, so the ring
// fills in notice order. Until the receiver has granted a zone, or when a
// message does not fit in the free part of it, the message goes as a plain
// message: nothing waits for space. The first large message to a peer asks for
// the zone; the request carries the sender's address, since the receiver may
// not know it.
//
// Source. With FI_SOURCE the CQ reports each receive's source address,
// mapped to the PeerId it was added as (kUnknownPeer when not added).
//
// Send endpoints. The shm provider of libfabric 1.17 completes an
// endpoint's sends over its inject size (4 KiB) in posting order: the
// receiver answers each in the sender's response queue, which the sender
// reads from its head only. A peer killed before it took such a send never
// answers, and every later one from that endpoint, to any peer, stays
// incomplete. So on shm without RMA (FabricOptions::send_endpoint_per_peer)
// each peer gets an endpoint of its own for the messages sent to it, bound
// to the same AV and CQ (reading the CQ progresses them all); a dead peer
// then blocks only the sends to itself. Receives stay on the main endpoint,
// whose address is the one peers know; since a message from a send endpoint
// has a source address the receiver never added, it carries remote CQ data
// kSourceTag | a hash of the sender's main address, which the receiver maps
// to the peer added with that address. Control messages (RMA, off on these
// endpoints) keep going from the main endpoint.
//
// Locking. fid_lock_ protects the fids against Shutdown(): every fi_* call
// on the endpoint, AV or CQ holds it shared, Shutdown() holds it exclusively
// while closing. When the domain is not FI_THREAD_SAFE every fi_* call holds
// it exclusively instead, which serialises them; the progress thread never
// sleeps while holding it (poll() and the backoff sleep are outside).
#pragma once

#include "common/fabric_transport_types.h"

namespace karat {
namespace fabric_internal {

class FabricTransport final : public Transport {
 public:
  explicit FabricTransport(const FabricOptions& options) : options_(options) {}
  ~FabricTransport() override { Shutdown(); }

  absl::Status Open();

  std::string LocalAddress() const override { return local_address_; }
  absl::StatusOr<PeerId> AddPeer(const std::string& name,
                                 const std::string& address) override;
  absl::Status Send(PeerId peer, const void* data, size_t len) override;
  absl::Status SendShared(PeerId peer,
                          std::shared_ptr<const std::string> message) override;
  absl::Status SendSharedAsync(PeerId peer,
                               std::shared_ptr<const std::string> message,
                               SendDone done) override;
  absl::Status FailPeer(PeerId peer, const absl::Status& reason) override;
  void SetPeerReceiveHandler(PeerReceiveHandler handler) override;
  std::string PeerName(PeerId peer) const override;
  size_t MaxMessageSize() const override { return options_.max_message_size; }
  std::shared_ptr<const void> HoldMessage() override;
  std::map<std::string, double> Counters() const override;
  void Shutdown() override;

 private:
  // Holds fid_lock_ shared, or exclusively when fi_* calls must be serialised
  // or `exclusive` is set.
  class FidLock {
   public:
    explicit FidLock(FabricTransport* t, bool exclusive = false)
        : t_(t), exclusive_(exclusive || t->serialize_) {
      if (exclusive_) {
        t_->fid_lock_.Lock();
      } else {
        t_->fid_lock_.ReaderLock();
      }
    }
    ~FidLock() {
      if (exclusive_) {
        t_->fid_lock_.Unlock();
      } else {
        t_->fid_lock_.ReaderUnlock();
      }
    }
    FidLock(const FidLock&) = delete;
    FidLock& operator=(const FidLock&) = delete;

   private:
    FabricTransport* t_;
    const bool exclusive_;
  };

  // fi_getinfo with the capabilities this endpoint would like, dropping the
  // optional ones (FI_RMA, FI_SOURCE) the provider lacks.
  absl::Status GetInfo();
  absl::Status OpenCq();
  // An endpoint from `info`, bound to the address vector and the completion
  // queue, enabled.
  absl::StatusOr<FidPtr<fid_ep>> OpenEndpoint(const fi_info* info);
  absl::Status PostRecv(RecvSlot* slot);
  // PostRecv() for a buffer whose message was handled; logs a failure.
  void RepostRecv(RecvSlot* slot);
  void ProgressLoop();
  bool OnProgressThread() const {
    return progress_thread_id_.load(std::memory_order_acquire) ==
           std::this_thread::get_id();
  }
  // Reads completions until the CQ is empty; returns how many were handled.
  // Received messages are queued in received_ for the progress thread. With
  // `try_only`, returns 0 at once when another thread is reading the CQ.
  // With `direct` (the progress thread's own polls), receives that no
  // queued one precedes are appended there instead, for the caller to
  // Dispatch() in order: a message's way to its handler then takes neither
  // recv_mu_ nor the queue.
  struct Received;
  int DrainCompletions(bool try_only, std::vector<Received>* direct = nullptr);
  void HandleCompletion(const fi_cq_data_entry& entry, fi_addr_t src,
                        std::vector<Received>* direct);
  void QueueReceived(const Received& r, bool wake,
                     std::vector<Received>* direct = nullptr);
  // Progress thread: delivers (or re-posts) the oldest queued receive; false
  // when none is queued.
  bool DeliverOne();
  // Progress thread: delivers or re-posts one receive.
  void Dispatch(const Received& r);
  // `source_tag`: the remote CQ data of a message from a peer's send
  // endpoint (0: none), which names the sender instead of `src`.
  void DeliverReceived(RecvSlot* slot, size_t len, fi_addr_t src,
                       uint64_t source_tag);
  // Progress thread: re-posts the buffers whose holds ended.
  void RepostReleased();
  void CallHandler(PeerId from, std::string_view message);
  // Progress thread: a control message (remote CQ data `data`).
  void HandleControl(RecvSlot* slot, size_t len, fi_addr_t src, uint64_t data);
  void HandleZoneRequest(std::string_view body);
  void HandleZoneReply(ControlKind kind, std::string_view body);
  void DeliverRmaNotice(std::string_view body, fi_addr_t src);
  // Any thread: applies a credit from a peer's zone (a tail update).
  void ApplyCredit(std::string_view body, fi_addr_t src);
  // Progress thread: returns the zone space delivered since the last credit.
  void SendCredit(ZoneIn* zone);
  void FlushCredits();
  // Sends (or RMA-writes) one message; `owned`, when set, holds the bytes
  // at `data` and lets the provider read them in place. With `async` (a
  // non-empty callback) the send does not wait for its completion: on OK
  // the callback was either moved into the posted op (`*async` left empty)
  // or left in place, meaning the message is complete already (inject); on
  // an error it is left in place (not to be called).
  absl::Status SendMessage(PeerId peer, const char* data, size_t len,
                           std::shared_ptr<const std::string> owned,
                           SendDone* async = nullptr);
  // The RMA path of SendMessage(): nullopt when the message must go as a
  // plain message instead (no zone yet, zone full, or a handshake started).
  // `async` only where the provider orders sends after writes.
  std::optional<absl::Status> TrySendRma(
      PeerId peer, const char* data, size_t len,
      std::shared_ptr<const std::string>* owned, SendDone* async);
  absl::Status SendControl(PeerId peer, ControlKind kind,
                           std::string_view body);
  absl::Status SendImpl(PeerId peer, const char* data, size_t len,
                        std::shared_ptr<const std::string> owned,
                        const WireOp& wire = WireOp(),
                        bool* post_failed = nullptr, SendDone* async = nullptr);
  // The error a send to `peer` fails with at once (FailPeer()); OK when
  // none.
  absl::Status PeerFailure(PeerId peer) const;
  // Calls `post` (under fid_lock_) until the provider takes the operation.
  // A full transmit queue (-FI_EAGAIN) is retried after reaping completions,
  // until the peer fails or `deadline` passes (InfiniteFuture: the send
  // timeout from the first full queue, so the common case never reads the
  // clock). `what` names the provider call in errors; *post_failed
  // (optional) is set when the provider refused the operation.
  absl::Status PostRetrying(PeerId peer, const char* what, absl::Time deadline,
                            absl::FunctionRef<ssize_t()> post,
                            bool* post_failed = nullptr);
  // Messages up to the provider's inject size: the provider copies them at
  // once and reports no completion, so nothing waits.
  absl::Status InjectSend(PeerId peer, fid_ep* ep, fi_addr_t fi_addr,
                          const char* data, size_t len, const WireOp& wire);
  // Registers `address` as a peer; `learnt` marks one the transport added on
  // its own (named after its address until AddPeer() names it).
  absl::StatusOr<PeerId> InsertPeer(const std::string& name,
                                    const std::string& address, bool learnt);
  PeerId PeerByFiAddr(fi_addr_t addr) const;
  // The peer whose main address hashes to a source tag's low 32 bits.
  PeerId PeerBySourceTag(uint64_t source_tag) const;
  // A send endpoint of its own for a peer, on the main endpoint's AV and
  // CQ; null (with a warning) when the provider refuses one. Under fid_lock_
  // held exclusively.
  FidPtr<fid_ep> OpenSendEndpoint();
  // A sender off the progress thread: polls the CQ for its own completion
  // while it spins; false if the spin ended first.
  bool SpinForSend(SendOp* op, size_t len, absl::Time deadline);
  int64_t SpinNs(size_t len) const {
    return options_.spin_us <= 0
               ? 0
               : int64_t{options_.spin_us} * 1000 + static_cast<int64_t>(len);
  }
  // A Send() on the progress thread: waits for its completion by reading the
  // CQ itself, since nobody else will.
  void AwaitSendOnProgressThread(SendOp* op, size_t len, absl::Time deadline);
  uint64_t SendsCompleted() {
    absl::MutexLock lock(&send_mu_);
    return sends_completed_;
  }
  // After a post found the transmit queue full and nothing was left to
  // reap: waits until a transmit completion is reaped after `seen` (the
  // count read before reaping) or `backoff` passes, and returns the next
  // backoff (reset when a completion came, doubled up to kMaxPollBackoff
  // when not). A sender thread wakes as soon as the progress thread frees
  // a slot, rather than sleeping out a backoff that has grown past the
  // time a transfer takes; the progress thread itself just sleeps, as
  // nothing else reaps for it.
  absl::Duration WaitForTransmitSlot(uint64_t seen, absl::Duration backoff);
  void HandleError();
  // The provider is done with `op` (its completion, or an error).
  void CompleteSend(SendOp* op, absl::Status status);
  // Decides `op`'s outcome: wakes its waiting sender, or queues its callback
  // for RunReadyCallbacks(); recycles it when the provider is done too.
  void FinishOp(SendOp* op, absl::Status status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(send_mu_);
  // Calls the callbacks whose outcome is decided, with no lock held: on the
  // progress thread at the top of its loop (never inside a receive handler
  // or a send, whose caller may hold locks a callback takes), and in
  // Shutdown() once the progress thread stopped.
  void RunReadyCallbacks();
  // Fails the asynchronous sends whose deadline passed; cheap while none
  // is in flight or due.
  void ExpireAsyncSends();
  // "send of N bytes to peer 'X' not completed within T ms", and what it may
  // be waiting behind.
  std::string TimeoutMessage(PeerId peer, size_t len, PeerId blocker) const;
  void RetryPendingReceives();
  void Wake();
  // Sleeps until woken, a completion (fd mode) or `poll_backoff` (polling
  // mode), and no later than the next asynchronous send's deadline.
  void WaitForWork(absl::Duration poll_backoff);
  SendOp* AcquireSendOp(size_t len);
  void RecycleSendOp(SendOp* op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(send_mu_);
  // The peer of the oldest send queued before `op` to another peer and not
  // completed yet, kUnknownPeer if none: what a timed-out `op` may be
  // waiting behind.
  PeerId OldestOtherSend(const SendOp* op) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(send_mu_);

  const FabricOptions options_;
  bool serialize_ = false;      // domain is not FI_THREAD_SAFE
  size_t inject_size_ = 0;      // fi_inject() limit; 0: not used
  bool source_ = false;         // FI_SOURCE: receives report their source
  bool cq_data_ = false;        // remote CQ data: control messages possible
  bool rma_ = false;            // FI_RMA granted and wanted
  bool rma_virt_addr_ = false;  // FI_MR_VIRT_ADDR: targets are addresses
  // FI_ORDER_SAW: a send posted after a write is not processed before it, so
  // the notice may follow the write without waiting for its completion.
  bool send_after_write_ = false;
  // A send endpoint per peer (see "Send endpoints"), and the remote CQ data
  // its user messages carry.
  bool send_ep_per_peer_ = false;
  uint64_t source_data_ = 0;
  std::string provider_;
  std::string local_address_;

  // Opened in this order, closed in the reverse order.
  InfoPtr info_;
  FidPtr<fid_fabric> fabric_;
  FidPtr<fid_domain> domain_;
  FidPtr<fid_cq> cq_;
  FidPtr<fid_av> av_;
  FidPtr<fid_ep> ep_;
  // Landing zones granted to senders, by zone index; their MRs close before
  // the domain. Progress thread only (Shutdown() after it stopped).
  std::vector<std::unique_ptr<ZoneIn>> zones_in_;
  bool credits_pending_ = false;  // some zone has space not yet credited
  absl::flat_hash_map<fi_addr_t, uint32_t> zone_by_sender_;
  int cq_fd_ = -1;  // the CQ's wait fd, or -1 in polling mode
  ScopedFd wake_fd_;

  absl::Mutex fid_lock_;
  bool closed_ ABSL_GUARDED_BY(fid_lock_) = false;

  std::vector<std::unique_ptr<RecvSlot>> recv_slots_;
  // HoldMessage(): the slot whose message the handler is reading (progress
  // thread only), whether the handler held it, and how many are held.
  RecvSlot* delivering_ = nullptr;
  bool delivering_held_ = false;
  int held_ = 0;  // progress thread only
  // Buffers not posted (FabricOptions::posted_receives): each replaces a
  // held one; `unreplaced_` holds found no spare, and their buffers are
  // posted again on release. Progress thread only after Open().
  std::vector<RecvSlot*> spare_;
  int unreplaced_ = 0;
  std::shared_ptr<ReleasedSlots> released_ = std::make_shared<ReleasedSlots>();
  std::atomic<uint64_t> messages_held_{0}, holds_returned_{0};
  // Progress thread only: receive buffers to re-post once the provider
  // accepts them.
  std::vector<RecvSlot*> pending_recvs_;

  // Only one thread reads the CQ at a time.
  absl::Mutex cq_mu_;
  // Receive completions in CQ order, delivered by the progress thread; with
  // deliver == false the slot is only re-posted (a failed receive).
  struct Received {
    RecvSlot* slot;
    size_t len = 0;
    bool deliver = false;
    fi_addr_t src = FI_ADDR_NOTAVAIL;
    uint64_t data = 0;        // remote CQ data; 0 for user messages
    uint64_t source_tag = 0;  // see DeliverReceived()
  };
  absl::Mutex recv_mu_;
  std::deque<Received> received_ ABSL_GUARDED_BY(recv_mu_);
  // received_.size(), readable without the lock.
  std::atomic<size_t> received_count_{0};
  // Whether the progress thread sleeps (or is about to); kept in
  // released_, whose releases read it too.
  std::atomic<bool>& progress_sleeping_ = released_->progress_sleeping;
  std::atomic<int> polling_senders_{0};
  // Set by every completion read and every posted send; the progress
  // thread clears it when it reads the clock while spinning, so no message
  // reads the clock for it.
  std::atomic<bool> activity_{false};
  void NoteActivity() {
    // Read first: a spinning sender and the progress thread would otherwise
    // bounce the line with every message.
    if (!activity_.load(std::memory_order_relaxed)) {
      activity_.store(true, std::memory_order_relaxed);
    }
  }

  absl::Mutex handler_mu_;
  std::shared_ptr<PeerReceiveHandler> handler_ ABSL_GUARDED_BY(handler_mu_);
  // Bumped by every SetPeerReceiveHandler(); the progress thread calls its
  // own copy of handler_ and copies it again only when this moved, so a
  // message's delivery takes no lock for it. A replaced handler is never
  // called once the progress thread saw the bump; its copy goes with the
  // next delivery.
  std::atomic<uint64_t> handler_generation_{0};
  std::shared_ptr<PeerReceiveHandler> progress_handler_;  // progress thread
  uint64_t progress_handler_generation_ = 0;              // progress thread

  mutable absl::Mutex peers_mu_;
  std::vector<Peer> peers_ ABSL_GUARDED_BY(peers_mu_);
  absl::flat_hash_map<std::string, PeerId> peer_by_address_
      ABSL_GUARDED_BY(peers_mu_);
  absl::flat_hash_map<fi_addr_t, PeerId> peer_by_fi_addr_
      ABSL_GUARDED_BY(peers_mu_);
  // SourceHash(address) -> fi_addr of the peer added with that address.
  absl::flat_hash_map<uint32_t, fi_addr_t> fi_addr_by_source_
      ABSL_GUARDED_BY(peers_mu_);
  std::atomic<uint64_t> send_endpoints_{0};

  // Guards every ZoneOut's fields but send_lock; never held across a wait.
  absl::Mutex rma_mu_;
  std::atomic<uint64_t> rma_sent_{0}, rma_bytes_sent_{0}, rma_received_{0},
      rma_fallback_setup_{0}, rma_fallback_full_{0}, rma_fallback_busy_{0},
      rma_zones_ready_{0}, rma_refused_{0}, zones_granted_{0},
      control_invalid_{0}, messages_unknown_source_{0};

  absl::Mutex send_mu_;
  absl::flat_hash_set<SendOp*> in_flight_ ABSL_GUARDED_BY(send_mu_);
  // Transmit completions reaped so far: a post that found the transmit
  // queue full waits for this to move (WaitForTransmitSlot).
  uint64_t sends_completed_ ABSL_GUARDED_BY(send_mu_) = 0;
  std::vector<std::unique_ptr<SendOp>> free_ops_ ABSL_GUARDED_BY(send_mu_);
  // Callbacks of asynchronous sends whose outcome is decided, to call with
  // no lock held; ready_count_ is its size, readable without the lock.
  std::vector<std::pair<SendDone, absl::Status>> ready_callbacks_
      ABSL_GUARDED_BY(send_mu_);
  std::atomic<size_t> ready_count_{0};
  // Asynchronous sends whose outcome is not decided yet, and the earliest
  // deadline among them (INT64_MAX: none; may be earlier than the real
  // one, which only costs a scan). Written under send_mu_.
  std::atomic<int> async_in_flight_{0};
  std::atomic<int64_t> next_async_deadline_ns_{INT64_MAX};
  std::atomic<uint64_t> async_sent_{0}, sends_failed_peer_{0},
      async_expired_{0};
  std::atomic<uint64_t> next_generation_{1};

  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
  std::atomic<bool> stop_{false};
  std::atomic<std::thread::id> progress_thread_id_{};
  std::thread progress_thread_;
};

}  // namespace fabric_internal
}  // namespace karat
