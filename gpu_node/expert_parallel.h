// Expert-parallel MoE across GPU ranks (DESIGN.md §2 step 5, §4): each rank
// owns a contiguous block of the routed experts (RunnerOptions), plus the
// experts of lost ranks the coordinator gives it (ModelRunner::
// SetExpertOwners, DESIGN.md §7); an MoE
// layer sends the rows routed to another rank's experts to that rank over
// the data plane (kMoeDispatch), computes its own experts meanwhile, and
// takes the other ranks' outputs back (kMoeCombine). The runner then sums
// them in increasing expert id, as it does for local experts, so a token's
// bits do not depend on the rank count (the linear kernel is batch-invariant,
// common/linear.h: an expert gives a row the same bits in any batch).
//
// Wire format (common/frame.h); every frame carries the sender's node id in
// src_node, and `session` holds a 64-bit request id chosen by the sender of
// the dispatch and echoed by the answer:
//   kMoeDispatch  layer, micro_batch, step (the sender's call counter),
//                 n_tokens = U distinct rows;
//                 sections[0] int32 expert ids, m >= 1, strictly increasing,
//                             all owned by the receiver
//                 sections[1] int32 row count of each expert (m, each >= 1)
//                 sections[2] int32 indices into sections[3], expert-major
//                             (sum of the counts)
//                 sections[3] fp32 rows, U x hidden (post-attention-normed);
//                             a row routed to several of the receiver's
//                             experts travels once
//   kMoeCombine   same layer, micro_batch, step, session;
//                 status 0:  n_tokens = sum of the counts;
//                            sections[0] fp32 expert outputs, expert-major
//                            in the dispatch's order, unweighted
//                 status != 0 (an absl code): the dispatch failed;
//                            sections[0] = message
// A failed dispatch is answered with a kMoeCombine carrying the error rather
// than a kError frame, so a node's receive demultiplexer can route by frame
// type alone (kError belongs to the attention path); a kError frame that
// answers a dispatch is accepted all the same.
// A step's rows for one rank are split over several dispatches (by expert)
// when one frame, dispatch or combine, would exceed the frame limit
// (ExpertParallelOptions::max_frame_bytes, the transport's MaxMessageSize()).
//
// Lossy and broken links (gpu_node/moe_retransmit.h, combine_cache.h): a
// dispatch whose combine has not come within the peer's retransmission
// timeout (RTO, from the measured answer times of that peer) is sent again,
// byte for byte, with exponential back-off; so is one whose send fails with
// UNAVAILABLE (a link that is down). A call fails only when `timeout` passes
// without an answer, when an answer carries an error, when a send fails
// otherwise, when the peer leaves the rank table (SetPeers) or on Abort.
// The serving rank remembers, per sender, the dispatches it has queued or
// is computing and the combines it answered last: a dispatch that arrives
// again is answered with the kept combine, or, while the first copy is
// still queued or computed, by that copy's combine; it is never computed
// twice (unless its combine was evicted from the bounded cache). A combine
// for a dispatch already answered is dropped and counted (frames_stale).
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
#include "common/frame.h"
#include "common/model_runner.h"
#include "common/transport.h"
#include "google/protobuf/map.h"
#include "gpu_node/combine_cache.h"
#include "gpu_node/moe_retransmit.h"
#include "gpu_node/worker_token.h"

namespace karat {

struct ExpertParallelOptions {
  // Bound on waiting for another rank's combine, resends included; past it
  // the layer fails with UNAVAILABLE naming the rank.
  absl::Duration timeout = absl::Seconds(30);
  // Retransmission timeout of a dispatch: srtt + 4 * rttvar of the peer's
  // answer times within [min, max], `initial` before its first answer.
  RtoBounds rto;
  // Per sender, the combines kept to answer a dispatch sent again.
  CombineCacheLimits combine_cache;
  // Bound on waiting for a rank's address (GpuNode.SetPeers): a rank that
  // has just joined may start its first turn before the coordinator's
  // table reaches it.
  absl::Duration peer_wait = absl::Seconds(5);
  // Largest frame to send; 0 means the transport's MaxMessageSize() (a
  // smaller value still applies the transport's bound too).
  size_t max_frame_bytes = 0;
  // A dispatch from a node id outside the rank table (a rank that got its
  // table before this one) is parked, up to these bounds, until SetPeers
  // names its sender, and then served; after `peer_wait` it is answered
  // with an UNAVAILABLE combine where the transport knows the sender's
  // address, else dropped. Beyond the bounds it is refused at once the
  // same way.
  size_t max_parked = 64;
  size_t max_parked_bytes = size_t(64) << 20;
};

// Thread safety: every method may be called from any thread. RunExperts of
// the backends from ForMicroBatch() may run concurrently (one thread per
// micro-batch); OnFrame/OnMessage run on the transport's receive thread and
// never block on computation or sends. Dispatches from other ranks are
// computed, in arrival order, on one service thread owned by this object;
// a combine sent again from the cache goes ahead of the queued ones.
class ExpertParallel {
 public:
  static constexpr int kMicroBatches = 2;

  // The rank and rank count are the runner's (RunnerOptions). `runner` and
  // `transport` must outlive this object. It installs no receive handler:
  // the node's receive demultiplexer hands kMoeDispatch, kMoeCombine (and
  // the kError answers to dispatches) to OnFrame(). Stop the transport's
  // deliveries before destroying this object.
  ExpertParallel(const ModelRunner* runner, Transport* transport,
                 const ExpertParallelOptions& options = {});
  ~ExpertParallel();  // Abort()s and joins the service thread

  int rank() const;
  int ranks() const;

  // This node's id (from registration), sent as src_node. The other ranks
  // accept frames only from the node ids of their rank table.
  void set_node_id(uint32_t id);
  // With a data-plane secret (docs/security.md "Data plane"; off by
  // default: plaintext mode): a frame is taken only when the transport
  // attributes it to the peer the rank table names for its src_node (the
  // address the coordinator registered for that node); others are dropped
  // and counted (frames_unauthenticated). A dispatch from a node id outside
  // the table is then parked only when the transport names its sender, and
  // served on release only when the table names that same peer.
  void set_authenticated(bool on);
  // The rank's worker, on which other ranks' dispatches are computed (the
  // service takes a turn per dispatch; DESIGN.md §4: one worker runs all
  // of the rank's operations). Null (the default): computed beside it.
  // Set it before other ranks can dispatch here, or while none are
  // served; `gate` must outlive this object's service thread.
  void set_service_gate(ServiceGate* gate);

  // Replaces the rank table (GpuNode.SetPeers). Entries for this rank are
  // ignored; ranks without an entry cannot be reached (a step that routes
  // to their experts fails with UNAVAILABLE). Parked dispatches whose
  // sender the new table names are then queued for the service thread, in
  // arrival order; steps waiting for a combine from a rank the new table
  // lacks (lost) or names with another node id fail at once with
  // UNAVAILABLE. The experts each rank owns are the runner's
  // (ModelRunner::SetExpertOwners, which the GPU node calls first).
  // INVALID_ARGUMENT, leaving the table as it was, for a rank outside [0,
  // ranks), a rank or node id listed twice, or an empty fabric address; the
  // transport's error when it refuses an address.
  absl::Status SetPeers(const std::vector<cluster::GpuPeer>& peers);
  // SetPeers' checks alone (adding the addresses to the transport, which
  // SetPeers does again to the same effect): the GPU node checks a table
  // before it moves any expert, so that a refused table leaves both as they
  // were.
  absl::Status CheckPeers(const std::vector<cluster::GpuPeer>& peers);

  // The expert backend of micro-batch `mb` (0 or 1) for ModelRunner::Step;
  // `hooks` (may be null) are called around each wait for other ranks.
  // Owned by this object; calling again for the same `mb` replaces its
  // hooks and must not overlap that micro-batch's RunExperts. nullptr for
  // an `mb` outside [0, kMicroBatches).
  ExpertBackend* ForMicroBatch(int mb, WaitHooks* hooks);

  // A data-plane frame for this object (kMoeDispatch, kMoeCombine, or a
  // kError answering a dispatch); the views need only live for the call.
  // `from` is the sender as the transport knows it (kUnknownPeer when it
  // cannot tell). Frames that fail validation are dropped, counted and
  // logged with the sender's node id; a malformed dispatch from a known
  // rank is also answered with an error combine so that its sender fails
  // at once. A dispatch this object has answered or is serving (same
  // sender, request id, layer, step and micro-batch) is not computed again
  // (see above). A dispatch from a node id outside the rank table is parked
  // (ExpertParallelOptions::max_parked) and served in arrival order once
  // SetPeers names its sender; other frames from such a node id, and parked
  // dispatches whose sender is still unknown after `peer_wait`, are
  // dropped and counted (frames_unknown_sender), a dispatch also answered
  // with an UNAVAILABLE combine when `from` is known. Dispatches from known
  // ranks never wait behind parked ones.
  void OnFrame(const FrameView& frame, PeerId from = kUnknownPeer);
  // Decodes `message` and calls OnFrame (undecodable: dropped and counted).
  // Call it from the transport's receive handler: a parked dispatch keeps
  // the transport's buffer (Transport::HoldMessage) or a copy.
  void OnMessage(std::string_view message, PeerId from = kUnknownPeer);

  // Makes waits in progress and later RunExperts fail with UNAVAILABLE and
  // drops queued and parked dispatches, so a decode loop stops promptly.
  // Idempotent.
  void Abort();

  // Counters, keys prefixed "moe_": frames_sent, bytes_sent,
  // frames_received, bytes_received, dispatches_sent, dispatches_served,
  // rows_sent, rows_served, frames_invalid, frames_unknown_sender,
  // frames_unauthenticated (set_authenticated),
  // frames_stale, send_errors, calls, calls_failed, waits, wait_seconds,
  // dispatches_parked (parked on arrival), parked_released (queued once
  // their sender became known), parked_expired (still unknown after
  // peer_wait), parked_refused (over the parking bounds), parked_answered
  // (expired or refused ones answered with an error combine), retransmits
  // (dispatches sent again: timer expired or send failed; dispatches_sent
  // counts each dispatch once), duplicates_served (dispatches that arrived
  // again, answered from the combine cache), duplicates_joined (arrived
  // again while the first copy was queued or computed: answered by its
  // combine), combine_cache_entries, combine_cache_bytes,
  // combine_cache_evictions, rto_ms (the mean current RTO over the ranks
  // of the table) and rto_max_ms (the largest). Log lines about single
  // frames (invalid, unknown sender, stale, failed sends, resends) are
  // rate-limited (common/log_limiter.h: one per kind and peer per 10 s);
  // the counters count every event, and log_lines_held_back the lines
  // left out.
  std::map<std::string, double> Stats() const;
  void ExportTo(google::protobuf::Map<std::string, double>* stats) const;

 private:
  struct Impl;
  class MicroBatchExperts;
  std::unique_ptr<Impl> impl_;
  std::vector<std::unique_ptr<MicroBatchExperts>> backends_;
};

}  // namespace karat
