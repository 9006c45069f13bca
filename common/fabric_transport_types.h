// Internal to the libfabric transport (fabric_transport*.cc): the
// constants, control message bodies, helpers and the bookkeeping structs
// (receive slots, send ops, landing zones, peers) that FabricTransport
// shares between its files. The design is described in
// fabric_transport_internal.h.
#pragma once

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
namespace fabric_internal {

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

inline std::string FiError(ssize_t rc) {
  const int code = static_cast<int>(rc < 0 ? -rc : rc);
  return absl::StrCat(fi_strerror(code), " (", code, ")");
}

inline absl::Status FiStatus(const char* call, ssize_t rc) {
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
inline int64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}
// absl::Now() from NowNs(), for the per-message paths.
inline absl::Time WallNow() { return absl::FromUnixNanos(NowNs()); }

// FNV-1a of an endpoint address, folded to 32 bits: the same in every
// process (absl::Hash is seeded per process).
inline uint32_t SourceHash(std::string_view address) {
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
inline std::string ProviderName(const std::string& provider) {
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

}  // namespace fabric_internal
}  // namespace karat
