// The data-plane transport seam (CONVENTIONS.md "Seams"): reliable messages
// between named endpoints. The real implementation is libfabric RDM
// (fabric_transport.cc); an in-process fake serves unit tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

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
  // Set before the first message can arrive (before publishing the address).
  virtual void SetReceiveHandler(ReceiveHandler handler) = 0;
  virtual size_t MaxMessageSize() const = 0;
  // Stops the progress thread and closes every resource. Idempotent.
  virtual void Shutdown() = 0;
};

struct FabricOptions {
  // libfabric provider: "shm" (one host), "tcp" (uses ofi_rxm), "verbs".
  std::string provider = "shm";
  // For tcp: the local interface address to bind ("127.0.0.1"); empty for
  // the provider's default.
  std::string node;
  size_t max_message_size = 8 << 20;
  int receive_buffers = 16;
  // Send fails with UNAVAILABLE after this long without completion.
  int send_timeout_ms = 10000;
};

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
