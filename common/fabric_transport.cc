// libfabric RDM implementation of Transport.
//
// Threads. One progress thread runs the receive handler and re-posts receive
// buffers. The completion queue is read by one thread at a time (cq_mu_):
// by the progress thread, or by a sender waiting for its own completion,
// which saves two thread hand-offs per message. Whoever reads it marks sends
// complete and appends received messages to one queue (received_) that only
// the progress thread delivers from, in order; a sender that queued a
// message wakes the progress thread if it sleeps. A Send() from inside the
// receive handler runs on the progress thread itself, so it reads the CQ on
// its own while waiting; what it reads is delivered after the handler
// returns: handlers never nest and order is kept.
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
// Waiting. When the provider gives the CQ an FI_WAIT_FD wait object (tcp and
// verbs through ofi_rxm), the progress thread sleeps in poll() on that fd and
// on an eventfd used to wake it, after fi_trywait() says sleeping is safe. The
// shm provider of libfabric 1.17 refuses FI_WAIT_FD and FI_WAIT_MUTEX_COND,
// and its FI_WAIT_UNSPEC / FI_WAIT_YIELD CQs spin inside fi_cq_sread at 100%
// of a core regardless of the timeout, so for such providers the CQ is opened
// without a wait object and polled with fi_cq_read, sleeping on the eventfd
// with an exponential backoff capped at kMaxPollBackoff between empty polls.
//
// Locking. fid_lock_ protects the fids against Shutdown(): every fi_* call
// on the endpoint, AV or CQ holds it shared, Shutdown() holds it exclusively
// while closing. When the domain is not FI_THREAD_SAFE every fi_* call holds
// it exclusively instead, which serialises them; the progress thread never
// sleeps while holding it (poll() and the backoff sleep are outside).
#include <poll.h>
#include <sched.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/log.h"
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
// Empty polls between two sched_yield() calls while spinning (a power of 2).
constexpr uint32_t kSpinsPerYield = 64;
// Completions read per fi_cq_read call.
constexpr int kCqBatch = 16;
// Idle send operations kept for reuse, with their buffers.
constexpr size_t kMaxCachedSendOps = 8;

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

int64_t NowNs() { return absl::GetCurrentTimeNanos(); }

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
  std::unique_ptr<char[]> buffer;
};

struct SendOp {
  OpContext op{{}, OpKind::kSend, this};
  std::unique_ptr<char[]> buffer;
  size_t capacity = 0;
  // A zero-copy send's message, held until its completion.
  std::shared_ptr<const std::string> owned;
  PeerId peer = kUnknownPeer;
  // Set with `done`, read without the lock by a spinning sender.
  std::atomic<bool> done_flag{false};
  // Guarded by FabricTransport::send_mu_.
  bool done = false;
  bool abandoned = false;  // the sender gave up waiting; recycle on completion
  absl::Status status;
};

struct Peer {
  std::string name;
  fi_addr_t fi_addr = FI_ADDR_UNSPEC;
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
  void SetReceiveHandler(ReceiveHandler handler) override;
  size_t MaxMessageSize() const override { return options_.max_message_size; }
  void Shutdown() override;

 private:
  // Holds fid_lock_ shared, or exclusively when fi_* calls must be serialised.
  class FidLock {
   public:
    explicit FidLock(FabricTransport* t) : t_(t) {
      if (t_->serialize_) {
        t_->fid_lock_.Lock();
      } else {
        t_->fid_lock_.ReaderLock();
      }
    }
    ~FidLock() {
      if (t_->serialize_) {
        t_->fid_lock_.Unlock();
      } else {
        t_->fid_lock_.ReaderUnlock();
      }
    }
    FidLock(const FidLock&) = delete;
    FidLock& operator=(const FidLock&) = delete;

   private:
    FabricTransport* t_;
  };

  absl::Status OpenCq();
  absl::Status PostRecv(RecvSlot* slot);
  void ProgressLoop();
  bool OnProgressThread() const {
    return progress_thread_id_.load(std::memory_order_acquire) ==
           std::this_thread::get_id();
  }
  // Reads completions until the CQ is empty; returns how many were handled.
  // Received messages are queued in received_ for the progress thread. With
  // `try_only`, returns 0 at once when another thread is reading the CQ.
  int DrainCompletions(bool try_only);
  void HandleCompletion(void* op_context, size_t len);
  void QueueReceived(RecvSlot* slot, size_t len, bool deliver);
  // Progress thread: delivers (or re-posts) the oldest queued receive; false
  // when none is queued.
  bool DeliverOne();
  void DeliverReceived(RecvSlot* slot, size_t len);
  absl::Status SendImpl(PeerId peer, const char* data, size_t len,
                        std::shared_ptr<const std::string> owned);
  // Messages up to the provider's inject size: the provider copies them at
  // once and reports no completion, so nothing waits.
  absl::Status InjectSend(PeerId peer, fi_addr_t fi_addr, const char* data,
                          size_t len);
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
  void HandleError();
  void CompleteSend(SendOp* op, absl::Status status);
  void RetryPendingReceives();
  void Wake();
  void WaitForWork(absl::Duration poll_backoff);
  std::string PeerName(PeerId peer);
  SendOp* AcquireSendOp(size_t len);
  void RecycleSendOp(SendOp* op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(send_mu_);

  const FabricOptions options_;
  bool serialize_ = false;  // domain is not FI_THREAD_SAFE
  size_t inject_size_ = 0;  // fi_inject() limit; 0: not used
  std::string provider_;
  std::string local_address_;

  // Opened in this order, closed in the reverse order.
  InfoPtr info_;
  FidPtr<fid_fabric> fabric_;
  FidPtr<fid_domain> domain_;
  FidPtr<fid_cq> cq_;
  FidPtr<fid_av> av_;
  FidPtr<fid_ep> ep_;
  int cq_fd_ = -1;  // the CQ's wait fd, or -1 in polling mode
  ScopedFd wake_fd_;

  absl::Mutex fid_lock_;
  bool closed_ ABSL_GUARDED_BY(fid_lock_) = false;

  std::vector<std::unique_ptr<RecvSlot>> recv_slots_;
  // Progress thread only: receive buffers to re-post once the provider
  // accepts them.
  std::vector<RecvSlot*> pending_recvs_;

  // Only one thread reads the CQ at a time.
  absl::Mutex cq_mu_;
  // Receive completions in CQ order, delivered by the progress thread; with
  // deliver == false the slot is only re-posted (a failed receive).
  struct Received {
    RecvSlot* slot;
    size_t len;
    bool deliver;
  };
  absl::Mutex recv_mu_;
  std::deque<Received> received_ ABSL_GUARDED_BY(recv_mu_);
  // received_.size(), readable without the lock.
  std::atomic<size_t> received_count_{0};
  std::atomic<bool> progress_sleeping_{false};
  std::atomic<int> polling_senders_{0};
  // NowNs() of the last completion or posted send.
  std::atomic<int64_t> last_activity_ns_{0};

  absl::Mutex handler_mu_;
  std::shared_ptr<ReceiveHandler> handler_ ABSL_GUARDED_BY(handler_mu_);

  absl::Mutex peers_mu_;
  std::vector<Peer> peers_ ABSL_GUARDED_BY(peers_mu_);
  absl::flat_hash_map<std::string, PeerId> peer_by_address_
      ABSL_GUARDED_BY(peers_mu_);

  absl::Mutex send_mu_;
  absl::flat_hash_set<SendOp*> in_flight_ ABSL_GUARDED_BY(send_mu_);
  std::vector<std::unique_ptr<SendOp>> free_ops_ ABSL_GUARDED_BY(send_mu_);

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
  if (options_.send_timeout_ms <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "send_timeout_ms must be positive, got ", options_.send_timeout_ms));
  }
  provider_ = ProviderName(options_.provider);

  InfoPtr hints(fi_allocinfo());
  if (hints == nullptr)
    return absl::ResourceExhaustedError("fi_allocinfo failed");
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = FI_MSG;
  hints->mode =
      FI_CONTEXT | FI_CONTEXT2;  // every operation passes an fi_context2
  hints->tx_attr->msg_order = FI_ORDER_SAS;  // in-order delivery per peer
  hints->domain_attr->threading = FI_THREAD_SAFE;
  // No FI_MR_LOCAL: buffers are not registered.
  hints->domain_attr->mr_mode =
      FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
  hints->fabric_attr->prov_name = strdup(provider_.c_str());

  const char* node = options_.node.empty() ? nullptr : options_.node.c_str();
  fi_info* info = nullptr;
  int rc = fi_getinfo(FI_VERSION(1, 17), node, nullptr,
                      node != nullptr ? FI_SOURCE : 0, hints.get(), &info);
  if (rc != 0) {
    return absl::UnavailableError(absl::StrCat(
        "no libfabric provider '", provider_,
        "' offers reliable in-order messages", node != nullptr ? " on " : "",
        options_.node, ": fi_getinfo: ", FiError(rc)));
  }
  info_.reset(info);
  if (info_->domain_attr->mr_mode & FI_MR_LOCAL) {
    // Buffers are not registered; a provider that needs local registration
    // for plain sends and receives is not supported yet.
    return absl::UnimplementedError(absl::StrCat(
        "provider '", provider_, "' requires FI_MR_LOCAL, not supported"));
  }
  if (options_.max_message_size > info_->ep_attr->max_msg_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_message_size ", options_.max_message_size, " exceeds provider '",
        provider_, "' limit ", info_->ep_attr->max_msg_size));
  }
  serialize_ = info_->domain_attr->threading != FI_THREAD_SAFE;
  inject_size_ = options_.use_inject ? info_->tx_attr->inject_size : 0;

  fid_fabric* fabric = nullptr;
  rc = fi_fabric(info_->fabric_attr, &fabric, nullptr);
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

  fid_ep* ep = nullptr;
  rc = fi_endpoint(domain_.get(), info_.get(), &ep, nullptr);
  if (rc != 0) return FiStatus("fi_endpoint", rc);
  ep_.reset(ep);
  rc = fi_ep_bind(ep_.get(), &av_->fid, 0);
  if (rc != 0) return FiStatus("fi_ep_bind(av)", rc);
  rc = fi_ep_bind(ep_.get(), &cq_->fid, FI_TRANSMIT | FI_RECV);
  if (rc != 0) return FiStatus("fi_ep_bind(cq)", rc);
  rc = fi_enable(ep_.get());
  if (rc != 0) return FiStatus("fi_enable", rc);

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

  wake_fd_.reset(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (wake_fd_.get() < 0) {
    return absl::InternalError(
        absl::StrCat("eventfd failed: ", std::strerror(errno)));
  }

  recv_slots_.reserve(options_.receive_buffers);
  for (int i = 0; i < options_.receive_buffers; ++i) {
    recv_slots_.push_back(std::make_unique<RecvSlot>());
    recv_slots_.back()->buffer.reset(new char[options_.max_message_size]);
    RETURN_IF_ERROR(PostRecv(recv_slots_.back().get()));
  }

  char straddr[256];
  size_t straddr_len = sizeof(straddr);
  fi_av_straddr(av_.get(), local_address_.data(), straddr, &straddr_len);
  KLOG(Info, kLogModule) << "opened " << info_->fabric_attr->prov_name
                         << " endpoint " << straddr << " (max message "
                         << options_.max_message_size << " B, "
                         << options_.receive_buffers << " receive buffers, "
                         << "inject up to " << inject_size_ << " B, "
                         << (cq_fd_ >= 0 ? "fd wait" : "polling")
                         << (serialize_ ? ", serialised calls" : "") << ")";
  progress_thread_ = std::thread([this] { ProgressLoop(); });
  return absl::OkStatus();
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

absl::StatusOr<PeerId> FabricTransport::AddPeer(const std::string& name,
                                                const std::string& address) {
  if (address.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer '", name, "': empty address"));
  }
  absl::MutexLock peers_lock(&peers_mu_);
  if (auto it = peer_by_address_.find(address); it != peer_by_address_.end()) {
    return it->second;
  }
  fi_addr_t fi_addr = FI_ADDR_UNSPEC;
  int rc;
  {
    FidLock lock(this);
    if (closed_) return absl::FailedPreconditionError("transport is shut down");
    rc = fi_av_insert(av_.get(), address.data(), 1, &fi_addr, 0, nullptr);
  }
  if (rc != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "peer '", name, "': fi_av_insert of address ", absl::CEscape(address),
        " failed: ", rc < 0 ? FiError(rc) : "not inserted"));
  }
  const PeerId id = static_cast<PeerId>(peers_.size());
  peers_.push_back(Peer{name, fi_addr});
  peer_by_address_.emplace(address, id);
  return id;
}

std::string FabricTransport::PeerName(PeerId peer) {
  absl::MutexLock lock(&peers_mu_);
  if (peer < 0 || static_cast<size_t>(peer) >= peers_.size())
    return absl::StrCat("#", peer);
  return peers_[peer].name;
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
  op->abandoned = false;
  op->status = absl::OkStatus();
  return op.release();
}

void FabricTransport::RecycleSendOp(SendOp* op) {
  in_flight_.erase(op);
  op->owned.reset();
  if (free_ops_.size() < kMaxCachedSendOps) {
    free_ops_.emplace_back(op);
  } else {
    delete op;
  }
}

absl::Status FabricTransport::Send(PeerId peer, const void* data, size_t len) {
  return SendImpl(peer, static_cast<const char*>(data), len, nullptr);
}

absl::Status FabricTransport::SendShared(
    PeerId peer, std::shared_ptr<const std::string> message) {
  if (message == nullptr) {
    return absl::InvalidArgumentError("SendShared: null message");
  }
  const char* data = message->data();
  const size_t len = message->size();
  if (options_.zero_copy_threshold == 0 || len < options_.zero_copy_threshold) {
    return SendImpl(peer, data, len, nullptr);
  }
  return SendImpl(peer, data, len, std::move(message));
}

absl::Status FabricTransport::InjectSend(PeerId peer, fi_addr_t fi_addr,
                                         const char* data, size_t len) {
  absl::Duration backoff = kMinPollBackoff;
  // Set at the first full transmit queue (the common case never reads the
  // clock).
  absl::Time deadline = absl::InfiniteFuture();
  for (;;) {
    ssize_t rc;
    bool closed;
    {
      FidLock lock(this);
      closed = closed_;
      rc = closed ? 0 : fi_inject(ep_.get(), data, len, fi_addr);
    }
    // Not under fid_lock_: AddPeer() takes peers_mu_ before it.
    if (closed) {
      return absl::UnavailableError(absl::StrCat(
          "send to peer '", PeerName(peer), "': transport is shut down"));
    }
    if (rc == 0) break;
    if (rc != -FI_EAGAIN) {
      return absl::UnavailableError(absl::StrCat("send to peer '",
                                                 PeerName(peer),
                                                 "': fi_inject failed: ",
                                                 FiError(rc)));
    }
    if (deadline == absl::InfiniteFuture()) {
      deadline = absl::Now() + absl::Milliseconds(options_.send_timeout_ms);
    }
    // The transmit queue is full: reap completions to free it.
    if (DrainCompletions(/*try_only=*/!OnProgressThread()) > 0) {
      backoff = kMinPollBackoff;
      continue;
    }
    if (!OnProgressThread()) Wake();
    if (absl::Now() >= deadline) {
      return absl::UnavailableError(absl::StrCat(
          "send to peer '", PeerName(peer), "': transmit queue stayed full for ",
          options_.send_timeout_ms, " ms"));
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, kMaxPollBackoff);
  }
  // Manual-progress providers may still have to move the bytes: make sure
  // the progress thread polls.
  last_activity_ns_.store(NowNs(), std::memory_order_relaxed);
  if (!OnProgressThread() &&
      progress_sleeping_.load(std::memory_order_seq_cst)) {
    Wake();
  }
  return absl::OkStatus();
}

absl::Status FabricTransport::SendImpl(
    PeerId peer, const char* data, size_t len,
    std::shared_ptr<const std::string> owned) {
  if (len > options_.max_message_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("message of ", len, " bytes exceeds the maximum of ",
                     options_.max_message_size));
  }
  fi_addr_t fi_addr;
  {
    absl::MutexLock lock(&peers_mu_);
    if (peer < 0 || static_cast<size_t>(peer) >= peers_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown peer id ", peer));
    }
    fi_addr = peers_[peer].fi_addr;
  }
  if (len > 0 && len <= inject_size_) {
    return InjectSend(peer, fi_addr, data, len);
  }
  const std::string name = PeerName(peer);
  const absl::Time deadline =
      absl::Now() + absl::Milliseconds(options_.send_timeout_ms);

  SendOp* op = AcquireSendOp(owned != nullptr ? 0 : len);
  op->peer = peer;
  const char* payload = op->buffer.get();
  if (owned != nullptr) {
    op->owned = std::move(owned);
    payload = data;
  } else if (len > 0) {
    std::memcpy(op->buffer.get(), data, len);
  }
  {
    absl::MutexLock lock(&send_mu_);
    in_flight_.insert(op);
  }

  absl::Status post_status;
  absl::Duration backoff = kMinPollBackoff;
  for (;;) {
    ssize_t rc;
    {
      FidLock lock(this);
      if (closed_) {
        post_status = absl::UnavailableError(
            absl::StrCat("send to peer '", name, "': transport is shut down"));
        break;
      }
      rc = fi_send(ep_.get(), payload, len, nullptr, fi_addr,
                   &op->op.context);
    }
    if (rc == 0) break;
    if (rc != -FI_EAGAIN) {
      post_status = absl::UnavailableError(absl::StrCat(
          "send to peer '", name, "': fi_send failed: ", FiError(rc)));
      break;
    }
    // The transmit queue is full: reap completions to free it.
    if (DrainCompletions(/*try_only=*/!OnProgressThread()) > 0) {
      backoff = kMinPollBackoff;
      continue;
    }
    if (!OnProgressThread()) Wake();
    if (absl::Now() >= deadline) {
      post_status = absl::UnavailableError(absl::StrCat(
          "send to peer '", name, "': transmit queue stayed full for ",
          options_.send_timeout_ms, " ms"));
      break;
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, kMaxPollBackoff);
  }
  if (!post_status.ok()) {
    absl::MutexLock lock(&send_mu_);
    RecycleSendOp(op);
    return post_status;
  }
  last_activity_ns_.store(NowNs(), std::memory_order_relaxed);
  if (OnProgressThread()) {
    AwaitSendOnProgressThread(op, len, deadline);
  } else if (!SpinForSend(op, len, deadline)) {
    // Manual-progress providers move data only when the CQ is read: the
    // progress thread takes over.
    Wake();
  }

  absl::MutexLock lock(&send_mu_);
  send_mu_.AwaitWithDeadline(absl::Condition(&op->done), deadline);
  if (!op->done) {
    // The buffer still belongs to the provider; the progress thread recycles
    // the op when its completion arrives, Shutdown() when the endpoint closes.
    op->abandoned = true;
    return absl::UnavailableError(absl::StrCat(
        "send of ", len, " bytes to peer '", name, "' not completed within ",
        options_.send_timeout_ms, " ms"));
  }
  absl::Status status = std::move(op->status);
  RecycleSendOp(op);
  return status;
}

bool FabricTransport::SpinForSend(SendOp* op, size_t len,
                                  absl::Time deadline) {
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
    if (absl::Now() >= deadline) return;
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

void FabricTransport::SetReceiveHandler(ReceiveHandler handler) {
  auto shared = std::make_shared<ReceiveHandler>(std::move(handler));
  absl::MutexLock lock(&handler_mu_);
  handler_ = std::move(shared);
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
  timespec timeout;
  if (cq_fd_ >= 0) {
    fds[nfds++] = pollfd{cq_fd_, POLLIN, 0};
    timeout = absl::ToTimespec(absl::Milliseconds(kWaitTimeoutMs));
  } else {
    timeout = absl::ToTimespec(poll_backoff);
  }
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
  absl::Time last_completion = absl::Now();
  const int64_t spin_ns = SpinNs(0);
  uint32_t idle_spins = 0;
  while (!stop_.load(std::memory_order_acquire)) {
    RetryPendingReceives();
    if (DeliverOne()) {
      backoff = kMinPollBackoff;
      last_completion = absl::Now();
      continue;
    }
    if (DrainCompletions(/*try_only=*/false) > 0) {
      backoff = kMinPollBackoff;
      last_completion = absl::Now();
      continue;
    }
    // Recent traffic and no sender polling: keep polling without sleeping,
    // letting other runnable threads of the host go first now and then.
    if (spin_ns > 0 && polling_senders_.load(std::memory_order_relaxed) == 0 &&
        NowNs() - last_activity_ns_.load(std::memory_order_relaxed) < spin_ns) {
      if ((++idle_spins & (kSpinsPerYield - 1)) == 0) {
        sched_yield();
      } else {
        CpuRelax();
      }
      continue;
    }
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
    bool queued;
    {
      absl::MutexLock lock(&recv_mu_);
      queued = !received_.empty();
    }
    if (!queued) WaitForWork(backoff);
    progress_sleeping_.store(false, std::memory_order_relaxed);
    const absl::Duration cap = absl::Now() - last_completion > kIdleAfter
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

int FabricTransport::DrainCompletions(bool try_only) {
  if (try_only) {
    if (!cq_mu_.TryLock()) return 0;
  } else {
    cq_mu_.Lock();
  }
  int handled = 0;
  for (;;) {
    fi_cq_data_entry entries[kCqBatch];
    ssize_t n;
    {
      FidLock lock(this);
      n = closed_ ? -FI_EAGAIN : fi_cq_read(cq_.get(), entries, kCqBatch);
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
      HandleCompletion(entries[i].op_context, entries[i].len);
    }
    handled += static_cast<int>(n);
  }
  cq_mu_.Unlock();
  if (handled > 0) last_activity_ns_.store(NowNs(), std::memory_order_relaxed);
  return handled;
}

void FabricTransport::QueueReceived(RecvSlot* slot, size_t len, bool deliver) {
  {
    absl::MutexLock lock(&recv_mu_);
    received_.push_back(Received{slot, len, deliver});
    received_count_.fetch_add(1, std::memory_order_release);
  }
  if (!OnProgressThread() &&
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
  if (r.deliver) {
    DeliverReceived(r.slot, r.len);
  } else {
    const absl::Status status = PostRecv(r.slot);
    if (!status.ok()) {
      KLOG(Error, kLogModule) << "re-posting a receive buffer: " << status;
    }
  }
  return true;
}

void FabricTransport::HandleCompletion(void* op_context, size_t len) {
  if (op_context == nullptr) return;
  const OpContext* op = static_cast<const OpContext*>(op_context);
  if (op->kind == OpKind::kSend) {
    CompleteSend(static_cast<SendOp*>(op->owner), absl::OkStatus());
    return;
  }
  QueueReceived(static_cast<RecvSlot*>(op->owner), len, /*deliver=*/true);
}

void FabricTransport::DeliverReceived(RecvSlot* slot, size_t len) {
  std::shared_ptr<ReceiveHandler> handler;
  {
    absl::MutexLock lock(&handler_mu_);
    handler = handler_;
  }
  if (handler != nullptr && *handler) {
    (*handler)(std::string_view(slot->buffer.get(), len));
  } else {
    KLOG(Warning, kLogModule)
        << "dropped a " << len << "-byte message: no receive handler";
  }
  const absl::Status status = PostRecv(slot);
  if (!status.ok()) {
    KLOG(Error, kLogModule) << "re-posting a receive buffer: " << status;
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
  QueueReceived(slot, 0, /*deliver=*/false);
}

void FabricTransport::CompleteSend(SendOp* op, absl::Status status) {
  absl::MutexLock lock(&send_mu_);
  if (op->abandoned) {
    RecycleSendOp(op);
    return;
  }
  op->status = std::move(status);
  op->done = true;
  op->done_flag.store(true, std::memory_order_release);
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
    absl::MutexLock lock(&fid_lock_);
    closed_ = true;
    // Reverse order of opening. Closing the endpoint discards every posted
    // operation, so no completion refers to our buffers afterwards.
    ep_.reset();
    av_.reset();
    cq_.reset();
    domain_.reset();
    fabric_.reset();
    info_.reset();
  }
  absl::MutexLock lock(&send_mu_);
  std::vector<SendOp*> ops(in_flight_.begin(), in_flight_.end());
  for (SendOp* op : ops) {
    if (op->abandoned) {
      in_flight_.erase(op);
      delete op;
    } else if (!op->done) {
      op->status = absl::UnavailableError(
          "transport shut down before the send completed");
      op->done = true;
      op->done_flag.store(true, std::memory_order_release);
    }
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> OpenFabricTransport(
    const FabricOptions& options) {
  auto transport = std::make_unique<FabricTransport>(options);
  RETURN_IF_ERROR(transport->Open());
  return std::unique_ptr<Transport>(std::move(transport));
}

}  // namespace karat
