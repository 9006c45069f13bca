// RemoteAttentionBackend's handshake with a KARAT node (docs/security.md
// "Data plane"): a kHello with a proof under the cluster's data-plane
// secret, sent again with a fresh nonce until a kHelloAck whose proof
// covers that nonce, the KARAT node's id and its address comes back.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/frame.h"
#include "common/hello_proof.h"
#include "common/log.h"
#include "common/log_limiter.h"
#include "common/status_macros.h"
#include "gpu_node/remote_attention_impl.h"
#include "security/hmac.h"

namespace karat {

void RemoteAttentionBackend::Impl::MarkNotReady(
    const std::string& fabric_address) {
  absl::MutexLock lock(&peers_mu);
  auto it = peers.find(fabric_address);
  if (it != peers.end()) it->second.ready = false;
}

void RemoteAttentionBackend::Impl::OnHelloAckLocked(const FrameView& ack,
                                                    PeerId from) {
  const FrameHeader& h = ack.header;
  auto it = hello_waiting.find(h.step);
  if (it == hello_waiting.end()) return;  // late: the handshake is over
  HelloWait& wait = it->second;
  if (!secret.empty()) {
    absl::StatusOr<HelloProof> proof =
        h.n_sections > kHelloAckProofSection
            ? ParseHelloProof(ack.sections[kHelloAckProofSection])
            : absl::InvalidArgumentError("no proof");
    const bool valid = proof.ok() && h.src_node == wait.node_id &&
                       proof->receiver == node_id.load() &&
                       proof->nonce == wait.nonce &&
                       HelloProofValid(secret, FrameType::kHelloAck, h.src_node,
                                       wait.address, *proof);
    if (!valid) {
      refused_acks.fetch_add(1);
      wait.refused = true;
      if (const int64_t held = log_limiter.Admit(
              absl::StrCat("ack/", transport->PeerName(from)));
          held >= 0) {
        KLOG(Warning, "gpu_node")
            << "dropping a HelloAck claiming node " << h.src_node << " from "
            << transport->PeerName(from)
            << ": its proof does not verify under the cluster's data-plane "
               "secret for the hello it answers"
            << HeldBackNote(held);
      }
      return;
    }
  }
  hello_acked.insert(h.step);
}

absl::StatusOr<PeerId> RemoteAttentionBackend::Impl::EnsurePeer(
    const cluster::KaratPlacement& p) {
  absl::MutexLock peers_lock(&peers_mu);
  const uint64_t generation = id_generation.load();
  if (generation != handshake_generation) {
    for (auto& [address, peer] : peers) peer.ready = false;
    handshake_generation = generation;
  }
  std::string key;  // the data-plane secret
  {
    // The incarnation the coordinator took for lost is not greeted again
    // (its turns resume elsewhere); one restarted at the same address has
    // another node id and is.
    absl::MutexLock lock(&mu);
    auto lost = lost_nodes.find(p.fabric_address());
    if (lost != lost_nodes.end() && lost->second == p.node_id()) {
      return absl::UnavailableError(absl::StrCat(
          "KARAT node ", KaratNodeName(p), " (node id ", p.node_id(),
          ") is lost; its sessions move to other homes"));
    }
    key = secret;
  }
  Peer& peer = peers[p.fabric_address()];
  if (peer.ready && peer.node_id == p.node_id()) return peer.id;
  peer.ready = false;
  peer.node_id = p.node_id();
  peer.name = KaratNodeName(p);
  ASSIGN_OR_RETURN(peer.id, transport->AddPeer(peer.name, p.fabric_address()));
  const std::string address = transport->LocalAddress();
  // Sent again, the wait doubling, until answered or the timeout: a lost
  // Hello or HelloAck, or a link down for a while, only delays it. Each
  // hello has a step and a nonce of its own (a KARAT node takes a nonce
  // once), and an answer to any of them will do.
  std::vector<uint64_t> steps;
  const absl::Time deadline = absl::Now() + options.timeout;
  absl::Duration wait = options.rto_initial_decode;
  absl::Status sent;
  bool acked = false;
  bool refused = false;
  while (!acked) {
    FrameHeader header;
    header.type = static_cast<uint16_t>(FrameType::kHello);
    header.src_node = node_id.load();
    header.step = ++hello_seq;
    HelloWait expect;
    expect.node_id = p.node_id();
    expect.address = p.fabric_address();
    // The handshake is encoded in a buffer of its own: the other
    // micro-batch may be sending with its buffer meanwhile.
    std::string hello;
    if (key.empty()) {
      EncodeFrame(header, {address}, &hello);
    } else {
      expect.nonce = security::RandomBytes(kHelloNonceBytes);
      const std::string proof = EncodeHelloProof(
          MakeHelloProof(key, FrameType::kHello, header.src_node, p.node_id(),
                         expect.nonce, address));
      EncodeFrame(header, {address, proof}, &hello);
    }
    {
      absl::MutexLock lock(&mu);
      hello_waiting[header.step] = std::move(expect);
    }
    steps.push_back(header.step);
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
    auto answered = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
      return std::any_of(steps.begin(), steps.end(), [&](uint64_t step) {
        return hello_acked.contains(step);
      });
    };
    auto done = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
      return answered() || aborted || is_lost();
    };
    const absl::Time until = std::min(absl::Now() + wait, deadline);
    mu.AwaitWithDeadline(absl::Condition(&done), until);
    acked = answered();
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
    for (uint64_t step : steps) {
      auto it = hello_waiting.find(step);
      if (it != hello_waiting.end() && it->second.refused) refused = true;
      hello_waiting.erase(step);
      hello_acked.erase(step);
    }
  }
  if (!acked) {
    RETURN_IF_ERROR(sent);
    return absl::UnavailableError(absl::StrCat(
        "KARAT node ", peer.name, " did not answer the handshake within ",
        absl::ToInt64Milliseconds(options.timeout), " ms",
        refused ? ": its answers' proofs did not verify under the cluster's "
                  "data-plane secret (is it a daemon of another cluster?)"
        : key.empty()
            ? ""
            : " (a KARAT node takes a hello only from a GPU node the "
              "coordinator announced to it, with a proof under the "
              "cluster's data-plane secret; its frames_refused counters "
              "say why it refused)"));
  }
  peer.ready = true;
  KLOG(Info, "gpu_node") << "connected to KARAT node " << peer.name;
  return peer.id;
}

void RemoteAttentionBackend::set_data_plane_secret(const std::string& secret) {
  bool changed = false;
  {
    absl::MutexLock lock(&impl_->mu);
    changed = impl_->secret != secret;
    impl_->secret = secret;
  }
  // KARAT nodes greeted under another secret are greeted again.
  if (changed) impl_->id_generation.fetch_add(1);
}

}  // namespace karat
