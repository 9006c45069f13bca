#include "karat_node/data_plane.h"

#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/hello_proof.h"
#include "common/log.h"
#include "common/log_ids.h"
#include "common/log_limiter.h"
#include "common/status_macros.h"
#include "karat_node/reserve_request.h"

namespace karat {

DataPlaneHandler::DataPlaneHandler(const ModelConfig& config,
                                   Transport* transport)
    : config_(config), transport_(transport) {}

DataPlaneHandler::~DataPlaneHandler() { Stop(); }

absl::StatusOr<std::unique_ptr<DataPlaneHandler>> DataPlaneHandler::Create(
    const ModelConfig& config, const DataPlaneOptions& options,
    Transport* transport) {
  if (options.devices.empty()) {
    return absl::InvalidArgumentError("a KARAT node needs at least 1 device");
  }
  if (options.inline_max_context < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("inline_max_context is ", options.inline_max_context,
                     "; must be >= 0 (0: never run frames inline)"));
  }
  std::unique_ptr<DataPlaneHandler> handler(
      new DataPlaneHandler(config, transport));
  handler->inline_max_context_ = options.inline_max_context;
  // One attention method for every device (the GQA forms; mla_dsa runs
  // RunIndexer/RunAttention).
  std::shared_ptr<const SparseAttention> method;
  if (config.attention.type != AttentionType::kMlaDsa) {
    MethodWeights weights;
    if (!options.model_dir.empty()) {
      ASSIGN_OR_RETURN(weights, LoadMethodWeights(options.model_dir, config));
    }
    ASSIGN_OR_RETURN(method, NewSparseAttention(config, weights));
  }
  for (size_t i = 0; i < options.devices.size(); ++i) {
    auto device = KaratDevice::Create(int(i), config, options.tokens_per_page,
                                      options.devices[i], method);
    if (!device.ok()) {
      return absl::Status(
          device.status().code(),
          absl::StrCat("device ", i, ": ", device.status().message()));
    }
    handler->devices_.push_back(std::move(device).value());
  }
  if (transport != nullptr) {
    DataPlaneHandler* h = handler.get();
    transport->SetPeerReceiveHandler(
        [h](PeerId from, std::string_view message) {
          h->OnMessage(from, message);
        });
  }
  return handler;
}

void DataPlaneHandler::Stop() {
  stopped_.store(true);
  control_.Stop();
  for (auto& d : devices_) d->Stop();
}

absl::StatusOr<DataPlaneHandler::Reserved> DataPlaneHandler::Reserve(
    uint64_t session, int device, int tokens, uint64_t turn_epoch,
    int kv_tokens) {
  RETURN_IF_ERROR(ValidateReserve(device, num_devices(), tokens));
  // Held across the device call so that two reservations of one new
  // session cannot pick two devices.
  absl::MutexLock lock(&sessions_mu_);
  auto it = session_device_.find(session);
  if (it != session_device_.end() && it->second != device) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", session, " lives on device ", it->second,
                     ", not ", device));
  }
  ASSIGN_OR_RETURN(
      KaratDevice::ReserveResult r,
      devices_[device]->Reserve(session, tokens, turn_epoch, kv_tokens));
  session_device_[session] = device;
  return Reserved{int64_t(devices_[device]->used_bytes()), r.kv_dropped,
                  r.session_bytes};
}

absl::Status DataPlaneHandler::FreeSession(uint64_t session) {
  absl::MutexLock lock(&sessions_mu_);
  auto it = session_device_.find(session);
  if (it == session_device_.end()) {
    return absl::NotFoundError(
        absl::StrCat("session ", session, " holds no pages on this node"));
  }
  const int device = it->second;
  session_device_.erase(it);
  return devices_[device]->Free(session);
}

int DataPlaneHandler::FreeAllSessions() {
  absl::MutexLock lock(&sessions_mu_);
  const int n = static_cast<int>(session_device_.size());
  for (const auto& [session, device] : session_device_) {
    absl::Status st = devices_[device]->Free(session);
    if (!st.ok()) {
      KLOG(Warning, "karat_node") << "session=" << ShortKey(session)
                                  << " freeing failed: " << st.message();
    }
  }
  session_device_.clear();
  return n;
}

std::vector<cluster::DeviceInfo> DataPlaneHandler::Devices() const {
  std::vector<cluster::DeviceInfo> out;
  for (const auto& d : devices_) out.push_back(d->Info());
  return out;
}

std::map<std::string, double> DataPlaneHandler::Counters() const {
  std::map<std::string, double> c;
  c["frames_received"] = double(frames_received_.load());
  c["frames_inline"] = double(frames_inline_.load());
  c["frames_invalid"] = double(frames_invalid_.load());
  c["errors"] = double(errors_.load() + reply_failures_->load());
  c["kv_bytes_ingested"] = double(kv_bytes_ingested_.load());
  c["log_lines_held_back"] = double(log_limiter_->held_back());
  admission_.ExportTo(&c);
  {
    absl::MutexLock lock(&invalid_mu_);
    for (const auto& [peer, n] : invalid_by_peer_) {
      c[absl::StrCat("frames_invalid.", peer)] = double(n);
    }
  }
  double sessions = 0, used = 0, capacity = 0;
  for (const auto& d : devices_) {
    sessions += d->sessions();
    used += double(d->used_bytes());
    capacity += double(d->capacity_bytes());
  }
  c["sessions"] = sessions;
  c["used_bytes"] = used;
  c["capacity_bytes"] = capacity;
  c["devices"] = double(devices_.size());
  return c;
}

std::string DataPlaneHandler::SenderName(PeerId from) const {
  return transport_ != nullptr ? transport_->PeerName(from)
                               : std::string("unknown peer");
}

void DataPlaneHandler::OnMessage(PeerId from, std::string_view message) {
  if (stopped_.load()) return;
  frames_received_.fetch_add(1);
  absl::StatusOr<FrameView> frame = DecodeFrame(message);
  if (!frame.ok()) {
    frames_invalid_.fetch_add(1);
    const std::string peer = SenderName(from);
    {
      absl::MutexLock lock(&invalid_mu_);
      ++invalid_by_peer_[peer];
    }
    if (const int64_t held = log_limiter_->Admit("invalid/" + peer);
        held >= 0) {
      KLOG(Warning, "karat_node")
          << "dropping an invalid frame of " << message.size()
          << " bytes from peer '" << peer << "': " << frame.status().message()
          << HeldBackNote(held);
    }
    return;
  }
  const FrameHeader& h = frame->header;
  if (static_cast<FrameType>(h.type) == FrameType::kHello) {
    control_.Post([this, from, m = std::string(message)] {
      HandleHello(m, from);
    });
    return;
  }
  // Only from the peer a hello bound to the frame's src_node (with a
  // data-plane secret; everyone in plaintext mode).
  if (const Refusal why = admission_.AdmitFrame(h.src_node, from);
      why != Refusal::kNone) {
    Refuse(why, h, from);
    return;
  }
  switch (static_cast<FrameType>(h.type)) {
    case FrameType::kIndexQK:
    case FrameType::kAttnQKV: {
      if (h.device >= uint32_t(num_devices())) {
        const FrameHeader header = h;
        control_.Post([this, header, from] {
          ReplyError(
              header,
              absl::InvalidArgumentError(absl::StrCat(
                  "device ", header.device, " does not exist on this node")),
              from);
        });
        return;
      }
      KaratDevice* device = devices_[h.device].get();
      // A decode step's frame of a short context: run at once here when
      // the device is idle (DataPlaneOptions::inline_max_context).
      if (h.n_tokens <= uint32_t(kInlineMaxTokens) &&
          uint64_t(h.pos_start) + h.n_tokens <= uint64_t(inline_max_context_) &&
          !device->paced() &&
          device->TryRunInline([&] { HandleData(device, from, *frame); })) {
        frames_inline_.fetch_add(1);
        return;
      }
      // A prefill's frames are large: the device reads them in the
      // transport's receive buffer while the next one arrives.
      device->Post(
          [this, device, from, m = ReceivedBytes(transport_, message)] {
            // Validated on arrival; decoded again over the held bytes.
            absl::StatusOr<FrameView> held = DecodeFrame(m.view());
            if (held.ok()) HandleData(device, from, *held);
          });
      return;
    }
    default: {
      const FrameHeader header = h;
      control_.Post([this, header, from] {
        ReplyError(header,
                   absl::InvalidArgumentError(
                       absl::StrCat("a KARAT node does not take ",
                                    FrameTypeName(header.type), " frames")),
                   from);
      });
      return;
    }
  }
}

void DataPlaneHandler::Refuse(Refusal why, const FrameHeader& h,
                              PeerId from) {
  admission_.Count(why);
  const std::string peer = SenderName(from);
  if (const int64_t held = log_limiter_->Admit(
          absl::StrCat("refused/", RefusalName(why), "/", peer));
      held >= 0) {
    KLOG(Warning, "karat_node")
        << "dropping a " << FrameTypeName(h.type) << " frame claiming node "
        << h.src_node << " from peer '" << peer << "' ("
        << RefusalName(why) << "): " << RefusalText(why)
        << HeldBackNote(held);
  }
}

void DataPlaneHandler::HandleHello(const std::string& message, PeerId from) {
  absl::StatusOr<FrameView> frame = DecodeFrame(message);
  if (!frame.ok()) return;  // validated on arrival
  const FrameHeader& h = frame->header;
  if (const Refusal why = admission_.AdmitHello(node_id_.load(), *frame);
      why != Refusal::kNone) {
    Refuse(why, h, from);
    return;
  }
  if (h.n_sections < 1 || frame->sections[0].empty()) {
    errors_.fetch_add(1);
    KLOG(Warning, "karat_node")
        << "kHello from node " << h.src_node << " carries no address; ignored";
    return;
  }
  const std::string name = absl::StrCat("node-", h.src_node);
  absl::StatusOr<PeerId> peer =
      transport_->AddPeer(name, std::string(frame->sections[0]));
  if (!peer.ok()) {
    errors_.fetch_add(1);
    KLOG(Warning, "karat_node")
        << "cannot add peer " << name << ": " << peer.status().message();
    return;
  }
  admission_.Bind(h.src_node, *peer);
  KLOG(Info, "karat_node") << "peer " << name << " connected";
  if (admission_.mode() != PeerAdmission::Mode::kAuthenticated) {
    Reply(h, FrameType::kHelloAck, {}, 0);
    return;
  }
  // The answer proves this node's secret over the hello's nonce and this
  // node's own address (AdmitHello parsed the proof).
  absl::StatusOr<HelloProof> hello =
      ParseHelloProof(frame->sections[kHelloProofSection]);
  if (!hello.ok()) return;
  const std::string proof = EncodeHelloProof(MakeHelloProof(
      admission_.secret(), FrameType::kHelloAck, node_id_.load(), h.src_node,
      hello->nonce, transport_->LocalAddress()));
  Reply(h, FrameType::kHelloAck, {proof}, 0);
}

void DataPlaneHandler::HandleData(KaratDevice* device, PeerId from,
                                  const FrameView& frame) {
  const FrameHeader& h = frame.header;
  std::vector<float> out;
  uint64_t ingested = 0;
  bool skipped = false;
  absl::Status status = device->Process(frame, &out, &ingested, &skipped);
  kv_bytes_ingested_.fetch_add(ingested);
  // A stale copy, or an index frame applied before: nothing to answer.
  if (skipped) return;
  if (!status.ok()) {
    ReplyError(h, status, from);
    return;
  }
  if (static_cast<FrameType>(h.type) == FrameType::kAttnQKV) {
    std::string_view bytes(reinterpret_cast<const char*>(out.data()),
                           out.size() * sizeof(float));
    Reply(h, FrameType::kAttnOut, {bytes}, 0);
  }
}

void DataPlaneHandler::ReplyError(const FrameHeader& request,
                                  const absl::Status& status, PeerId from) {
  errors_.fetch_add(1);
  const std::string peer = SenderName(from);
  if (const int64_t held = log_limiter_->Admit(
          absl::StrCat("error/", peer, "/", int(status.code())));
      held >= 0) {
    KLOG(Warning, "karat_node")
        << "session=" << ShortKey(request.session)
        << " device=" << request.device << " layer=" << request.layer
        << " from node " << request.src_node << " (peer '" << peer
        << "'): " << FrameTypeName(request.type) << " failed: " << status
        << HeldBackNote(held);
  }
  const std::string text(status.message());
  Reply(request, FrameType::kError, {text},
        static_cast<uint32_t>(status.code()));
}

void DataPlaneHandler::Reply(const FrameHeader& request, FrameType type,
                             const std::vector<std::string_view>& sections,
                             uint32_t status_code) {
  const PeerId peer = admission_.PeerOf(request.src_node);
  if (peer == kUnknownPeer) {
    errors_.fetch_add(1);
    if (const int64_t held = log_limiter_->Admit(
            absl::StrCat("no-hello/", request.src_node));
        held >= 0) {
      KLOG(Warning, "karat_node")
          << "session=" << ShortKey(request.session) << " cannot answer node "
          << request.src_node << ": no kHello from it" << HeldBackNote(held);
    }
    return;
  }
  FrameHeader header;
  header.type = static_cast<uint16_t>(type);
  header.src_node = node_id_.load();
  header.layer = request.layer;
  header.micro_batch = request.micro_batch;
  header.device = request.device;
  header.step = request.step;
  header.session = request.session;
  header.turn = request.turn;
  header.pos_start = request.pos_start;
  header.n_tokens = request.n_tokens;
  header.status = status_code;
  // A fresh buffer per frame, never touched after the send: the transport
  // may read a large one in place for as long as it keeps its reference.
  auto buffer = std::make_shared<std::string>();
  EncodeFrame(header, sections, buffer.get());
  // The worker goes on without waiting for the completion; a send that
  // fails later is counted and logged from the transport's thread (the
  // callback holds no reference to this handler, which may be gone by then).
  const std::string what =
      absl::StrCat("session=", request.session, " sending ",
                   FrameTypeName(header.type), " to node ", request.src_node);
  absl::Status sent = transport_->SendSharedAsync(
      peer, std::move(buffer),
      [failures = reply_failures_, limiter = log_limiter_, what,
       node = request.src_node](absl::Status status) {
        if (status.ok()) return;
        failures->fetch_add(1);
        if (const int64_t held =
                limiter->Admit(absl::StrCat("send/", node, "/",
                                            int(status.code())));
            held >= 0) {
          KLOG(Warning, "karat_node")
              << what << " failed: " << status << HeldBackNote(held);
        }
      });
  if (!sent.ok()) {
    errors_.fetch_add(1);
    if (const int64_t held = log_limiter_->Admit(
            absl::StrCat("send/", request.src_node, "/", int(sent.code())));
        held >= 0) {
      KLOG(Warning, "karat_node") << what << " failed: " << sent
                                  << HeldBackNote(held);
    }
  }
}

}  // namespace karat
