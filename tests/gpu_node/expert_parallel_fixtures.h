// Fixtures of the expert-parallel tests (expert_parallel_test.cc,
// expert_parallel_links_test.cc): model files, runners, a cluster of ranks
// over an in-process FakeFabric (optionally behind link emulators), decode
// streams, raw frames.
#pragma once

#include <catch2/catch.hpp>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/frame.h"
#include "common/link_emulation.h"
#include "common/model_runner.h"
#include "common/transport.h"
#include "common/weights.h"
#include "gpu_node/expert_parallel.h"

namespace karat {
namespace moe_test {

inline const ModelFiles& Files(const std::string& preset) {
  static auto* cache = new std::map<std::string, ModelFiles>();
  auto it = cache->find(preset);
  if (it == cache->end()) {
    ModelFiles f;
    auto cfg = PresetConfig(preset);
    REQUIRE(cfg.ok());
    f.config = *cfg;
    f.tensors = GenerateWeights(f.config, 1);
    it = cache->emplace(preset, std::move(f)).first;
  }
  return it->second;
}

inline std::unique_ptr<ModelRunner> MakeRunner(const ModelFiles& f, int rank,
                                               int ranks) {
  auto r = ModelRunner::Create(f, RunnerOptions{rank, ranks});
  REQUIRE(r.ok());
  return std::move(*r);
}

inline constexpr uint32_t kNodeIdBase = 100;

// G ranks on one FakeFabric; rank r has node id kNodeIdBase + r.
// Rank `rank`'s entry in a rank table: node "gpu<rank>", node id
// kNodeIdBase + rank, at `address`.
inline cluster::GpuPeer RankEntry(int rank, const std::string& address) {
  cluster::GpuPeer p;
  p.set_rank(rank);
  p.set_name("gpu" + std::to_string(rank));
  p.set_node_id(kNodeIdBase + rank);
  p.set_fabric_address(address);
  return p;
}

struct Cluster {
  struct Rank {
    std::unique_ptr<ModelRunner> runner;
    std::unique_ptr<Transport> transport;
    LinkEmulator* links = nullptr;  // the transport, with `emulate_links`
    std::unique_ptr<ExpertParallel> ep;
  };

  // Without `set_peers` no rank has its table yet (SetPeers(peers) later).
  // With `emulate_links` each rank's endpoint is wrapped in a LinkEmulator
  // named "gpu<r>" (no rules yet; seeded with `seed`).
  Cluster(const ModelFiles& f, int ranks,
          const ExpertParallelOptions& options = {}, bool set_peers = true,
          bool emulate_links = false, uint64_t seed = 1) {
    for (int r = 0; r < ranks; ++r) {
      Rank rank;
      const std::string name = "gpu" + std::to_string(r);
      rank.runner = MakeRunner(f, r, ranks);
      rank.transport = fabric.NewEndpoint(name);
      if (emulate_links) {
        LinkEmulatorOptions o;
        o.local_name = name;
        o.seed = seed;
        auto links =
            std::make_unique<LinkEmulator>(std::move(rank.transport), o);
        rank.links = links.get();
        rank.transport = std::move(links);
      }
      rank.ep = std::make_unique<ExpertParallel>(rank.runner.get(),
                                                 rank.transport.get(), options);
      rank.ep->set_node_id(kNodeIdBase + r);
      ExpertParallel* ep = rank.ep.get();
      rank.transport->SetPeerReceiveHandler(
          [ep](PeerId from, std::string_view message) {
            ep->OnMessage(message, from);
          });
      peers.push_back(RankEntry(r, rank.transport->LocalAddress()));
      this->ranks.push_back(std::move(rank));
    }
    if (set_peers) {
      for (Rank& rank : this->ranks) REQUIRE(rank.ep->SetPeers(peers).ok());
    }
  }
  ~Cluster() {
    // Deliveries stop before the ExpertParallel objects go.
    for (Rank& rank : ranks) rank.transport->Shutdown();
  }

  FakeFabric fabric;
  std::vector<Rank> ranks;
  std::vector<cluster::GpuPeer> peers;
};

inline std::vector<int32_t> Prompt(uint64_t session, int len) {
  std::vector<int32_t> p{256};
  for (int j = 0; j < len; ++j) p.push_back(int((session * 37 + j * 11) % 256));
  return p;
}

// One micro-batch's work: a prefill of its sessions in one step, then
// `decodes` greedy decode steps. Returns every step's logits, in order.
struct Stream {
  std::vector<uint64_t> sessions;
  int decodes = 3;
};

inline absl::Status RunStream(const ModelRunner& runner, ExpertBackend* experts,
                              const Stream& stream,
                              std::vector<std::vector<float>>* logits) {
  LocalAttentionBackend attention(runner.config(), 16, size_t(64) << 20);
  absl::Status s = attention.Init();
  if (!s.ok()) return s;
  std::vector<Segment> segs;
  for (uint64_t session : stream.sessions) {
    s = attention.Reserve(session, 128);
    if (!s.ok()) return s;
    segs.push_back({session, 0, Prompt(session, 6 + int(session % 7) * 3)});
  }
  for (int step = 0; step <= stream.decodes; ++step) {
    auto out = runner.Step(segs, &attention, experts);
    if (!out.ok()) return out.status();
    for (size_t i = 0; i < segs.size(); ++i) {
      logits->push_back((*out)[i]);
      const int next = segs[i].pos_start + int(segs[i].tokens.size());
      segs[i].tokens = {SampleToken((*out)[i], 0.0f, 0, next)};
      segs[i].pos_start = next;
    }
  }
  return absl::OkStatus();
}

inline bool SameBits(const std::vector<std::vector<float>>& a,
                     const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].size() != b[i].size() ||
        std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) !=
            0) {
      return false;
    }
  }
  return true;
}

class CountingHooks : public WaitHooks {
 public:
  void BeforeWait() override {
    absl::MutexLock lock(&mu_);
    ++before_;
    if (in_wait_) unbalanced_ = true;
    in_wait_ = true;
  }
  void AfterWait() override {
    absl::MutexLock lock(&mu_);
    ++after_;
    if (!in_wait_) unbalanced_ = true;
    in_wait_ = false;
  }
  int before() {
    absl::MutexLock lock(&mu_);
    return before_;
  }
  int after() {
    absl::MutexLock lock(&mu_);
    return after_;
  }
  bool unbalanced() {
    absl::MutexLock lock(&mu_);
    return unbalanced_;
  }

 private:
  absl::Mutex mu_;
  int before_ = 0, after_ = 0;
  bool in_wait_ = false, unbalanced_ = false;
};

// A prefill long enough that some row of some MoE layer routes to rank 1.
// Runs, on every rank of `cluster` at once, one stream per micro-batch
// (two on rank 0, one on the others; `decodes` decode steps each) and
// checks every logit against `reference` (a single-rank runner), and that
// each micro-batch waited on other ranks with balanced hooks.
inline void RunAllAgainstOneRank(Cluster& cluster, const ModelRunner& reference,
                                 int decodes = 3) {
  struct Job {
    int rank, mb;
    Stream stream;
    std::vector<std::vector<float>> logits;
    absl::Status status;
  };
  std::vector<Job> jobs;
  uint64_t session = 1;
  for (int r = 0; r < int(cluster.ranks.size()); ++r) {
    for (int mb = 0; mb < (r == 0 ? 2 : 1); ++mb) {
      Job job{r, mb, {}, {}, {}};
      job.stream.sessions = {session, session + 1};
      job.stream.decodes = decodes;
      session += 2;
      jobs.push_back(std::move(job));
    }
  }
  std::vector<CountingHooks> hooks(jobs.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < jobs.size(); ++i) {
    Job& job = jobs[i];
    ExpertBackend* experts =
        cluster.ranks[job.rank].ep->ForMicroBatch(job.mb, &hooks[i]);
    REQUIRE(experts != nullptr);
    const ModelRunner* runner = cluster.ranks[job.rank].runner.get();
    threads.emplace_back([&job, runner, experts] {
      job.status = RunStream(*runner, experts, job.stream, &job.logits);
    });
  }
  for (std::thread& t : threads) t.join();

  for (size_t i = 0; i < jobs.size(); ++i) {
    const Job& job = jobs[i];
    INFO("rank " << job.rank << " micro-batch " << job.mb);
    INFO(job.status);
    REQUIRE(job.status.ok());
    std::vector<std::vector<float>> expected;
    REQUIRE(RunStream(reference, nullptr, job.stream, &expected).ok());
    CHECK(SameBits(job.logits, expected));
    CHECK(hooks[i].before() == hooks[i].after());
    CHECK_FALSE(hooks[i].unbalanced());
  }
  CHECK(hooks[0].before() > 0);
}

inline absl::Status PrefillOnRank0(const ModelRunner& runner,
                                   ExpertBackend* experts) {
  std::vector<std::vector<float>> logits;
  Stream stream;
  stream.sessions = {7, 8, 9};
  stream.decodes = 0;
  return RunStream(runner, experts, stream, &logits);
}

// Polls `stat` of `ep` until it reaches `value`; false past a generous
// bound, so that a broken build fails instead of hanging.
inline bool WaitForStat(const ExpertParallel& ep, const std::string& stat,
                        double value) {
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (ep.Stats()[stat] < value) {
    if (absl::Now() > give_up) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

// Frames a rank receives: collected by a raw endpoint's handler.
struct Inbox {
  absl::Mutex mu;
  std::vector<std::string> frames;
  // Keeps every message `t` receives.
  void Collect(Transport* t) {
    t->SetReceiveHandler([this](std::string_view m) {
      absl::MutexLock lock(&mu);
      frames.emplace_back(m);
    });
  }
  bool WaitFor(size_t n) {
    absl::MutexLock lock(&mu);
    auto ready = [this, n]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
      return frames.size() >= n;
    };
    // A bound so that a broken build fails instead of hanging.
    return mu.AwaitWithTimeout(absl::Condition(&ready), absl::Seconds(60));
  }
};

inline std::string Dispatch(uint32_t src_node, uint64_t request, int layer,
                            const std::vector<int32_t>& experts,
                            const std::vector<int32_t>& counts,
                            const std::vector<int32_t>& indices,
                            const std::vector<float>& rows, int hidden) {
  FrameHeader h;
  h.type = static_cast<uint16_t>(FrameType::kMoeDispatch);
  h.src_node = src_node;
  h.layer = uint32_t(layer);
  h.session = request;
  h.n_tokens = uint32_t(rows.size() / size_t(hidden));
  std::string out;
  EncodeFrame(h,
              {std::string_view(reinterpret_cast<const char*>(experts.data()),
                                experts.size() * 4),
               std::string_view(reinterpret_cast<const char*>(counts.data()),
                                counts.size() * 4),
               std::string_view(reinterpret_cast<const char*>(indices.data()),
                                indices.size() * 4),
               std::string_view(reinterpret_cast<const char*>(rows.data()),
                                rows.size() * 4)},
              &out);
  return out;
}

}  // namespace moe_test
}  // namespace karat
