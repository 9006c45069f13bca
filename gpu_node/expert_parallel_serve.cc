// ExpertParallel's serving side: frames received, dispatches parked until
// their sender is known, computed for other ranks and answered.
#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"
#include "gpu_node/expert_parallel_impl.h"

namespace karat {

using expert_parallel_internal::CopyArray;
using expert_parallel_internal::FrameBytes;

absl::Status ExpertParallel::Impl::SendEncoded(
    PeerId peer, std::shared_ptr<const std::string> frame) {
  const size_t size = frame->size();
  absl::Status s = transport->SendShared(peer, std::move(frame));
  if (!s.ok()) {
    send_errors.fetch_add(1);
    return s;
  }
  frames_sent.fetch_add(1);
  bytes_sent.fetch_add(size);
  return absl::OkStatus();
}

absl::Status ExpertParallel::Impl::SendFrame(
    PeerId peer, const FrameHeader& header,
    const std::vector<std::string_view>& sections) {
  // A fresh buffer per frame: the transport may keep a shared one past the
  // call (Transport::SendShared), and two micro-batches and the service
  // thread send concurrently.
  auto buffer = std::make_shared<std::string>();
  EncodeFrame(header, sections, buffer.get());
  return SendEncoded(peer, std::move(buffer));
}

void ExpertParallel::Impl::CountInvalid(const FrameHeader& h,
                                        std::string_view why) {
  frames_invalid.fetch_add(1);
  EP_LOG(this, Warning, absl::StrCat("invalid/", h.src_node))
      << "rank " << rank << ": dropping a " << FrameTypeName(h.type)
      << " frame from node " << h.src_node << " (request " << h.session
      << ", layer " << h.layer << "): " << why;
}

void ExpertParallel::Impl::CountUnauthenticated(const FrameHeader& h,
                                                PeerId from) {
  frames_unauthenticated.fetch_add(1);
  const std::string sender = transport->PeerName(from);
  EP_LOG(this, Warning, absl::StrCat("unauthenticated/", sender))
      << "rank " << rank << ": dropping a " << FrameTypeName(h.type)
      << " frame claiming node " << h.src_node << " from " << sender
      << ": not the transport peer the rank table names for that node";
}

DispatchKey ExpertParallel::Impl::KeyOf(const FrameHeader& h) {
  return DispatchKey{h.session, h.step, h.layer, h.micro_batch};
}

void ExpertParallel::Impl::OnDispatch(const FrameView& frame, int from_rank,
                                      const Peer& peer, uint64_t seq) {
  const FrameHeader& h = frame.header;
  const DispatchKey key = KeyOf(h);
  {
    // A dispatch sent again: answered with the kept combine, or by the
    // combine of the copy that is queued or being computed.
    absl::MutexLock lock(&mu);
    if (aborted || stopping) return;
    CombineCache::Seen seen = combines.Begin(h.src_node, key);
    if (seen.state == CombineCache::State::kAnswered) {
      resends.push_back(
          Resend{h, from_rank, peer.id, peer.name, std::move(seen.answer)});
      ++service_events;
      return;
    }
    if (seen.state == CombineCache::State::kInProgress) {
      duplicates_joined.fetch_add(1);
      EP_LOG(this, Debug, absl::StrCat("joined/", h.src_node))
          << "rank " << rank << ": MoeDispatch request " << h.session
          << " (layer " << h.layer << ") of GPU rank " << from_rank
          << " came again while it is served; its combine answers both";
      return;
    }
  }
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
  if (aborted || stopping) {
    combines.Abandon(h.src_node, key);
    return;
  }
  ++service_events;
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
    } else if (type == FrameType::kMoeDispatch && authenticated.load() &&
               from == kUnknownPeer) {
      // A sender the transport cannot name could never be checked against
      // the table SetPeers brings: dropped, not parked (the dispatching
      // rank sends it again after its RTO).
      CountUnauthenticated(h, from);
      return;
    } else if (type == FrameType::kMoeDispatch) {
      Parked p;
      p.header = h;
      p.from = from;
      p.deadline = absl::Now() + options.peer_wait;
      p.size = message != nullptr ? message->size() : FrameBytes(frame);
      absl::MutexLock jobs_lock(&mu);
      if (aborted || stopping) return;
      p.seq = next_seq++;
      ++service_events;
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
      EP_LOG(this, Info, absl::StrCat("park/", h.src_node))
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
  if (authenticated.load() && from != peer.id) {
    CountUnauthenticated(h, from);
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
    EP_LOG(this, Warning, absl::StrCat("answer/node/", h.src_node))
        << "rank " << rank << ": cannot answer request " << h.session
        << " of node " << h.src_node << ": " << sent;
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
  auto encoded = std::make_shared<std::string>();
  if (status.ok()) {
    answer.n_tokens = uint32_t(job.indices.size());
    EncodeFrame(answer, {SectionBytes(out.data(), out.size() * sizeof(float))},
                encoded.get());
  } else {
    answer.status = uint32_t(status.code());
    const std::string text(status.message());
    EncodeFrame(answer, {text}, encoded.get());
  }
  {
    // Kept before the send: a copy of the dispatch that arrives from now on
    // is answered from the cache (one that arrives during the send gets a
    // second combine, which its sender drops as stale), never left
    // waiting for a combine that is already gone.
    absl::MutexLock lock(&mu);
    combines.Finish(h.src_node, KeyOf(h), encoded);
  }
  const absl::Status sent = SendEncoded(job.peer, std::move(encoded));
  if (sent.ok() && status.ok()) {
    dispatches_served.fetch_add(1);
    rows_served.fetch_add(job.rows.size() / size_t(hidden));
  }
  if (!sent.ok()) {
    EP_LOG(this, Warning, absl::StrCat("answer/", job.from_rank))
        << "rank " << rank << ": cannot answer request " << h.session
        << " (layer " << h.layer << ") of GPU rank " << job.from_rank << " ("
        << job.peer_name << "): " << sent.message()
        << "; its combine is kept for the dispatch sent again";
  }
}

void ExpertParallel::Impl::SendAgain(const Resend& r) {
  const FrameHeader& h = r.header;
  const absl::Status sent = SendEncoded(r.peer, r.answer);
  if (sent.ok()) {
    duplicates_served.fetch_add(1);
    EP_LOG(this, Debug, absl::StrCat("again/", r.from_rank))
        << "rank " << rank << ": MoeDispatch request " << h.session
        << " (layer " << h.layer << ") of GPU rank " << r.from_rank
        << " came again; answered with the kept combine";
    return;
  }
  EP_LOG(this, Warning, absl::StrCat("answer/", r.from_rank))
      << "rank " << rank << ": cannot answer request " << h.session
      << " (layer " << h.layer << ") of GPU rank " << r.from_rank << " ("
      << r.peer_name << ") again: " << sent.message();
}

void ExpertParallel::Impl::ServiceLoop() {
  for (;;) {
    Job job;
    bool have_job = false;
    std::vector<Parked> expired, dropped;
    std::vector<Resend> again;
    {
      absl::MutexLock lock(&mu);
      for (;;) {
        if (stopping) return;
        if (!jobs.empty() || !refused.empty() || !resends.empty()) break;
        if (!parked.empty() && parked.front().deadline <= absl::Now()) break;
        const uint64_t events = service_events;
        auto ready = [this, events]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
          return stopping || !jobs.empty() || service_events != events;
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
      while (!resends.empty()) {
        again.push_back(std::move(resends.front()));
        resends.pop_front();
      }
      if (!jobs.empty()) {
        job = std::move(jobs.front());
        jobs.pop_front();
        have_job = true;
      }
    }
    for (const Resend& r : again) SendAgain(r);
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

}  // namespace karat
