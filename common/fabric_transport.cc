// libfabric RDM implementation of Transport (its design is described in
// fabric_transport_internal.h). This file: opening the fabric, domain, CQ,
// address vector and endpoints, receive buffers, peers and their addresses,
// counters, shutdown, and OpenFabricTransport().
#include "common/fabric_transport_internal.h"

namespace karat {
namespace fabric_internal {

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

}  // namespace fabric_internal

absl::StatusOr<std::unique_ptr<Transport>> OpenFabricTransport(
    const FabricOptions& options) {
  auto transport = std::make_unique<fabric_internal::FabricTransport>(options);
  RETURN_IF_ERROR(transport->Open());
  return std::unique_ptr<Transport>(std::move(transport));
}

}  // namespace karat
