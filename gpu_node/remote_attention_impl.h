// The state of RemoteAttentionBackend (gpu_node/remote_attention.h), shared
// by its files: remote_attention.cc (segments, answers, resends) and
// remote_attention_handshake.cc (the kHello / kHelloAck handshake with each
// KARAT node).
#pragma once

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/frame.h"
#include "common/log_limiter.h"
#include "gpu_node/moe_retransmit.h"
#include "gpu_node/remote_attention.h"

namespace karat {

inline std::string KaratNodeName(const cluster::KaratPlacement& p) {
  return p.node_name().empty() ? absl::StrCat("node-", p.node_id())
                               : p.node_name();
}

struct RemoteAttentionBackend::Impl {
  Impl(const AttnShapes& s, Transport* t, const RemoteAttentionOptions& o)
      : shapes(s), transport(t), options(o) {}
  // The callbacks of frames still with the transport refer to this object:
  // wait for their outcomes (none once the transport is shut down, as the
  // daemon does first; otherwise at the latest after its send timeout).
  ~Impl() {
    absl::MutexLock lock(&mu);
    auto reported = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
      return sends_in_flight == 0;
    };
    mu.Await(absl::Condition(&reported));
  }

  void OnMessage(std::string_view message, PeerId from);
  // A kHelloAck (remote_attention_handshake.cc): marks its hello answered
  // when its proof verifies (any ack in plaintext mode).
  void OnHelloAckLocked(const FrameView& ack, PeerId from)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Greets the KARAT node of `p` unless done (remote_attention_handshake.cc).
  absl::StatusOr<PeerId> EnsurePeer(const cluster::KaratPlacement& p);
  void MarkNotReady(const std::string& fabric_address);
  struct Slot;
  // After `answered` came back: resends the earlier segments to its device
  // that are still unanswered (FastResendLocked in the .cc).
  void FastResendLocked(const Slot& answered) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  using Key = std::tuple<uint32_t, uint64_t, uint32_t,
                         uint64_t>;  // micro-batch, step, layer, session
  // Sends (again) the request frames of the segment awaited as `key`
  // without waiting for their completions. A send the link refuses
  // (UNAVAILABLE: down, or the peer's endpoint not there) is left to the
  // retransmission timer; any other refusal fails the segment.
  void SendSlot(const Key& key);
  absl::Status RunLayer(int mb, WaitHooks* hooks, int layer,
                        const std::vector<Segment>& segs,
                        LayerTraffic* traffic);
  // The frame buffer for a new frame of micro-batch `mb` (see RunLayer).
  std::shared_ptr<std::string> Buffer(int mb);

  class View : public AttentionBackend {
   public:
    View(Impl* impl, int mb, WaitHooks* hooks)
        : impl_(impl), mb_(mb), hooks_(hooks) {}
    absl::Status RunLayer(int layer, const std::vector<Segment>& segs,
                          LayerTraffic* traffic) override {
      return impl_->RunLayer(mb_, hooks_, layer, segs, traffic);
    }
    WaitHooks* hooks() const { return hooks_; }

   private:
    Impl* const impl_;
    const int mb_;
    WaitHooks* const hooks_;
  };
  std::unique_ptr<View> views[2];

  const AttnShapes shapes;
  Transport* const transport;
  const RemoteAttentionOptions options;
  std::atomic<uint32_t> node_id{0};
  std::atomic<uint64_t> id_generation{0};
  std::atomic<uint64_t> bytes_sent{0};
  std::atomic<uint64_t> bytes_received{0};
  std::atomic<uint64_t> frames_invalid{0};
  std::atomic<uint64_t> retransmits{0};
  std::atomic<uint64_t> fast_resends{0};
  std::atomic<uint64_t> resend_requests{0};
  std::atomic<uint64_t> stale_answers{0};
  std::atomic<uint64_t> segments_failed{0};
  // Frames dropped: acks whose proof did not verify, answers from a sender
  // other than the KARAT node's transport peer (with a secret).
  std::atomic<uint64_t> refused_acks{0};
  std::atomic<uint64_t> refused_answers{0};
  LogLimiter log_limiter{absl::Seconds(10)};

  struct Peer {
    PeerId id = kUnknownPeer;
    std::string name;
    uint32_t node_id = 0;  // the incarnation greeted
    bool ready = false;    // handshake done
  };
  // Both micro-batches' threads; held across a handshake.
  absl::Mutex peers_mu;
  absl::flat_hash_map<std::string, Peer> peers
      ABSL_GUARDED_BY(peers_mu);  // by fabric address
  uint64_t handshake_generation ABSL_GUARDED_BY(peers_mu) =
      0;  // id_generation the peers were greeted with
  uint64_t hello_seq ABSL_GUARDED_BY(peers_mu) = 0;  // each hello's step
  // Written by the decode loop between steps, read during steps.
  struct Placement {
    cluster::KaratPlacement where;
    uint64_t turn_epoch = 0;
  };
  absl::flat_hash_map<uint64_t, Placement> placements;
  std::atomic<uint64_t> step{0};
  // Per micro-batch: the last layer run, and the frame encoding buffers
  // (see Buffer()).
  int last_layer[2] = {-1, -1};
  std::vector<std::shared_ptr<std::string>> buffers[2];

  // Shared with the receive handler and the send callbacks.
  struct Slot {
    float* out = nullptr;
    size_t expected_bytes = 0;
    std::string node;
    std::string address;  // the node's fabric address (FailNode)
    int mb = 0;
    bool done = false;
    absl::Status status;
    // Retransmission: the request frames, where they go, when they were
    // first sent, how often, and when they go again.
    PeerId peer = kUnknownPeer;
    std::vector<std::shared_ptr<std::string>> frames;
    bool decode = true;  // estimator class: a decode-sized segment
    absl::Time first_sent;
    int sends = 0;
    absl::Duration rto;  // this segment's wait, doubled per resend
    absl::Time resend_at = absl::InfiniteFuture();
    uint32_t device = 0;
    uint64_t seq = 0;  // Impl::send_seq of its last send
  };
  absl::Mutex mu;
  absl::flat_hash_map<Key, Slot> pending ABSL_GUARDED_BY(mu);
  int outstanding[2] ABSL_GUARDED_BY(mu) = {0, 0};
  // Set when a slot of the micro-batch is due for a resend before its
  // timer (its device asked for it): wakes the wait.
  bool resend_due[2] ABSL_GUARDED_BY(mu) = {false, false};
  bool aborted ABSL_GUARDED_BY(mu) = false;
  // The cluster's data-plane secret (empty: plaintext mode, no proofs).
  std::string secret ABSL_GUARDED_BY(mu);
  // Hellos sent and not yet answered, by their step: what the answer's
  // proof must cover, and whether an answer came whose proof did not.
  struct HelloWait {
    std::string nonce;
    uint32_t node_id = 0;  // the KARAT node's
    std::string address;   // its fabric address
    bool refused = false;
  };
  absl::flat_hash_map<uint64_t, HelloWait> hello_waiting ABSL_GUARDED_BY(mu);
  // KARAT node incarnations the coordinator took for lost (FailNode):
  // fabric address -> node id.
  absl::flat_hash_map<std::string, uint32_t> lost_nodes ABSL_GUARDED_BY(mu);
  // Sends in the order they went out (Slot::seq), for the fast resend.
  uint64_t send_seq ABSL_GUARDED_BY(mu) = 0;
  absl::flat_hash_set<uint64_t> hello_acked ABSL_GUARDED_BY(mu);
  // Answer-time estimates per KARAT node address, [decode, prefill]
  // (gpu_node/moe_retransmit.h: RFC 6298, Karn's rule).
  struct Estimators {
    explicit Estimators(const RemoteAttentionOptions& o)
        : e{RttEstimator(
                RtoBounds{o.rto_initial_decode, o.rto_min, o.rto_max_decode}
                    .Sanitized()),
            RttEstimator(RtoBounds{o.rto_initial_prefill, o.rto_min, o.rto_max}
                             .Sanitized())} {}
    RttEstimator e[2];
  };
  absl::flat_hash_map<std::string, Estimators> rto ABSL_GUARDED_BY(mu);
  RttEstimator& RtoFor(const Slot& slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = rto.try_emplace(slot.address, options).first;
    return it->second.e[slot.decode ? 0 : 1];
  }
  // Ends an awaited output with `status`.
  void FailSlotLocked(Slot* slot, absl::Status status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (slot->done) return;
    slot->done = true;
    slot->status = std::move(status);
    --outstanding[slot->mb];
  }
  // Frames sent whose outcome the transport has not reported yet.
  int sends_in_flight ABSL_GUARDED_BY(mu) = 0;
};

}  // namespace karat
