// The KARAT half of attention over the data plane (DESIGN.md §2 steps 2-4):
// for each segment of a step, the indexer Q/K (layers with an indexer) and
// the attention Q with the new KV entries go to the segment's home KARAT
// device; the attention outputs come back as kAttnOut frames. Section
// layouts are those of karat_node/data_plane.h.
//
// Peers are added lazily from the sessions' placements, with a kHello /
// kHelloAck handshake before the first data frame. The receive handler runs
// on the transport's thread and only decodes, matches and signals.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "cluster.pb.h"
#include "common/attention.h"
#include "common/model_runner.h"
#include "common/transport.h"
#include "gpu_node/decode_loop.h"

namespace karat {

struct RemoteAttentionOptions {
  // Bound on a handshake and on waiting for a layer's outputs; past it the
  // layer fails with UNAVAILABLE naming the KARAT node.
  absl::Duration timeout = absl::Seconds(30);
};

// Thread safety: SetPlacement, ClearPlacement and BeginStep are called from
// one thread (the decode loop) between steps; during a step the two
// micro-batches' backends (ForMicroBatch) may run layers from two threads at
// once. set_node_id, Abort and the counters: any thread.
class RemoteAttentionBackend : public StepBackend {
 public:
  // Installs the receive handler on `transport` unless `install_handler`
  // is false (the owner then passes attention frames to OnMessage). The
  // transport must be shut down before the backend is destroyed.
  RemoteAttentionBackend(const AttnShapes& shapes, Transport* transport,
                         const RemoteAttentionOptions& options,
                         bool install_handler = true);
  ~RemoteAttentionBackend() override;

  // This node's id (from registration), sent as src_node.
  void set_node_id(uint32_t id);

  void SetPlacement(uint64_t session,
                    const cluster::KaratPlacement& placement) override;
  void ClearPlacement(uint64_t session) override;
  void BeginStep() override;
  // Micro-batch 0 without wait hooks.
  absl::Status RunLayer(int layer, const std::vector<Segment>& segs,
                        LayerTraffic* traffic) override;
  // Frames of micro-batch `mb` carry it in their header; `hooks` are called
  // around the wait for the attention outputs.
  AttentionBackend* ForMicroBatch(int mb, WaitHooks* hooks) override;

  // The receive path, for a node that demultiplexes its transport's
  // messages itself (see the constructor); `from`, the sender as the
  // transport reports it, is named (Transport::PeerName) only in the log of
  // a dropped frame.
  void OnMessage(std::string_view message, PeerId from = kUnknownPeer);

  // Makes waits in progress and later calls fail with UNAVAILABLE, so a
  // decode loop blocked on a KARAT node can stop promptly. Any thread.
  void Abort();
  // The KARAT node at `fabric_address` is gone (the coordinator says so):
  // the outputs still awaited from it fail at once with UNAVAILABLE and
  // `reason`, instead of after RemoteAttentionOptions::timeout, and the
  // next frame to that address greets it again. Returns how many awaited
  // outputs failed. Any thread.
  int FailNode(const std::string& fabric_address, const std::string& reason);

  uint64_t bytes_sent() const;
  uint64_t bytes_received() const;
  uint64_t frames_invalid() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace karat
