#include "karat_node/peer_admission.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/hello_proof.h"

namespace karat {

const char* RefusalName(Refusal r) {
  switch (r) {
    case Refusal::kNone:
      return "";
    case Refusal::kNotRegistered:
      return "not_registered";
    case Refusal::kNoProof:
      return "no_proof";
    case Refusal::kMalformedProof:
      return "malformed_proof";
    case Refusal::kOtherReceiver:
      return "other_receiver";
    case Refusal::kBadProof:
      return "bad_proof";
    case Refusal::kUnknownNode:
      return "unknown_node";
    case Refusal::kNotGpu:
      return "not_gpu";
    case Refusal::kReplayed:
      return "replayed";
    case Refusal::kUnauthenticated:
      return "unauthenticated";
  }
  return "unknown";
}

const char* RefusalText(Refusal r) {
  switch (r) {
    case Refusal::kNone:
      return "taken";
    case Refusal::kNotRegistered:
      return "this node has not registered with the coordinator yet";
    case Refusal::kNoProof:
      return "the hello carries no proof (a sender without the cluster's "
             "data-plane secret, e.g. one in plaintext mode)";
    case Refusal::kMalformedProof:
      return "the hello's proof is malformed";
    case Refusal::kOtherReceiver:
      return "the hello was made for another node id";
    case Refusal::kBadProof:
      return "the hello's proof does not verify under the cluster's "
             "data-plane secret";
    case Refusal::kUnknownNode:
      return "the coordinator has not announced this node id";
    case Refusal::kNotGpu:
      return "the coordinator did not announce this node id as a GPU node";
    case Refusal::kReplayed:
      return "the hello's nonce was seen before";
    case Refusal::kUnauthenticated:
      return "the sender is not the peer a verified hello bound to this "
             "node id";
  }
  return "unknown reason";
}

void NonceWindow::Insert(std::string nonce) {
  if (capacity_ == 0 || !seen_.insert(nonce).second) return;
  order_.push_back(std::move(nonce));
  if (order_.size() > capacity_) {
    seen_.erase(order_.front());
    order_.pop_front();
  }
}

Refusal CheckHello(const HelloContext& context, const FrameView& hello,
                   std::string* nonce) {
  const FrameHeader& h = hello.header;
  if (h.n_sections <= kHelloProofSection) return Refusal::kNoProof;
  absl::StatusOr<HelloProof> proof =
      ParseHelloProof(hello.sections[kHelloProofSection]);
  if (!proof.ok()) return Refusal::kMalformedProof;
  if (proof->receiver != context.self_id) return Refusal::kOtherReceiver;
  if (!HelloProofValid(std::string(context.secret), FrameType::kHello,
                       h.src_node, hello.sections[0], *proof))
    return Refusal::kBadProof;
  auto node = context.announced->find(h.src_node);
  if (node == context.announced->end()) return Refusal::kUnknownNode;
  if (node->second.role != "gpu") return Refusal::kNotGpu;
  if (context.seen->Contains(proof->nonce)) return Refusal::kReplayed;
  if (nonce != nullptr) *nonce = std::move(proof->nonce);
  return Refusal::kNone;
}

void PeerAdmission::Open() {
  absl::MutexLock lock(&mu_);
  mode_ = Mode::kOpen;
  secret_.clear();
}

void PeerAdmission::Close() {
  absl::MutexLock lock(&mu_);
  mode_ = Mode::kClosed;
  secret_.clear();
  peers_.clear();
}

void PeerAdmission::Authenticate(std::string secret) {
  absl::MutexLock lock(&mu_);
  // Peers bound under this secret proved it, whatever this node's id is now
  // (a GPU node greets again when the id it knows this node by changes):
  // they stay. A GPU node whose own id stayed the same after a coordinator
  // restart would otherwise never greet again, and every frame of it would
  // be refused. Under another secret they must prove the new one.
  if (mode_ != Mode::kAuthenticated || secret_ != secret) peers_.clear();
  mode_ = Mode::kAuthenticated;
  secret_ = std::move(secret);
}

void PeerAdmission::SetSecret(const std::string& secret) {
  if (secret.empty()) {
    Open();
  } else {
    Authenticate(secret);
  }
}

PeerAdmission::Mode PeerAdmission::mode() const {
  absl::ReaderMutexLock lock(&mu_);
  return mode_;
}

std::string PeerAdmission::secret() const {
  absl::ReaderMutexLock lock(&mu_);
  return secret_;
}

void PeerAdmission::SetAnnounced(AnnouncedNodes nodes) {
  absl::MutexLock lock(&mu_);
  announced_ = std::move(nodes);
  if (mode_ != Mode::kAuthenticated) return;
  for (auto it = peers_.begin(); it != peers_.end();) {
    auto node = announced_.find(it->first);
    if (node == announced_.end() || node->second.role != "gpu") {
      peers_.erase(it++);
    } else {
      ++it;
    }
  }
}

Refusal PeerAdmission::AdmitHello(uint32_t self_id, const FrameView& hello) {
  absl::MutexLock lock(&mu_);
  switch (mode_) {
    case Mode::kOpen:
      return Refusal::kNone;
    case Mode::kClosed:
      return Refusal::kNotRegistered;
    case Mode::kAuthenticated:
      break;
  }
  std::string nonce;
  const Refusal r = CheckHello(
      HelloContext{secret_, self_id, &announced_, &seen_}, hello, &nonce);
  if (r == Refusal::kNone) seen_.Insert(std::move(nonce));
  return r;
}

void PeerAdmission::Bind(uint32_t node, PeerId peer) {
  absl::MutexLock lock(&mu_);
  peers_[node] = peer;
}

PeerId PeerAdmission::PeerOf(uint32_t node) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = peers_.find(node);
  return it == peers_.end() ? kUnknownPeer : it->second;
}

Refusal PeerAdmission::AdmitFrame(uint32_t src_node, PeerId from) const {
  absl::ReaderMutexLock lock(&mu_);
  switch (mode_) {
    case Mode::kOpen:
      return Refusal::kNone;
    case Mode::kClosed:
      return Refusal::kNotRegistered;
    case Mode::kAuthenticated:
      break;
  }
  auto it = peers_.find(src_node);
  if (from == kUnknownPeer || it == peers_.end() || it->second != from)
    return Refusal::kUnauthenticated;
  return Refusal::kNone;
}

void PeerAdmission::Count(Refusal r) {
  if (r == Refusal::kNone) return;
  absl::MutexLock lock(&mu_);
  ++refused_[static_cast<int>(r)];
}

void PeerAdmission::ExportTo(std::map<std::string, double>* out) const {
  absl::ReaderMutexLock lock(&mu_);
  uint64_t total = 0;
  for (int i = 1; i < kRefusalKinds; ++i) {
    (*out)[absl::StrCat("frames_refused.",
                        RefusalName(static_cast<Refusal>(i)))] =
        double(refused_[i]);
    total += refused_[i];
  }
  (*out)["frames_refused"] = double(total);
}

}  // namespace karat
