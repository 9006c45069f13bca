#include "coordinator/scheduling.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace karat::coordinator {
namespace {

using DeviceKey = std::pair<uint32_t, int32_t>;

DeviceKey Key(const HomeDevice& d) { return {d.node_id, d.device}; }

std::string Name(const HomeDevice& d) {
  return absl::StrCat("node ", d.node_id, " device ", d.device);
}

int Index(MicroBatch mb) { return static_cast<int>(mb); }

absl::Status ValidateRequests(const std::vector<RankRequest>& requests) {
  std::unordered_set<uint64_t> seen;
  for (const RankRequest& r : requests) {
    if (!seen.insert(r.request_id).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("request ", r.request_id, " is listed twice"));
    }
    if (r.context_tokens < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("request ", r.request_id, " has a negative context (",
                       r.context_tokens, " tokens)"));
    }
  }
  return absl::OkStatus();
}

void SortById(std::vector<MicroBatchAssignment>& a) {
  std::sort(a.begin(), a.end(),
            [](const MicroBatchAssignment& x, const MicroBatchAssignment& y) {
              return x.request_id < y.request_id;
            });
}

absl::Status ValidateDevices(const std::vector<DeviceOccupancy>& devices) {
  std::set<DeviceKey> seen;
  for (const DeviceOccupancy& d : devices) {
    if (!seen.insert(Key(d.id)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(Name(d.id), " is listed twice"));
    }
    if (d.capacity_bytes < 0 || d.used_bytes < 0 ||
        d.used_bytes > d.capacity_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(Name(d.id), " reports ", d.used_bytes, " used of ",
                       d.capacity_bytes, " bytes; want 0 <= used <= capacity"));
    }
  }
  return absl::OkStatus();
}

// The order of ChooseHomeDevices() (placement.h): least used bytes, then
// more free bytes, then lower node id, then lower device id. Admission and
// placement share it so that admission reserves the device placement picks.
bool LessOccupied(const DeviceOccupancy& a, const DeviceOccupancy& b) {
  return std::make_tuple(a.used_bytes, b.capacity_bytes - b.used_bytes,
                         a.id.node_id, a.id.device) <
         std::make_tuple(b.used_bytes, a.capacity_bytes - a.used_bytes,
                         b.id.node_id, b.id.device);
}

}  // namespace

std::optional<MicroBatch> MicroBatchPlan::Find(uint64_t request_id) const {
  auto it = std::lower_bound(assignments.begin(), assignments.end(), request_id,
                             [](const MicroBatchAssignment& a, uint64_t id) {
                               return a.request_id < id;
                             });
  if (it == assignments.end() || it->request_id != request_id) {
    return std::nullopt;
  }
  return it->micro_batch;
}

absl::StatusOr<MicroBatchPlan> AssignByContextLength(
    const std::vector<RankRequest>& requests) {
  RETURN_IF_ERROR(ValidateRequests(requests));
  // Devices are balanced independently: µB0 and µB1 of device d both run on
  // d's cores, so only their split on d decides how long one waits for the
  // other there (§III-F). An ordered map keeps the walk order fixed.
  std::map<DeviceKey, std::vector<const RankRequest*>> by_device;
  for (const RankRequest& r : requests) by_device[Key(r.home)].push_back(&r);

  MicroBatchPlan plan;
  plan.assignments.reserve(requests.size());
  // Rank-wide totals, for the ties on a device: a device whose two shares
  // are equal (most often: both empty) takes the request into the
  // micro-batch that is lighter over the whole rank, so a rank whose
  // devices each hold one of its requests still gets two micro-batches.
  int64_t rank_ctx[2] = {0, 0};
  int rank_count[2] = {0, 0};
  for (auto& [device, on_device] : by_device) {
    // Longest first (Algorithm 1, line "sort by context length, descending"):
    // placing large items first is what bounds the final gap by the largest
    // context. Equal lengths go by id so the result does not depend on the
    // order the caller listed the requests in.
    std::sort(on_device.begin(), on_device.end(),
              [](const RankRequest* a, const RankRequest* b) {
                if (a->context_tokens != b->context_tokens) {
                  return a->context_tokens > b->context_tokens;
                }
                return a->request_id < b->request_id;
              });
    int64_t ctx[2] = {0, 0};
    int count[2] = {0, 0};
    for (const RankRequest* r : on_device) {
      int mb;
      if (ctx[0] != ctx[1]) {
        mb = ctx[0] < ctx[1] ? 0 : 1;
      } else if (count[0] != count[1]) {
        mb = count[1] < count[0] ? 1 : 0;
      } else if (rank_ctx[0] != rank_ctx[1]) {
        mb = rank_ctx[1] < rank_ctx[0] ? 1 : 0;
      } else {
        mb = rank_count[1] < rank_count[0] ? 1 : 0;
      }
      ctx[mb] += r->context_tokens;
      ++count[mb];
      rank_ctx[mb] += r->context_tokens;
      ++rank_count[mb];
      plan.assignments.push_back({r->request_id, static_cast<MicroBatch>(mb)});
    }
  }
  SortById(plan.assignments);
  return plan;
}

absl::StatusOr<MicroBatchPlan> AssignByRequestCount(
    const std::vector<RankRequest>& requests, const MicroBatchPlan& previous) {
  RETURN_IF_ERROR(ValidateRequests(requests));
  std::unordered_map<uint64_t, MicroBatch> before;
  for (const MicroBatchAssignment& a : previous.assignments) {
    if (!before.emplace(a.request_id, a.micro_batch).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "previous plan assigns request ", a.request_id, " twice"));
    }
  }
  MicroBatchPlan plan;
  plan.assignments.reserve(requests.size());
  int count[2] = {0, 0};
  std::vector<uint64_t> fresh;
  for (const RankRequest& r : requests) {
    auto it = before.find(r.request_id);
    if (it == before.end()) {
      fresh.push_back(r.request_id);
      continue;
    }
    ++count[Index(it->second)];
    plan.assignments.push_back({r.request_id, it->second});
  }
  // Ids are issued in arrival order, so increasing id replays arrival order
  // whatever order the caller listed the requests in.
  std::sort(fresh.begin(), fresh.end());
  for (uint64_t id : fresh) {
    const int mb = count[1] < count[0] ? 1 : 0;
    ++count[mb];
    plan.assignments.push_back({id, static_cast<MicroBatch>(mb)});
  }
  SortById(plan.assignments);
  return plan;
}

absl::StatusOr<MicroBatchPlan> AssignMicroBatches(
    MicroBatchMode mode, const std::vector<RankRequest>& requests,
    const MicroBatchPlan& previous) {
  switch (mode) {
    case MicroBatchMode::kContextLength:
      return AssignByContextLength(requests);
    case MicroBatchMode::kRequestCount:
      return AssignByRequestCount(requests, previous);
  }
  return absl::InvalidArgumentError("unknown micro-batch mode");
}

absl::StatusOr<MicroBatchImbalance> Imbalance(
    const std::vector<RankRequest>& requests, const MicroBatchPlan& plan) {
  RETURN_IF_ERROR(ValidateRequests(requests));
  // A map rather than Find() so that a plan built by hand need not be sorted.
  std::unordered_map<uint64_t, MicroBatch> where;
  for (const MicroBatchAssignment& a : plan.assignments) {
    where.emplace(a.request_id, a.micro_batch);
  }
  std::map<DeviceKey, DeviceMicroBatchLoad> loads;
  MicroBatchImbalance out;
  for (const RankRequest& r : requests) {
    auto it = where.find(r.request_id);
    if (it == where.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the plan does not assign request ", r.request_id));
    }
    const int mb = Index(it->second);
    DeviceMicroBatchLoad& load = loads[Key(r.home)];
    load.device = r.home;
    load.context_tokens[mb] += r.context_tokens;
    ++load.requests[mb];
    out.rank_context_tokens[mb] += r.context_tokens;
    ++out.rank_requests[mb];
  }
  for (auto& [key, load] : loads) {
    load.imbalance = std::abs(load.context_tokens[0] - load.context_tokens[1]);
    out.sum_device_imbalance += load.imbalance;
    out.max_device_imbalance =
        std::max(out.max_device_imbalance, load.imbalance);
    out.devices.push_back(load);
  }
  out.token_imbalance =
      std::abs(out.rank_context_tokens[0] - out.rank_context_tokens[1]);
  return out;
}

int64_t PagesForNewTokens(const PageGeometry& geometry, int64_t resident_tokens,
                          int64_t new_tokens) {
  const int64_t tpp = geometry.tokens_per_page;
  auto pages = [tpp](int64_t tokens) { return (tokens + tpp - 1) / tpp; };
  // The session's last page may have room left; only whole new pages cost.
  return pages(resident_tokens + new_tokens) - pages(resident_tokens);
}

absl::StatusOr<int> MaxBatchForSlo(double tbt_slo_ms,
                                   const StepCostModel& model,
                                   int64_t mean_context_tokens) {
  if (!std::isfinite(tbt_slo_ms) || tbt_slo_ms <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tbt_slo_ms must be finite and > 0, got ", tbt_slo_ms));
  }
  for (double p :
       {model.fixed_ms, model.per_request_ms, model.per_context_token_ms}) {
    if (!std::isfinite(p) || p < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step cost model parameters must be finite and >= 0, got ", p));
    }
  }
  if (mean_context_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("mean context must be >= 0, got ", mean_context_tokens));
  }
  // A relative slack so that a batch whose modelled step lands exactly on the
  // target (up to rounding of the model's decimal parameters) counts as
  // meeting it.
  const double limit = tbt_slo_ms * (1 + 1e-9);
  if (model.fixed_ms > limit) return 0;
  const double per_request =
      model.per_request_ms +
      model.per_context_token_ms * static_cast<double>(mean_context_tokens);
  if (per_request == 0) return kUnboundedBatch;
  const double b = std::floor((limit - model.fixed_ms) / per_request);
  if (b >= static_cast<double>(kUnboundedBatch)) return kUnboundedBatch;
  int batch = static_cast<int>(b);
  while (batch > 0 && model.fixed_ms + per_request * batch > limit) --batch;
  return batch;
}

absl::StatusOr<AdmissionDecision> Admit(
    const std::vector<QueuedTurn>& queue,
    const std::vector<DeviceOccupancy>& devices,
    const std::vector<RankLoad>& ranks, const AdmissionConfig& config) {
  const PageGeometry& geometry = config.geometry;
  if (geometry.tokens_per_page <= 0 || geometry.bytes_per_page <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "page geometry needs tokens_per_page > 0 and bytes_per_page > 0, got ",
        geometry.tokens_per_page, " and ", geometry.bytes_per_page));
  }
  RETURN_IF_ERROR(ValidateDevices(devices));
  // Working copies: admitting a turn reserves its bytes and batch slot for
  // the turns behind it in the same pass.
  std::vector<DeviceOccupancy> dev = devices;
  std::map<DeviceKey, size_t> dev_index;
  for (size_t i = 0; i < dev.size(); ++i) dev_index[Key(dev[i].id)] = i;
  std::map<int32_t, RankLoad> rank;
  for (const RankLoad& r : ranks) {
    if (r.current_batch < 0 || r.max_batch < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", r.rank, " has a negative batch size or limit"));
    }
    if (!rank.emplace(r.rank, r).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", r.rank, " is listed twice"));
    }
  }
  std::unordered_set<uint64_t> turn_ids;
  for (const QueuedTurn& t : queue) {
    if (!turn_ids.insert(t.turn_id).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("turn ", t.turn_id, " is queued twice"));
    }
    if (t.resident_tokens < 0 || t.new_tokens < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("turn ", t.turn_id, " has a negative token count"));
    }
    if (t.home && !dev_index.count(Key(*t.home))) {
      return absl::NotFoundError(
          absl::StrCat("turn ", t.turn_id, ": home ", Name(*t.home),
                       " is not an alive device; re-place the session first"));
    }
    if (t.rank && !rank.count(*t.rank)) {
      return absl::NotFoundError(
          absl::StrCat("turn ", t.turn_id, ": rank ", *t.rank, " is unknown"));
    }
  }

  auto room = [](const RankLoad& r) {
    // An idle rank always takes one request (see RankLoad).
    return std::max(r.max_batch, 1) - r.current_batch;
  };
  // Device space that blocked turns wait for; with skip_blocked_head, later
  // turns may not take it, or a stream of small turns could starve a large
  // one. Ranks need no such hold: every turn takes exactly one batch slot and
  // slots only get fewer within a pass, so a later turn can never take the
  // slot a blocked one lacked.
  std::set<DeviceKey> held_devices;
  bool held_homeless = false;

  AdmissionDecision decision;
  bool stopped = false;
  for (const QueuedTurn& t : queue) {
    if (stopped) {
      decision.waiting.push_back({t.turn_id, 0});
      continue;
    }
    const int64_t pages =
        t.home
            ? PagesForNewTokens(geometry, t.resident_tokens, t.new_tokens)
            : PagesForNewTokens(geometry, 0, t.resident_tokens + t.new_tokens);
    const int64_t bytes = pages * geometry.bytes_per_page;

    // Device.
    std::optional<size_t> device;
    if (t.home) {
      const size_t i = dev_index[Key(*t.home)];
      const DeviceOccupancy& d = dev[i];
      if (bytes == 0 || (!held_devices.count(Key(d.id)) &&
                         d.capacity_bytes - d.used_bytes >= bytes)) {
        device = i;
      }
    } else if (!held_homeless) {
      for (size_t i = 0; i < dev.size(); ++i) {
        const DeviceOccupancy& d = dev[i];
        if (held_devices.count(Key(d.id))) continue;
        if (d.capacity_bytes - d.used_bytes < bytes) continue;
        if (!device || LessOccupied(d, dev[*device])) device = i;
      }
    }

    // Rank.
    std::optional<int32_t> chosen_rank;
    if (t.rank) {
      if (room(rank[*t.rank]) > 0) chosen_rank = *t.rank;
    } else {
      int best_room = 0;
      for (const auto& [id, r] : rank) {  // increasing id: ties go low
        if (room(r) > best_room) {
          best_room = room(r);
          chosen_rank = id;
        }
      }
    }

    if (device && chosen_rank) {
      dev[*device].used_bytes += bytes;
      ++rank[*chosen_rank].current_batch;
      decision.admitted.push_back(
          {t.turn_id, *chosen_rank, dev[*device].id, pages});
      continue;
    }
    decision.waiting.push_back({t.turn_id, 0});
    if (!config.skip_blocked_head) {
      stopped = true;
      continue;
    }
    if (!device) {
      if (t.home) {
        held_devices.insert(Key(*t.home));
      } else {
        // A homeless turn waits for any device with room; holding every
        // device would let one large new session stop resident sessions
        // from growing, so it holds back only later homeless turns.
        held_homeless = true;
      }
    }
  }
  for (size_t i = 0; i < decision.waiting.size(); ++i) {
    decision.waiting[i].turns_ahead = static_cast<int>(i);
  }
  return decision;
}

absl::StatusOr<PagePlacement> PlacePages(
    const std::vector<DeviceOccupancy>& devices,
    const PagePlacementRequest& request) {
  if (request.pages < 0 || request.bytes_per_page <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("placement needs pages >= 0 and bytes_per_page > 0, got ",
                     request.pages, " and ", request.bytes_per_page));
  }
  RETURN_IF_ERROR(ValidateDevices(devices));
  auto free_pages = [&](const DeviceOccupancy& d) {
    return (d.capacity_bytes - d.used_bytes) / request.bytes_per_page;
  };

  // Fills `home` first, then the other devices of its node, most free first.
  auto place_on_node =
      [&](const DeviceOccupancy& home) -> std::optional<PagePlacement> {
    PagePlacement p;
    p.home = home.id;
    std::vector<const DeviceOccupancy*> order = {&home};
    std::vector<const DeviceOccupancy*> siblings;
    for (const DeviceOccupancy& d : devices) {
      if (d.id.node_id == home.id.node_id && !(d.id == home.id)) {
        siblings.push_back(&d);
      }
    }
    std::sort(siblings.begin(), siblings.end(),
              [](const DeviceOccupancy* a, const DeviceOccupancy* b) {
                const int64_t fa = a->capacity_bytes - a->used_bytes;
                const int64_t fb = b->capacity_bytes - b->used_bytes;
                if (fa != fb) return fa > fb;
                return a->id.device < b->id.device;
              });
    order.insert(order.end(), siblings.begin(), siblings.end());
    int64_t left = request.pages;
    for (const DeviceOccupancy* d : order) {
      if (left == 0) break;
      const int64_t n = std::min(left, free_pages(*d));
      if (n <= 0) continue;
      p.runs.push_back({d->id, request.pages - left, n});
      if (d != &home) p.spilled_bytes += n * request.bytes_per_page;
      left -= n;
    }
    if (left > 0) return std::nullopt;
    return p;
  };

  if (request.home) {
    auto it = std::find_if(
        devices.begin(), devices.end(),
        [&](const DeviceOccupancy& d) { return d.id == *request.home; });
    if (it == devices.end()) {
      return absl::NotFoundError(absl::StrCat("home ", Name(*request.home),
                                              " is not an alive device"));
    }
    std::optional<PagePlacement> p = place_on_node(*it);
    if (!p) {
      return absl::ResourceExhaustedError(
          absl::StrCat(request.pages, " pages of ", request.bytes_per_page,
                       " bytes do not fit on ", Name(*request.home),
                       " and the other devices of its node"));
    }
    return *p;
  }

  std::vector<const DeviceOccupancy*> candidates;
  for (const DeviceOccupancy& d : devices) candidates.push_back(&d);
  std::sort(candidates.begin(), candidates.end(),
            [](const DeviceOccupancy* a, const DeviceOccupancy* b) {
              return LessOccupied(*a, *b);
            });
  for (const DeviceOccupancy* d : candidates) {
    // A home must take at least the first page (DESIGN.md §3); a session
    // with nothing to place yet just takes the least occupied device.
    if (request.pages > 0 && free_pages(*d) < 1) continue;
    if (std::optional<PagePlacement> p = place_on_node(*d)) return *p;
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "no KARAT node has room for ", request.pages, " pages of ",
      request.bytes_per_page, " bytes (", devices.size(), " devices)"));
}

}  // namespace karat::coordinator
