// The KARAT half of attention over the data plane (DESIGN.md §2 steps 2-4):
// for each segment of a step, the indexer Q/K (layers with an indexer) and
// the attention Q with the new KV entries go to the segment's home KARAT
// device; the attention outputs come back as kAttnOut frames. Section
// layouts are those of karat_node/data_plane.h.
//
// Peers are added lazily from the sessions' placements, with a kHello /
// kHelloAck handshake before the first data frame (authenticated with the
// cluster's data-plane secret: remote_attention_handshake.cc). The receive handler runs
// on the transport's thread and only decodes, matches and signals.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
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
  // Bound on a handshake and on waiting for a segment's attention output,
  // however often its frames were resent; past it the segment fails with
  // UNAVAILABLE naming the KARAT node (a link down for less stalls the
  // segment for about as long; docs/data-plane.md, lossy links).
  absl::Duration timeout = absl::Seconds(30);
  // Retransmission (gpu_node/moe_retransmit.h): a segment whose output has not
  // come back within the RTO of its KARAT node is sent again (its index and
  // attention frames), the wait doubling per resend; one whose device has
  // answered a later segment meanwhile goes again at once (the device runs
  // its frames in arrival order, so it was lost). The RTO is estimated per
  // node from the answers to frames sent once, apart for decode-sized
  // segments and for longer ones (prefill chunks), starting from these
  // values; clamped to [rto_min, rto_max_decode or rto_max]. A decode
  // segment's wait stays short however often it is resent: loss on a link
  // is not congestion, and a link that comes back is used again at once.
  absl::Duration rto_initial_decode = absl::Milliseconds(50);
  absl::Duration rto_initial_prefill = absl::Seconds(1);
  absl::Duration rto_min = absl::Milliseconds(5);
  absl::Duration rto_max_decode = absl::Milliseconds(50);
  absl::Duration rto_max = absl::Seconds(1);
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

  // This node's id (from a registration), sent as src_node; the KARAT
  // nodes are greeted again after it (a registration may follow a
  // coordinator restart whose node table dropped this node meanwhile).
  void set_node_id(uint32_t id);
  // The cluster's data-plane secret (RegisterNodeResponse; empty, the
  // default: plaintext mode). With one, a handshake's kHello carries a
  // proof (common/hello_proof.h) and only a kHelloAck whose proof verifies
  // completes it, and attention answers are taken only from the transport
  // peer of the KARAT node they answer; other frames are dropped and
  // counted (attention_frames_refused). A new secret means new handshakes.
  // Any thread (remote_attention_handshake.cc).
  void set_data_plane_secret(const std::string& secret);

  void SetPlacement(uint64_t session, const cluster::KaratPlacement& placement,
                    uint64_t turn_epoch) override;
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
  // `node_id` (0: unknown) is the lost incarnation: later handshakes with
  // it fail at once (one restarted at the same address has another id).
  int FailNode(const std::string& fabric_address, uint32_t node_id,
               const std::string& reason);

  uint64_t bytes_sent() const;
  uint64_t bytes_received() const;
  uint64_t frames_invalid() const;
  // attention_retransmits (segments sent again), attention_fast_resends (of
  // those, at once: a later segment to their device was answered),
  // attention_resend_requests
  // (a KARAT device asked for the index keys again), attention_stale_answers
  // (answers to a segment already answered), attention_segments_failed,
  // attention_rto_ms (the largest decode RTO over the KARAT nodes),
  // attention_frames_refused and attention_frames_refused.<reason>
  // (bad_proof: a kHelloAck whose proof did not verify; unauthenticated: an
  // answer from another transport peer than its KARAT node's),
  // log_lines_held_back.
  std::map<std::string, double> Counters() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace karat
