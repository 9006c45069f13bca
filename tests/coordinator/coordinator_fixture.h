// The fixture of the coordinator's service tests: the coordinator
// in-process, with fake GPU and KARAT nodes (also in-process gRPC servers on
// free ports) registered through RegisterNode.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "cluster.grpc.pb.h"
#include "coordinator/coordinator.h"
#include "karat.grpc.pb.h"

namespace karat::coordinator {
namespace {

namespace v1 = ::karat::v1;
namespace cl = ::karat::cluster;

// A KARAT node whose devices each hold `capacity_tokens` positions.
class FakeKaratNode final : public cl::KaratNode::Service {
 public:
  explicit FakeKaratNode(std::vector<int> capacity_tokens)
      : capacity_(std::move(capacity_tokens)) {}

  grpc::Status Reserve(grpc::ServerContext*, const cl::ReserveRequest* req,
                       cl::ReserveResponse* resp) override {
    absl::MutexLock lock(&mu_);
    reserves_.push_back(*req);
    if (req->device() < 0 ||
        req->device() >= static_cast<int>(capacity_.size()))
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no such device");
    // A device of fixed capacity: what it cannot hold it never will; with
    // `busy_tokens` held by others, what does not fit beside them yet.
    if (req->tokens() > capacity_[req->device()])
      return grpc::Status(grpc::StatusCode::OUT_OF_RANGE, "full even empty");
    if (req->tokens() > capacity_[req->device()] - busy_tokens.load())
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "full now");
    resp->set_used_bytes(req->tokens() * 100);
    return grpc::Status::OK;
  }
  grpc::Status FreeSession(grpc::ServerContext*,
                           const cl::FreeSessionRequest* req,
                           cl::FreeSessionResponse*) override {
    absl::MutexLock lock(&mu_);
    freed_.push_back(req->session());
    return grpc::Status::OK;
  }
  std::vector<cl::ReserveRequest> reserves() {
    absl::MutexLock lock(&mu_);
    return reserves_;
  }
  std::vector<uint64_t> freed() {
    absl::MutexLock lock(&mu_);
    return freed_;
  }
  int devices() const { return static_cast<int>(capacity_.size()); }
  std::atomic<int> busy_tokens{0};

 private:
  const std::vector<int> capacity_;
  absl::Mutex mu_;
  std::vector<cl::ReserveRequest> reserves_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> freed_ ABSL_GUARDED_BY(mu_);
};

// A GPU node that streams tokens_[0], tokens_[1], ... (cycling) for
// max_new_tokens. With `hold_after` = k it stops after k tokens and waits to
// be cancelled; with `fail_after` = k it fails with UNAVAILABLE after k.
class FakeGpuNode final : public cl::GpuNode::Service {
 public:
  explicit FakeGpuNode(std::vector<int32_t> tokens)
      : tokens_(std::move(tokens)) {}

  grpc::Status RunTurn(grpc::ServerContext* ctx, const cl::RunTurnRequest* req,
                       grpc::ServerWriter<cl::RunTurnEvent>* writer) override {
    {
      absl::MutexLock lock(&mu_);
      runs_.push_back(*req);
    }
    int64_t pos = req->pos_start() + req->feed_tokens_size();
    // A feed prefilled in steps of `progress_step` tokens reports each step
    // that does not finish it.
    const int step = progress_step.load();
    for (int fed = step; step > 0 && fed < req->feed_tokens_size();
         fed += step) {
      cl::RunTurnEvent ev;
      ev.set_progress(true);
      ev.set_prefill_fed(fed);
      ev.set_prefill_total(req->feed_tokens_size());
      writer->Write(ev);
    }
    for (int i = 0; i < req->max_new_tokens(); ++i) {
      if (i == hold_after.load()) {
        while (!ctx->IsCancelled() && !release.load())
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
        if (!release.load())
          return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
        return grpc::Status::OK;
      }
      if (i == fail_after.load()) {
        if (fail_once.load()) fail_after = -1;
        if (on_fail) on_fail();
        return grpc::Status(grpc::StatusCode::UNAVAILABLE, "fake GPU lost");
      }
      cl::RunTurnEvent ev;
      if (step_us > 0) {
        ev.set_step_us(step_us);
        ev.set_step_requests(1);
        ev.set_step_context_tokens(pos + i);
        // The first token ends the prefill: its step fed the prompt.
        if (i == 0) ev.set_step_prefill_tokens(req->feed_tokens_size());
      }
      // By position: a resumed or continued pass streams the same tokens
      // as one uninterrupted call would.
      ev.set_token_id(by_position.load()
                          ? tokens_[size_t(pos + i) % tokens_.size()]
                          : tokens_[i % tokens_.size()]);
      ev.set_position(pos + i);
      ev.set_kv_len(static_cast<int32_t>(pos + i));
      ev.set_last(i + 1 == req->max_new_tokens());
      writer->Write(ev);
      if (ev.token_id() == 257) break;
    }
    return grpc::Status::OK;
  }
  // gpu_only mode: KV room of `kv_capacity_tokens` positions per session.
  grpc::Status Reserve(grpc::ServerContext*, const cl::ReserveRequest* req,
                       cl::ReserveResponse* resp) override {
    absl::MutexLock lock(&mu_);
    reserves_.push_back(*req);
    if (req->tokens() > kv_capacity_tokens.load())
      return grpc::Status(grpc::StatusCode::OUT_OF_RANGE, "HBM full");
    resp->set_used_bytes(req->tokens() * 100);
    return grpc::Status::OK;
  }
  grpc::Status FreeSession(grpc::ServerContext*,
                           const cl::FreeSessionRequest* req,
                           cl::FreeSessionResponse*) override {
    absl::MutexLock lock(&mu_);
    freed_.push_back(req->session());
    return grpc::Status::OK;
  }
  grpc::Status SetPeers(grpc::ServerContext*, const cl::SetPeersRequest* req,
                        cl::SetPeersResponse*) override {
    absl::MutexLock lock(&mu_);
    peers_.push_back(*req);
    // With `refuse_more_experts`, an ownership that gives this rank more
    // experts than its block is refused, as a rank whose HBM is full.
    const int n = req->expert_owner_size();
    if (refuse_more_experts.load() && n > 0) {
      int mine = 0, rank = -1;
      for (const auto& p : req->peers())
        if (p.name() == name) rank = p.rank();
      for (int owner : req->expert_owner()) mine += owner == rank;
      if (mine > n / 2)  // two ranks
        return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                            "experts 4,5,6,7 do not fit in --hbm-bytes");
    }
    return grpc::Status::OK;
  }
  grpc::Status KaratNodeLost(grpc::ServerContext*,
                             const cl::KaratNodeLostRequest* req,
                             cl::KaratNodeLostResponse*) override {
    absl::MutexLock lock(&mu_);
    karat_lost_.push_back(req->node_name());
    return grpc::Status::OK;
  }
  grpc::Status SetMicroBatches(grpc::ServerContext*,
                               const cl::SetMicroBatchesRequest* req,
                               cl::SetMicroBatchesResponse*) override {
    absl::MutexLock lock(&mu_);
    micro_batches_.push_back(std::map<uint64_t, int>(req->micro_batch().begin(),
                                                     req->micro_batch().end()));
    return grpc::Status::OK;
  }
  std::vector<cl::RunTurnRequest> runs() {
    absl::MutexLock lock(&mu_);
    return runs_;
  }
  std::vector<cl::ReserveRequest> reserves() {
    absl::MutexLock lock(&mu_);
    return reserves_;
  }
  std::vector<uint64_t> freed() {
    absl::MutexLock lock(&mu_);
    return freed_;
  }
  std::vector<cl::SetPeersRequest> peers() {
    absl::MutexLock lock(&mu_);
    return peers_;
  }
  std::vector<std::map<uint64_t, int>> micro_batches() {
    absl::MutexLock lock(&mu_);
    return micro_batches_;
  }
  std::vector<std::string> karat_lost() {
    absl::MutexLock lock(&mu_);
    return karat_lost_;
  }
  std::atomic<int> hold_after{-1};
  std::atomic<int> progress_step{0};
  // Tokens by position (tokens_[position % size]) instead of by the call's
  // token count.
  std::atomic<bool> by_position{false};
  // With `fail_once` only the first call fails; `on_fail` (set before the
  // turn) runs just before the failure.
  std::atomic<bool> fail_once{false};
  std::function<void()> on_fail;
  // When > 0, every token reports a step of this many microseconds with one
  // request (RunTurnEvent.step_*), the first one's step with the prompt fed.
  std::atomic<int64_t> step_us{0};
  // A held turn ends normally once this is set.
  std::atomic<bool> release{false};
  std::atomic<int> fail_after{-1};
  std::atomic<int> kv_capacity_tokens{1000};
  std::atomic<bool> refuse_more_experts{false};
  std::string name;  // as registered, for refuse_more_experts

 private:
  const std::vector<int32_t> tokens_;
  absl::Mutex mu_;
  std::vector<cl::RunTurnRequest> runs_ ABSL_GUARDED_BY(mu_);
  std::vector<cl::ReserveRequest> reserves_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> freed_ ABSL_GUARDED_BY(mu_);
  std::vector<cl::SetPeersRequest> peers_ ABSL_GUARDED_BY(mu_);
  std::vector<std::map<uint64_t, int>> micro_batches_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> karat_lost_ ABSL_GUARDED_BY(mu_);
};

// Waits (bounded) until `gpu` has received `n` RunTurn calls.
[[maybe_unused]] void WaitRuns(FakeGpuNode& gpu, size_t n) {
  for (int i = 0; i < 1000 && gpu.runs().size() < n; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

struct FakeServer {
  std::unique_ptr<grpc::Server> server;
  std::string address;
  explicit FakeServer(grpc::Service* service) {
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(service);
    server = b.BuildAndStart();
    address = "127.0.0.1:" + std::to_string(port);
  }
  ~FakeServer() { server->Shutdown(std::chrono::system_clock::now()); }
};

// A test clock (the coordinator's time seam).
struct TestClock {
  absl::Mutex mu;
  absl::Time now = absl::FromUnixSeconds(1000000);
  absl::Time Now() {
    absl::MutexLock l(&mu);
    return now;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock l(&mu);
    now += d;
  }
};

class Cluster {
 public:
  explicit Cluster(int limit = 64,
                   const std::function<void(Options&)>& configure = nullptr) {
    Options o;
    o.max_new_tokens_limit = limit;
    o.node_timeout_ms = 5000;
    o.now = [this] { return clock.Now(); };
    if (configure) configure(o);
    auto c = Coordinator::Start(o);
    REQUIRE(c.ok());
    coordinator = std::move(*c);
    auto channel = grpc::CreateChannel(coordinator->address(),
                                       grpc::InsecureChannelCredentials());
    client = v1::Karat::NewStub(channel);
    membership = cl::Coordinator::NewStub(channel);
  }

  uint32_t Register(const std::string& name, const std::string& role,
                    const std::string& address, int devices, int rank = 0,
                    int ranks = 0) {
    cl::RegisterNodeRequest req;
    req.set_name(name);
    req.set_role(role);
    req.set_rank(rank);
    req.set_ranks(ranks);
    if (role == "gpu") req.set_routed_experts(routed_experts);
    req.set_grpc_address(address);
    req.set_fabric_address("fabric-" + name);
    req.set_provider("shm");
    for (int d = 0; d < devices; ++d) {
      auto* info = req.add_devices();
      info->set_device(d);
      info->set_capacity_bytes(1 << 20);
      info->set_used_bytes(d * 10);  // device 0 is the least occupied
    }
    cl::RegisterNodeResponse resp;
    grpc::ClientContext ctx;
    REQUIRE(membership->RegisterNode(&ctx, req, &resp).ok());
    return resp.node_id();
  }

  void AddNodes(std::vector<int> capacity, std::vector<int32_t> tokens) {
    karat = std::make_unique<FakeKaratNode>(std::move(capacity));
    gpu = std::make_unique<FakeGpuNode>(std::move(tokens));
    karat_server = std::make_unique<FakeServer>(karat.get());
    gpu_server = std::make_unique<FakeServer>(gpu.get());
    karat_id =
        Register("karat0", "karat", karat_server->address, karat->devices());
    gpu_id = Register("gpu0", "gpu", gpu_server->address, 0);
  }

  std::string NewSession(uint64_t seed = 7) {
    v1::CreateSessionRequest req;
    req.set_seed(seed);
    v1::Session s;
    grpc::ClientContext ctx;
    REQUIRE(client->CreateSession(&ctx, req, &s).ok());
    return s.session_id();
  }

  v1::Session Get(const std::string& id) {
    v1::GetSessionRequest req;
    req.set_session_id(id);
    req.set_include_tokens(true);
    v1::Session s;
    grpc::ClientContext ctx;
    auto st = client->GetSession(&ctx, req, &s);
    REQUIRE(st.ok());
    return s;
  }

  struct Result {
    grpc::Status status;
    std::vector<v1::GeneratedToken> tokens;
    std::optional<v1::TurnDone> done;
    std::vector<int> queued;  // QueuePosition updates, in order
    std::vector<std::pair<int, int>> prefill;  // (fed, total) reports
  };
  Result Generate(const std::string& id, const std::string& prompt, int max_new,
                  int cancel_after = -1) {
    v1::GenerateRequest req;
    req.set_session_id(id);
    req.set_prompt(prompt);
    req.set_max_new_tokens(max_new);
    return Generate(req, cancel_after);
  }
  Result Generate(const v1::GenerateRequest& req, int cancel_after = -1) {
    Result r;
    grpc::ClientContext ctx;
    auto reader = client->Generate(&ctx, req);
    v1::GenerateResponse resp;
    while (reader->Read(&resp)) {
      if (resp.has_queued()) r.queued.push_back(resp.queued().position());
      if (resp.has_token()) r.tokens.push_back(resp.token());
      if (resp.has_done()) r.done = resp.done();
      if (resp.has_prefill()) {
        CHECK(r.tokens.empty());
        r.prefill.emplace_back(resp.prefill().fed_tokens(),
                               resp.prefill().total_tokens());
      }
      if (static_cast<int>(r.tokens.size()) == cancel_after) ctx.TryCancel();
    }
    r.status = reader->Finish();
    return r;
  }

  v1::ClusterStatus Status() {
    v1::ClusterStatus status;
    grpc::ClientContext ctx;
    REQUIRE(client->GetClusterStatus(&ctx, {}, &status).ok());
    return status;
  }

  // Waits (bounded) until the coordinator stat `name` reaches `value`.
  void WaitStat(const std::string& name, double value) {
    for (int i = 0; i < 1000; ++i) {
      auto stats = Status().stats();
      if (stats.count(name) && stats.at(name) == value) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    FAIL("stat " << name << " never reached " << value);
  }

  // Waits until the session's previous generate has fully ended.
  void WaitIdle(const std::string& id) {
    for (int i = 0; i < 500 && Get(id).state() != "idle"; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    REQUIRE(Get(id).state() == "idle");
  }

  // RegisterNodeRequest.routed_experts of GPU nodes (0: not reported).
  int routed_experts = 0;
  TestClock clock;
  std::unique_ptr<Coordinator> coordinator;
  std::unique_ptr<v1::Karat::Stub> client;
  std::unique_ptr<cl::Coordinator::Stub> membership;
  std::unique_ptr<FakeKaratNode> karat;
  std::unique_ptr<FakeGpuNode> gpu;
  std::unique_ptr<FakeServer> karat_server, gpu_server;
  uint32_t karat_id = 0, gpu_id = 0;
};

}  // namespace
}  // namespace karat::coordinator
