// The data-plane transport seam (CONVENTIONS.md "Seams"): reliable messages
// between named endpoints. The real implementation is libfabric RDM
// (fabric_transport*.cc); an in-process fake serves unit tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace karat {

using PeerId = int32_t;
constexpr PeerId kUnknownPeer = -1;

// A message endpoint. Thread safety: Send() and AddPeer() may be called from
// any thread; the receive handler runs on the endpoint's single progress
// thread, one message at a time, and must not block for long (hand work to
// another thread). Messages between one pair of endpoints are delivered in
// send order.
class Transport {
 public:
  using ReceiveHandler = std::function<void(std::string_view message)>;
  // `from`: the sender's id when its address was added with AddPeer() (or
  // learnt by the transport itself, see PeerName()), kUnknownPeer when the
  // transport cannot tell. The view is valid only during the call.
  using PeerReceiveHandler =
      std::function<void(PeerId from, std::string_view message)>;
  virtual ~Transport() = default;

  // This endpoint's address, opaque bytes to hand to a peer's AddPeer().
  virtual std::string LocalAddress() const = 0;
  // Registers a remote endpoint; `name` is used in logs and errors. Adding
  // the same address again returns the same id.
  virtual absl::StatusOr<PeerId> AddPeer(const std::string& name,
                                         const std::string& address) = 0;
  // Sends one message of up to MaxMessageSize() bytes. The data is copied or
  // fully sent before returning, so the caller may reuse it. Fails with
  // UNAVAILABLE when the peer cannot be reached within the configured bound.
  virtual absl::Status Send(PeerId peer, const void* data, size_t len) = 0;
  // Sends `*message` like Send(), but lets the transport read it in place
  // instead of copying it where the provider allows (large messages). The
  // transport keeps its reference until the provider is done with the bytes,
  // which may outlast a failed (timed-out) call: the caller must not modify
  // the string while it does not hold the only reference. The default
  // implementation calls Send().
  virtual absl::Status SendShared(PeerId peer,
                                  std::shared_ptr<const std::string> message) {
    return Send(peer, message->data(), message->size());
  }
  // The outcome of an asynchronous send (SendSharedAsync()).
  using SendDone = std::function<void(absl::Status)>;
  // SendSharedAsync()'s argument check: INVALID_ARGUMENT without a message
  // or a callback.
  static absl::Status CheckAsyncArgs(
      const std::shared_ptr<const std::string>& message, const SendDone& done) {
    if (message == nullptr)
      return absl::InvalidArgumentError("SendSharedAsync: null message");
    if (!done)
      return absl::InvalidArgumentError("SendSharedAsync: no callback");
    return absl::OkStatus();
  }
  // Sends `*message` like SendShared(), but returns once the message is
  // handed to the provider (a full transmit queue still blocks, up to the
  // send timeout) instead of waiting for its completion. The outcome goes
  // to `done`, called exactly once when this returns OK and never when it
  // returns an error (bad arguments, a peer that cannot be posted to, a
  // failed peer, shutdown; as with Send(), an error does not prove that the
  // peer never gets the message): OK once the provider completed it,
  // UNAVAILABLE naming the peer on a provider error, when it is not
  // completed within the send timeout, when the peer is failed
  // (FailPeer()) or when the transport shuts down first. `done` runs
  // without any of the transport's locks held: on the caller's thread
  // before this returns when the outcome is known at once (small messages
  // the provider copies at once, a transport that sends synchronously),
  // otherwise on a thread of the transport (the libfabric transport: its
  // progress thread, between receive handlers, never inside a handler or
  // another send; a link emulator's queue thread) or in Shutdown(). It must
  // not block, and may call the transport (send again). Messages to one
  // peer keep their order with the other sends to it, synchronous or not.
  // The transport keeps its reference to the string until the provider is
  // done with the bytes, as SendShared() does. The default implementation
  // calls SendShared(), then `done`.
  virtual absl::Status SendSharedAsync(
      PeerId peer, std::shared_ptr<const std::string> message, SendDone done) {
    if (absl::Status args = CheckAsyncArgs(message, done); !args.ok())
      return args;
    absl::Status status = SendShared(peer, std::move(message));
    if (!status.ok()) return status;
    done(absl::OkStatus());
    return absl::OkStatus();
  }
  // Gives up on `peer` (e.g. a process known to be dead): every send to it
  // in progress, a synchronous one waiting for its completion or for room
  // in the transmit queue as well as an asynchronous one, finishes at once
  // with UNAVAILABLE carrying `reason`'s message, and later sends to it fail
  // at once, until AddPeer() adds its address again. Bytes the provider may
  // still read stay referenced until it completes them or the transport
  // shuts down. INVALID_ARGUMENT for an id this endpoint never issued.
  virtual absl::Status FailPeer(PeerId peer, const absl::Status& reason) = 0;
  // Set before the first message can arrive (before publishing the address).
  // Replaces any handler set before with either call.
  virtual void SetPeerReceiveHandler(PeerReceiveHandler handler) = 0;
  // As SetPeerReceiveHandler(), for handlers that need not know the sender.
  void SetReceiveHandler(ReceiveHandler handler) {
    if (!handler) {
      SetPeerReceiveHandler(nullptr);
      return;
    }
    SetPeerReceiveHandler(
        [handler = std::move(handler)](PeerId, std::string_view message) {
          handler(message);
        });
  }
  // Only from inside the receive handler: keeps the bytes of the message
  // being handled valid after the handler returns, until the returned handle
  // is destroyed (on any thread; it may outlive the transport), so that a
  // handler can pass a large message to another thread without copying it.
  // The transport has one receive buffer fewer until then; it holds at most
  // half of its buffers at a time and returns nullptr beyond that, and
  // wherever it cannot hold the bytes (then copy them: ReceivedBytes does).
  virtual std::shared_ptr<const void> HoldMessage() { return nullptr; }
  // The name `peer` was added with, for logs; "unknown peer" for
  // kUnknownPeer and "peer #<id>" for an id this endpoint never issued. A
  // sender the transport learnt on its own (an RMA handshake from an
  // address not yet added) is named after its address until AddPeer()
  // names it.
  virtual std::string PeerName(PeerId peer) const = 0;
  virtual size_t MaxMessageSize() const = 0;
  // Transport counters for logs, tests and benchmarks (the libfabric
  // transport: "rma_messages_sent", "rma_fallback_zone_full", ...); empty
  // when the implementation keeps none.
  virtual std::map<std::string, double> Counters() const { return {}; }
  // Stops the progress thread and closes every resource. Idempotent.
  virtual void Shutdown() = 0;
};

// A received message's bytes kept past the receive handler: held in the
// transport's receive buffer where it allows (Transport::HoldMessage()) and
// the message has at least `min_hold_bytes`, copied otherwise. Create it in
// the handler; move it to the thread that reads the bytes. A large message
// the transport cannot hold (all its holds taken by a burst, or a message
// an RMA write left in a landing zone, which must return to its sender) is
// copied into a buffer from a process-wide pool, which keeps the buffers
// given back to it up to kPooledCopyBuffers of them and kPooledCopyBytes in
// all: the copy, on the transport's thread, then writes memory already
// mapped instead of taking a page fault every 4 KiB of a fresh allocation
// (in a virtual machine, a 160 KiB copy into fresh memory took 0.2-0.7 ms).
class ReceivedBytes {
 public:
  static constexpr size_t kDefaultMinHoldBytes = 16 << 10;
  static constexpr size_t kPooledCopyBuffers = 64;
  static constexpr size_t kPooledCopyBytes = 64 << 20;
  ReceivedBytes() = default;
  ReceivedBytes(Transport* transport, std::string_view message,
                size_t min_hold_bytes = kDefaultMinHoldBytes) {
    if (message.size() < min_hold_bytes) {
      copy_.assign(message);
      return;
    }
    hold_ = transport->HoldMessage();
    if (hold_ != nullptr) {
      held_ = message;
      return;
    }
    pooled_ = TakeCopyBuffer();
    pooled_->assign(message);
  }
  std::string_view view() const {
    if (hold_ != nullptr) return held_;
    if (pooled_ != nullptr) return *pooled_;
    return copy_;
  }
  bool held() const { return hold_ != nullptr; }
  // Buffers in the pool now (for tests).
  static size_t FreeCopyBuffers();

 private:
  // Gives a buffer back to the pool, or frees it where the pool would
  // exceed its limits.
  struct ReturnCopyBuffer {
    void operator()(std::string* buffer) const;
  };
  using CopyBuffer = std::unique_ptr<std::string, ReturnCopyBuffer>;
  // The pool's most recently returned buffer, or a new one.
  static CopyBuffer TakeCopyBuffer();

  std::shared_ptr<const void> hold_;
  std::string_view held_;
  CopyBuffer pooled_;
  std::string copy_;
};

// The libfabric transport's SendShared() hands messages of at least this
// many bytes to the provider in place; smaller ones it copies, as Send()
// does (cheaper than a provider's rendezvous). Data-plane clients send every
// frame with SendShared() and leave the choice to the transport. The
// default of FabricOptions::zero_copy_threshold.
constexpr size_t kSharedSendMinBytes = 16 << 10;

// FabricOptions::spin_us's default (see there); the node daemons' --spin-us.
inline constexpr int kDefaultSpinUs = 1000;

struct FabricOptions {
  // libfabric provider: "shm" (one host), "tcp" (uses ofi_rxm), "verbs".
  std::string provider = "shm";
  // For tcp: the local interface address to bind ("127.0.0.1"); empty for
  // the provider's default.
  std::string node;
  size_t max_message_size = 8 << 20;
  int receive_buffers = 16;
  // Receive buffers posted to the provider at a time (1 ..
  // receive_buffers); the others stand in for buffers a handler holds
  // (HoldMessage). Few posted buffers keep large messages landing in the
  // same, cache-warm memory instead of cycling through all of them; a
  // message that finds none posted waits in the provider until the
  // progress thread re-posts one, right after the handler.
  int posted_receives = 1;
  // Send fails with UNAVAILABLE after this long without completion.
  int send_timeout_ms = 10000;
  // SendShared() hands messages of at least this many bytes to the provider
  // without copying them (smaller ones are copied, which is cheaper than the
  // provider's rendezvous). 0 disables it.
  size_t zero_copy_threshold = kSharedSendMinBytes;
  // Messages up to the provider's inject size are handed over with
  // fi_inject(): the provider copies them at once and Send() does not wait
  // for a completion (a later delivery failure is then only logged).
  bool use_inject = true;
  // After traffic, the progress thread and a waiting sender poll the
  // completion queue without sleeping for this long (plus the expected
  // transfer time of a message in flight) before backing off to sleeps; an
  // idle endpoint costs no CPU. 0 disables spinning. 1 ms covers the gap
  // between a decode step's per-layer messages on the small models (a GPU
  // rank computes ~0.25 ms a layer at batch 1): with 200 us the KARAT
  // node's progress thread was asleep when the next layer's request came,
  // and a single session's GPU rank stalled 90-140 us a layer, not ~65.
  int spin_us = kDefaultSpinUs;
  // Bulk transfers by RMA write (fi_write into a landing zone the receiver
  // registered), where the provider offers FI_RMA: a message of at least
  // rma_threshold bytes is written straight into the receiver's zone and
  // announced by a small notice that travels in order with the other
  // messages; the receiver's handler reads the bytes in place and the space
  // returns to the sender (credits) after the handler. A message goes as a
  // plain message instead while the zone is being set up, when it does not
  // fit in the zone's free space, or when either side has RMA off.
  // The daemons set it with RmaPays(provider).
  bool use_rma = true;
  size_t rma_threshold = 64 << 10;
  // Bytes of the landing zone this endpoint registers for each peer that
  // asks for one (rounded up to 4 KiB; at least max_message_size, so the
  // largest message fits), and how many such zones it grants at most.
  size_t rma_zone_bytes = 32 << 20;
  int rma_max_zones = 64;
  // On shm without RMA: messages to each peer go out from an endpoint of
  // their own (receives stay on the one endpoint whose address peers know),
  // so that a peer that dies before taking a message over the inject size
  // (4 KiB) blocks only the sends to itself. The shm provider of libfabric
  // 1.17 completes an endpoint's sends in posting order, and with a single
  // endpoint such a send left in a dead peer's queue would block every later
  // one, to every peer. Costs a small shared-memory region per peer.
  bool send_endpoint_per_peer = true;
};

// Whether bulk transfers by RMA write beat plain messages on `provider`
// (the daemons' FabricOptions::use_rma). Over tcp (and verbs) a message
// written into the receiver's landing zone skips the receive-side copy
// (karat-bench-fabric: about 2x fi_pingpong's bandwidth at 1-4 MiB). On shm
// a plain message is already one cross-process copy, and a write must
// complete before its notice may follow (shm does not order sends after
// writes), which costs a round trip: there messages are faster (RMA measured
// 0.3-0.65x of the message path's bandwidth).
inline bool RmaPays(const std::string& provider) { return provider != "shm"; }

// The interface a daemon's data plane binds to (FabricOptions::node):
// `fabric_node` (--fabric-node) when given; else 127.0.0.1 for tcp, so that
// a daemon started without one cannot be reached from other hosts (several
// hosts need --fabric-node; `karatctl plan` gives it from the cluster
// file); else the provider's default (shm binds no interface).
inline std::string DataPlaneBindNode(const std::string& provider,
                                     const std::string& fabric_node) {
  if (!fabric_node.empty()) return fabric_node;
  return provider == "tcp" ? std::string("127.0.0.1") : std::string();
}

// Opens a libfabric RDM endpoint with its progress thread. The thread blocks
// on the completion queue's wait object (no busy polling).
absl::StatusOr<std::unique_ptr<Transport>> OpenFabricTransport(
    const FabricOptions& options);

// In-process fake: endpoints created from one FakeFabric reach each other by
// address. Messages are delivered on a per-endpoint thread, in order.
class FakeFabric {
 public:
  FakeFabric();
  ~FakeFabric();
  std::unique_ptr<Transport> NewEndpoint(const std::string& name);

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace karat
