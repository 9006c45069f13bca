#include "gpu_node/remote_attention.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/frame.h"
#include "common/log.h"
#include "common/log_ids.h"
#include "common/log_limiter.h"
#include "common/status_macros.h"
#include "gpu_node/remote_attention_impl.h"

namespace karat {

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
    OnHelloAckLocked(*frame, from);
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
  // With a data-plane secret only the KARAT node's own transport peer (the
  // address its placement names, greeted by a verified handshake) answers.
  if (!secret.empty() && from != slot.peer) {
    refused_answers.fetch_add(1);
    if (const int64_t held = log_limiter.Admit(
            absl::StrCat("refused/", transport->PeerName(from)));
        held >= 0) {
      KLOG(Warning, "gpu_node")
          << "dropping a " << FrameTypeName(h.type) << " frame claiming node "
          << h.src_node << " from " << transport->PeerName(from)
          << ": not the transport peer of KARAT node " << slot.node
          << HeldBackNote(held);
    }
    return;
  }
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
  // Every registration greets the KARAT nodes again, whether the id changed
  // or not: they know this node by its id, and a coordinator that
  // restarted may have announced a table without it meanwhile (a KARAT node
  // then forgets the binding and refuses this node's frames, silently,
  // until it greets again).
  impl_->node_id.store(id);
  impl_->id_generation.fetch_add(1);
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
  c["attention_frames_refused.bad_proof"] = double(impl_->refused_acks.load());
  c["attention_frames_refused.unauthenticated"] =
      double(impl_->refused_answers.load());
  c["attention_frames_refused"] =
      double(impl_->refused_acks.load() + impl_->refused_answers.load());
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
      slot.node = KaratNodeName(where);
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
