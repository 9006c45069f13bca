#include "gpu_node/expert_parallel.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"
#include "common/status_macros.h"

namespace karat {
namespace {

constexpr const char* kLogModule = "expert_parallel";

template <typename T>
std::vector<T> CopyArray(std::string_view bytes) {
  std::vector<T> v(bytes.size() / sizeof(T));
  if (!v.empty()) std::memcpy(v.data(), bytes.data(), v.size() * sizeof(T));
  return v;
}

size_t FrameBytes(const FrameView& frame) {
  std::vector<size_t> lens;
  for (uint32_t i = 0; i < frame.header.n_sections && i < kMaxSections; ++i) {
    lens.push_back(frame.sections[i].size());
  }
  return EncodedFrameSize(lens);
}

}  // namespace

// The experts of one frame to one rank, in increasing id.
struct DispatchPlan {
  int rank = 0;
  std::vector<int> experts;
};

struct ExpertParallel::Impl {
  Impl(const ModelRunner* r, Transport* t, const ExpertParallelOptions& o)
      : runner(r),
        transport(t),
        options(o),
        rank(r->rank()),
        ranks(r->ranks()),
        hidden(r->config().hidden_size) {}

  struct Peer {
    bool known = false;
    std::string name;
    uint32_t node_id = 0;
    std::string address;
    PeerId id = kUnknownPeer;
  };

  // One RunExperts call, on its caller's stack; guarded by mu.
  struct Call {
    int outstanding = 0;
    bool failed = false;
  };
  // One dispatch awaiting its combine; guarded by mu.
  struct Pending {
    Call* call = nullptr;
    int rank = 0;
    uint32_t node_id = 0;
    std::string peer_name;
    int layer = 0;
    // Destination of each expert's outputs, in the dispatch's order.
    std::vector<std::pair<float*, size_t>> dst;  // (out, floats)
    size_t expected_floats = 0;
    bool done = false;
    absl::Status status;
    // Ends it with `error` before its combine arrived and fails its call.
    void Fail(absl::Status error) {
      done = true;
      status = std::move(error);
      --call->outstanding;
      call->failed = true;
    }
  };

  // A dispatch from another rank for the service thread: parsed, or the
  // error to answer with.
  struct Job {
    uint64_t seq = 0;  // arrival order
    FrameHeader header;
    int from_rank = 0;
    PeerId peer = kUnknownPeer;
    std::string peer_name;
    absl::Status error;
    std::vector<int32_t> experts, counts, indices;
    std::vector<float> rows;
    // The weights of this rank's experts when the dispatch was accepted
    // (SetPeers may give some back before it is served).
    ExpertSnapshot held;
  };
  // A dispatch from a node id outside the rank table, kept until SetPeers
  // names its sender or `deadline` passes.
  struct Parked {
    uint64_t seq = 0;
    FrameHeader header;
    PeerId from = kUnknownPeer;  // as the transport knows the sender
    absl::Time deadline;
    size_t size = 0;
    ReceivedBytes bytes;  // the whole frame; empty for a refused one
    std::string why;      // for a refused one
  };

  // A rank table as SetPeers installs it.
  struct PeerTable {
    std::vector<Peer> peers;                          // by rank
    absl::flat_hash_map<uint32_t, int> rank_of_node;  // the other ranks'
  };
  // SetPeers' table from `list`, every address added to the transport
  // (which returns the same id for an address added again), or why it is
  // refused.
  absl::StatusOr<PeerTable> BuildPeerTable(
      const std::vector<cluster::GpuPeer>& list);
  absl::Status Run(int mb, WaitHooks* hooks, uint64_t step,
                   const ExpertWork& work,
                   std::vector<std::vector<float>>* out);
  // `owners`: the runner's expert ownership, one snapshot per call.
  absl::StatusOr<std::vector<DispatchPlan>> Plan(
      const ExpertWork& work, const std::vector<int>& owners) const;
  absl::Status SendFrame(PeerId peer, const FrameHeader& header,
                         const std::vector<std::string_view>& sections);
  // A dispatch frame, sent without waiting for its completion: a send that
  // fails later fails the dispatch `id` (and wakes its call) with the
  // message SendFrame()'s caller would have given.
  absl::Status SendDispatch(PeerId peer, const FrameHeader& header,
                            const std::vector<std::string_view>& sections,
                            uint64_t id, std::string failure_prefix);
  void Receive(const FrameView& frame, PeerId from,
               const std::string_view* message);
  // Queues the dispatch for the service thread; `seq` 0 takes the next
  // arrival number, a parked dispatch's keeps its place.
  void OnDispatch(const FrameView& frame, int from_rank, const Peer& peer,
                  uint64_t seq = 0);
  // Answers (where the sender's address is known) or drops a parked
  // dispatch whose sender stayed unknown.
  void DropParked(const Parked& p, std::string_view why);
  void OnAnswer(const FrameView& frame, int from_rank);
  void Serve(Job& job);
  void ServiceLoop();
  void CountInvalid(const FrameHeader& h, std::string_view why);

  const ModelRunner* const runner;
  Transport* const transport;
  const ExpertParallelOptions options;
  const int rank;
  const int ranks;
  const int hidden;
  std::atomic<uint32_t> node_id{0};
  std::atomic<ServiceGate*> service_gate{nullptr};
  std::atomic<uint64_t> next_request{1};

  mutable absl::Mutex peers_mu;
  std::vector<Peer> peers ABSL_GUARDED_BY(peers_mu);
  absl::flat_hash_map<uint32_t, int> rank_of_node ABSL_GUARDED_BY(peers_mu);
  // Abort(), for the waits on peers_mu (`aborted` is mu's).
  bool peers_aborted ABSL_GUARDED_BY(peers_mu) = false;

  absl::Mutex mu;
  absl::flat_hash_map<uint64_t, Pending> pending ABSL_GUARDED_BY(mu);
  bool aborted ABSL_GUARDED_BY(mu) = false;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  std::deque<Job> jobs ABSL_GUARDED_BY(mu);  // in increasing seq
  uint64_t next_seq ABSL_GUARDED_BY(mu) = 1;
  std::deque<Parked> parked ABSL_GUARDED_BY(mu);  // in increasing seq
  size_t parked_bytes ABSL_GUARDED_BY(mu) = 0;
  // Refused on arrival (over the bounds): dropped by the service thread,
  // since answering sends and the receive thread must not block.
  std::deque<Parked> refused ABSL_GUARDED_BY(mu);
  uint64_t parked_events ABSL_GUARDED_BY(mu) = 0;  // wakes the service thread
  std::thread service;
  // Dispatches sent asynchronously whose outcome is not reported yet: the
  // destructor waits for them (the transport reports each exactly once, at
  // the latest when it shuts down or the send times out), since their
  // callbacks refer to this object.
  int sends_in_flight ABSL_GUARDED_BY(mu) = 0;

  std::atomic<uint64_t> frames_sent{0}, bytes_sent{0}, frames_received{0},
      bytes_received{0}, dispatches_sent{0}, dispatches_served{0}, rows_sent{0},
      rows_served{0}, frames_invalid{0}, frames_unknown_sender{0},
      frames_stale{0}, send_errors{0}, calls{0}, calls_failed{0}, waits{0},
      wait_ns{0}, dispatches_parked{0}, parked_released{0}, parked_expired{0},
      parked_refused{0}, parked_answered{0};
};

class ExpertParallel::MicroBatchExperts : public ExpertBackend {
 public:
  MicroBatchExperts(Impl* impl, int mb) : impl_(impl), mb_(mb) {}
  void set_hooks(WaitHooks* hooks) { hooks_.store(hooks); }
  absl::Status RunExperts(const ExpertWork& work,
                          std::vector<std::vector<float>>* out) override {
    return impl_->Run(mb_, hooks_.load(), step_.fetch_add(1) + 1, work, out);
  }

 private:
  Impl* const impl_;
  const int mb_;
  std::atomic<WaitHooks*> hooks_{nullptr};
  std::atomic<uint64_t> step_{0};
};

// --- Sending side -----------------------------------------------------------

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

absl::Status ExpertParallel::Impl::SendFrame(
    PeerId peer, const FrameHeader& header,
    const std::vector<std::string_view>& sections) {
  // A fresh buffer per frame: the transport may keep a shared one past the
  // call (Transport::SendShared), and two micro-batches and the service
  // thread send concurrently.
  auto buffer = std::make_shared<std::string>();
  EncodeFrame(header, sections, buffer.get());
  const size_t size = buffer->size();
  absl::Status s = transport->SendShared(peer, std::move(buffer));
  if (!s.ok()) {
    send_errors.fetch_add(1);
    return s;
  }
  frames_sent.fetch_add(1);
  bytes_sent.fetch_add(size);
  return absl::OkStatus();
}

absl::Status ExpertParallel::Impl::SendDispatch(
    PeerId peer, const FrameHeader& header,
    const std::vector<std::string_view>& sections, uint64_t id,
    std::string failure_prefix) {
  auto buffer = std::make_shared<std::string>();
  EncodeFrame(header, sections, buffer.get());
  const size_t size = buffer->size();
  {
    absl::MutexLock lock(&mu);
    ++sends_in_flight;
  }
  // Runs on a transport thread (or here, before the call returns): only
  // marks the dispatch failed.
  absl::Status s = transport->SendSharedAsync(
      peer, std::move(buffer), [this, id, failure_prefix](absl::Status status) {
        absl::MutexLock lock(&mu);
        --sends_in_flight;
        if (status.ok()) return;
        send_errors.fetch_add(1);
        auto it = pending.find(id);
        if (it == pending.end() || it->second.done) return;  // answered
        it->second.Fail(absl::UnavailableError(
            absl::StrCat(failure_prefix, status.message())));
      });
  if (!s.ok()) {
    absl::MutexLock lock(&mu);
    --sends_in_flight;
    send_errors.fetch_add(1);
    return s;
  }
  frames_sent.fetch_add(1);
  bytes_sent.fetch_add(size);
  return absl::OkStatus();
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
      KLOG(Warning, kLogModule) << "rank " << rank << " layer " << work.layer
                                << " micro-batch " << mb << ": " << status;
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
    {
      absl::MutexLock lock(&mu);
      pending.emplace(id, std::move(p));
      ++call.outstanding;
    }
    registered.push_back(id);
    FrameHeader header;
    header.type = static_cast<uint16_t>(FrameType::kMoeDispatch);
    header.src_node = node_id.load();
    header.layer = uint32_t(work.layer);
    header.micro_batch = uint32_t(mb);
    header.step = step;
    header.session = id;
    header.n_tokens = uint32_t(distinct.size());
    // Every dispatch is posted before any is waited for; one whose send
    // fails later fails the call as one refused now does.
    std::string failure_prefix =
        absl::StrCat("cannot send MoeDispatch of layer ", work.layer,
                     " to GPU rank ", plan.rank, " (", peer.name, "): ");
    absl::Status sent =
        SendDispatch(peer.id, header,
                     {SectionBytes(ids.data(), ids.size() * 4),
                      SectionBytes(counts.data(), counts.size() * 4),
                      SectionBytes(indices.data(), indices.size() * 4),
                      SectionBytes(rows.data(), rows.size() * sizeof(float))},
                     id, failure_prefix);
    if (!sent.ok()) {
      return finish(
          absl::UnavailableError(absl::StrCat(failure_prefix, sent.message())));
    }
    dispatches_sent.fetch_add(1);
    rows_sent.fetch_add(distinct.size());
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

  // 3. The other ranks' combines.
  if (hooks != nullptr) hooks->BeforeWait();
  absl::Status result;
  const absl::Time start = absl::Now();
  {
    absl::MutexLock lock(&mu);
    auto done = [this, &call]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
      return call.outstanding == 0 || call.failed || aborted;
    };
    mu.AwaitWithTimeout(absl::Condition(&done), options.timeout);
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
        result = absl::UnavailableError(
            absl::StrCat("no MoeCombine from GPU rank ", p.rank, " (",
                         p.peer_name, ") for layer ", work.layer, " within ",
                         absl::ToInt64Milliseconds(options.timeout), " ms"));
      }
    }
    for (uint64_t id : registered) pending.erase(id);
    registered.clear();
  }
  waits.fetch_add(1);
  wait_ns.fetch_add(uint64_t(absl::ToInt64Nanoseconds(absl::Now() - start)));
  if (hooks != nullptr) hooks->AfterWait();
  return finish(result);
}

// --- Receiving side ---------------------------------------------------------

void ExpertParallel::Impl::CountInvalid(const FrameHeader& h,
                                        std::string_view why) {
  frames_invalid.fetch_add(1);
  KLOG(Warning, kLogModule)
      << "rank " << rank << ": dropping a " << FrameTypeName(h.type)
      << " frame from node " << h.src_node << " (request " << h.session
      << ", layer " << h.layer << "): " << why;
}

void ExpertParallel::Impl::OnDispatch(const FrameView& frame, int from_rank,
                                      const Peer& peer, uint64_t seq) {
  const FrameHeader& h = frame.header;
  const ModelConfig& c = runner->config();
  Job job;
  job.header = h;
  job.from_rank = from_rank;
  job.peer = peer.id;
  job.peer_name = peer.name;
  auto invalid = [&](absl::Status error) {
    CountInvalid(h, std::string(error.message()));
    job.error = std::move(error);
  };
  const size_t row_bytes = size_t(hidden) * sizeof(float);
  if (h.n_sections != 4) {
    invalid(absl::InvalidArgumentError(absl::StrCat(
        "MoeDispatch has ", h.n_sections, " sections; expected 4")));
  } else if (h.layer >= uint32_t(c.num_hidden_layers) ||
             !c.IsMoeLayer(int(h.layer))) {
    invalid(absl::InvalidArgumentError(
        absl::StrCat("MoeDispatch for layer ", h.layer,
                     ", which is not an MoE layer of this model")));
  } else if (frame.sections[0].empty() || frame.sections[0].size() % 4 != 0 ||
             frame.sections[1].size() != frame.sections[0].size()) {
    invalid(absl::InvalidArgumentError(
        absl::StrCat("MoeDispatch expert list of ", frame.sections[0].size(),
                     " bytes and count list of ", frame.sections[1].size(),
                     " bytes; expected equal non-empty multiples of 4")));
  } else if (frame.sections[3].size() != size_t(h.n_tokens) * row_bytes) {
    invalid(absl::InvalidArgumentError(
        absl::StrCat("MoeDispatch rows of ", frame.sections[3].size(),
                     " bytes; ", h.n_tokens, " rows of hidden size ", hidden,
                     " need ", size_t(h.n_tokens) * row_bytes)));
  } else {
    job.held = runner->SnapshotExperts(int(h.layer));
    job.experts = CopyArray<int32_t>(frame.sections[0]);
    job.counts = CopyArray<int32_t>(frame.sections[1]);
    uint64_t total = 0;
    int prev = -1;
    for (size_t i = 0; i < job.experts.size() && job.error.ok(); ++i) {
      const int e = job.experts[i];
      if (e <= prev || e >= c.n_routed_experts) {
        invalid(absl::InvalidArgumentError(
            absl::StrCat("MoeDispatch expert ids not increasing within [0, ",
                         c.n_routed_experts, "): ", e, " after ", prev)));
      } else if (!job.held.holds(e)) {
        invalid(absl::FailedPreconditionError(absl::StrCat(
            "MoeDispatch for expert ", e, ", which GPU rank ", rank,
            " does not hold (the ranks disagree on the expert ownership)")));
      } else if (job.counts[i] < 1) {
        invalid(absl::InvalidArgumentError(absl::StrCat(
            "MoeDispatch row count ", job.counts[i], " for expert ", e)));
      }
      prev = e;
      total += uint64_t(std::max(job.counts[i], 0));
    }
    if (job.error.ok() && frame.sections[2].size() != total * 4) {
      invalid(absl::InvalidArgumentError(
          absl::StrCat("MoeDispatch index list of ", frame.sections[2].size(),
                       " bytes; the counts add up to ", total, " rows")));
    }
    if (job.error.ok()) {
      job.indices = CopyArray<int32_t>(frame.sections[2]);
      for (int32_t index : job.indices) {
        if (index < 0 || uint32_t(index) >= h.n_tokens) {
          invalid(absl::InvalidArgumentError(
              absl::StrCat("MoeDispatch row index ", index, " outside [0, ",
                           h.n_tokens, ")")));
          break;
        }
      }
    }
    if (job.error.ok()) job.rows = CopyArray<float>(frame.sections[3]);
  }
  absl::MutexLock lock(&mu);
  if (aborted || stopping) return;
  if (seq == 0) {
    job.seq = next_seq++;
    jobs.push_back(std::move(job));
    return;
  }
  job.seq = seq;
  auto pos = std::upper_bound(
      jobs.begin(), jobs.end(), seq,
      [](uint64_t s, const Job& queued) { return s < queued.seq; });
  jobs.insert(pos, std::move(job));
}

void ExpertParallel::Impl::Receive(const FrameView& frame, PeerId from,
                                   const std::string_view* message) {
  const FrameHeader& h = frame.header;
  frames_received.fetch_add(1);
  bytes_received.fetch_add(FrameBytes(frame));
  const auto type = static_cast<FrameType>(h.type);
  if (type != FrameType::kMoeDispatch && type != FrameType::kMoeCombine &&
      type != FrameType::kError) {
    CountInvalid(h, "not an expert-parallel frame type");
    return;
  }
  Peer peer;
  int from_rank = -1;
  {
    // The lookup and the parking happen under peers_mu, so a SetPeers that
    // names the sender either precedes the lookup or finds the dispatch
    // parked.
    absl::MutexLock lock(&peers_mu);
    auto it = rank_of_node.find(h.src_node);
    if (it != rank_of_node.end()) {
      from_rank = it->second;
      peer = peers[size_t(from_rank)];
    } else if (type == FrameType::kMoeDispatch) {
      Parked p;
      p.header = h;
      p.from = from;
      p.deadline = absl::Now() + options.peer_wait;
      p.size = message != nullptr ? message->size() : FrameBytes(frame);
      absl::MutexLock jobs_lock(&mu);
      if (aborted || stopping) return;
      p.seq = next_seq++;
      ++parked_events;
      if (parked.size() >= options.max_parked ||
          parked_bytes + p.size > options.max_parked_bytes) {
        p.why = absl::StrCat("the node id is not in the GPU rank table and ",
                             parked.size(), " dispatches (", parked_bytes,
                             " bytes) already wait for their senders' entries");
        parked_refused.fetch_add(1);
        refused.push_back(std::move(p));
        return;
      }
      if (message != nullptr) {
        p.bytes = ReceivedBytes(transport, *message);
      } else {
        std::vector<std::string_view> sections;
        for (uint32_t i = 0; i < h.n_sections && i < kMaxSections; ++i) {
          sections.push_back(frame.sections[i]);
        }
        std::string copy;
        EncodeFrame(h, sections, &copy);
        p.bytes = ReceivedBytes(transport, copy, copy.size() + 1);
      }
      parked_bytes += p.size;
      dispatches_parked.fetch_add(1);
      KLOG(Info, kLogModule)
          << "rank " << rank << ": parking a MoeDispatch from node "
          << h.src_node << " (request " << h.session << ", layer " << h.layer
          << ") until the rank table names it (at most "
          << absl::FormatDuration(options.peer_wait) << ")";
      parked.push_back(std::move(p));
      return;
    }
  }
  if (from_rank < 0) {
    frames_unknown_sender.fetch_add(1);
    CountInvalid(h, "the node id is not in the GPU rank table");
    return;
  }
  if (type == FrameType::kMoeDispatch) {
    OnDispatch(frame, from_rank, peer);
  } else {
    OnAnswer(frame, from_rank);
  }
}

void ExpertParallel::Impl::DropParked(const Parked& p, std::string_view why) {
  const FrameHeader& h = p.header;
  frames_unknown_sender.fetch_add(1);
  CountInvalid(h, absl::StrCat(std::string(why),
                               p.from != kUnknownPeer
                                   ? "; answering with an error"
                                   : "; the sender's address is unknown "
                                     "too, so it gets no answer"));
  if (p.from == kUnknownPeer) return;
  FrameHeader answer;
  answer.type = static_cast<uint16_t>(FrameType::kMoeCombine);
  answer.src_node = node_id.load();
  answer.layer = h.layer;
  answer.micro_batch = h.micro_batch;
  answer.step = h.step;
  answer.session = h.session;
  answer.status = uint32_t(absl::StatusCode::kUnavailable);
  const std::string text = absl::StrCat("GPU rank ", rank, " cannot serve a ",
                                        "MoeDispatch from node ", h.src_node,
                                        ": ", std::string(why));
  absl::Status sent = SendFrame(p.from, answer, {text});
  if (sent.ok()) {
    parked_answered.fetch_add(1);
  } else {
    KLOG(Warning, kLogModule)
        << "rank " << rank << ": cannot answer request " << h.session
        << " of node " << h.src_node << ": " << sent;
  }
}

void ExpertParallel::Impl::OnAnswer(const FrameView& frame, int from_rank) {
  const FrameHeader& h = frame.header;
  const bool error =
      h.type == static_cast<uint16_t>(FrameType::kError) || h.status != 0;
  absl::MutexLock lock(&mu);
  auto it = pending.find(h.session);
  if (it == pending.end() || it->second.done) {
    frames_stale.fetch_add(1);
    KLOG(Debug, kLogModule)
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
  const char* src = frame.sections[0].data();
  for (const auto& [dst, floats] : p.dst) {
    std::memcpy(dst, src, floats * sizeof(float));
    src += floats * sizeof(float);
  }
}

void ExpertParallel::Impl::Serve(Job& job) {
  const FrameHeader& h = job.header;
  FrameHeader answer;
  answer.src_node = node_id.load();
  answer.layer = h.layer;
  answer.micro_batch = h.micro_batch;
  answer.step = h.step;
  answer.session = h.session;
  absl::Status status = job.error;
  std::vector<float> out;
  if (status.ok()) {
    const int D = hidden;
    out.resize(job.indices.size() * size_t(D));
    // The computation takes a turn on the rank's worker; the answer is
    // sent after it.
    ServiceGate* const gate = service_gate.load(std::memory_order_acquire);
    if (gate != nullptr) gate->Enter();
    size_t k = 0;
    for (size_t i = 0; i < job.experts.size() && status.ok(); ++i) {
      const int n = job.counts[i];
      status =
          runner->ApplyExpert(job.held, int(h.layer), job.experts[i],
                              job.rows.data(), &job.indices[k], n, &out[k * D]);
      k += size_t(n);
    }
    if (gate != nullptr) gate->Leave();
  }
  answer.type = static_cast<uint16_t>(FrameType::kMoeCombine);
  absl::Status sent;
  if (status.ok()) {
    answer.n_tokens = uint32_t(job.indices.size());
    sent = SendFrame(job.peer, answer,
                     {SectionBytes(out.data(), out.size() * sizeof(float))});
    if (sent.ok()) {
      dispatches_served.fetch_add(1);
      rows_served.fetch_add(job.rows.size() / size_t(hidden));
    }
  } else {
    answer.status = uint32_t(status.code());
    const std::string text(status.message());
    sent = SendFrame(job.peer, answer, {text});
  }
  if (!sent.ok()) {
    KLOG(Warning, kLogModule)
        << "rank " << rank << ": cannot answer request " << h.session
        << " (layer " << h.layer << ") of GPU rank " << job.from_rank << " ("
        << job.peer_name << "): " << sent;
  }
}

void ExpertParallel::Impl::ServiceLoop() {
  for (;;) {
    Job job;
    bool have_job = false;
    std::vector<Parked> expired, dropped;
    {
      absl::MutexLock lock(&mu);
      for (;;) {
        if (stopping) return;
        if (!jobs.empty() || !refused.empty()) break;
        if (!parked.empty() && parked.front().deadline <= absl::Now()) break;
        const uint64_t events = parked_events;
        auto ready = [this, events]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
          return stopping || !jobs.empty() || parked_events != events;
        };
        if (parked.empty()) {
          mu.Await(absl::Condition(&ready));
        } else {
          mu.AwaitWithDeadline(absl::Condition(&ready),
                               parked.front().deadline);
        }
      }
      const absl::Time now = absl::Now();
      while (!parked.empty() && parked.front().deadline <= now) {
        parked_bytes -= parked.front().size;
        expired.push_back(std::move(parked.front()));
        parked.pop_front();
      }
      while (!refused.empty()) {
        dropped.push_back(std::move(refused.front()));
        refused.pop_front();
      }
      if (!jobs.empty()) {
        job = std::move(jobs.front());
        jobs.pop_front();
        have_job = true;
      }
    }
    for (const Parked& p : dropped) DropParked(p, p.why);
    for (const Parked& p : expired) {
      DropParked(p, absl::StrCat("the node id is still not in the GPU rank "
                                 "table after ",
                                 absl::FormatDuration(options.peer_wait)));
      parked_expired.fetch_add(1);  // last: tests wait for it
    }
    if (have_job) Serve(job);
  }
}

// --- ExpertParallel ---------------------------------------------------------

ExpertParallel::ExpertParallel(const ModelRunner* runner, Transport* transport,
                               const ExpertParallelOptions& options)
    : impl_(std::make_unique<Impl>(runner, transport, options)) {
  {
    absl::MutexLock lock(&impl_->peers_mu);
    impl_->peers.resize(size_t(impl_->ranks));
  }
  for (int mb = 0; mb < kMicroBatches; ++mb) {
    backends_.push_back(std::make_unique<MicroBatchExperts>(impl_.get(), mb));
  }
  Impl* impl = impl_.get();
  impl_->service = std::thread([impl] { impl->ServiceLoop(); });
}

ExpertParallel::~ExpertParallel() {
  Abort();
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->stopping = true;
  }
  if (impl_->service.joinable()) impl_->service.join();
  // Outcomes of dispatches still with the transport (none once it is shut
  // down, as the daemon does first).
  absl::MutexLock lock(&impl_->mu);
  auto reported = [this]() ABSL_SHARED_LOCKS_REQUIRED(impl_->mu) {
    return impl_->sends_in_flight == 0;
  };
  impl_->mu.Await(absl::Condition(&reported));
}

int ExpertParallel::rank() const { return impl_->rank; }
int ExpertParallel::ranks() const { return impl_->ranks; }

void ExpertParallel::set_service_gate(ServiceGate* gate) {
  impl_->service_gate.store(gate, std::memory_order_release);
}

void ExpertParallel::set_node_id(uint32_t id) { impl_->node_id.store(id); }

absl::StatusOr<ExpertParallel::Impl::PeerTable>
ExpertParallel::Impl::BuildPeerTable(
    const std::vector<cluster::GpuPeer>& list) {
  Impl& m = *this;
  PeerTable result;
  std::vector<Peer>& table = result.peers;
  table.resize(size_t(m.ranks));
  absl::flat_hash_map<uint32_t, int>& by_node = result.rank_of_node;
  absl::flat_hash_set<int> seen;
  for (const cluster::GpuPeer& p : list) {
    if (p.rank() < 0 || p.rank() >= m.ranks) {
      return absl::InvalidArgumentError(
          absl::StrCat("GPU peer '", p.name(), "' has rank ", p.rank(),
                       " outside [0, ", m.ranks, ")"));
    }
    if (!seen.insert(p.rank()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("GPU rank ", p.rank(), " is listed twice"));
    }
    if (p.rank() == m.rank) continue;
    if (p.fabric_address().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "GPU rank ", p.rank(), " ('", p.name(), "') has no fabric address"));
    }
    if (!by_node.emplace(p.node_id(), p.rank()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("node id ", p.node_id(), " is listed for GPU ranks ",
                       by_node[p.node_id()], " and ", p.rank()));
    }
    Peer& peer = table[size_t(p.rank())];
    peer.known = true;
    peer.name = p.name().empty() ? absl::StrCat("rank-", p.rank()) : p.name();
    peer.node_id = p.node_id();
    peer.address = p.fabric_address();
  }
  for (Peer& peer : table) {
    if (!peer.known) continue;
    absl::StatusOr<PeerId> id = m.transport->AddPeer(peer.name, peer.address);
    if (!id.ok()) {
      return absl::Status(
          id.status().code(),
          absl::StrCat("GPU peer '", peer.name, "': ", id.status().message()));
    }
    peer.id = *id;
  }
  return result;
}

absl::Status ExpertParallel::CheckPeers(
    const std::vector<cluster::GpuPeer>& list) {
  return impl_->BuildPeerTable(list).status();
}

absl::Status ExpertParallel::SetPeers(
    const std::vector<cluster::GpuPeer>& list) {
  Impl& m = *impl_;
  ASSIGN_OR_RETURN(Impl::PeerTable built, m.BuildPeerTable(list));
  std::vector<Impl::Peer>& table = built.peers;
  struct Released {
    Impl::Parked parked;
    int rank;
    Impl::Peer peer;
  };
  std::vector<Released> released;
  // Ranks that left the table (or came back at another address): their
  // transport peers are failed below, so that a send blocked toward a dead
  // rank ends now instead of after the send timeout.
  std::vector<std::pair<PeerId, std::string>> dropped;
  size_t peer_count = 0;  // ranks other than this one in the new table
  {
    absl::MutexLock lock(&m.peers_mu);
    absl::MutexLock jobs_lock(&m.mu);
    absl::flat_hash_set<PeerId> kept;
    for (const Impl::Peer& peer : table) {
      if (peer.known) kept.insert(peer.id);
    }
    for (size_t r = 0; r < m.peers.size(); ++r) {
      const Impl::Peer& old = m.peers[r];
      if (!old.known || old.id == kUnknownPeer || kept.contains(old.id)) {
        continue;
      }
      const bool rejoined = r < table.size() && table[r].known;
      dropped.emplace_back(
          old.id, rejoined ? absl::StrCat("GPU rank ", r,
                                          " rejoined the cluster as another "
                                          "node")
                           : absl::StrCat("GPU rank ", r,
                                          " was removed from the cluster"));
    }
    // Dispatches waiting on a rank that left the table (lost) or came back
    // as another node fail now rather than after `timeout`.
    for (auto& [id, p] : m.pending) {
      if (p.done) continue;
      const Impl::Peer& now = table[size_t(p.rank)];
      if (now.known && now.node_id == p.node_id) continue;
      p.Fail(absl::UnavailableError(absl::StrCat(
          "GPU rank ", p.rank, " (", p.peer_name, ") left the rank table ",
          now.known ? "(it rejoined as another node)" : "(it was lost)",
          " while layer ", p.layer, " waited for its MoeCombine")));
    }
    peer_count = built.rank_of_node.size();
    m.peers = std::move(table);
    m.rank_of_node = std::move(built.rank_of_node);
    for (auto it = m.parked.begin(); it != m.parked.end();) {
      auto known = m.rank_of_node.find(it->header.src_node);
      if (known == m.rank_of_node.end()) {
        ++it;
        continue;
      }
      m.parked_bytes -= it->size;
      released.push_back(
          {std::move(*it), known->second, m.peers[size_t(known->second)]});
      it = m.parked.erase(it);
    }
    if (!released.empty()) ++m.parked_events;
  }
  KLOG(Info, kLogModule) << "rank " << m.rank << " of " << m.ranks << ": "
                         << peer_count << " GPU peers"
                         << (released.empty()
                                 ? ""
                                 : absl::StrCat("; serving ", released.size(),
                                                " parked dispatches"));
  for (const auto& [id, reason] : dropped) {
    const absl::Status failed =
        m.transport->FailPeer(id, absl::UnavailableError(reason));
    if (!failed.ok()) {
      KLOG(Warning, kLogModule)
          << "rank " << m.rank << ": " << reason
          << ", but failing its transport peer: " << failed;
    }
  }
  // Queued in their arrival places (OnDispatch keeps the queue in order).
  for (Released& r : released) {
    absl::StatusOr<FrameView> frame = DecodeFrame(r.parked.bytes.view());
    if (!frame.ok()) continue;  // decoded once on arrival
    m.parked_released.fetch_add(1);
    m.OnDispatch(*frame, r.rank, r.peer, r.parked.seq);
  }
  return absl::OkStatus();
}

ExpertBackend* ExpertParallel::ForMicroBatch(int mb, WaitHooks* hooks) {
  if (mb < 0 || mb >= kMicroBatches) {
    KLOG(Error, kLogModule) << "no micro-batch " << mb << " (0 or 1)";
    return nullptr;
  }
  backends_[size_t(mb)]->set_hooks(hooks);
  return backends_[size_t(mb)].get();
}

void ExpertParallel::OnMessage(std::string_view message, PeerId from) {
  absl::StatusOr<FrameView> frame = DecodeFrame(message);
  if (!frame.ok()) {
    impl_->frames_received.fetch_add(1);
    impl_->bytes_received.fetch_add(message.size());
    impl_->frames_invalid.fetch_add(1);
    KLOG(Warning, kLogModule)
        << "rank " << impl_->rank << ": dropping an undecodable "
        << message.size() << "-byte frame: " << frame.status().message();
    return;
  }
  impl_->Receive(*frame, from, &message);
}

void ExpertParallel::OnFrame(const FrameView& frame, PeerId from) {
  impl_->Receive(frame, from, nullptr);
}

void ExpertParallel::Abort() {
  {
    absl::MutexLock lock(&impl_->peers_mu);
    impl_->peers_aborted = true;
  }
  absl::MutexLock lock(&impl_->mu);
  impl_->aborted = true;
  impl_->jobs.clear();
  impl_->parked.clear();
  impl_->parked_bytes = 0;
  impl_->refused.clear();
  ++impl_->parked_events;
}

std::map<std::string, double> ExpertParallel::Stats() const {
  const Impl& m = *impl_;
  return {
      {"moe_frames_sent", double(m.frames_sent.load())},
      {"moe_bytes_sent", double(m.bytes_sent.load())},
      {"moe_frames_received", double(m.frames_received.load())},
      {"moe_bytes_received", double(m.bytes_received.load())},
      {"moe_dispatches_sent", double(m.dispatches_sent.load())},
      {"moe_dispatches_served", double(m.dispatches_served.load())},
      {"moe_rows_sent", double(m.rows_sent.load())},
      {"moe_rows_served", double(m.rows_served.load())},
      {"moe_frames_invalid", double(m.frames_invalid.load())},
      {"moe_frames_unknown_sender", double(m.frames_unknown_sender.load())},
      {"moe_frames_stale", double(m.frames_stale.load())},
      {"moe_send_errors", double(m.send_errors.load())},
      {"moe_calls", double(m.calls.load())},
      {"moe_calls_failed", double(m.calls_failed.load())},
      {"moe_waits", double(m.waits.load())},
      {"moe_wait_seconds", double(m.wait_ns.load()) * 1e-9},
      {"moe_dispatches_parked", double(m.dispatches_parked.load())},
      {"moe_parked_released", double(m.parked_released.load())},
      {"moe_parked_expired", double(m.parked_expired.load())},
      {"moe_parked_refused", double(m.parked_refused.load())},
      {"moe_parked_answered", double(m.parked_answered.load())},
  };
}

void ExpertParallel::ExportTo(
    google::protobuf::Map<std::string, double>* stats) const {
  for (const auto& [key, value] : Stats()) (*stats)[key] = value;
}

}  // namespace karat
