// Internals of ExpertParallel (gpu_node/expert_parallel.h), shared by its
// source files: expert_parallel.cc (the public methods, the rank table),
// expert_parallel_dispatch.cc (the dispatching side: plans, sends, waits
// for combines) and expert_parallel_serve.cc (the serving side: frames
// received, dispatches computed for other ranks).
#pragma once

#include <atomic>
#include <cstring>
#include <deque>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"
#include "common/log_limiter.h"
#include "gpu_node/combine_cache.h"
#include "gpu_node/expert_parallel.h"
#include "gpu_node/moe_retransmit.h"

namespace karat {
namespace expert_parallel_internal {

inline constexpr const char* kLogModule = "expert_parallel";

template <typename T>
std::vector<T> CopyArray(std::string_view bytes) {
  std::vector<T> v(bytes.size() / sizeof(T));
  if (!v.empty()) std::memcpy(v.data(), bytes.data(), v.size() * sizeof(T));
  return v;
}

inline size_t FrameBytes(const FrameView& frame) {
  std::vector<size_t> lens;
  for (uint32_t i = 0; i < frame.header.n_sections && i < kMaxSections; ++i) {
    lens.push_back(frame.sections[i].size());
  }
  return EncodedFrameSize(lens);
}

// The experts of one frame to one rank, in increasing id.
struct DispatchPlan {
  int rank = 0;
  std::vector<int> experts;
};

// A log line that LogLimiter let through, ending with how many like it
// were held back (EP_LOG).
class LimitedLogLine {
 public:
  LimitedLogLine(LogLevel level, int64_t held)
      : message_(level, kLogModule), held_(held) {}
  ~LimitedLogLine() { message_.stream() << HeldBackNote(held_); }
  std::ostream& stream() { return message_.stream(); }

 private:
  LogMessage message_;
  const int64_t held_;
};

}  // namespace expert_parallel_internal

using expert_parallel_internal::DispatchPlan;

// KLOG for lines that can repeat at the rate of traffic: at most one per
// `key` (a string) per interval of `impl`'s LogLimiter.
//   EP_LOG(this, Warning, StrCat("invalid/", node)) << "dropping ...";
#define EP_LOG(impl, level, key)                             \
  if (int64_t ep_log_held_ = -1;                             \
      !::karat::LogEnabled(::karat::LogLevel::k##level) ||   \
      (ep_log_held_ = (impl)->log_limiter.Admit(key)) < 0) { \
  } else                                                     \
    ::karat::expert_parallel_internal::LimitedLogLine(       \
        ::karat::LogLevel::k##level, ep_log_held_)           \
        .stream()

struct ExpertParallel::Impl {
  Impl(const ModelRunner* r, Transport* t, const ExpertParallelOptions& o)
      : runner(r),
        transport(t),
        options(o),
        rank(r->rank()),
        ranks(r->ranks()),
        hidden(r->config().hidden_size),
        combines(o.combine_cache) {}

  struct Peer {
    bool known = false;
    std::string name;
    uint32_t node_id = 0;
    std::string address;
    PeerId id = kUnknownPeer;
  };

  // One RunExperts call, on its caller's stack; guarded by mu.
  struct Call {
    int outstanding = 0;
    bool failed = false;
    // Bumped when a send of one of its dispatches reports, so that the
    // waiting caller looks at their timers again.
    uint64_t events = 0;
  };
  // One dispatch awaiting its combine; guarded by mu.
  struct Pending {
    Call* call = nullptr;
    int rank = 0;
    uint32_t node_id = 0;
    std::string peer_name;
    int layer = 0;
    // The rank's transport peer (SetPeers updates it for a rank that keeps
    // its node id at a new address) and the encoded frame, sent again as
    // is.
    PeerId peer = kUnknownPeer;
    std::shared_ptr<const std::string> frame;
    RetransmitTimer timer{absl::ZeroDuration()};
    // "cannot send MoeDispatch of layer L to GPU rank R (name): "
    std::string send_prefix;
    absl::Status last_send_error;
    // Destination of each expert's outputs, in the dispatch's order.
    std::vector<std::pair<float*, size_t>> dst;  // (out, floats)
    size_t expected_floats = 0;
    bool done = false;
    absl::Status status;
    // Ends it with `error` before its combine arrived and fails its call.
    void Fail(absl::Status error) {
      done = true;
      status = std::move(error);
      --call->outstanding;
      call->failed = true;
    }
  };

  // A dispatch from another rank for the service thread: parsed, or the
  // error to answer with.
  struct Job {
    uint64_t seq = 0;  // arrival order
    FrameHeader header;
    int from_rank = 0;
    PeerId peer = kUnknownPeer;
    std::string peer_name;
    absl::Status error;
    std::vector<int32_t> experts, counts, indices;
    std::vector<float> rows;
    // The weights of this rank's experts when the dispatch was accepted
    // (SetPeers may give some back before it is served).
    ExpertSnapshot held;
  };
  // A combine sent again from the cache (the service thread sends it).
  struct Resend {
    FrameHeader header;  // of the dispatch that came again
    int from_rank = 0;
    PeerId peer = kUnknownPeer;
    std::string peer_name;
    std::shared_ptr<const std::string> answer;
  };
  // The answer times of one rank (reset when it comes back as another
  // node); guarded by mu.
  struct PeerTiming {
    bool in_table = false;
    uint32_t node_id = 0;
    RttEstimator rtt;
  };

  // A dispatch from a node id outside the rank table, kept until SetPeers
  // names its sender or `deadline` passes.
  struct Parked {
    uint64_t seq = 0;
    FrameHeader header;
    PeerId from = kUnknownPeer;  // as the transport knows the sender
    absl::Time deadline;
    size_t size = 0;
    ReceivedBytes bytes;  // the whole frame; empty for a refused one
    std::string why;      // for a refused one
  };

  // A rank table as SetPeers installs it.
  struct PeerTable {
    std::vector<Peer> peers;                          // by rank
    absl::flat_hash_map<uint32_t, int> rank_of_node;  // the other ranks'
  };
  // SetPeers' table from `list`, every address added to the transport
  // (which returns the same id for an address added again), or why it is
  // refused.
  absl::StatusOr<PeerTable> BuildPeerTable(
      const std::vector<cluster::GpuPeer>& list);
  absl::Status Run(int mb, WaitHooks* hooks, uint64_t step,
                   const ExpertWork& work,
                   std::vector<std::vector<float>>* out);
  // `owners`: the runner's expert ownership, one snapshot per call.
  absl::StatusOr<std::vector<DispatchPlan>> Plan(
      const ExpertWork& work, const std::vector<int>& owners) const;
  // Sends an encoded frame, waiting for its completion (the serving
  // side's answers); counts it.
  absl::Status SendEncoded(PeerId peer,
                           std::shared_ptr<const std::string> frame);
  absl::Status SendFrame(PeerId peer, const FrameHeader& header,
                         const std::vector<std::string_view>& sections);
  // Sends (again) the frame of dispatch `id`, without waiting for its
  // completion; the outcome goes to OnSendOutcome. Call without mu.
  void Transmit(uint64_t id);
  // What became of a copy of dispatch `id`: `refused` when the transport
  // refused it at once. UNAVAILABLE schedules another copy; another error
  // fails the dispatch and wakes its call.
  void OnSendOutcome(uint64_t id, const absl::Status& status, bool refused);
  // The answer times of `r` (mu held).
  PeerTiming& TimingOf(int r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return timing[size_t(r)];
  }
  void Receive(const FrameView& frame, PeerId from,
               const std::string_view* message);
  // Queues the dispatch for the service thread; `seq` 0 takes the next
  // arrival number, a parked dispatch's keeps its place.
  void OnDispatch(const FrameView& frame, int from_rank, const Peer& peer,
                  uint64_t seq = 0);
  // Answers (where the sender's address is known) or drops a parked
  // dispatch whose sender stayed unknown.
  void DropParked(const Parked& p, std::string_view why);
  void OnAnswer(const FrameView& frame, int from_rank);
  // The cache key of a dispatch.
  static DispatchKey KeyOf(const FrameHeader& h);
  void Serve(Job& job);
  void SendAgain(const Resend& resend);
  void ServiceLoop();
  void CountInvalid(const FrameHeader& h, std::string_view why);
  // Counts and logs a frame dropped because its transport sender is not
  // the peer the rank table names for its src_node (`authenticated`).
  void CountUnauthenticated(const FrameHeader& h, PeerId from);

  const ModelRunner* const runner;
  Transport* const transport;
  const ExpertParallelOptions options;
  const int rank;
  const int ranks;
  const int hidden;
  std::atomic<uint32_t> node_id{0};
  // set_authenticated(): frames only from the rank table's transport peers.
  std::atomic<bool> authenticated{false};
  std::atomic<ServiceGate*> service_gate{nullptr};
  std::atomic<uint64_t> next_request{1};

  mutable absl::Mutex peers_mu;
  std::vector<Peer> peers ABSL_GUARDED_BY(peers_mu);
  absl::flat_hash_map<uint32_t, int> rank_of_node ABSL_GUARDED_BY(peers_mu);
  // Abort(), for the waits on peers_mu (`aborted` is mu's).
  bool peers_aborted ABSL_GUARDED_BY(peers_mu) = false;

  absl::Mutex mu;
  absl::flat_hash_map<uint64_t, Pending> pending ABSL_GUARDED_BY(mu);
  bool aborted ABSL_GUARDED_BY(mu) = false;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  std::deque<Job> jobs ABSL_GUARDED_BY(mu);  // in increasing seq
  uint64_t next_seq ABSL_GUARDED_BY(mu) = 1;
  std::deque<Parked> parked ABSL_GUARDED_BY(mu);  // in increasing seq
  size_t parked_bytes ABSL_GUARDED_BY(mu) = 0;
  // Refused on arrival (over the bounds): dropped by the service thread,
  // since answering sends and the receive thread must not block.
  std::deque<Parked> refused ABSL_GUARDED_BY(mu);
  // Combines to send again, ahead of `jobs`.
  std::deque<Resend> resends ABSL_GUARDED_BY(mu);
  uint64_t service_events ABSL_GUARDED_BY(mu) = 0;  // wakes the service thread
  // The dispatches served and being served, per sender.
  CombineCache combines ABSL_GUARDED_BY(mu);
  // By rank; sized by the constructor.
  std::vector<PeerTiming> timing ABSL_GUARDED_BY(mu);
  LogLimiter log_limiter{absl::Seconds(10)};
  std::thread service;
  // Dispatches sent asynchronously whose outcome is not reported yet: the
  // destructor waits for them (the transport reports each exactly once, at
  // the latest when it shuts down or the send times out), since their
  // callbacks refer to this object.
  int sends_in_flight ABSL_GUARDED_BY(mu) = 0;

  std::atomic<uint64_t> frames_sent{0}, bytes_sent{0}, frames_received{0},
      bytes_received{0}, dispatches_sent{0}, dispatches_served{0}, rows_sent{0},
      rows_served{0}, frames_invalid{0}, frames_unknown_sender{0},
      frames_stale{0}, send_errors{0}, calls{0}, calls_failed{0}, waits{0},
      wait_ns{0}, dispatches_parked{0}, parked_released{0}, parked_expired{0},
      parked_refused{0}, parked_answered{0}, retransmits{0},
      duplicates_served{0}, duplicates_joined{0}, frames_unauthenticated{0};
};

}  // namespace karat
