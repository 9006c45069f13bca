// Link emulation (DESIGN.md §7 "Injection"): a Transport decorator that makes
// each link (this node -> one peer) slower, lossy or disconnected, and counts
// its traffic (common/link_stats.h).
//
// Per link:
//   * latency: every message is delivered no earlier than `latency_us` plus a
//     jitter drawn uniformly from [0, jitter_us] after its Send() (drawn from
//     a generator seeded from the emulator's seed and the two node names, so
//     a run is reproducible);
//   * bandwidth: a cap of `bandwidth_mbps` megabits per second; each message
//     occupies the link for bytes * 8 / rate, and messages queue behind each
//     other (serialisation delay), before the latency is added;
//   * loss: each message is dropped with probability `loss` (Send() still
//     returns OK, as a lost packet would; counted as dropped);
//   * down: Send() fails with UNAVAILABLE and queued messages are discarded.
// Messages of one link keep their order (a later message is never delivered
// before an earlier one, whatever the jitter). A link with no active setting
// and nothing queued sends directly on the caller's thread, so an emulator
// without rules costs a counter update per message. Delayed messages are
// held by one thread per link that sleeps until the head message is due (no
// busy waiting); Send() then returns once the message is queued, and an
// error of the delayed send is logged and counted as failed. A sender that
// gets more than `max_queued_bytes` ahead of a link blocks until it drains.
// SendSharedAsync() follows the same rules, and reports to its callback what
// became of the message: OK when the wrapped transport completed it (or it
// was lost, as a lost packet is not noticed), UNAVAILABLE when the link went
// down, the peer was failed or the emulator shut down with the message
// still queued, or the wrapped transport's error.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/link_rules.h"
#include "common/link_stats.h"
#include "common/transport.h"

namespace karat {

struct LinkEmulatorOptions {
  // This node's name: rules apply when their source is this name or "*".
  std::string local_name;
  uint64_t seed = 1;
  size_t max_queued_bytes = 256 << 20;
  // Counters of every link; the emulator creates its own when null.
  std::shared_ptr<LinkStats> stats;
};

// Thread safety: as Transport; SetLinks() may be called from any thread and
// applies to the messages sent after it returns.
class LinkEmulator final : public Transport {
 public:
  LinkEmulator(std::unique_ptr<Transport> inner, LinkEmulatorOptions options);
  ~LinkEmulator() override;

  // Replaces every rule. INVALID_ARGUMENT (and nothing changes) when one is
  // out of range.
  absl::Status SetLinks(std::vector<LinkRule> rules);
  std::vector<LinkRule> links() const;
  // Restarts every link's jitter and loss generator from `seed` (and the two
  // node names); a change of seed only, the same seed again changes nothing.
  void SetSeed(uint64_t seed);
  // Names to match rules against and to count under, by the name a peer was
  // added with (e.g. "node-3" -> "gpu0"); peers not listed keep their own.
  // Applies to known and future peers.
  void SetPeerNames(std::map<std::string, std::string> names);
  // The settings in force towards a registered peer.
  LinkSettings SettingsFor(PeerId peer) const;
  const std::shared_ptr<LinkStats>& stats() const;

  std::string LocalAddress() const override;
  absl::StatusOr<PeerId> AddPeer(const std::string& name,
                                 const std::string& address) override;
  absl::Status Send(PeerId peer, const void* data, size_t len) override;
  // Passes `message` on to the wrapped transport's SendShared(); a delayed
  // link queues the reference instead of a copy.
  absl::Status SendShared(PeerId peer,
                          std::shared_ptr<const std::string> message) override;
  absl::Status SendSharedAsync(PeerId peer,
                               std::shared_ptr<const std::string> message,
                               SendDone done) override;
  // Discards the messages queued to `peer` (their callbacks get the
  // failure), fails later sends until AddPeer() adds it again, and fails
  // the peer in the wrapped transport.
  absl::Status FailPeer(PeerId peer, const absl::Status& reason) override;
  // The wrapped transport's sender ids, names and counters, passed through.
  void SetPeerReceiveHandler(PeerReceiveHandler handler) override;
  std::string PeerName(PeerId peer) const override;
  size_t MaxMessageSize() const override;
  std::map<std::string, double> Counters() const override;
  // Stops every link thread (queued messages are discarded), then shuts the
  // wrapped transport down. Idempotent.
  void Shutdown() override;

 private:
  // Send(), SendShared() and SendSharedAsync(): `shared`, when set, holds
  // the `len` bytes at `data`; `async`, when set, the callback (moved out
  // when the call returns OK).
  absl::Status SendMessage(PeerId peer, const char* data, size_t len,
                           std::shared_ptr<const std::string> shared,
                           SendDone* async = nullptr);

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace karat
