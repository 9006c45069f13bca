// Which senders a KARAT node's data plane takes frames from (docs/security.md
// "Data plane").
//
// With a data-plane secret (RegisterNodeResponse.data_plane_secret) a GPU
// node becomes a peer only through a kHello whose proof (common/
// hello_proof.h) verifies under the secret, names this node as its receiver,
// carries a nonce not seen before, and comes from a node id the coordinator
// announced with the "gpu" role (SetLinksRequest.node_names and
// node_roles). Every later frame must come from the transport peer that
// hello bound to its src_node; a frame whose transport sender is another
// (or unknown) is dropped. Frames refused either way are counted per reason
// (frames_refused.<reason>) and never answered.
//
// Without a secret (plaintext mode) every hello is taken as it is and frames
// are not checked, as before the data plane was authenticated. A daemon
// Close()s its data plane until its first registration says which mode
// applies.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "common/frame.h"
#include "common/transport.h"

namespace karat {

// Why a frame was refused; kNone: taken.
enum class Refusal {
  kNone,
  kNotRegistered,    // closed: the node has not registered yet
  kNoProof,          // a hello without a proof section
  kMalformedProof,   // a proof section of the wrong layout
  kOtherReceiver,    // a hello made for another node id
  kBadProof,         // a MAC that does not verify under the secret
  kUnknownNode,      // src_node not announced by the coordinator
  kNotGpu,           // src_node announced, but not as a GPU node
  kReplayed,         // a hello nonce seen before
  kUnauthenticated,  // a frame not from the peer a hello bound to src_node
};
inline constexpr int kRefusalKinds = 10;

// The counter suffix of a refusal ("no_proof", ...); "" for kNone.
const char* RefusalName(Refusal r);
// What a refusal means, for logs.
const char* RefusalText(Refusal r);

// What the coordinator announced of a registered node.
struct AnnouncedNode {
  std::string name;
  std::string role;  // "gpu" or "karat" (RegisterNodeRequest.role)
};
using AnnouncedNodes = std::map<uint32_t, AnnouncedNode>;

// The hello nonces taken, the latest `capacity` of them.
class NonceWindow {
 public:
  explicit NonceWindow(size_t capacity = 4096) : capacity_(capacity) {}
  bool Contains(const std::string& nonce) const {
    return seen_.contains(nonce);
  }
  void Insert(std::string nonce);
  size_t size() const { return order_.size(); }

 private:
  size_t capacity_;
  absl::flat_hash_set<std::string> seen_;
  std::deque<std::string> order_;
};

struct HelloContext {
  std::string_view secret;  // non-empty
  uint32_t self_id = 0;     // this node's id from its registration
  const AnnouncedNodes* announced = nullptr;
  const NonceWindow* seen = nullptr;
};

// The verdict on a decoded kHello (pure): kNone when its proof verifies
// under the secret, names `self_id`, comes from an announced GPU node and
// carries a nonce not in `seen`; else the first reason in the order of
// Refusal. A taken hello's nonce goes to `*nonce` when given.
Refusal CheckHello(const HelloContext& context, const FrameView& hello,
                   std::string* nonce = nullptr);

// The admission state of one data plane. Thread-safe.
class PeerAdmission {
 public:
  enum class Mode { kOpen, kClosed, kAuthenticated };

  // Plaintext: every hello is taken, frames are not checked (the default).
  void Open();
  // Nothing is taken until Open() or Authenticate().
  void Close();
  // Hellos must prove `secret` (non-empty). Bound peers stay when they
  // proved this same secret (a registration again under the coordinator's
  // unchanged secret), else they are forgotten.
  void Authenticate(std::string secret);
  // After a registration: Authenticate(secret), or Open() when it is empty.
  void SetSecret(const std::string& secret);
  Mode mode() const;
  std::string secret() const;

  // The coordinator's table of registered nodes. With a secret, a bound
  // peer whose id it no longer names as a GPU node is forgotten.
  void SetAnnounced(AnnouncedNodes nodes);

  // The verdict on a hello to `self_id`; a taken one's nonce is remembered.
  // kNone in open mode.
  Refusal AdmitHello(uint32_t self_id, const FrameView& hello);
  // Binds `node` to the transport peer its hello came from (its address).
  void Bind(uint32_t node, PeerId peer);
  // The peer bound to `node`; kUnknownPeer when none.
  PeerId PeerOf(uint32_t node) const;
  // Whether a frame claiming `src_node` that the transport attributes to
  // `from` may be handled: kNone in open mode, or when `from` is the peer
  // bound to `src_node`.
  Refusal AdmitFrame(uint32_t src_node, PeerId from) const;

  // Counts a refusal (kNone: nothing).
  void Count(Refusal r);
  // frames_refused (all reasons) and frames_refused.<reason> for every
  // reason, into `out`.
  void ExportTo(std::map<std::string, double>* out) const;

 private:
  mutable absl::Mutex mu_;
  Mode mode_ ABSL_GUARDED_BY(mu_) = Mode::kOpen;
  std::string secret_ ABSL_GUARDED_BY(mu_);
  AnnouncedNodes announced_ ABSL_GUARDED_BY(mu_);
  NonceWindow seen_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint32_t, PeerId> peers_ ABSL_GUARDED_BY(mu_);
  uint64_t refused_[kRefusalKinds] ABSL_GUARDED_BY(mu_) = {};
};

}  // namespace karat
