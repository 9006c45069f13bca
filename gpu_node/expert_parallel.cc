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
#include "gpu_node/expert_parallel_impl.h"

namespace karat {

using expert_parallel_internal::kLogModule;

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

// --- ExpertParallel ---------------------------------------------------------

ExpertParallel::ExpertParallel(const ModelRunner* runner, Transport* transport,
                               const ExpertParallelOptions& options)
    : impl_(std::make_unique<Impl>(runner, transport, options)) {
  {
    absl::MutexLock lock(&impl_->peers_mu);
    impl_->peers.resize(size_t(impl_->ranks));
  }
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->timing.assign(size_t(impl_->ranks),
                         Impl::PeerTiming{false, 0, RttEstimator(options.rto)});
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
      if (now.known && now.node_id == p.node_id) {
        p.peer = now.id;  // its copies go to the address of the new table
        continue;
      }
      p.Fail(absl::UnavailableError(absl::StrCat(
          "GPU rank ", p.rank, " (", p.peer_name, ") left the rank table ",
          now.known ? "(it rejoined as another node)" : "(it was lost)",
          " while layer ", p.layer, " waited for its MoeCombine")));
    }
    // Answer times are a node's: a rank that comes back as another node
    // starts from the initial RTO.
    absl::flat_hash_set<uint32_t> senders;
    for (size_t r = 0; r < table.size(); ++r) {
      Impl::PeerTiming& timing = m.timing[r];
      const bool same = table[r].known && timing.in_table &&
                        timing.node_id == table[r].node_id;
      if (!same) {
        timing.rtt = RttEstimator(m.options.rto);
        timing.node_id = table[r].node_id;
      }
      timing.in_table = table[r].known;
      if (table[r].known) senders.insert(table[r].node_id);
    }
    m.combines.RetainSenders(senders);
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
    if (!released.empty()) ++m.service_events;
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
    if (m.authenticated.load() && r.parked.from != r.peer.id) {
      m.CountUnauthenticated(frame->header, r.parked.from);
      continue;
    }
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
    EP_LOG(impl_, Warning, "undecodable")
        << "rank " << impl_->rank << ": dropping an undecodable "
        << message.size() << "-byte frame: " << frame.status().message();
    return;
  }
  impl_->Receive(*frame, from, &message);
}

void ExpertParallel::set_authenticated(bool on) {
  impl_->authenticated.store(on);
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
  impl_->resends.clear();
  impl_->combines.Clear();
  ++impl_->service_events;
}

std::map<std::string, double> ExpertParallel::Stats() const {
  Impl& m = *impl_;
  double rto_sum_ms = 0, rto_max_ms = 0, cache_entries = 0, cache_bytes = 0,
         cache_evictions = 0;
  int timed = 0;
  {
    absl::MutexLock lock(&m.mu);
    for (const Impl::PeerTiming& t : m.timing) {
      if (!t.in_table) continue;
      const double ms = absl::ToDoubleMilliseconds(t.rtt.rto());
      rto_sum_ms += ms;
      rto_max_ms = std::max(rto_max_ms, ms);
      ++timed;
    }
    cache_entries = double(m.combines.entries());
    cache_bytes = double(m.combines.bytes());
    cache_evictions = double(m.combines.evictions());
  }
  return {
      {"moe_retransmits", double(m.retransmits.load())},
      {"moe_duplicates_served", double(m.duplicates_served.load())},
      {"moe_duplicates_joined", double(m.duplicates_joined.load())},
      {"moe_combine_cache_entries", cache_entries},
      {"moe_combine_cache_bytes", cache_bytes},
      {"moe_combine_cache_evictions", cache_evictions},
      {"moe_rto_ms", timed > 0 ? rto_sum_ms / timed : 0.0},
      {"moe_rto_max_ms", rto_max_ms},
      {"moe_log_lines_held_back", double(m.log_limiter.held_back())},
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
      {"moe_frames_unauthenticated", double(m.frames_unauthenticated.load())},
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
