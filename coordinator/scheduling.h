// Scheduling policies of the scale-out design (DESIGN.md §3 "Placement",
// §4 "Scheduling"): micro-batch assignment (CMR and the request-count mode it
// is compared against), admission of queued turns, and home-device placement
// with spill.
//
// Every function here is a pure policy: it takes the state it needs as plain
// values and returns a decision. None reads a clock, does I/O, keeps state
// between calls or touches a global, so each is safe to call from any thread
// concurrently and gives the same answer for the same input. Malformed input
// (duplicate ids, negative sizes, a referenced device that is not listed) is
// reported as INVALID_ARGUMENT / NOT_FOUND rather than silently repaired.
//
// Use in the runtime (coordinator.cc): AssignMicroBatches() recomputes a
// rank's micro-batches on every admission and finish (pushed to the rank
// with GpuNode.SetMicroBatches), Imbalance() feeds the token-imbalance
// metric, and MaxBatchForSlo() caps a rank's batch under the TBT target at
// admission. Admit() and PlacePages() are not used there: the coordinator
// does not know the page geometry, so it admits by asking the home device to
// reserve (KaratNode.Reserve, which spills inside the node) and places the
// home device with ChooseHomeDevices() (placement.h).
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/placement.h"

namespace karat::coordinator {

// ---------------------------------------------------------------------------
// Micro-batch assignment (§III-F, Algorithm 1; DESIGN.md §4 "CMR")
// ---------------------------------------------------------------------------

// The two micro-batches of a GPU rank. Their operations interleave so that
// one micro-batch's KARAT-side attention overlaps the other's GPU work.
enum class MicroBatch : int { k0 = 0, k1 = 1 };

// One request of a GPU rank, as the micro-batch policies see it.
struct RankRequest {
  uint64_t request_id = 0;     // unique within the rank
  HomeDevice home;             // the device holding the request's KV
  int64_t context_tokens = 0;  // tokens its attention reads; >= 0
};

struct MicroBatchAssignment {
  uint64_t request_id = 0;
  MicroBatch micro_batch = MicroBatch::k0;
  bool operator==(const MicroBatchAssignment& o) const {
    return request_id == o.request_id && micro_batch == o.micro_batch;
  }
};

// A micro-batch for every request of a rank. Invariant: `assignments` is
// sorted by increasing request id and holds each id once, so two plans for
// the same requests compare equal whatever order the requests came in.
struct MicroBatchPlan {
  std::vector<MicroBatchAssignment> assignments;

  // The micro-batch of `request_id`, or nullopt if the plan has none.
  std::optional<MicroBatch> Find(uint64_t request_id) const;
  bool operator==(const MicroBatchPlan& o) const {
    return assignments == o.assignments;
  }
};

// Context-length-aware micro-batch rebalancing (CMR, §III-F Algorithm 1).
// Recomputes the whole plan from scratch; the caller runs it whenever a
// request of the rank is admitted or finishes. For every device d
// independently: the requests whose KV is on d, in decreasing context length
// (ties: lower request id first), each go to the micro-batch whose aggregate
// context length on d is smaller; ties go to the micro-batch with fewer
// requests on d, then to the one with less context over the whole rank (as
// placed so far, devices in (node, device) order), then to the one with
// fewer requests over the rank, then to micro-batch 0. The plan moves no KV.
//
// Guarantee (greedy bound): on every device the final |ctx(µB0) − ctx(µB1)|
// is at most the longest context on that device.
//
// Errors: INVALID_ARGUMENT for a duplicate request id or a negative context.
absl::StatusOr<MicroBatchPlan> AssignByContextLength(
    const std::vector<RankRequest>& requests);

// The prior approach, kept for comparison: balance by request count over the
// whole rank, append-only. Requests that `previous` assigns keep their
// micro-batch; entries of `previous` for requests not in `requests` (they
// finished) are dropped. Each new request, in increasing request id (the
// order ids are issued in), goes to the micro-batch that holds fewer
// requests at that moment; ties go to micro-batch 0.
//
// Errors: INVALID_ARGUMENT for a duplicate request id or a negative context.
absl::StatusOr<MicroBatchPlan> AssignByRequestCount(
    const std::vector<RankRequest>& requests, const MicroBatchPlan& previous);

// Which of the two above the runtime uses (configuration).
enum class MicroBatchMode { kContextLength, kRequestCount };

// Dispatches to AssignByContextLength (which ignores `previous`) or
// AssignByRequestCount.
absl::StatusOr<MicroBatchPlan> AssignMicroBatches(
    MicroBatchMode mode, const std::vector<RankRequest>& requests,
    const MicroBatchPlan& previous);

// Load of one device's share of the two micro-batches.
struct DeviceMicroBatchLoad {
  HomeDevice device;
  int64_t context_tokens[2] = {0, 0};  // indexed by MicroBatch
  int requests[2] = {0, 0};
  int64_t imbalance = 0;  // |context_tokens[0] − context_tokens[1]|
};

// How evenly a plan splits a rank's attention work. Per-device imbalance is
// what CMR minimises: both micro-batches' attention on device d runs on d's
// cores, so the longer one sets the pipeline's pace on d.
struct MicroBatchImbalance {
  std::vector<DeviceMicroBatchLoad> devices;  // by (node_id, device)
  int64_t sum_device_imbalance = 0;           // Σ_d imbalance(d)
  int64_t max_device_imbalance = 0;           // max_d imbalance(d); 0 if none
  int64_t rank_context_tokens[2] = {0, 0};    // over all devices
  int rank_requests[2] = {0, 0};
  int64_t token_imbalance = 0;  // |rank_context_tokens[0] − [1]|
};

// Measures `plan` over `requests`. Errors: INVALID_ARGUMENT for a duplicate
// request id, a negative context, or a request the plan does not assign.
absl::StatusOr<MicroBatchImbalance> Imbalance(
    const std::vector<RankRequest>& requests, const MicroBatchPlan& plan);

// ---------------------------------------------------------------------------
// KARAT devices and page geometry, shared by admission and placement
// ---------------------------------------------------------------------------

// One device of an alive KARAT node as the coordinator last saw it. The
// caller lists only devices of alive nodes. Invariant (checked):
// 0 <= used_bytes <= capacity_bytes.
struct DeviceOccupancy {
  HomeDevice id;
  int64_t capacity_bytes = 0;
  int64_t used_bytes = 0;
};

// How tokens become bytes. A page holds `tokens_per_page` consecutive tokens
// of a session in every layer; `bytes_per_page` is what one such page costs
// across all layers (layers × KvLayout::page_bytes). Both must be > 0.
struct PageGeometry {
  int32_t tokens_per_page = 64;
  int64_t bytes_per_page = 0;
};

// Pages a session holding `resident_tokens` needs to grow by `new_tokens`:
// ceil((resident + new) / tpp) − ceil(resident / tpp). Arguments must be >= 0
// and tokens_per_page > 0 (checked by the callers below).
int64_t PagesForNewTokens(const PageGeometry& geometry, int64_t resident_tokens,
                          int64_t new_tokens);

// ---------------------------------------------------------------------------
// Admission (DESIGN.md §4 "Admission")
// ---------------------------------------------------------------------------

// Decode step time of one rank as a linear model fitted offline:
//   step_ms = fixed_ms + per_request_ms · batch + per_context_token_ms · Σctx
// All parameters must be finite and >= 0.
struct StepCostModel {
  double fixed_ms = 0;
  double per_request_ms = 0;
  double per_context_token_ms = 0;
};

// A batch size that no TBT target limits.
inline constexpr int kUnboundedBatch = std::numeric_limits<int>::max();

// The largest batch B whose step time meets the TBT target when every request
// reads `mean_context_tokens`: fixed + (per_request + per_ctx · ctx) · B <=
// tbt_slo_ms. 0 when even an empty step misses it; kUnboundedBatch when the
// per-request cost is 0. Errors: INVALID_ARGUMENT for a non-positive or
// non-finite target, a negative context, or a negative / non-finite model
// parameter.
absl::StatusOr<int> MaxBatchForSlo(double tbt_slo_ms,
                                   const StepCostModel& model,
                                   int64_t mean_context_tokens);

// A GPU rank's batch as admission sees it. `max_batch` usually comes from
// MaxBatchForSlo(). A rank with an empty batch always has room for one
// request: no batching choice makes a lone request's step faster, and
// refusing it would stall the queue forever.
struct RankLoad {
  int32_t rank = 0;  // unique
  int current_batch = 0;
  int max_batch = 0;
};

// A turn waiting to start. `home` is the session's home device, or nullopt
// for a session that has none yet (first turn, or its node was lost and the
// KV will be rebuilt). `rank` is the rank the session is bound to, or nullopt
// for any.
struct QueuedTurn {
  uint64_t turn_id = 0;  // unique within the queue
  std::optional<HomeDevice> home;
  std::optional<int32_t> rank;
  // Tokens of the session's context: already on `home`, or for a homeless
  // session the tokens its KV must be rebuilt from (they need pages too).
  int64_t resident_tokens = 0;
  int64_t new_tokens = 0;  // prompt tokens plus the decode budget
};

struct AdmissionConfig {
  PageGeometry geometry;
  // false: strict FIFO, the first turn that cannot start holds every turn
  // behind it. true: a blocked turn is passed over, but a later turn may not
  // take the device space it waits for: a turn blocked on its home device
  // holds that device, a blocked homeless turn holds back later homeless
  // turns. So small turns cannot starve a large one out of the same device.
  bool skip_blocked_head = false;
};

// A turn admitted now: it may start on `rank` with its pages on `home`.
struct GrantedTurn {
  uint64_t turn_id = 0;
  int32_t rank = 0;
  HomeDevice home;  // the session's home, or the one chosen for it
  int64_t pages = 0;
  bool operator==(const GrantedTurn& o) const {
    return turn_id == o.turn_id && rank == o.rank && home == o.home &&
           pages == o.pages;
  }
};

// A turn that stays queued; `turns_ahead` is what the client's stream shows.
struct WaitingTurn {
  uint64_t turn_id = 0;
  int turns_ahead = 0;  // position in the queue after this pass; 0 = next
  bool operator==(const WaitingTurn& o) const {
    return turn_id == o.turn_id && turns_ahead == o.turns_ahead;
  }
};

struct AdmissionDecision {
  std::vector<GrantedTurn> admitted;  // in queue order
  std::vector<WaitingTurn> waiting;   // in queue order
};

// Walks `queue` front to back and admits each turn whose pages fit and whose
// rank has room, reserving both for the turns after it in the same pass. A
// turn fits when its home device has
// PagesForNewTokens(resident, new) · bytes_per_page free bytes (pages do not
// spill at admission; spill is placement's fallback for growth, DESIGN.md
// §3). A homeless turn gets the device placement would pick: the least
// occupied (used bytes, then more free bytes, then lower node id, device id)
// among those that can hold it. A turn bound to a rank needs room there; an
// unbound one takes the rank with the most room (ties: lower rank id).
// Without `skip_blocked_head` no turn overtakes another.
//
// Errors: INVALID_ARGUMENT for duplicate turn, device or rank ids, negative
// token counts, a bad geometry or device; NOT_FOUND for a home device or rank
// that is not listed (the caller re-places sessions of lost nodes first).
absl::StatusOr<AdmissionDecision> Admit(
    const std::vector<QueuedTurn>& queue,
    const std::vector<DeviceOccupancy>& devices,
    const std::vector<RankLoad>& ranks, const AdmissionConfig& config);

// ---------------------------------------------------------------------------
// Home-device placement with spill (DESIGN.md §3 "Placement")
// ---------------------------------------------------------------------------

struct PagePlacementRequest {
  std::optional<HomeDevice> home;  // nullopt: the session has none yet
  int64_t pages = 0;               // >= 0
  int64_t bytes_per_page = 0;      // > 0
};

// `pages` consecutive pages of the request, starting at `first_page` (0 is
// the request's first new page), all on `device`.
struct PageRun {
  HomeDevice device;
  int64_t first_page = 0;
  int64_t pages = 0;
  bool operator==(const PageRun& o) const {
    return device == o.device && first_page == o.first_page && pages == o.pages;
  }
};

struct PagePlacement {
  HomeDevice home;
  std::vector<PageRun> runs;  // home first, then spill devices; no empty run
  int64_t spilled_bytes = 0;  // bytes placed off the home device
};

// Places `request.pages` pages. A session without a home gets the least
// occupied device (the order of ChooseHomeDevices(): used bytes, then more
// free bytes, then lower node id, device id) that has room for a page and
// whose node can hold the whole request; later candidates are tried only
// when an earlier one's node cannot. Pages go to the home device while it has
// room; the rest spill to the other devices of the home's node, most free
// bytes first (ties: lower device id), each filled before the next. Pages
// never spill across nodes: the devices of one node share its host memory,
// so the home device's kernels still read a spilled page (at the cost that
// `spilled_bytes` counts), whereas another node's page would put the network
// on the attention path.
//
// Errors: INVALID_ARGUMENT for bad sizes or duplicate devices; NOT_FOUND when
// `home` is not listed; RESOURCE_EXHAUSTED when the pages do not fit (nothing
// is placed partially).
absl::StatusOr<PagePlacement> PlacePages(
    const std::vector<DeviceOccupancy>& devices,
    const PagePlacementRequest& request);

}  // namespace karat::coordinator
