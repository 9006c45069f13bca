#include "gpu_node/remote_attention.h"

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
#include "common/status_macros.h"

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
  // Sends one request frame of a layer without waiting for its completion;
  // a send that fails later fails the segment's slot (`key`) and wakes the
  // layer's wait with the error a refused send returns here.
  using Key = std::tuple<uint32_t, uint64_t, uint32_t,
                         uint64_t>;  // micro-batch, step, layer, session
  absl::Status Send(int mb, PeerId peer, const std::string& node,
                    const FrameHeader& header,
                    const std::vector<std::string_view>& sections,
                    const Key& key);
  absl::Status RunLayer(int mb, WaitHooks* hooks, int layer,
                        const std::vector<Segment>& segs,
                        LayerTraffic* traffic);

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

  struct Peer {
    PeerId id = kUnknownPeer;
    std::string name;
    bool ready = false;  // handshake done
  };
  // Both micro-batches' threads; held across a handshake.
  absl::Mutex peers_mu;
  absl::flat_hash_map<std::string, Peer> peers
      ABSL_GUARDED_BY(peers_mu);  // by fabric address
  uint64_t handshake_generation ABSL_GUARDED_BY(peers_mu) =
      0;  // id_generation the peers were greeted with
  uint64_t hello_nonce ABSL_GUARDED_BY(peers_mu) = 0;
  // Written by the decode loop between steps, read during steps.
  absl::flat_hash_map<uint64_t, cluster::KaratPlacement> placements;
  std::atomic<uint64_t> step{0};
  // Per micro-batch: the last layer run, and the frame encoding buffers
  // (see Send()).
  int last_layer[2] = {-1, -1};
  std::vector<std::shared_ptr<std::string>> buffers[2];

  // Shared with the receive handler.
  struct Slot {
    float* out = nullptr;
    size_t expected_bytes = 0;
    std::string node;
    std::string address;  // the node's fabric address (FailNode)
    int mb = 0;
    bool done = false;
    absl::Status status;
  };
  absl::Mutex mu;
  absl::flat_hash_map<Key, Slot> pending ABSL_GUARDED_BY(mu);
  int outstanding[2] ABSL_GUARDED_BY(mu) = {0, 0};
  bool failed[2] ABSL_GUARDED_BY(mu) = {false, false};
  bool aborted ABSL_GUARDED_BY(mu) = false;
  absl::flat_hash_set<uint64_t> hello_waiting ABSL_GUARDED_BY(mu);
  absl::flat_hash_set<uint64_t> hello_acked ABSL_GUARDED_BY(mu);
  // Ends an awaited output with `status` and fails its micro-batch's wait.
  void FailSlotLocked(Slot* slot, absl::Status status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    slot->done = true;
    slot->status = std::move(status);
    --outstanding[slot->mb];
    failed[slot->mb] = true;
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
    KLOG(Warning, "gpu_node")
        << "dropping an invalid frame of " << message.size() << " bytes from "
        << transport->PeerName(from) << ": " << frame.status().message();
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
    KLOG(Warning, "gpu_node")
        << "unexpected " << FrameTypeName(h.type) << " frame from node "
        << h.src_node << " (" << transport->PeerName(from) << ")";
    return;
  }
  auto it = pending.find(Key{h.micro_batch, h.step, h.layer, h.session});
  if (it == pending.end() || it->second.done) {
    KLOG(Debug, "gpu_node")
        << "session=" << h.session << " stale " << FrameTypeName(h.type)
        << " (step " << h.step << ", layer " << h.layer << ") dropped";
    return;
  }
  Slot& slot = it->second;
  slot.done = true;
  --outstanding[slot.mb];
  if (type == FrameType::kError) {
    const std::string_view text =
        h.n_sections > 0 ? frame->sections[0] : std::string_view();
    slot.status = absl::Status(
        StatusCodeFromWire(h.status),
        absl::StrCat("KARAT node ", slot.node, ": ", std::string(text)));
    failed[slot.mb] = true;
  } else if (h.n_sections != 1 ||
             frame->sections[0].size() != slot.expected_bytes) {
    slot.status = absl::DataLossError(
        absl::StrCat("KARAT node ", slot.node, " sent an attention output of ",
                     h.n_sections > 0 ? frame->sections[0].size() : 0,
                     " bytes; expected ", slot.expected_bytes));
    failed[slot.mb] = true;
  } else {
    std::memcpy(slot.out, frame->sections[0].data(), slot.expected_bytes);
  }
}

absl::Status RemoteAttentionBackend::Impl::Send(
    int mb, PeerId peer, const std::string& node, const FrameHeader& header,
    const std::vector<std::string_view>& sections, const Key& key) {
  // Frames are encoded into reused buffers, one per frame in flight. The
  // transport holds a buffer until the provider is done with it (even past
  // a failed send); a buffer is rewritten only once this is again its only
  // owner, and a new one joins the pool otherwise.
  std::vector<std::shared_ptr<std::string>>& pool = buffers[mb];
  std::shared_ptr<std::string>* buffer = nullptr;
  for (std::shared_ptr<std::string>& b : pool) {
    if (b.use_count() == 1) {
      buffer = &b;
      break;
    }
  }
  // Beyond this many frames in flight, further buffers are not kept.
  constexpr size_t kMaxPooledBuffers = 64;
  std::shared_ptr<std::string> fresh;
  if (buffer != nullptr) {
    // Pairs with the transport's release of its reference, so that the
    // provider's reads of the old bytes happen before the rewrite.
#if defined(__SANITIZE_THREAD__)
    // ThreadSanitizer does not model fences (gcc -Wtsan), and would report
    // the rewrite as racing with those reads. A copy of the pointer gives it
    // the same ordering to see: libstdc++ increments the count with an
    // acquire-release operation, which reads the transport's release.
    std::shared_ptr<std::string>(*buffer).reset();
#else
    std::atomic_thread_fence(std::memory_order_acquire);
#endif
  } else if (pool.size() < kMaxPooledBuffers) {
    pool.push_back(std::make_shared<std::string>());
    buffer = &pool.back();
  } else {
    fresh = std::make_shared<std::string>();
    buffer = &fresh;
  }
  EncodeFrame(header, sections, buffer->get());
  const size_t size = (*buffer)->size();
  const std::string prefix =
      absl::StrCat("cannot send ", FrameTypeName(header.type),
                   " to KARAT node ", node, ": ");
  {
    absl::MutexLock lock(&mu);
    ++sends_in_flight;
  }
  // The transport reads a large frame in place and copies a small one
  // (FabricOptions::zero_copy_threshold). The callback runs on a transport
  // thread (or here, before the call returns).
  absl::Status s = transport->SendSharedAsync(
      peer, *buffer, [this, key, prefix](absl::Status status) {
        absl::MutexLock lock(&mu);
        --sends_in_flight;
        if (status.ok()) return;
        auto it = pending.find(key);
        if (it == pending.end() || it->second.done) return;  // answered
        FailSlotLocked(&it->second, absl::UnavailableError(absl::StrCat(
                                        prefix, status.message())));
      });
  if (!s.ok()) {
    absl::MutexLock lock(&mu);
    --sends_in_flight;
    return absl::UnavailableError(absl::StrCat(prefix, s.message()));
  }
  bytes_sent.fetch_add(size);
  return absl::OkStatus();
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
  Peer& peer = peers[p.fabric_address()];
  if (peer.ready) return peer.id;
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
  absl::Status sent = transport->Send(peer.id, hello.data(), hello.size());
  if (!sent.ok()) {
    sent = absl::UnavailableError(absl::StrCat(
        "cannot send Hello to KARAT node ", peer.name, ": ", sent.message()));
  }
  bool acked = false;
  {
    absl::MutexLock lock(&mu);
    if (sent.ok()) {
      auto done = [this, nonce]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
        return hello_acked.contains(nonce) || aborted;
      };
      mu.AwaitWithTimeout(absl::Condition(&done), options.timeout);
      acked = hello_acked.contains(nonce);
    }
    hello_waiting.erase(nonce);
    hello_acked.erase(nonce);
  }
  RETURN_IF_ERROR(sent);
  if (!acked) {
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
    uint64_t session, const cluster::KaratPlacement& placement) {
  impl_->placements[session] = placement;
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
                                     const std::string& reason) {
  int failed = 0;
  {
    absl::MutexLock lock(&impl_->mu);
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

  std::vector<PeerId> peers(segs.size());
  std::vector<const cluster::KaratPlacement*> homes(segs.size());
  for (size_t i = 0; i < segs.size(); ++i) {
    auto it = m.placements.find(segs[i].session);
    if (it == m.placements.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("session ", segs[i].session, " has no KARAT placement"));
    }
    homes[i] = &it->second;
    ASSIGN_OR_RETURN(peers[i], m.EnsurePeer(*homes[i]));
  }

  auto key = [&](size_t i) {
    return Impl::Key{uint32_t(mb), step, uint32_t(layer), segs[i].session};
  };
  {
    absl::MutexLock lock(&m.mu);
    m.failed[mb] = false;
    m.outstanding[mb] = 0;
    for (size_t i = 0; i < segs.size(); ++i) {
      Impl::Slot slot;
      slot.out = traffic->OutFor(int(i), s);
      slot.expected_bytes = segs[i].tokens.size() * size_t(s.heads) *
                            size_t(s.out_dim) * sizeof(float);
      slot.node = NodeName(*homes[i]);
      slot.address = homes[i]->fabric_address();
      slot.mb = mb;
      if (m.pending.emplace(key(i), std::move(slot)).second) {
        ++m.outstanding[mb];
      }
    }
  }
  auto clear_pending = [&] {
    absl::MutexLock lock(&m.mu);
    for (size_t i = 0; i < segs.size(); ++i) m.pending.erase(key(i));
    m.outstanding[mb] = 0;
  };

  // The projections are done (on the emulated GPU) before they are sent.
  if (hooks != nullptr) hooks->BeforeSend();
  for (size_t i = 0; i < segs.size(); ++i) {
    const size_t n = segs[i].tokens.size();
    FrameHeader header;
    header.src_node = m.node_id.load();
    header.layer = uint32_t(layer);
    header.micro_batch = uint32_t(mb);
    header.device = uint32_t(homes[i]->device());
    header.step = step;
    header.session = segs[i].session;
    header.pos_start = uint32_t(segs[i].pos_start);
    header.n_tokens = uint32_t(n);
    const std::string node = NodeName(*homes[i]);
    absl::Status sent;
    if (traffic->has_indexer) {
      const IndexInputs in = traffic->IndexFor(int(i), s);
      const size_t hi = s.index_heads, di = s.index_dim;
      header.type = static_cast<uint16_t>(FrameType::kIndexQK);
      sent = m.Send(mb, peers[i], node, header,
                    {SectionBytes(in.q_codes, n * hi * di),
                     SectionBytes(in.q_scales, n * hi * sizeof(float)),
                     SectionBytes(in.weights, n * hi * sizeof(float)),
                     SectionBytes(in.k_codes, n * di),
                     SectionBytes(in.k_scales, n * sizeof(float))},
                    key(i));
    }
    if (sent.ok()) {
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
      sent = m.Send(mb, peers[i], node, header, sections, key(i));
    }
    if (!sent.ok()) {
      clear_pending();
      m.MarkNotReady(homes[i]->fabric_address());
      return sent;
    }
  }

  absl::Status result;
  if (hooks != nullptr) hooks->BeforeWait();
  {
    absl::MutexLock lock(&m.mu);
    auto done = [&m, mb]() ABSL_SHARED_LOCKS_REQUIRED(m.mu) {
      return m.outstanding[mb] == 0 || m.failed[mb] || m.aborted;
    };
    m.mu.AwaitWithTimeout(absl::Condition(&done), m.options.timeout);
    if (m.aborted)
      result = absl::UnavailableError("the GPU node is shutting down");
    for (size_t i = 0; i < segs.size() && result.ok(); ++i) {
      const Impl::Slot& slot = m.pending[key(i)];
      if (!slot.status.ok()) {
        result = slot.status;
      } else if (!slot.done && !m.failed[mb]) {
        result = absl::UnavailableError(absl::StrCat(
            "no attention output from KARAT node ", slot.node, " for session ",
            segs[i].session, " layer ", layer, " within ",
            absl::ToInt64Milliseconds(m.options.timeout), " ms"));
      }
    }
    for (size_t i = 0; i < segs.size(); ++i) m.pending.erase(key(i));
    m.outstanding[mb] = 0;
  }
  if (hooks != nullptr) hooks->AfterWait();
  if (!result.ok()) {
    // A node that stopped answering gets a fresh handshake next time.
    if (absl::IsUnavailable(result)) {
      for (size_t i = 0; i < segs.size(); ++i) {
        m.MarkNotReady(homes[i]->fabric_address());
      }
    }
    KLOG(Warning, "gpu_node")
        << "layer " << layer << " of step " << step << " failed: " << result;
  }
  return result;
}

}  // namespace karat
