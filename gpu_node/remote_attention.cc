#include "gpu_node/remote_attention.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/frame.h"
#include "common/log.h"
#include "common/log_ids.h"
#include "common/log_limiter.h"
#include "common/status_macros.h"
#include "gpu_node/moe_retransmit.h"

namespace karat {
namespace {

std::string NodeName(const cluster::KaratPlacement& p) {
  return p.node_name().empty() ? absl::StrCat("node-", p.node_id())
                               : p.node_name();
}

}  // namespace

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
  uint64_t hello_nonce ABSL_GUARDED_BY(peers_mu) = 0;
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
  absl::flat_hash_set<uint64_t> hello_waiting ABSL_GUARDED_BY(mu);
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

void RemoteAttentionBackend::Impl::OnMessage(std::string_view message,
                                             PeerId from) {
  bytes_received.fetch_add(message.size());
  absl::StatusOr<FrameView> frame = DecodeFrame(message);
  if (!frame.ok()) {
    frames_invalid.fetch_add(1);
    const std::string peer = transport->PeerName(from);
    if (const int64_t held = log_limiter.Admit("invalid/" + peer); held >= 0) {
      KLOG(Warning, "gpu_node")
          << "dropping an invalid frame of " << message.size() << " bytes from "
          << peer << ": " << frame.status().message() << HeldBackNote(held);
    }
    return;
  }
  const FrameHeader& h = frame->header;
  const auto type = static_cast<FrameType>(h.type);
  absl::MutexLock lock(&mu);
  if (type == FrameType::kHelloAck) {
    if (hello_waiting.contains(h.step)) hello_acked.insert(h.step);
    return;
  }
  if (type != FrameType::kAttnOut && type != FrameType::kError) {
    frames_invalid.fetch_add(1);
    if (const int64_t held =
            log_limiter.Admit(absl::StrCat("unexpected/", h.src_node));
        held >= 0) {
      KLOG(Warning, "gpu_node")
          << "unexpected " << FrameTypeName(h.type) << " frame from node "
          << h.src_node << " (" << transport->PeerName(from) << ")"
          << HeldBackNote(held);
    }
    return;
  }
  auto it = pending.find(Key{h.micro_batch, h.step, h.layer, h.session});
  if (it == pending.end() || it->second.done) {
    // The answer to a copy sent again, or to a segment given up on.
    stale_answers.fetch_add(1);
    KLOG(Debug, "gpu_node") << "session=" << ShortKey(h.session) << " stale "
                            << FrameTypeName(h.type) << " (step " << h.step
                            << ", layer " << h.layer << ") dropped";
    return;
  }
  Slot& slot = it->second;
  if (type == FrameType::kError) {
    const absl::StatusCode code = StatusCodeFromWire(h.status);
    if (code == absl::StatusCode::kAborted) {
      // The device lacked the segment's index keys (lost on the way): send
      // both frames again now.
      resend_requests.fetch_add(1);
      slot.resend_at = absl::InfinitePast();
      resend_due[slot.mb] = true;
      return;
    }
    const std::string_view text =
        h.n_sections > 0 ? frame->sections[0] : std::string_view();
    FailSlotLocked(
        &slot, absl::Status(code, absl::StrCat("KARAT node ", slot.node, ": ",
                                               std::string(text))));
    return;
  }
  if (h.n_sections != 1 || frame->sections[0].size() != slot.expected_bytes) {
    FailSlotLocked(
        &slot, absl::DataLossError(absl::StrCat(
                   "KARAT node ", slot.node, " sent an attention output of ",
                   h.n_sections > 0 ? frame->sections[0].size() : 0,
                   " bytes; expected ", slot.expected_bytes)));
    return;
  }
  std::memcpy(slot.out, frame->sections[0].data(), slot.expected_bytes);
  // Only an answer to frames sent once times the node (Karn).
  if (slot.sends == 1) RtoFor(slot).AddSample(absl::Now() - slot.first_sent);
  slot.done = true;
  --outstanding[slot.mb];
  FastResendLocked(slot);
}

void RemoteAttentionBackend::Impl::FastResendLocked(const Slot& answered) {
  // A device runs its frames in arrival order and a link keeps its order,
  // so the answer to a later send means an earlier unanswered segment to the
  // same device was lost on the way there or back: it goes again now
  // instead of after its RTO.
  for (auto& [key, slot] : pending) {
    if (slot.done || slot.seq >= answered.seq ||
        slot.address != answered.address || slot.device != answered.device ||
        slot.resend_at == absl::InfinitePast())
      continue;
    fast_resends.fetch_add(1);
    slot.resend_at = absl::InfinitePast();
    resend_due[slot.mb] = true;
  }
}

std::shared_ptr<std::string> RemoteAttentionBackend::Impl::Buffer(int mb) {
  // Frames are encoded into reused buffers, one per frame in flight. The
  // transport holds a buffer until the provider is done with it (even past
  // a failed send), and a segment awaiting its answer holds its frames for
  // resends; a buffer is rewritten only once the pool is again its only
  // owner, and a new one joins the pool otherwise.
  std::vector<std::shared_ptr<std::string>>& pool = buffers[mb];
  for (std::shared_ptr<std::string>& b : pool) {
    if (b.use_count() == 1) {
      // Pairs with the transport's release of its reference, so that the
      // provider's reads of the old bytes happen before the rewrite.
#if defined(__SANITIZE_THREAD__)
      // ThreadSanitizer does not model fences (gcc -Wtsan), and would report
      // the rewrite as racing with those reads. A copy of the pointer gives
      // it the same ordering to see: libstdc++ increments the count with an
      // acquire-release operation, which reads the transport's release.
      std::shared_ptr<std::string>(b).reset();
#else
      std::atomic_thread_fence(std::memory_order_acquire);
#endif
      return b;
    }
  }
  // Beyond this many frames in flight, further buffers are not kept.
  constexpr size_t kMaxPooledBuffers = 64;
  auto fresh = std::make_shared<std::string>();
  if (pool.size() < kMaxPooledBuffers) pool.push_back(fresh);
  return fresh;
}

void RemoteAttentionBackend::Impl::SendSlot(const Key& key) {
  PeerId peer;
  std::vector<std::shared_ptr<std::string>> frames;
  std::string node;
  {
    absl::MutexLock lock(&mu);
    auto it = pending.find(key);
    if (it == pending.end() || it->second.done) return;
    Slot& slot = it->second;
    peer = slot.peer;
    frames = slot.frames;
    node = slot.node;
    const absl::Time now = absl::Now();
    slot.seq = ++send_seq;
    if (slot.sends == 0) {
      slot.first_sent = now;
      slot.rto = RtoFor(slot).rto();
    } else {
      retransmits.fetch_add(1);
      slot.rto = RtoFor(slot).Backoff(slot.rto);
    }
    ++slot.sends;
    slot.resend_at = now + slot.rto;
    sends_in_flight += int(frames.size());
  }
  for (size_t f = 0; f < frames.size(); ++f) {
    const std::shared_ptr<std::string>& frame = frames[f];
    const std::string prefix =
        absl::StrCat("cannot send ", FrameTypeName(PeekFrameType(*frame)),
                     " to KARAT node ", node, ": ");
    // The transport reads a large frame in place and copies a small one
    // (FabricOptions::zero_copy_threshold). The callback runs on a transport
    // thread (or here, before the call returns).
    const size_t size = frame->size();
    absl::Status s = transport->SendSharedAsync(
        peer, frame, [this, key, prefix](absl::Status status) {
          absl::MutexLock lock(&mu);
          --sends_in_flight;
          // The link refused it for now: the timer sends it again.
          if (status.ok() || absl::IsUnavailable(status) ||
              absl::IsDeadlineExceeded(status))
            return;
          auto it = pending.find(key);
          if (it == pending.end()) return;
          FailSlotLocked(&it->second, absl::UnavailableError(absl::StrCat(
                                          prefix, status.message())));
        });
    if (s.ok()) {
      bytes_sent.fetch_add(size);
      continue;
    }
    absl::MutexLock lock(&mu);
    --sends_in_flight;
    if (absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s)) continue;
    auto it = pending.find(key);
    if (it != pending.end())
      FailSlotLocked(&it->second,
                     absl::UnavailableError(absl::StrCat(prefix, s.message())));
    // The frames after this one are not sent: none of them will report.
    sends_in_flight -= int(frames.size() - f - 1);
    return;
  }
}

void RemoteAttentionBackend::Impl::MarkNotReady(
    const std::string& fabric_address) {
  absl::MutexLock lock(&peers_mu);
  auto it = peers.find(fabric_address);
  if (it != peers.end()) it->second.ready = false;
}

absl::StatusOr<PeerId> RemoteAttentionBackend::Impl::EnsurePeer(
    const cluster::KaratPlacement& p) {
  absl::MutexLock peers_lock(&peers_mu);
  const uint64_t generation = id_generation.load();
  if (generation != handshake_generation) {
    for (auto& [address, peer] : peers) peer.ready = false;
    handshake_generation = generation;
  }
  {
    // The incarnation the coordinator took for lost is not greeted again
    // (its turns resume elsewhere); one restarted at the same address has
    // another node id and is.
    absl::MutexLock lock(&mu);
    auto lost = lost_nodes.find(p.fabric_address());
    if (lost != lost_nodes.end() && lost->second == p.node_id()) {
      return absl::UnavailableError(
          absl::StrCat("KARAT node ", NodeName(p), " (node id ", p.node_id(),
                       ") is lost; its sessions move to other homes"));
    }
  }
  Peer& peer = peers[p.fabric_address()];
  if (peer.ready && peer.node_id == p.node_id()) return peer.id;
  peer.ready = false;
  peer.node_id = p.node_id();
  peer.name = NodeName(p);
  ASSIGN_OR_RETURN(peer.id, transport->AddPeer(peer.name, p.fabric_address()));
  const uint64_t nonce = ++hello_nonce;
  {
    absl::MutexLock lock(&mu);
    hello_waiting.insert(nonce);
  }
  FrameHeader header;
  header.type = static_cast<uint16_t>(FrameType::kHello);
  header.src_node = node_id.load();
  header.step = nonce;
  const std::string address = transport->LocalAddress();
  // The handshake is encoded in a buffer of its own: the other micro-batch
  // may be sending with its buffer meanwhile.
  std::string hello;
  EncodeFrame(header, {address}, &hello);
  // Sent again, the wait doubling, until answered or the timeout: a lost
  // Hello or HelloAck, or a link down for a while, only delays it.
  const absl::Time deadline = absl::Now() + options.timeout;
  absl::Duration wait = options.rto_initial_decode;
  absl::Status sent;
  bool acked = false;
  while (!acked) {
    sent = transport->Send(peer.id, hello.data(), hello.size());
    if (!sent.ok()) {
      sent = absl::UnavailableError(absl::StrCat(
          "cannot send Hello to KARAT node ", peer.name, ": ", sent.message()));
    }
    absl::MutexLock lock(&mu);
    auto is_lost = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
      auto it = lost_nodes.find(p.fabric_address());
      return it != lost_nodes.end() && it->second == p.node_id();
    };
    auto done = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
      return hello_acked.contains(nonce) || aborted || is_lost();
    };
    const absl::Time until = std::min(absl::Now() + wait, deadline);
    mu.AwaitWithDeadline(absl::Condition(&done), until);
    acked = hello_acked.contains(nonce);
    if (!acked && is_lost()) {
      sent = absl::UnavailableError(
          absl::StrCat("KARAT node ", peer.name,
                       " was taken for lost during the handshake"));
      break;
    }
    if (acked || aborted || absl::Now() >= deadline) break;
    if (!sent.ok() && !absl::IsUnavailable(sent)) break;
    wait = std::min(wait * 2, options.rto_max);
  }
  {
    absl::MutexLock lock(&mu);
    hello_waiting.erase(nonce);
    hello_acked.erase(nonce);
  }
  if (!acked) {
    RETURN_IF_ERROR(sent);
    return absl::UnavailableError(absl::StrCat(
        "KARAT node ", peer.name, " did not answer the handshake within ",
        absl::ToInt64Milliseconds(options.timeout), " ms"));
  }
  peer.ready = true;
  KLOG(Info, "gpu_node") << "connected to KARAT node " << peer.name;
  return peer.id;
}

RemoteAttentionBackend::RemoteAttentionBackend(
    const AttnShapes& shapes, Transport* transport,
    const RemoteAttentionOptions& options, bool install_handler)
    : impl_(std::make_unique<Impl>(shapes, transport, options)) {
  Impl* impl = impl_.get();
  if (install_handler) {
    transport->SetPeerReceiveHandler(
        [impl](PeerId from, std::string_view message) {
          impl->OnMessage(message, from);
        });
  }
}

void RemoteAttentionBackend::OnMessage(std::string_view message, PeerId from) {
  impl_->OnMessage(message, from);
}

AttentionBackend* RemoteAttentionBackend::ForMicroBatch(int mb,
                                                        WaitHooks* hooks) {
  mb = mb == 1 ? 1 : 0;
  std::unique_ptr<Impl::View>& view = impl_->views[mb];
  if (view == nullptr || view->hooks() != hooks) {
    view = std::make_unique<Impl::View>(impl_.get(), mb, hooks);
  }
  return view.get();
}

RemoteAttentionBackend::~RemoteAttentionBackend() = default;

void RemoteAttentionBackend::set_node_id(uint32_t id) {
  // KARAT nodes know this node by its id: a new id needs new handshakes.
  if (impl_->node_id.exchange(id) != id) impl_->id_generation.fetch_add(1);
}

void RemoteAttentionBackend::SetPlacement(
    uint64_t session, const cluster::KaratPlacement& placement,
    uint64_t turn_epoch) {
  impl_->placements[session] = Impl::Placement{placement, turn_epoch};
}

void RemoteAttentionBackend::ClearPlacement(uint64_t session) {
  impl_->placements.erase(session);
}

void RemoteAttentionBackend::BeginStep() {
  ++impl_->step;
  impl_->last_layer[0] = impl_->last_layer[1] = -1;
}

void RemoteAttentionBackend::Abort() {
  absl::MutexLock lock(&impl_->mu);
  impl_->aborted = true;
}

int RemoteAttentionBackend::FailNode(const std::string& fabric_address,
                                     uint32_t node_id,
                                     const std::string& reason) {
  int failed = 0;
  {
    absl::MutexLock lock(&impl_->mu);
    if (node_id != 0) impl_->lost_nodes[fabric_address] = node_id;
    for (auto& [key, slot] : impl_->pending) {
      if (slot.done || slot.address != fabric_address) continue;
      impl_->FailSlotLocked(
          &slot, absl::UnavailableError(absl::StrCat("KARAT node ", slot.node,
                                                     " is lost: ", reason)));
      ++failed;
    }
  }
  // Sends to it, blocked or later, fail at once too (Transport::FailPeer),
  // until a handshake adds the address again. A handshake in progress holds
  // peers_mu up to the timeout: then it is left to fail by itself.
  if (impl_->peers_mu.TryLock()) {
    PeerId id = kUnknownPeer;
    auto it = impl_->peers.find(fabric_address);
    if (it != impl_->peers.end()) {
      it->second.ready = false;
      id = it->second.id;
    }
    impl_->peers_mu.Unlock();
    if (id != kUnknownPeer) {
      (void)impl_->transport->FailPeer(
          id,
          absl::UnavailableError(absl::StrCat("KARAT node is lost: ", reason)));
    }
  }
  return failed;
}

uint64_t RemoteAttentionBackend::bytes_sent() const {
  return impl_->bytes_sent.load();
}
uint64_t RemoteAttentionBackend::bytes_received() const {
  return impl_->bytes_received.load();
}
uint64_t RemoteAttentionBackend::frames_invalid() const {
  return impl_->frames_invalid.load();
}

std::map<std::string, double> RemoteAttentionBackend::Counters() const {
  std::map<std::string, double> c;
  c["attention_retransmits"] = double(impl_->retransmits.load());
  c["attention_fast_resends"] = double(impl_->fast_resends.load());
  c["attention_resend_requests"] = double(impl_->resend_requests.load());
  c["attention_stale_answers"] = double(impl_->stale_answers.load());
  c["attention_segments_failed"] = double(impl_->segments_failed.load());
  c["log_lines_held_back"] = double(impl_->log_limiter.held_back());
  double rto_ms = 0;
  {
    absl::MutexLock lock(&impl_->mu);
    for (const auto& [address, e] : impl_->rto)
      rto_ms = std::max(rto_ms, absl::ToDoubleMilliseconds(e.e[0].rto()));
  }
  c["attention_rto_ms"] = rto_ms;
  return c;
}

absl::Status RemoteAttentionBackend::RunLayer(int layer,
                                              const std::vector<Segment>& segs,
                                              LayerTraffic* traffic) {
  return impl_->RunLayer(0, nullptr, layer, segs, traffic);
}

absl::Status RemoteAttentionBackend::Impl::RunLayer(
    int mb, WaitHooks* hooks, int layer, const std::vector<Segment>& segs,
    LayerTraffic* traffic) {
  Impl& m = *this;
  // A layer not after the previous one starts a new step even without
  // BeginStep(), so that (micro-batch, step, layer, session) never repeats.
  if (layer <= m.last_layer[mb]) ++m.step;
  m.last_layer[mb] = layer;
  const uint64_t step = m.step.load();
  const AttnShapes& s = m.shapes;
  {
    absl::MutexLock lock(&m.mu);
    if (m.aborted)
      return absl::UnavailableError("the GPU node is shutting down");
  }
  // A segment's failure is its own (LayerTraffic::failed) when the caller
  // sized `failed`; otherwise it fails the layer.
  const bool isolate = traffic->failed.size() == segs.size();
  auto out_floats = [&](size_t i) {
    return segs[i].tokens.size() * size_t(s.heads) * size_t(s.out_dim);
  };
  auto fail_segment = [&](size_t i, const absl::Status& st) {
    m.segments_failed.fetch_add(1);
    if (!isolate) return st;
    traffic->failed[i] = st;
    float* out = traffic->OutFor(int(i), s);
    std::fill(out, out + out_floats(i), 0.0f);
    return absl::OkStatus();
  };

  // The segments to send: placed, their node greeted.
  std::vector<size_t> live;
  std::vector<PeerId> peers(segs.size(), kUnknownPeer);
  std::vector<const Placement*> homes(segs.size(), nullptr);
  for (size_t i = 0; i < segs.size(); ++i) {
    if (isolate && !traffic->failed[i].ok()) continue;  // an earlier layer
    auto it = m.placements.find(segs[i].session);
    absl::Status st;
    if (it == m.placements.end()) {
      st = absl::FailedPreconditionError(
          absl::StrCat("session ", segs[i].session, " has no KARAT placement"));
    } else {
      homes[i] = &it->second;
      absl::StatusOr<PeerId> peer = m.EnsurePeer(it->second.where);
      if (peer.ok()) {
        peers[i] = *peer;
      } else {
        st = peer.status();
      }
    }
    if (st.ok()) {
      live.push_back(i);
      continue;
    }
    RETURN_IF_ERROR(fail_segment(i, st));
  }

  auto key = [&](size_t i) {
    return Impl::Key{uint32_t(mb), step, uint32_t(layer), segs[i].session};
  };
  // The projections are done (on the emulated GPU) before they are sent.
  if (hooks != nullptr && !live.empty()) hooks->BeforeSend();
  // Each segment's request frames, encoded once and kept for resends.
  {
    std::vector<Impl::Slot> slots(live.size());
    for (size_t j = 0; j < live.size(); ++j) {
      const size_t i = live[j];
      const size_t n = segs[i].tokens.size();
      const cluster::KaratPlacement& where = homes[i]->where;
      FrameHeader header;
      header.src_node = m.node_id.load();
      header.layer = uint32_t(layer);
      header.micro_batch = uint32_t(mb);
      header.device = uint32_t(where.device());
      header.step = step;
      header.session = segs[i].session;
      header.turn = homes[i]->turn_epoch;
      header.pos_start = uint32_t(segs[i].pos_start);
      header.n_tokens = uint32_t(n);
      Impl::Slot& slot = slots[j];
      if (traffic->has_indexer) {
        const IndexInputs in = traffic->IndexFor(int(i), s);
        const size_t hi = s.index_heads, di = s.index_dim;
        header.type = static_cast<uint16_t>(FrameType::kIndexQK);
        slot.frames.push_back(m.Buffer(mb));
        EncodeFrame(header,
                    {SectionBytes(in.q_codes, n * hi * di),
                     SectionBytes(in.q_scales, n * hi * sizeof(float)),
                     SectionBytes(in.weights, n * hi * sizeof(float)),
                     SectionBytes(in.k_codes, n * di),
                     SectionBytes(in.k_scales, n * sizeof(float))},
                    slot.frames.back().get());
      }
      const AttnInputs in = traffic->AttnFor(int(i), s);
      header.type = static_cast<uint16_t>(FrameType::kAttnQKV);
      std::vector<std::string_view> sections = {
          SectionBytes(in.q,
                       n * size_t(s.heads) * size_t(s.q_dim) * sizeof(float)),
          SectionBytes(in.kv, n * size_t(s.kv_dim) * sizeof(uint16_t))};
      // The optional flags section of the GQA forms
      // (karat_node/data_plane.h): bit 0 marks the end of the turn's
      // prefill; sent only when set, so every other frame stays as it was.
      static constexpr uint32_t kEndsPrefill = 1;
      if (segs[i].ends_prefill && s.kv_heads > 0) {
        sections.push_back(SectionBytes(&kEndsPrefill, sizeof(kEndsPrefill)));
      }
      slot.frames.push_back(m.Buffer(mb));
      EncodeFrame(header, sections, slot.frames.back().get());
      slot.out = traffic->OutFor(int(i), s);
      slot.expected_bytes = out_floats(i) * sizeof(float);
      slot.node = NodeName(where);
      slot.address = where.fabric_address();
      slot.mb = mb;
      slot.peer = peers[i];
      slot.decode = n <= 4;
      slot.device = uint32_t(where.device());
    }
    absl::MutexLock lock(&m.mu);
    m.outstanding[mb] = 0;
    m.resend_due[mb] = false;
    for (size_t j = 0; j < live.size(); ++j) {
      if (m.pending.emplace(key(live[j]), std::move(slots[j])).second)
        ++m.outstanding[mb];
    }
  }
  for (size_t i : live) m.SendSlot(key(i));

  // Waits for every output; resends what is due; gives up on a segment at
  // the deadline.
  const absl::Time deadline = absl::Now() + m.options.timeout;
  absl::Status result;
  if (hooks != nullptr) hooks->BeforeWait();
  for (;;) {
    std::vector<Impl::Key> due;
    {
      absl::MutexLock lock(&m.mu);
      absl::Time wake = deadline;
      for (size_t i : live) {
        const Impl::Slot& slot = m.pending[key(i)];
        if (!slot.done) wake = std::min(wake, slot.resend_at);
      }
      auto ready = [&m, mb]() ABSL_SHARED_LOCKS_REQUIRED(m.mu) {
        return m.outstanding[mb] == 0 || m.aborted || m.resend_due[mb];
      };
      m.mu.AwaitWithDeadline(absl::Condition(&ready), wake);
      m.resend_due[mb] = false;
      if (m.aborted) {
        result = absl::UnavailableError("the GPU node is shutting down");
        break;
      }
      if (m.outstanding[mb] == 0) break;
      const absl::Time now = absl::Now();
      for (size_t i : live) {
        Impl::Slot& slot = m.pending[key(i)];
        if (slot.done) continue;
        if (now >= deadline) {
          m.FailSlotLocked(
              &slot,
              absl::UnavailableError(absl::StrCat(
                  "no attention output from KARAT node ", slot.node,
                  " for session ", segs[i].session, " layer ", layer,
                  " within ", absl::ToInt64Milliseconds(m.options.timeout),
                  " ms (sent ", slot.sends, " times)")));
        } else if (now >= slot.resend_at) {
          due.push_back(key(i));
        }
      }
      if (m.outstanding[mb] == 0) break;
    }
    for (const Impl::Key& k : due) m.SendSlot(k);
  }
  // Collect the outcomes.
  std::vector<absl::Status> outcome(segs.size());
  {
    absl::MutexLock lock(&m.mu);
    for (size_t i : live) {
      auto it = m.pending.find(key(i));
      if (result.ok()) outcome[i] = it->second.status;
      m.pending.erase(it);
    }
    m.outstanding[mb] = 0;
  }
  if (hooks != nullptr) hooks->AfterWait();
  if (!result.ok()) return result;
  for (size_t i : live) {
    if (outcome[i].ok()) continue;
    // A node that stopped answering gets a fresh handshake next time.
    if (absl::IsUnavailable(outcome[i]))
      m.MarkNotReady(homes[i]->where.fabric_address());
    if (const int64_t held = m.log_limiter.Admit(
            absl::StrCat("segment/", int(outcome[i].code())));
        held >= 0) {
      KLOG(Warning, "gpu_node")
          << "session=" << ShortKey(segs[i].session) << " layer " << layer
          << " of step " << step << " failed: " << outcome[i]
          << HeldBackNote(held);
    }
    RETURN_IF_ERROR(fail_segment(i, outcome[i]));
  }
  return absl::OkStatus();
}

}  // namespace karat
