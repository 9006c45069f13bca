// libfabric RDM implementation of Transport.
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
#include <poll.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/log.h"
#include "common/stable_hash.h"
#include "common/status_macros.h"
#include "common/transport.h"

namespace karat {
namespace {

constexpr const char* kLogModule = "fabric";
// How long the progress thread sleeps on the CQ fd before re-checking for
// shutdown (the eventfd wakes it earlier).
constexpr int kWaitTimeoutMs = 100;
// Polling mode: first and longest sleep between empty polls of the CQ.
constexpr absl::Duration kMinPollBackoff = absl::Microseconds(10);
constexpr absl::Duration kMaxPollBackoff = absl::Milliseconds(1);
// After this long without a completion the endpoint counts as idle and the
// polling sleep grows to kIdlePollBackoff, so an idle daemon costs close to
// no CPU; the first message after idleness waits at most that long.
constexpr absl::Duration kIdleAfter = absl::Seconds(1);
constexpr absl::Duration kIdlePollBackoff = absl::Milliseconds(5);
// Empty polls between two reads of the clock while spinning (a power of 2).
constexpr uint32_t kSpinsPerClock = 16;
// Spinning, the progress thread lets other runnable threads of the host go
// first (sched_yield) once per this long. A yield costs ~0.4 us here; one
// every 64 polls (~5 us) was 5-10% of the spin, and a message that came
// during one waited for it: 4 KiB ping-pong 0.45 -> 0.42 us one way.
constexpr int64_t kYieldEveryNs = 50'000;
// Completions read per fi_cq_read call.
constexpr int kCqBatch = 16;
// Idle send operations kept for reuse, with their buffers.
constexpr size_t kMaxCachedSendOps = 8;
// Remote CQ data of control messages: kControlTag | ControlKind. User
// messages carry no CQ data.
constexpr uint64_t kControlTag = 0x4B524D00;  // "KRM" + kind
constexpr uint64_t kControlTagMask = 0xFFFFFFFFFFFFFF00;
// Remote CQ data of user messages from a per-peer send endpoint:
// kSourceTag | SourceHash(the sender's main address).
constexpr uint64_t kSourceTag = uint64_t{0x4B535243} << 32;  // "KSRC"
constexpr uint64_t kSourceTagMask = uint64_t{0xFFFFFFFF} << 32;
enum class ControlKind : uint8_t {
  kZoneRequest = 1,  // ZoneRequest + the sender's address
  kZoneGrant = 2,    // ZoneGrant
  kZoneRefuse = 3,   // ZoneRefuse
  kRmaNotice = 4,    // RmaNotice: a message landed in the zone
  kCredit = 5,       // Credit: zone space released
};
constexpr uint32_t kRmaProtocolVersion = 1;
// Landing zones are registered in multiples of this.
constexpr size_t kZoneAlign = 4096;

// Control message bodies (host byte order: both ends run on hosts of one
// cluster, and the frame format assumes little-endian already).
struct ZoneRequest {
  uint32_t version;
  int32_t token;  // the receiver's PeerId at the sender, echoed back
  // followed by the sender's address
};
struct ZoneGrant {
  uint32_t version;
  int32_t token;
  uint32_t zone;  // receiver's zone index, named in notices
  uint32_t reserved;
  uint64_t remote_addr;  // target address of offset 0
  uint64_t key;
  uint64_t size;
};
struct ZoneRefuse {
  uint32_t version;
  int32_t token;
};
struct RmaNotice {
  uint32_t zone;
  uint32_t reserved;
  uint64_t offset;
  uint64_t len;
  uint64_t end;  // ring position after this message, credited back
};
struct Credit {
  int32_t token;
  uint32_t reserved;
  uint64_t end;
};
template <typename T>
bool ReadBody(std::string_view bytes, T* out) {
  if (bytes.size() < sizeof(T)) return false;
  std::memcpy(out, bytes.data(), sizeof(T));
  return true;
}

std::string FiError(ssize_t rc) {
  const int code = static_cast<int>(rc < 0 ? -rc : rc);
  return absl::StrCat(fi_strerror(code), " (", code, ")");
}

absl::Status FiStatus(const char* call, ssize_t rc) {
  return absl::UnavailableError(absl::StrCat(call, " failed: ", FiError(rc)));
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Wall-clock time in nanoseconds since the Unix epoch (comparable with
// absl::ToUnixNanos(absl::Now())), from the vDSO: every message reads the
// clock a few times, and absl::GetCurrentTimeNanos() costs about 100 ns
// here against about 28 ns for clock_gettime().
int64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}
// absl::Now() from NowNs(), for the per-message paths.
absl::Time WallNow() { return absl::FromUnixNanos(NowNs()); }

// FNV-1a of an endpoint address, folded to 32 bits: the same in every
// process (absl::Hash is seeded per process).
uint32_t SourceHash(std::string_view address) {
  const uint64_t h = Fnv1a64(address);
  return static_cast<uint32_t>(h ^ (h >> 32));
}

// Owns one fid and closes it with fi_close.
template <typename T>
struct FidCloser {
  void operator()(T* fid) const {
    const int rc = fi_close(&fid->fid);
    if (rc != 0) {
      KLOG(Warning, kLogModule) << "fi_close failed: " << FiError(rc);
    }
  }
};
template <typename T>
using FidPtr = std::unique_ptr<T, FidCloser<T>>;

struct InfoDeleter {
  void operator()(fi_info* info) const { fi_freeinfo(info); }
};
using InfoPtr = std::unique_ptr<fi_info, InfoDeleter>;

// Owns a file descriptor.
class ScopedFd {
 public:
  ScopedFd() = default;
  explicit ScopedFd(int fd) : fd_(fd) {}
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ~ScopedFd() {
    if (fd_ >= 0) close(fd_);
  }
  int get() const { return fd_; }
  void reset(int fd) {
    if (fd_ >= 0) close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

// "tcp" and "verbs" are message-endpoint providers; RDM on top of them comes
// from the ofi_rxm utility provider.
std::string ProviderName(const std::string& provider) {
  if (provider == "tcp" || provider == "verbs") return provider + ";ofi_rxm";
  return provider;
}

// The context of every posted operation. libfabric reports the address of
// `context`, which is also the address of the OpContext (its first member).
enum class OpKind { kSend, kRecv };

struct OpContext {
  fi_context2 context;
  OpKind kind;
  void* owner;  // the RecvSlot or SendOp
};
static_assert(std::is_standard_layout_v<OpContext>);

struct RecvSlot {
  OpContext op{{}, OpKind::kRecv, this};
  // Shared with the handles of HoldMessage(), which may outlive the
  // transport.
  std::shared_ptr<char[]> buffer;
};

// Receive buffers whose holds (HoldMessage()) ended, for the progress
// thread to re-post. Shared with the holds' deleters; after `closed` (set
// by Shutdown()) a release only frees its reference to the buffer.
struct ReleasedSlots {
  absl::Mutex mu;
  bool closed ABSL_GUARDED_BY(mu) = false;
  std::vector<RecvSlot*> slots ABSL_GUARDED_BY(mu);
  int wake_fd ABSL_GUARDED_BY(mu) = -1;  // the progress thread's eventfd
  std::atomic<size_t> count{0};          // slots.size()
  // Whether the progress thread sleeps (or is about to): only then does a
  // release write to wake_fd. Awake, it re-posts released slots at the top
  // of its loop, and it checks `count` after raising this flag, before it
  // sleeps; sparing the write saves a system call per held message.
  std::atomic<bool> progress_sleeping{false};
};

// A posted send. It is recycled once both the provider is done with it
// (`completed`: its completion arrived, or the endpoint closed) and its owner
// (`released`: the waiting sender, or the callback of an asynchronous send)
// no longer looks at it; a send failed early (timeout, FailPeer()) keeps its
// buffer until the provider is done.
struct SendOp {
  OpContext op{{}, OpKind::kSend, this};
  std::unique_ptr<char[]> buffer;
  size_t capacity = 0;
  // A zero-copy send's message, held until its completion.
  std::shared_ptr<const std::string> owned;
  PeerId peer = kUnknownPeer;
  size_t len = 0;
  // Unique per send (set when the op is taken for one), so that a pointer
  // kept across an unlock can tell the same send from a later one at the
  // same address. The rest is guarded by
  // FabricTransport::send_mu_.
  uint64_t generation = 0;
  // NowNs() when the send was queued.
  int64_t queued_ns = 0;
  // Set with `done`, read without the lock by a spinning sender.
  std::atomic<bool> done_flag{false};
  bool done = false;       // the outcome (`status`) is decided
  bool completed = false;  // the provider is done with the buffer
  bool released = false;   // the owner no longer looks at the op
  absl::Status status;
  // An asynchronous send's callback, until the outcome is decided, and the
  // NowNs() after which it fails.
  Transport::SendDone callback;
  int64_t deadline_ns = 0;
};

// The sender's side of the landing zone a peer granted. Guarded by
// FabricTransport::rma_mu_, except send_lock.
struct ZoneOut {
  enum class State { kNone, kRequested, kReady, kRefused };
  State state = State::kNone;
  uint64_t remote_addr = 0;
  uint64_t key = 0;
  uint64_t size = 0;
  uint32_t zone = 0;
  uint64_t head = 0;  // ring bytes allocated, cumulative
  uint64_t tail = 0;  // ring bytes credited back, cumulative
  // Serialises RMA sends to the peer (allocation through notice), so the
  // receiver sees notices in ring order. Never waited for on the progress
  // thread.
  absl::Mutex send_lock;
};

// A landing zone this endpoint registered for one sender. Progress thread
// only (created and read there), closed by Shutdown().
struct ZoneIn {
  std::unique_ptr<char[]> buffer;
  size_t size = 0;
  fi_addr_t sender = FI_ADDR_UNSPEC;
  int32_t token = 0;           // the sender's id for us, echoed in credits
  PeerId peer = kUnknownPeer;  // the sender, as known here
  uint64_t delivered_end = 0;  // ring end of the last delivered message
  uint64_t credited_end = 0;   // last end sent back in a credit
  FidPtr<fid_mr> mr;
};

struct Peer {
  std::string name;
  fi_addr_t fi_addr = FI_ADDR_UNSPEC;
  // Added by the transport itself (an RMA handshake), not by AddPeer().
  bool learnt = false;
  std::unique_ptr<ZoneOut> zone_out = std::make_unique<ZoneOut>();
  // The endpoint user messages to this peer go out from (see "Send
  // endpoints"); null: the main endpoint. Closed by Shutdown().
  FidPtr<fid_ep> send_ep;
  // Set by FailPeer(): sends fail with it until AddPeer() adds the address
  // again.
  absl::Status failed;
};

// What SendImpl posts: a message (with remote CQ data when `has_data`) or
// an RMA write into a peer's landing zone.
struct WireOp {
  bool write = false;
  bool has_data = false;
  uint64_t data = 0;
  uint64_t remote_addr = 0;  // write only
  uint64_t key = 0;          // write only
  // Write only: a control message posted right after the write, before its
  // completion (the provider orders sends after writes).
  std::string_view notice;
};

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

absl::Status FabricTransport::Open() {
  if (options_.max_message_size == 0) {
    return absl::InvalidArgumentError("max_message_size must be positive");
  }
  if (options_.receive_buffers < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "receive_buffers must be at least 1, got ", options_.receive_buffers));
  }
  if (options_.posted_receives < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "posted_receives must be at least 1, got ", options_.posted_receives));
  }
  if (options_.send_timeout_ms <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "send_timeout_ms must be positive, got ", options_.send_timeout_ms));
  }
  if (options_.use_rma && options_.rma_threshold == 0) {
    return absl::InvalidArgumentError("rma_threshold must be positive");
  }
  if (options_.use_rma && options_.rma_max_zones < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rma_max_zones must be >= 0, got ", options_.rma_max_zones));
  }
  provider_ = ProviderName(options_.provider);
  RETURN_IF_ERROR(GetInfo());
  if (options_.max_message_size > info_->ep_attr->max_msg_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_message_size ", options_.max_message_size, " exceeds provider '",
        provider_, "' limit ", info_->ep_attr->max_msg_size));
  }
  serialize_ = info_->domain_attr->threading != FI_THREAD_SAFE;
  inject_size_ = options_.use_inject ? info_->tx_attr->inject_size : 0;

  fid_fabric* fabric = nullptr;
  int rc = fi_fabric(info_->fabric_attr, &fabric, nullptr);
  if (rc != 0) return FiStatus("fi_fabric", rc);
  fabric_.reset(fabric);

  fid_domain* domain = nullptr;
  rc = fi_domain(fabric_.get(), info_.get(), &domain, nullptr);
  if (rc != 0) return FiStatus("fi_domain", rc);
  domain_.reset(domain);

  RETURN_IF_ERROR(OpenCq());

  fi_av_attr av_attr{};
  av_attr.type = FI_AV_TABLE;
  fid_av* av = nullptr;
  rc = fi_av_open(domain_.get(), &av_attr, &av, nullptr);
  if (rc != 0) return FiStatus("fi_av_open", rc);
  av_.reset(av);

  ASSIGN_OR_RETURN(ep_, OpenEndpoint(info_.get()));

  std::string name(256, '\0');
  size_t name_len = name.size();
  rc = fi_getname(&ep_->fid, name.data(), &name_len);
  if (rc == -FI_ETOOSMALL) {
    name.resize(name_len);
    rc = fi_getname(&ep_->fid, name.data(), &name_len);
  }
  if (rc != 0) return FiStatus("fi_getname", rc);
  name.resize(name_len);
  local_address_ = std::move(name);
  send_ep_per_peer_ = options_.send_endpoint_per_peer && provider_ == "shm" &&
                      !rma_ && info_->domain_attr->cq_data_size >= 8;
  source_data_ = kSourceTag | SourceHash(local_address_);
  if (source_) {
    // The first AV entry is this endpoint itself, never a PeerId: shm (1.17)
    // reports fi_addr 0 as the source of a sender that is not in the AV,
    // which must not alias the first real peer.
    fi_addr_t self = FI_ADDR_UNSPEC;
    rc = fi_av_insert(av_.get(), local_address_.data(), 1, &self, 0, nullptr);
    if (rc != 1) {
      KLOG(Warning, kLogModule)
          << "cannot insert the endpoint's own address into its AV ("
          << (rc < 0 ? FiError(rc) : "not inserted")
          << "); senders are not identified";
      source_ = false;
    }
  }

  wake_fd_.reset(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (wake_fd_.get() < 0) {
    return absl::InternalError(
        absl::StrCat("eventfd failed: ", std::strerror(errno)));
  }

  recv_slots_.reserve(options_.receive_buffers);
  for (int i = 0; i < options_.receive_buffers; ++i) {
    recv_slots_.push_back(std::make_unique<RecvSlot>());
    recv_slots_.back()->buffer.reset(new char[options_.max_message_size]);
  }
  {
    absl::MutexLock lock(&released_->mu);
    released_->wake_fd = wake_fd_.get();
  }
  const int posted =
      std::min(options_.posted_receives, options_.receive_buffers);
  for (int i = 0; i < options_.receive_buffers; ++i) {
    if (i < posted) {
      RETURN_IF_ERROR(PostRecv(recv_slots_[i].get()));
    } else {
      spare_.push_back(recv_slots_[i].get());
    }
  }

  char straddr[256];
  size_t straddr_len = sizeof(straddr);
  fi_av_straddr(av_.get(), local_address_.data(), straddr, &straddr_len);
  KLOG(Info, kLogModule)
      << "opened " << info_->fabric_attr->prov_name << " endpoint " << straddr
      << " (max message " << options_.max_message_size << " B, "
      << options_.receive_buffers << " receive buffers, "
      << "inject up to " << inject_size_ << " B, "
      << (cq_fd_ >= 0 ? "fd wait" : "polling")
      << (rma_ ? absl::StrCat(", RMA from ", options_.rma_threshold, " B")
               : std::string(", no RMA"))
      << (rma_ && send_after_write_ ? ", notices follow writes at once" : "")
      << (source_ ? "" : ", no source addresses")
      << (send_ep_per_peer_ ? ", a send endpoint per peer" : "")
      << (serialize_ ? ", serialised calls" : "") << ")";
  progress_thread_ = std::thread([this] { ProgressLoop(); });
  return absl::OkStatus();
}

absl::Status FabricTransport::GetInfo() {
  const char* node = options_.node.empty() ? nullptr : options_.node.c_str();
  // Wanted capabilities first, then without the optional ones.
  std::vector<uint64_t> cap_sets;
  if (options_.use_rma) cap_sets.push_back(FI_MSG | FI_RMA | FI_SOURCE);
  cap_sets.push_back(FI_MSG | FI_SOURCE);
  cap_sets.push_back(FI_MSG);
  int rc = 0;
  for (const uint64_t caps : cap_sets) {
    InfoPtr hints(fi_allocinfo());
    if (hints == nullptr) {
      return absl::ResourceExhaustedError("fi_allocinfo failed");
    }
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = caps;
    hints->mode =
        FI_CONTEXT | FI_CONTEXT2;  // every operation passes an fi_context2
    hints->tx_attr->msg_order = FI_ORDER_SAS;  // in-order delivery per peer
    hints->domain_attr->threading = FI_THREAD_SAFE;
    // No FI_MR_LOCAL: buffers are not registered (landing zones are).
    hints->domain_attr->mr_mode =
        FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    hints->fabric_attr->prov_name = strdup(provider_.c_str());
    fi_info* info = nullptr;
    rc = fi_getinfo(FI_VERSION(1, 17), node, nullptr,
                    node != nullptr ? FI_SOURCE : 0, hints.get(), &info);
    if (rc != 0) continue;
    info_.reset(info);
    if (info_->domain_attr->mr_mode & FI_MR_LOCAL) {
      // Buffers are not registered; a provider that needs local
      // registration for plain sends and receives is not supported yet.
      return absl::UnimplementedError(absl::StrCat(
          "provider '", provider_, "' requires FI_MR_LOCAL, not supported"));
    }
    source_ = (info_->caps & FI_SOURCE) != 0;
    cq_data_ = info_->domain_attr->cq_data_size >= 4;
    rma_ = options_.use_rma && (info_->caps & FI_RMA) != 0 && cq_data_ &&
           (info_->domain_attr->mr_mode & FI_MR_ENDPOINT) == 0;
    rma_virt_addr_ = (info_->domain_attr->mr_mode & FI_MR_VIRT_ADDR) != 0;
    send_after_write_ = (info_->tx_attr->msg_order & FI_ORDER_SAW) != 0;
    return absl::OkStatus();
  }
  return absl::UnavailableError(absl::StrCat(
      "no libfabric provider '", provider_,
      "' offers reliable in-order messages", node != nullptr ? " on " : "",
      options_.node, ": fi_getinfo: ", FiError(rc)));
}

absl::Status FabricTransport::OpenCq() {
  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_DATA;
  cq_attr.size =
      std::max<size_t>(info_->tx_attr->size + info_->rx_attr->size, 64);
  cq_attr.wait_obj = FI_WAIT_FD;
  fid_cq* cq = nullptr;
  int rc = fi_cq_open(domain_.get(), &cq_attr, &cq, nullptr);
  if (rc == 0) {
    cq_.reset(cq);
    rc = fi_control(&cq_->fid, FI_GETWAIT, &cq_fd_);
    if (rc == 0) return absl::OkStatus();
    KLOG(Warning, kLogModule)
        << "provider " << provider_
        << ": fi_control(FI_GETWAIT) failed: " << FiError(rc);
    cq_fd_ = -1;
    cq_.reset();
  }
  KLOG(Info, kLogModule)
      << "provider " << provider_
      << " offers no fd wait object on its completion queue (" << FiError(rc)
      << "); polling with up to " << absl::FormatDuration(kMaxPollBackoff)
      << " sleeps";
  cq_attr.wait_obj = FI_WAIT_NONE;
  rc = fi_cq_open(domain_.get(), &cq_attr, &cq, nullptr);
  if (rc != 0) return FiStatus("fi_cq_open", rc);
  cq_.reset(cq);
  return absl::OkStatus();
}

absl::Status FabricTransport::PostRecv(RecvSlot* slot) {
  FidLock lock(this);
  if (closed_) return absl::OkStatus();
  const ssize_t rc =
      fi_recv(ep_.get(), slot->buffer.get(), options_.max_message_size, nullptr,
              FI_ADDR_UNSPEC, &slot->op.context);
  if (rc == -FI_EAGAIN) {
    pending_recvs_.push_back(slot);
    return absl::OkStatus();
  }
  if (rc != 0) return FiStatus("fi_recv", rc);
  return absl::OkStatus();
}

void FabricTransport::RepostRecv(RecvSlot* slot) {
  const absl::Status status = PostRecv(slot);
  if (!status.ok()) {
    KLOG(Error, kLogModule) << "re-posting a receive buffer: " << status;
  }
}

absl::StatusOr<PeerId> FabricTransport::AddPeer(const std::string& name,
                                                const std::string& address) {
  return InsertPeer(name, address, /*learnt=*/false);
}

absl::StatusOr<PeerId> FabricTransport::InsertPeer(const std::string& name,
                                                   const std::string& address,
                                                   bool learnt) {
  if (address.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer '", name, "': empty address"));
  }
  absl::MutexLock peers_lock(&peers_mu_);
  if (auto it = peer_by_address_.find(address); it != peer_by_address_.end()) {
    Peer& peer = peers_[it->second];
    if (!learnt && peer.learnt) {
      // Learnt from its RMA handshake first; now it has a name.
      peer.name = name;
      peer.learnt = false;
    }
    if (!learnt) peer.failed = absl::OkStatus();  // added again: usable
    return it->second;
  }
  fi_addr_t fi_addr = FI_ADDR_UNSPEC;
  int rc;
  std::string display = name;
  FidPtr<fid_ep> send_ep;
  {
    // Exclusive for a send endpoint: it is bound to the CQ before it is
    // enabled, and reading the CQ progresses every endpoint bound to it (one
    // not enabled yet has no shared memory to progress).
    FidLock lock(this, /*exclusive=*/send_ep_per_peer_);
    if (closed_) return absl::FailedPreconditionError("transport is shut down");
    rc = fi_av_insert(av_.get(), address.data(), 1, &fi_addr, 0, nullptr);
    if (rc == 1 && learnt) {
      char straddr[256] = "";
      size_t straddr_len = sizeof(straddr);
      fi_av_straddr(av_.get(), address.data(), straddr, &straddr_len);
      display = absl::StrCat("unnamed peer ", straddr);
    }
    if (rc == 1 && send_ep_per_peer_) send_ep = OpenSendEndpoint();
  }
  if (rc != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "peer '", name, "': fi_av_insert of address ", absl::CEscape(address),
        " failed: ", rc < 0 ? FiError(rc) : "not inserted"));
  }
  const PeerId id = static_cast<PeerId>(peers_.size());
  Peer& peer = peers_.emplace_back();
  peer.name = display;
  peer.fi_addr = fi_addr;
  peer.learnt = learnt;
  peer.send_ep = std::move(send_ep);
  peer_by_address_.emplace(address, id);
  peer_by_fi_addr_.emplace(fi_addr, id);
  fi_addr_by_source_.emplace(SourceHash(address), fi_addr);
  return id;
}

absl::StatusOr<FidPtr<fid_ep>> FabricTransport::OpenEndpoint(
    const fi_info* info) {
  // shm names an endpoint's shared memory "<pid>:<uid>:<index>": a region
  // left by a killed process whose pid this process now has makes
  // fi_enable fail with EBUSY, and the provider removes it on the way; the
  // next endpoint (next index) opens. A killed daemon leaves one region per
  // endpoint it had (its per-peer send endpoints too), so a few in a row
  // may be stale.
  constexpr int kEnableAttempts = 16;
  for (int attempt = 1;; ++attempt) {
    fid_ep* raw = nullptr;
    int rc =
        fi_endpoint(domain_.get(), const_cast<fi_info*>(info), &raw, nullptr);
    if (rc != 0) return FiStatus("fi_endpoint", rc);
    FidPtr<fid_ep> ep(raw);
    rc = fi_ep_bind(ep.get(), &av_->fid, 0);
    if (rc != 0) return FiStatus("fi_ep_bind(av)", rc);
    rc = fi_ep_bind(ep.get(), &cq_->fid, FI_TRANSMIT | FI_RECV);
    if (rc != 0) return FiStatus("fi_ep_bind(cq)", rc);
    rc = fi_enable(ep.get());
    if (rc == -FI_EBUSY && attempt < kEnableAttempts) {
      KLOG(Warning, kLogModule) << "fi_enable: " << FiError(rc)
                                << " (a stale shared-memory region?); retrying";
      continue;
    }
    if (rc != 0) return FiStatus("fi_enable", rc);
    return ep;
  }
}

FidPtr<fid_ep> FabricTransport::OpenSendEndpoint() {
  // It receives nothing: a small receive side keeps its shared memory small.
  InfoPtr info(fi_dupinfo(info_.get()));
  if (info == nullptr) return nullptr;
  info->rx_attr->size = std::min<size_t>(info->rx_attr->size, 64);
  absl::StatusOr<FidPtr<fid_ep>> ep = OpenEndpoint(info.get());
  if (!ep.ok()) {
    KLOG(Warning, kLogModule)
        << "cannot open a send endpoint for a peer (" << ep.status().message()
        << "); its messages go from the main endpoint";
    return nullptr;
  }
  send_endpoints_.fetch_add(1, std::memory_order_relaxed);
  return *std::move(ep);
}

std::string FabricTransport::PeerName(PeerId peer) const {
  if (peer == kUnknownPeer) return "unknown peer";
  absl::MutexLock lock(&peers_mu_);
  if (peer < 0 || static_cast<size_t>(peer) >= peers_.size())
    return absl::StrCat("peer #", peer);
  return peers_[peer].name;
}

PeerId FabricTransport::PeerBySourceTag(uint64_t source_tag) const {
  absl::MutexLock lock(&peers_mu_);
  auto it = fi_addr_by_source_.find(static_cast<uint32_t>(source_tag));
  if (it == fi_addr_by_source_.end()) return kUnknownPeer;
  auto peer = peer_by_fi_addr_.find(it->second);
  return peer == peer_by_fi_addr_.end() ? kUnknownPeer : peer->second;
}

PeerId FabricTransport::PeerByFiAddr(fi_addr_t addr) const {
  if (addr == FI_ADDR_NOTAVAIL || addr == FI_ADDR_UNSPEC) return kUnknownPeer;
  absl::MutexLock lock(&peers_mu_);
  auto it = peer_by_fi_addr_.find(addr);
  return it == peer_by_fi_addr_.end() ? kUnknownPeer : it->second;
}

std::map<std::string, double> FabricTransport::Counters() const {
  std::map<std::string, double> c;
  c["rma_messages_sent"] = double(rma_sent_.load());
  c["rma_bytes_sent"] = double(rma_bytes_sent_.load());
  c["rma_messages_received"] = double(rma_received_.load());
  c["rma_fallback_setup"] = double(rma_fallback_setup_.load());
  c["rma_fallback_zone_full"] = double(rma_fallback_full_.load());
  c["rma_fallback_busy"] = double(rma_fallback_busy_.load());
  c["rma_zones_ready"] = double(rma_zones_ready_.load());
  c["rma_zones_refused"] = double(rma_refused_.load());
  c["rma_zones_granted"] = double(zones_granted_.load());
  c["control_invalid"] = double(control_invalid_.load());
  c["messages_unknown_source"] = double(messages_unknown_source_.load());
  c["send_endpoints"] = double(send_endpoints_.load());
  c["messages_held"] = double(messages_held_.load());
  c["holds_returned"] = double(holds_returned_.load());
  c["rma_enabled"] = rma_ ? 1 : 0;
  c["async_sends"] = double(async_sent_.load());
  c["async_sends_in_flight"] = double(async_in_flight_.load());
  c["async_sends_timed_out"] = double(async_expired_.load());
  c["sends_failed_peer"] = double(sends_failed_peer_.load());
  return c;
}

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

std::optional<absl::Status> FabricTransport::TrySendRma(
    PeerId peer, const char* data, size_t len,
    std::shared_ptr<const std::string>* owned, SendDone* async) {
  if (async != nullptr && !send_after_write_) async = nullptr;
  ZoneOut* zone;
  {
    absl::MutexLock lock(&peers_mu_);
    if (peer < 0 || static_cast<size_t>(peer) >= peers_.size()) {
      return std::nullopt;  // SendImpl reports the bad id
    }
    zone = peers_[peer].zone_out.get();
  }
  // The progress thread must not wait for another sender: it may be the one
  // that has to read that sender's completion.
  if (OnProgressThread()) {
    if (!zone->send_lock.TryLock()) {
      rma_fallback_busy_.fetch_add(1, std::memory_order_relaxed);
      return std::nullopt;
    }
  } else {
    zone->send_lock.Lock();
  }
  // Ring space is allocated in multiples of 64 bytes, so every message
  // starts 64-byte aligned in the zone (frames need 8).
  const uint64_t alloc = (uint64_t{len} + 63) & ~uint64_t{63};
  bool request = false;
  bool fits = false;
  bool ready = false;
  WireOp wire;
  RmaNotice notice{};
  {
    absl::MutexLock lock(&rma_mu_);
    switch (zone->state) {
      case ZoneOut::State::kNone:
        zone->state = ZoneOut::State::kRequested;
        request = true;
        break;
      case ZoneOut::State::kRequested:
      case ZoneOut::State::kRefused:
        break;
      case ZoneOut::State::kReady: {
        ready = true;
        const uint64_t pos = zone->head % zone->size;
        const uint64_t skip = pos + alloc > zone->size ? zone->size - pos : 0;
        if (alloc <= zone->size &&
            zone->head + skip + alloc - zone->tail <= zone->size) {
          fits = true;
          const uint64_t offset = skip > 0 ? 0 : pos;
          zone->head += skip + alloc;
          notice = RmaNotice{zone->zone, 0, offset, len, zone->head};
          wire.write = true;
          wire.remote_addr = zone->remote_addr + offset;
          wire.key = zone->key;
        }
        break;
      }
    }
  }
  if (!fits) {
    zone->send_lock.Unlock();
    if (request) {
      std::string body(sizeof(ZoneRequest), '\0');
      const ZoneRequest req{kRmaProtocolVersion, peer};
      std::memcpy(body.data(), &req, sizeof(req));
      body += local_address_;
      const absl::Status status =
          SendControl(peer, ControlKind::kZoneRequest, body);
      if (!status.ok()) {
        KLOG(Warning, kLogModule) << "RMA zone request to peer '"
                                  << PeerName(peer) << "': " << status;
        absl::MutexLock lock(&rma_mu_);
        zone->state = ZoneOut::State::kNone;  // ask again next time
      }
    }
    if (!ready) {
      rma_fallback_setup_.fetch_add(1, std::memory_order_relaxed);
    } else {
      rma_fallback_full_.fetch_add(1, std::memory_order_relaxed);
    }
    return std::nullopt;
  }
  bool post_failed = false;
  const std::string_view notice_body(reinterpret_cast<const char*>(&notice),
                                     sizeof(notice));
  if (send_after_write_) wire.notice = notice_body;
  absl::Status status =
      SendImpl(peer, data, len, *owned, wire, &post_failed, async);
  if (status.ok() && !send_after_write_) {
    status = SendControl(peer, ControlKind::kRmaNotice, notice_body);
  }
  zone->send_lock.Unlock();
  if (status.ok()) {
    rma_sent_.fetch_add(1, std::memory_order_relaxed);
    rma_bytes_sent_.fetch_add(len, std::memory_order_relaxed);
    return status;
  }
  if (post_failed) {
    // The provider refused the write itself (not the peer): send plainly
    // from now on. The ring space stays allocated, which is harmless.
    KLOG(Warning, kLogModule)
        << "RMA write to peer '" << PeerName(peer) << "' refused ("
        << status.message() << "); sending plain messages to it";
    {
      absl::MutexLock lock(&rma_mu_);
      zone->state = ZoneOut::State::kRefused;
    }
    return SendImpl(peer, data, len, std::move(*owned), WireOp(), nullptr,
                    async);
  }
  return status;
}

absl::Status FabricTransport::SendControl(PeerId peer, ControlKind kind,
                                          std::string_view body) {
  WireOp wire;
  wire.has_data = true;
  wire.data = kControlTag | static_cast<uint64_t>(kind);
  return SendImpl(peer, body.data(), body.size(), nullptr, wire);
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

void FabricTransport::HandleControl(RecvSlot* slot, size_t len, fi_addr_t src,
                                    uint64_t data) {
  const std::string_view body(slot->buffer.get(), len);
  const auto kind = static_cast<ControlKind>(data & 0xFF);
  switch (kind) {
    case ControlKind::kZoneRequest:
      HandleZoneRequest(body);
      break;
    case ControlKind::kZoneGrant:
    case ControlKind::kZoneRefuse:
      HandleZoneReply(kind, body);
      break;
    case ControlKind::kRmaNotice:
      DeliverRmaNotice(body, src);
      break;
    case ControlKind::kCredit:
      ApplyCredit(body, src);
      break;
    default:
      control_invalid_.fetch_add(1, std::memory_order_relaxed);
      KLOG(Warning, kLogModule)
          << "dropped a control message of unknown kind " << (data & 0xFF)
          << " from " << PeerName(PeerByFiAddr(src));
      break;
  }
  RepostRecv(slot);
}

void FabricTransport::ApplyCredit(std::string_view body, fi_addr_t src) {
  Credit credit;
  ZoneOut* zone = nullptr;
  if (ReadBody(body, &credit)) {
    absl::MutexLock lock(&peers_mu_);
    if (credit.token >= 0 &&
        static_cast<size_t>(credit.token) < peers_.size()) {
      zone = peers_[credit.token].zone_out.get();
    }
  }
  bool valid = false;
  if (zone != nullptr) {
    absl::MutexLock lock(&rma_mu_);
    if (zone->state == ZoneOut::State::kReady && credit.end <= zone->head) {
      zone->tail = std::max(zone->tail, credit.end);
      valid = true;
    }
  }
  if (!valid) {
    control_invalid_.fetch_add(1, std::memory_order_relaxed);
    KLOG(Warning, kLogModule)
        << "dropped an invalid RMA credit of " << body.size() << " bytes from "
        << PeerName(PeerByFiAddr(src));
  }
}

void FabricTransport::SendCredit(ZoneIn* zone) {
  if (zone->credited_end == zone->delivered_end) return;
  zone->credited_end = zone->delivered_end;
  const Credit credit{zone->token, 0, zone->delivered_end};
  const absl::Status status = SendControl(
      zone->peer, ControlKind::kCredit,
      std::string_view(reinterpret_cast<const char*>(&credit), sizeof(credit)));
  if (!status.ok() && !stop_.load(std::memory_order_relaxed)) {
    KLOG(Warning, kLogModule)
        << "RMA credit to peer '" << PeerName(zone->peer) << "': " << status;
  }
}

void FabricTransport::FlushCredits() {
  if (!credits_pending_) return;
  credits_pending_ = false;
  for (auto& zone : zones_in_) SendCredit(zone.get());
}

void FabricTransport::HandleZoneRequest(std::string_view body) {
  ZoneRequest request;
  if (!ReadBody(body, &request) || body.size() == sizeof(request)) {
    control_invalid_.fetch_add(1, std::memory_order_relaxed);
    KLOG(Warning, kLogModule)
        << "dropped an invalid RMA zone request of " << body.size() << " bytes";
    return;
  }
  const std::string address(body.substr(sizeof(request)));
  absl::StatusOr<PeerId> peer = InsertPeer("", address, /*learnt=*/true);
  if (!peer.ok()) {
    control_invalid_.fetch_add(1, std::memory_order_relaxed);
    KLOG(Warning, kLogModule)
        << "RMA zone request from an unusable address: " << peer.status();
    return;
  }
  fi_addr_t sender;
  {
    absl::MutexLock lock(&peers_mu_);
    sender = peers_[*peer].fi_addr;
  }
  const std::string name = PeerName(*peer);
  auto refuse = [&](const std::string& why) {
    KLOG(Info, kLogModule) << "refusing an RMA landing zone to peer '" << name
                           << "': " << why;
    const ZoneRefuse reply{kRmaProtocolVersion, request.token};
    const absl::Status status = SendControl(
        *peer, ControlKind::kZoneRefuse,
        std::string_view(reinterpret_cast<const char*>(&reply), sizeof(reply)));
    if (!status.ok()) {
      KLOG(Warning, kLogModule)
          << "RMA zone refusal to peer '" << name << "': " << status;
    }
  };
  if (request.version != kRmaProtocolVersion) {
    refuse(absl::StrCat("protocol version ", request.version, ", expected ",
                        kRmaProtocolVersion));
    return;
  }
  if (!rma_) {
    refuse("RMA is off on this endpoint");
    return;
  }
  uint32_t index;
  if (auto it = zone_by_sender_.find(sender); it != zone_by_sender_.end()) {
    index = it->second;  // asked again (e.g. after a failed grant)
  } else {
    if (zones_in_.size() >= static_cast<size_t>(options_.rma_max_zones)) {
      refuse(absl::StrCat("all ", options_.rma_max_zones, " zones granted"));
      return;
    }
    auto zone = std::make_unique<ZoneIn>();
    zone->size = (std::max(options_.rma_zone_bytes, options_.max_message_size) +
                  kZoneAlign - 1) &
                 ~(kZoneAlign - 1);
    zone->buffer.reset(new (std::nothrow) char[zone->size]);
    if (zone->buffer == nullptr) {
      refuse(absl::StrCat("cannot allocate ", zone->size, " bytes"));
      return;
    }
    zone->sender = sender;
    fid_mr* mr = nullptr;
    int rc;
    {
      FidLock lock(this);
      if (closed_) return;
      rc = fi_mr_reg(domain_.get(), zone->buffer.get(), zone->size,
                     FI_REMOTE_WRITE, 0, zones_in_.size() + 1, 0, &mr, nullptr);
    }
    if (rc != 0) {
      refuse(absl::StrCat("fi_mr_reg failed: ", FiError(rc)));
      return;
    }
    zone->mr.reset(mr);
    index = static_cast<uint32_t>(zones_in_.size());
    zones_in_.push_back(std::move(zone));
    zone_by_sender_.emplace(sender, index);
    zones_granted_.fetch_add(1, std::memory_order_relaxed);
  }
  ZoneIn* zone = zones_in_[index].get();
  zone->token = request.token;
  zone->peer = *peer;
  ZoneGrant grant{};
  grant.version = kRmaProtocolVersion;
  grant.token = request.token;
  grant.zone = index;
  grant.remote_addr =
      rma_virt_addr_ ? reinterpret_cast<uintptr_t>(zone->buffer.get()) : 0;
  grant.key = fi_mr_key(zone->mr.get());
  grant.size = zone->size;
  if (grant.key == FI_KEY_NOTAVAIL) {
    refuse("the provider gives no key for the zone");
    return;
  }
  const absl::Status status = SendControl(
      *peer, ControlKind::kZoneGrant,
      std::string_view(reinterpret_cast<const char*>(&grant), sizeof(grant)));
  if (!status.ok()) {
    KLOG(Warning, kLogModule)
        << "RMA zone grant to peer '" << name << "': " << status;
    return;
  }
  KLOG(Info, kLogModule) << "granted a " << zone->size
                         << "-byte RMA landing zone to peer '" << name << "'";
}

void FabricTransport::HandleZoneReply(ControlKind kind, std::string_view body) {
  ZoneGrant grant{};
  bool valid;
  if (kind == ControlKind::kZoneGrant) {
    valid = ReadBody(body, &grant) && grant.size > 0;
  } else {
    ZoneRefuse refuse{};
    valid = ReadBody(body, &refuse);
    grant.version = refuse.version;
    grant.token = refuse.token;
  }
  ZoneOut* zone = nullptr;
  if (valid && grant.version == kRmaProtocolVersion) {
    absl::MutexLock lock(&peers_mu_);
    if (grant.token >= 0 && static_cast<size_t>(grant.token) < peers_.size()) {
      zone = peers_[grant.token].zone_out.get();
    }
  }
  if (zone == nullptr) {
    control_invalid_.fetch_add(1, std::memory_order_relaxed);
    KLOG(Warning, kLogModule)
        << "dropped an invalid RMA zone reply of " << body.size() << " bytes";
    return;
  }
  const std::string name = PeerName(grant.token);
  absl::MutexLock lock(&rma_mu_);
  if (zone->state != ZoneOut::State::kRequested) return;  // a duplicate
  if (kind == ControlKind::kZoneRefuse) {
    zone->state = ZoneOut::State::kRefused;
    rma_refused_.fetch_add(1, std::memory_order_relaxed);
    KLOG(Info, kLogModule) << "peer '" << name
                           << "' refused an RMA landing zone; sending it "
                              "plain messages";
    return;
  }
  zone->remote_addr = grant.remote_addr;
  zone->key = grant.key;
  zone->size = grant.size;
  zone->zone = grant.zone;
  zone->head = 0;
  zone->tail = 0;
  zone->state = ZoneOut::State::kReady;
  rma_zones_ready_.fetch_add(1, std::memory_order_relaxed);
  KLOG(Info, kLogModule) << "peer '" << name << "' granted a " << grant.size
                         << "-byte RMA landing zone";
}

void FabricTransport::DeliverRmaNotice(std::string_view body, fi_addr_t src) {
  RmaNotice notice;
  ZoneIn* zone = nullptr;
  if (ReadBody(body, &notice) && notice.zone < zones_in_.size()) {
    zone = zones_in_[notice.zone].get();
    // A notice must name its sender's own zone. Only a source the AV maps
    // to another peer counts against it: an unresolved source is not proof.
    const bool other_sender =
        source_ && src != zone->sender && PeerByFiAddr(src) != kUnknownPeer;
    if (notice.offset > zone->size || notice.len > zone->size - notice.offset ||
        other_sender) {
      zone = nullptr;
    }
  }
  if (zone == nullptr) {
    control_invalid_.fetch_add(1, std::memory_order_relaxed);
    KLOG(Warning, kLogModule)
        << "dropped an invalid RMA notice of " << body.size() << " bytes from "
        << PeerName(PeerByFiAddr(src));
    return;
  }
  rma_received_.fetch_add(1, std::memory_order_relaxed);
  CallHandler(zone->peer,
              std::string_view(zone->buffer.get() + notice.offset, notice.len));
  // Credits go back once a quarter of the zone is free to reuse, and
  // whenever the progress thread runs out of work (FlushCredits), so a
  // stream costs one credit per quarter zone rather than one per message.
  zone->delivered_end = std::max(zone->delivered_end, notice.end);
  if (zone->delivered_end - zone->credited_end >= zone->size / 4) {
    SendCredit(zone);
  } else {
    credits_pending_ = true;
  }
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

void FabricTransport::Shutdown() {
  absl::MutexLock shutdown_lock(&shutdown_mu_);
  if (shut_down_) return;
  shut_down_ = true;
  if (progress_thread_.joinable()) {
    stop_.store(true, std::memory_order_release);
    Wake();
    if (progress_thread_.get_id() == std::this_thread::get_id()) {
      // Called from the receive handler: the thread ends after the handler.
      progress_thread_.detach();
    } else {
      progress_thread_.join();
    }
  }
  {
    // Holds released from now on only drop their buffer references.
    absl::MutexLock lock(&released_->mu);
    released_->closed = true;
    released_->wake_fd = -1;
    released_->slots.clear();
    released_->count.store(0);
  }
  {
    // peers_mu_ before fid_lock_, as in AddPeer().
    absl::MutexLock peers_lock(&peers_mu_);
    absl::MutexLock lock(&fid_lock_);
    closed_ = true;
    // Reverse order of opening. Closing the endpoints discards every posted
    // operation, so no completion refers to our buffers afterwards.
    for (Peer& peer : peers_) peer.send_ep.reset();
    ep_.reset();
    for (auto& zone : zones_in_) zone->mr.reset();
    av_.reset();
    cq_.reset();
    domain_.reset();
    fabric_.reset();
    info_.reset();
  }
  {
    // The endpoints are closed: the provider is done with every buffer. A
    // thread still handling completions it read before (cq_mu_) finishes
    // first, so that no op it refers to is recycled under it.
    absl::MutexLock cq_lock(&cq_mu_);
    absl::MutexLock lock(&send_mu_);
    std::vector<SendOp*> ops(in_flight_.begin(), in_flight_.end());
    for (SendOp* op : ops) {
      op->completed = true;
      if (!op->done) {
        FinishOp(op, absl::UnavailableError(
                         "transport shut down before the send completed"));
      } else if (op->released) {
        RecycleSendOp(op);
      }
    }
  }
  RunReadyCallbacks();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> OpenFabricTransport(
    const FabricOptions& options) {
  auto transport = std::make_unique<FabricTransport>(options);
  RETURN_IF_ERROR(transport->Open());
  return std::unique_ptr<Transport>(std::move(transport));
}

}  // namespace karat
