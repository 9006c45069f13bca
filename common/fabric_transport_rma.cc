// FabricTransport RMA: writing large messages into a peer's landing zone
// (TrySendRma), control messages, and the receiver's side: zone requests,
// grants and refusals, RMA notices and credits.
#include "common/fabric_transport_internal.h"

namespace karat {
namespace fabric_internal {

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

}  // namespace fabric_internal
}  // namespace karat
