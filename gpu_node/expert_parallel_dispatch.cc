// ExpertParallel's dispatching side: the plan of a step's frames, their
// sends, and the wait for the other ranks' combines.
#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"
#include "gpu_node/expert_parallel_impl.h"

namespace karat {

absl::StatusOr<std::vector<DispatchPlan>> ExpertParallel::Impl::Plan(
    const ExpertWork& work, const std::vector<int>& owners) const {
  const int E = runner->config().n_routed_experts;
  size_t max_bytes = transport->MaxMessageSize();
  if (options.max_frame_bytes > 0) {
    max_bytes = std::min(max_bytes, options.max_frame_bytes);
  }
  const size_t row_bytes = size_t(hidden) * sizeof(float);
  std::vector<DispatchPlan> plans;
  std::vector<char> marked(size_t(work.rows), 0);
  for (int r = 0; r < ranks; ++r) {
    if (r == rank) continue;
    DispatchPlan plan;
    plan.rank = r;
    size_t distinct = 0, total = 0;
    auto reset = [&] {
      for (int e : plan.experts) {
        for (int row : work.rows_of[e]) marked[row] = 0;
      }
      plan.experts.clear();
      distinct = total = 0;
    };
    for (int e = 0; e < E; ++e) {
      if (owners[size_t(e)] != r || work.rows_of[e].empty()) continue;
      for (int attempt = 0; attempt < 2; ++attempt) {
        size_t new_distinct = distinct;
        for (int row : work.rows_of[e]) new_distinct += marked[row] ? 0 : 1;
        const size_t m = plan.experts.size() + 1;
        const size_t new_total = total + work.rows_of[e].size();
        const size_t dispatch_bytes = EncodedFrameSize(
            {m * 4, m * 4, new_total * 4, new_distinct * row_bytes});
        const size_t combine_bytes = EncodedFrameSize({new_total * row_bytes});
        if (std::max(dispatch_bytes, combine_bytes) <= max_bytes) {
          for (int row : work.rows_of[e]) marked[row] = 1;
          plan.experts.push_back(e);
          distinct = new_distinct;
          total = new_total;
          break;
        }
        if (plan.experts.empty()) {
          return absl::ResourceExhaustedError(
              absl::StrCat("the ", work.rows_of[e].size(), " rows of expert ",
                           e, " in layer ", work.layer, " need a ",
                           std::max(dispatch_bytes, combine_bytes),
                           "-byte frame; the data plane carries at most ",
                           max_bytes, " bytes (use smaller steps)"));
        }
        plans.push_back(plan);
        reset();
      }
    }
    if (!plan.experts.empty()) {
      plans.push_back(plan);
      reset();
    }
  }
  return plans;
}

void ExpertParallel::Impl::Transmit(uint64_t id) {
  std::shared_ptr<const std::string> frame;
  PeerId peer;
  {
    absl::MutexLock lock(&mu);
    auto it = pending.find(id);
    if (it == pending.end() || it->second.done) return;
    it->second.timer.OnPosting(absl::Now());
    frame = it->second.frame;
    peer = it->second.peer;
    ++sends_in_flight;
  }
  const size_t size = frame->size();
  // The callback runs on a transport thread, or here before the call
  // returns.
  absl::Status s = transport->SendSharedAsync(
      peer, std::move(frame), [this, id](absl::Status status) {
        OnSendOutcome(id, status, /*refused=*/false);
      });
  if (!s.ok()) {
    OnSendOutcome(id, s, /*refused=*/true);
    return;
  }
  frames_sent.fetch_add(1);
  bytes_sent.fetch_add(size);
}

void ExpertParallel::Impl::OnSendOutcome(uint64_t id,
                                         const absl::Status& status,
                                         bool refused) {
  absl::MutexLock lock(&mu);
  --sends_in_flight;
  if (!status.ok()) send_errors.fetch_add(1);
  auto it = pending.find(id);
  if (it == pending.end() || it->second.done) return;  // answered, or over
  Pending& p = it->second;
  const absl::Time now = absl::Now();
  ++p.call->events;
  if (status.ok()) {
    p.timer.OnCompleted(now);
    return;
  }
  if (status.code() != absl::StatusCode::kUnavailable) {
    p.Fail(absl::Status(status.code(),
                        absl::StrCat(p.send_prefix, status.message())));
    return;
  }
  // The link or the peer is unreachable for now: another copy one RTO
  // later, until the deadline.
  if (refused) {
    p.timer.OnRefused(now);
  } else {
    p.timer.OnFailed(now);
  }
  p.last_send_error = status;
  EP_LOG(this, Warning, absl::StrCat("send/", p.rank))
      << "rank " << rank << ": " << p.send_prefix << status.message()
      << "; sending it again in " << absl::FormatDuration(p.timer.due() - now);
}

absl::Status ExpertParallel::Impl::Run(int mb, WaitHooks* hooks, uint64_t step,
                                       const ExpertWork& work,
                                       std::vector<std::vector<float>>* out) {
  calls.fetch_add(1);
  const int E = runner->config().n_routed_experts;
  const int D = hidden;
  if (out == nullptr) return absl::InvalidArgumentError("no output vector");
  if (work.rows < 0 || (work.rows > 0 && work.xn == nullptr) ||
      work.rows_of.size() != size_t(E)) {
    calls_failed.fetch_add(1);
    return absl::InvalidArgumentError(absl::StrCat(
        "malformed expert work for layer ", work.layer, ": ", work.rows,
        " rows, ", work.rows_of.size(), " expert lists for ", E, " experts"));
  }
  for (int e = 0; e < E; ++e) {
    int prev = -1;
    for (int row : work.rows_of[e]) {
      if (row <= prev || row >= work.rows) {
        calls_failed.fetch_add(1);
        return absl::InvalidArgumentError(absl::StrCat(
            "expert ", e, " of layer ", work.layer, " lists row ", row,
            " (rows must increase within [0, ", work.rows, "))"));
      }
      prev = row;
    }
  }
  {
    absl::MutexLock lock(&mu);
    if (aborted) {
      calls_failed.fetch_add(1);
      return absl::UnavailableError(
          "expert parallelism stopped: the GPU node is shutting down");
    }
  }
  // One ownership snapshot for the whole call (SetPeers may move experts
  // meanwhile; the combine is the same whoever computes an expert). It
  // keeps the weights of this rank's experts: one that SetPeers gives back
  // to a rejoined rank before step 2 reaches it is still computed here.
  const ExpertSnapshot snapshot = runner->SnapshotExperts(work.layer);
  const std::vector<int>& owners = snapshot.owners();
  absl::StatusOr<std::vector<DispatchPlan>> plans = Plan(work, owners);
  if (!plans.ok()) {
    calls_failed.fetch_add(1);
    return plans.status();
  }
  out->clear();
  out->resize(E);
  for (int e = 0; e < E; ++e) (*out)[e].resize(work.rows_of[e].size() * D);

  Call call;
  std::vector<uint64_t> registered;
  // Every return below goes through here: no Pending may outlive the call
  // (it points into `call` and `out`).
  auto finish = [&](absl::Status status) {
    {
      absl::MutexLock lock(&mu);
      for (uint64_t id : registered) pending.erase(id);
    }
    if (!status.ok()) {
      calls_failed.fetch_add(1);
      EP_LOG(this, Warning, absl::StrCat("call/", int(status.code())))
          << "rank " << rank << " layer " << work.layer << " micro-batch " << mb
          << ": " << status;
    }
    return status;
  };

  // 1. Dispatch the other ranks' rows (once the router's result would be
  // there on the emulated GPU).
  if (hooks != nullptr && !plans->empty()) hooks->BeforeSend();
  std::vector<int> local_of(size_t(work.rows), -1);
  for (const DispatchPlan& plan : *plans) {
    Peer peer;
    bool stopped;
    {
      absl::MutexLock lock(&peers_mu);
      const int r = plan.rank;
      auto known = [this, r]() ABSL_SHARED_LOCKS_REQUIRED(peers_mu) {
        return peers[r].known || peers_aborted;
      };
      peers_mu.AwaitWithTimeout(absl::Condition(&known), options.peer_wait);
      peer = peers[r];
      stopped = peers_aborted;
    }
    if (stopped) {
      return finish(absl::UnavailableError(
          "expert parallelism stopped: the GPU node is shutting down"));
    }
    if (!peer.known) {
      return finish(absl::UnavailableError(
          absl::StrCat("layer ", work.layer,
                       " routes rows to the experts of GPU rank ", plan.rank,
                       ", which has no data-plane address (no SetPeers entry "
                       "within ",
                       absl::FormatDuration(options.peer_wait), ")")));
    }
    std::vector<int32_t> ids, counts, indices;
    std::vector<int> distinct;
    for (int e : plan.experts) {
      ids.push_back(e);
      counts.push_back(int32_t(work.rows_of[e].size()));
      for (int row : work.rows_of[e]) {
        if (local_of[row] < 0) {
          local_of[row] = 0;
          distinct.push_back(row);
        }
      }
    }
    std::sort(distinct.begin(), distinct.end());
    std::vector<float> rows(distinct.size() * D);
    for (size_t i = 0; i < distinct.size(); ++i) {
      local_of[distinct[i]] = int(i);
      std::memcpy(&rows[i * D], work.xn + size_t(distinct[i]) * D,
                  sizeof(float) * D);
    }
    Pending p;
    p.call = &call;
    p.rank = plan.rank;
    p.node_id = peer.node_id;
    p.peer_name = peer.name;
    p.layer = work.layer;
    for (int e : plan.experts) {
      for (int row : work.rows_of[e]) indices.push_back(local_of[row]);
      p.dst.push_back({(*out)[e].data(), (*out)[e].size()});
      p.expected_floats += (*out)[e].size();
    }
    for (int row : distinct) local_of[row] = -1;

    const uint64_t id = next_request.fetch_add(1);
    FrameHeader header;
    header.type = static_cast<uint16_t>(FrameType::kMoeDispatch);
    header.src_node = node_id.load();
    header.layer = uint32_t(work.layer);
    header.micro_batch = uint32_t(mb);
    header.step = step;
    header.session = id;
    header.n_tokens = uint32_t(distinct.size());
    // A fresh buffer per frame: the transport keeps a reference past the
    // call, and a resend sends the same bytes.
    auto frame = std::make_shared<std::string>();
    EncodeFrame(header,
                {SectionBytes(ids.data(), ids.size() * 4),
                 SectionBytes(counts.data(), counts.size() * 4),
                 SectionBytes(indices.data(), indices.size() * 4),
                 SectionBytes(rows.data(), rows.size() * sizeof(float))},
                frame.get());
    p.peer = peer.id;
    p.frame = std::move(frame);
    p.send_prefix =
        absl::StrCat("cannot send MoeDispatch of layer ", work.layer,
                     " to GPU rank ", plan.rank, " (", peer.name, "): ");
    {
      absl::MutexLock lock(&mu);
      p.timer = RetransmitTimer(TimingOf(plan.rank).rtt.rto());
      pending.emplace(id, std::move(p));
      ++call.outstanding;
    }
    registered.push_back(id);
    dispatches_sent.fetch_add(1);
    rows_sent.fetch_add(distinct.size());
    // Every dispatch is posted before any is waited for. A send that fails
    // with UNAVAILABLE, now or later, is tried again (step 3); another
    // error fails the call.
    Transmit(id);
    absl::Status refused;
    {
      absl::MutexLock lock(&mu);
      refused = pending.at(id).status;
    }
    if (!refused.ok()) return finish(refused);
  }

  // 2. This rank's experts, while the dispatches are in flight.
  for (int e = 0; e < E; ++e) {
    const std::vector<int>& rows = work.rows_of[e];
    if (rows.empty() || owners[size_t(e)] != rank) continue;
    absl::Status s =
        runner->ApplyExpert(snapshot, work.layer, e, work.xn, rows.data(),
                            int(rows.size()), (*out)[e].data());
    if (!s.ok()) return finish(s);
  }
  if (registered.empty()) return finish(absl::OkStatus());

  // 3. The other ranks' combines, sending again the dispatches whose
  // timers expire, until every combine is in or the deadline passes.
  if (hooks != nullptr) hooks->BeforeWait();
  absl::Status result;
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + options.timeout;
  mu.Lock();
  for (;;) {
    if (aborted || call.failed || call.outstanding == 0) break;
    const absl::Time now = absl::Now();
    if (now >= deadline) break;
    std::vector<uint64_t> due;
    absl::Time wake = deadline;
    for (uint64_t id : registered) {
      Pending& p = pending.at(id);
      if (p.done) continue;
      if (!p.timer.Due(now)) {
        wake = std::min(wake, p.timer.due());
        continue;
      }
      const absl::Duration waited = p.timer.rto();
      p.timer.OnExpired(&TimingOf(p.rank).rtt);
      due.push_back(id);
      EP_LOG(this, Info, absl::StrCat("resend/", p.rank))
          << "rank " << rank << ": no MoeCombine from GPU rank " << p.rank
          << " (" << p.peer_name << ") for request " << id << " (layer "
          << p.layer << ") within " << absl::FormatDuration(waited)
          << "; sending it again (copy " << p.timer.attempts() + 1 << ")";
    }
    if (!due.empty()) {
      retransmits.fetch_add(due.size());
      mu.Unlock();
      for (uint64_t id : due) Transmit(id);
      mu.Lock();
      continue;
    }
    const uint64_t seen = call.events;
    auto changed = [this, &call, seen]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
      return aborted || call.failed || call.outstanding == 0 ||
             call.events != seen;
    };
    mu.AwaitWithDeadline(absl::Condition(&changed), wake);
  }
  if (aborted) {
    result = absl::UnavailableError(
        "expert parallelism stopped: the GPU node is shutting down");
  }
  for (uint64_t id : registered) {
    if (!result.ok()) break;
    const Pending& p = pending.at(id);
    if (!p.status.ok()) {
      result = p.status;
    } else if (!p.done && !call.failed) {
      std::string sends =
          absl::StrCat("; sent ", p.timer.attempts(),
                       p.timer.attempts() == 1 ? " time" : " times");
      if (!p.last_send_error.ok()) {
        absl::StrAppend(
            &sends, ", the last failed send: ", p.last_send_error.message());
      }
      result = absl::UnavailableError(absl::StrCat(
          "no MoeCombine from GPU rank ", p.rank, " (", p.peer_name,
          ") for layer ", work.layer, " within ",
          absl::ToInt64Milliseconds(options.timeout), " ms", sends));
    }
  }
  for (uint64_t id : registered) pending.erase(id);
  registered.clear();
  mu.Unlock();
  waits.fetch_add(1);
  wait_ns.fetch_add(uint64_t(absl::ToInt64Nanoseconds(absl::Now() - start)));
  if (hooks != nullptr) hooks->AfterWait();
  return finish(result);
}

void ExpertParallel::Impl::OnAnswer(const FrameView& frame, int from_rank) {
  const FrameHeader& h = frame.header;
  const bool error =
      h.type == static_cast<uint16_t>(FrameType::kError) || h.status != 0;
  absl::MutexLock lock(&mu);
  auto it = pending.find(h.session);
  if (it == pending.end() || it->second.done) {
    // Answered already (a dispatch sent twice can be answered twice), or
    // its call is over.
    frames_stale.fetch_add(1);
    EP_LOG(this, Debug, absl::StrCat("stale/", h.src_node))
        << "rank " << rank << ": stale " << FrameTypeName(h.type)
        << " from node " << h.src_node << " (request " << h.session
        << ", layer " << h.layer << ") dropped";
    return;
  }
  Pending& p = it->second;
  if (from_rank != p.rank) {
    CountInvalid(h, absl::StrCat("answers a dispatch to GPU rank ", p.rank,
                                 " but comes from rank ", from_rank));
    return;
  }
  p.done = true;
  --p.call->outstanding;
  if (error) {
    const std::string_view text =
        h.n_sections > 0 ? frame.sections[0] : std::string_view();
    p.status = absl::Status(
        StatusCodeFromWire(h.status),
        absl::StrCat("GPU rank ", p.rank, " (", p.peer_name, "), layer ",
                     p.layer, ": ", std::string(text)));
    p.call->failed = true;
    return;
  }
  const size_t got = h.n_sections == 1 ? frame.sections[0].size() : 0;
  if (h.n_sections != 1 || got != p.expected_floats * sizeof(float)) {
    CountInvalid(h, absl::StrCat("MoeCombine of ", got, " bytes in ",
                                 h.n_sections, " sections; expected ",
                                 p.expected_floats * sizeof(float)));
    p.status = absl::DataLossError(absl::StrCat(
        "GPU rank ", p.rank, " (", p.peer_name, ") sent a MoeCombine of ", got,
        " bytes for layer ", p.layer, "; expected ",
        p.expected_floats * sizeof(float)));
    p.call->failed = true;
    return;
  }
  // The answer time, where it is unambiguous (a dispatch sent once), for
  // the rank's RTO.
  if (const std::optional<absl::Duration> sample = p.timer.Sample(absl::Now());
      sample.has_value()) {
    PeerTiming& timing_of_rank = TimingOf(p.rank);
    if (timing_of_rank.node_id == p.node_id) {
      timing_of_rank.rtt.AddSample(*sample);
    }
  }
  const char* src = frame.sections[0].data();
  for (const auto& [dst, floats] : p.dst) {
    std::memcpy(dst, src, floats * sizeof(float));
    src += floats * sizeof(float);
  }
}

}  // namespace karat
