// The coordinator service in-process, with fake GPU and KARAT nodes (also
// in-process gRPC servers on free ports) registered through RegisterNode.
#include "coordinator/coordinator.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cmath>
#include <map>
#include <optional>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "cluster.grpc.pb.h"
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
    if (req->device() < 0 || req->device() >= static_cast<int>(capacity_.size()))
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no such device");
    if (req->tokens() > capacity_[req->device()])
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "full");
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
  explicit FakeGpuNode(std::vector<int32_t> tokens) : tokens_(std::move(tokens)) {}

  grpc::Status RunTurn(grpc::ServerContext* ctx, const cl::RunTurnRequest* req,
                       grpc::ServerWriter<cl::RunTurnEvent>* writer) override {
    {
      absl::MutexLock lock(&mu_);
      runs_.push_back(*req);
    }
    int64_t pos = req->pos_start() + req->feed_tokens_size();
    for (int i = 0; i < req->max_new_tokens(); ++i) {
      if (i == hold_after.load()) {
        while (!ctx->IsCancelled())
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
        return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
      }
      if (i == fail_after.load())
        return grpc::Status(grpc::StatusCode::UNAVAILABLE, "fake GPU lost");
      cl::RunTurnEvent ev;
      ev.set_token_id(tokens_[i % tokens_.size()]);
      ev.set_position(pos + i);
      ev.set_kv_len(static_cast<int32_t>(pos + i));
      ev.set_last(i + 1 == req->max_new_tokens());
      writer->Write(ev);
      if (ev.token_id() == 257) break;
    }
    return grpc::Status::OK;
  }
  std::vector<cl::RunTurnRequest> runs() {
    absl::MutexLock lock(&mu_);
    return runs_;
  }
  std::atomic<int> hold_after{-1};
  std::atomic<int> fail_after{-1};

 private:
  const std::vector<int32_t> tokens_;
  absl::Mutex mu_;
  std::vector<cl::RunTurnRequest> runs_ ABSL_GUARDED_BY(mu_);
};

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
  explicit Cluster(int limit = 64) {
    Options o;
    o.max_new_tokens_limit = limit;
    o.node_timeout_ms = 5000;
    o.now = [this] { return clock.Now(); };
    auto c = Coordinator::Start(o);
    REQUIRE(c.ok());
    coordinator = std::move(*c);
    auto channel = grpc::CreateChannel(coordinator->address(),
                                       grpc::InsecureChannelCredentials());
    client = v1::Karat::NewStub(channel);
    membership = cl::Coordinator::NewStub(channel);
  }

  uint32_t Register(const std::string& name, const std::string& role,
                    const std::string& address, int devices) {
    cl::RegisterNodeRequest req;
    req.set_name(name);
    req.set_role(role);
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
    karat_id = Register("karat0", "karat", karat_server->address, karat->devices());
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
      if (resp.has_token()) r.tokens.push_back(resp.token());
      if (resp.has_done()) r.done = resp.done();
      if (static_cast<int>(r.tokens.size()) == cancel_after) ctx.TryCancel();
    }
    r.status = reader->Finish();
    return r;
  }

  // Waits until the session's previous generate has fully ended.
  void WaitIdle(const std::string& id) {
    for (int i = 0; i < 500 && Get(id).state() != "idle"; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    REQUIRE(Get(id).state() == "idle");
  }

  TestClock clock;
  std::unique_ptr<Coordinator> coordinator;
  std::unique_ptr<v1::Karat::Stub> client;
  std::unique_ptr<cl::Coordinator::Stub> membership;
  std::unique_ptr<FakeKaratNode> karat;
  std::unique_ptr<FakeGpuNode> gpu;
  std::unique_ptr<FakeServer> karat_server, gpu_server;
  uint32_t karat_id = 0, gpu_id = 0;
};

TEST_CASE("membership: ids from 1, heartbeats, unknown ids, timeouts") {
  Cluster c;
  c.AddNodes({1000}, {65});
  CHECK(c.karat_id == 1);
  CHECK(c.gpu_id == 2);

  cl::HeartbeatRequest hb;
  hb.set_node_id(99);
  cl::HeartbeatResponse hr;
  {
    grpc::ClientContext ctx;
    REQUIRE(c.membership->Heartbeat(&ctx, hb, &hr).ok());
    CHECK_FALSE(hr.known());
  }
  hb.set_node_id(c.karat_id);
  auto* d = hb.add_devices();
  d->set_device(0);
  d->set_capacity_bytes(5000);
  d->set_used_bytes(1234);
  (*hb.mutable_stats())["frames"] = 3;
  c.clock.Advance(absl::Seconds(4));
  {
    grpc::ClientContext ctx;
    REQUIRE(c.membership->Heartbeat(&ctx, hb, &hr).ok());
    CHECK(hr.known());
  }
  c.clock.Advance(absl::Seconds(2));  // gpu0 silent for 6 s, karat0 for 2 s
  v1::ClusterStatus status;
  {
    grpc::ClientContext ctx;
    REQUIRE(c.client->GetClusterStatus(&ctx, {}, &status).ok());
  }
  REQUIRE(status.nodes_size() == 2);
  CHECK(status.nodes(0).name() == "karat0");
  CHECK(status.nodes(0).alive());
  CHECK(status.nodes(0).last_heartbeat_ms_ago() == 2000);
  CHECK(status.nodes(0).devices(0).used_bytes() == 1234);
  CHECK(status.nodes(0).stats().at("frames") == 3);
  CHECK(status.nodes(1).role() == "gpu");
  CHECK_FALSE(status.nodes(1).alive());

  // No alive GPU node: UNAVAILABLE.
  auto r = c.Generate(c.NewSession(), "hi", 3);
  CHECK(r.status.error_code() == grpc::StatusCode::UNAVAILABLE);
}

TEST_CASE("membership: a bad role is refused") {
  Cluster c;
  cl::RegisterNodeRequest req;
  req.set_name("x");
  req.set_role("tpu");
  req.set_grpc_address("127.0.0.1:1");
  cl::RegisterNodeResponse resp;
  grpc::ClientContext ctx;
  CHECK(c.membership->RegisterNode(&ctx, req, &resp).error_code() ==
        grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_CASE("generate: validation errors") {
  Cluster c(/*limit=*/16);
  std::string sid = c.NewSession();
  REQUIRE(sid.size() == 18);
  CHECK(sid.rfind("s-", 0) == 0);

  SECTION("unknown session") {
    auto r = c.Generate("s-0000000000000000", "hi", 3);
    CHECK(r.status.error_code() == grpc::StatusCode::NOT_FOUND);
  }
  SECTION("max_new_tokens out of range names the limit") {
    auto r = c.Generate(sid, "hi", 17);
    CHECK(r.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(r.status.error_message().find("16") != std::string::npos);
    CHECK(c.Generate(sid, "hi", 0).status.error_code() ==
          grpc::StatusCode::INVALID_ARGUMENT);
  }
  SECTION("empty prompt") {
    CHECK(c.Generate(sid, "", 3).status.error_code() ==
          grpc::StatusCode::INVALID_ARGUMENT);
  }
  SECTION("token ids out of range") {
    v1::GenerateRequest req;
    req.set_session_id(sid);
    req.set_max_new_tokens(3);
    req.add_prompt_tokens(65);
    req.add_prompt_tokens(258);
    CHECK(c.Generate(req).status.error_code() ==
          grpc::StatusCode::INVALID_ARGUMENT);
  }
  SECTION("negative or NaN temperature") {
    v1::GenerateRequest req;
    req.set_session_id(sid);
    req.set_max_new_tokens(3);
    req.set_prompt("hi");
    req.set_temperature(-0.5f);
    CHECK(c.Generate(req).status.error_code() ==
          grpc::StatusCode::INVALID_ARGUMENT);
    req.set_temperature(std::nanf(""));
    CHECK(c.Generate(req).status.error_code() ==
          grpc::StatusCode::INVALID_ARGUMENT);
  }
  SECTION("no nodes at all") {
    auto r = c.Generate(sid, "hi", 3);
    CHECK(r.status.error_code() == grpc::StatusCode::UNAVAILABLE);
  }
}

TEST_CASE("generate: RESOURCE_EXHAUSTED leaves the session unchanged") {
  Cluster c;
  c.AddNodes({5, 6}, {65});
  std::string sid = c.NewSession();
  // 1 BOS + 2 prompt + 4 new = 7 positions: fits neither device.
  auto r = c.Generate(sid, "hi", 4);
  CHECK(r.status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(r.status.error_message().find("7 tokens") != std::string::npos);
  v1::Session s = c.Get(sid);
  CHECK(s.num_tokens() == 0);
  CHECK(s.turns() == 0);
  CHECK(s.home_node().empty());
  CHECK(s.state() == "idle");
  CHECK(c.karat->reserves().size() == 2);
  CHECK(c.gpu->runs().empty());

  // 1 + 2 + 3 = 6 positions: device 0 (least occupied) refuses, device 1
  // takes it.
  r = c.Generate(sid, "hi", 3);
  REQUIRE(r.status.ok());
  s = c.Get(sid);
  CHECK(s.home_node() == "karat0");
  CHECK(s.home_device() == 1);
  auto reserves = c.karat->reserves();
  REQUIRE(reserves.size() == 4);
  CHECK(reserves[2].device() == 0);
  CHECK(reserves[3].device() == 1);
  CHECK(reserves[3].tokens() == 6);
}

TEST_CASE("generate: history and kv_len across two turns") {
  Cluster c;
  c.AddNodes({1000, 1000}, {'A', 'B', 'C'});
  std::string sid = c.NewSession(42);

  auto r1 = c.Generate(sid, "hi", 3);
  REQUIRE(r1.status.ok());
  REQUIRE(r1.tokens.size() == 3);
  CHECK(r1.tokens[0].text() == "A");
  CHECK(r1.tokens[0].position() == 3);
  CHECK(r1.tokens[2].position() == 5);
  REQUIRE(r1.done.has_value());
  CHECK(r1.done->finish_reason() == "length");
  CHECK(r1.done->generated_tokens() == 3);
  CHECK(r1.done->prompt_tokens() == 2);

  auto runs = c.gpu->runs();
  REQUIRE(runs.size() == 1);
  CHECK(runs[0].pos_start() == 0);
  CHECK(std::vector<int32_t>(runs[0].feed_tokens().begin(),
                             runs[0].feed_tokens().end()) ==
        std::vector<int32_t>{256, 'h', 'i'});
  CHECK(runs[0].seed() == 42);
  CHECK(runs[0].placement().node_name() == "karat0");
  CHECK(runs[0].placement().fabric_address() == "fabric-karat0");
  CHECK(runs[0].placement().device() == 0);
  CHECK(runs[0].session() != 0);

  v1::Session s = c.Get(sid);
  CHECK(std::vector<int32_t>(s.tokens().begin(), s.tokens().end()) ==
        std::vector<int32_t>{256, 'h', 'i', 'A', 'B', 'C'});
  CHECK(s.turns() == 1);

  auto r2 = c.Generate(sid, "x", 2);
  REQUIRE(r2.status.ok());
  runs = c.gpu->runs();
  REQUIRE(runs.size() == 2);
  CHECK(runs[1].pos_start() == 5);  // the last sampled token is re-fed
  CHECK(std::vector<int32_t>(runs[1].feed_tokens().begin(),
                             runs[1].feed_tokens().end()) ==
        std::vector<int32_t>{'C', 'x'});
  CHECK(runs[1].session() == runs[0].session());
  auto reserves = c.karat->reserves();
  REQUIRE(reserves.size() == 2);
  CHECK(reserves[1].tokens() == 6 + 1 + 2);
  CHECK(reserves[1].device() == 0);  // the home is kept
  s = c.Get(sid);
  CHECK(s.num_tokens() == 9);
  CHECK(s.turns() == 2);

  v1::ClusterStatus status;
  grpc::ClientContext ctx;
  REQUIRE(c.client->GetClusterStatus(&ctx, {}, &status).ok());
  CHECK(status.tokens_generated() == 5);
  CHECK(status.sessions() == 1);
  CHECK(status.active_generations() == 0);
}

TEST_CASE("generate: EOS ends the turn") {
  Cluster c;
  c.AddNodes({1000}, {'A', 257});
  std::string sid = c.NewSession();
  auto r = c.Generate(sid, "q", 10);
  REQUIRE(r.status.ok());
  REQUIRE(r.tokens.size() == 2);
  CHECK(r.tokens[1].text().empty());
  CHECK(r.done->finish_reason() == "eos");
}

TEST_CASE("generate: cancelling mid-stream leaves the session usable") {
  Cluster c;
  c.AddNodes({1000}, {'A', 'B', 'C', 'D'});
  c.gpu->hold_after = 2;
  std::string sid = c.NewSession();
  auto r = c.Generate(sid, "hi", 8, /*cancel_after=*/2);
  CHECK(r.status.error_code() == grpc::StatusCode::CANCELLED);
  CHECK(r.tokens.size() == 2);
  c.WaitIdle(sid);
  v1::Session s = c.Get(sid);
  CHECK(std::vector<int32_t>(s.tokens().begin(), s.tokens().end()) ==
        std::vector<int32_t>{256, 'h', 'i', 'A', 'B'});

  c.gpu->hold_after = -1;
  auto r2 = c.Generate(sid, "z", 1);
  REQUIRE(r2.status.ok());
  auto runs = c.gpu->runs();
  REQUIRE(runs.size() == 2);
  CHECK(runs[1].pos_start() == 4);
  CHECK(std::vector<int32_t>(runs[1].feed_tokens().begin(),
                             runs[1].feed_tokens().end()) ==
        std::vector<int32_t>{'B', 'z'});
}

TEST_CASE("generate: a second generate on a busy session is refused") {
  Cluster c;
  c.AddNodes({1000}, {'A'});
  c.gpu->hold_after = 1;
  std::string sid = c.NewSession();
  grpc::ClientContext ctx;
  v1::GenerateRequest req;
  req.set_session_id(sid);
  req.set_prompt("hi");
  req.set_max_new_tokens(4);
  auto reader = c.client->Generate(&ctx, req);
  v1::GenerateResponse resp;
  REQUIRE(reader->Read(&resp));  // the first token: the turn is running
  CHECK(c.Get(sid).state() == "generating");

  auto r = c.Generate(sid, "again", 2);
  CHECK(r.status.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(r.status.error_message().find(sid) != std::string::npos);

  v1::CloseSessionRequest close;
  close.set_session_id(sid);
  v1::CloseSessionResponse closed;
  {
    grpc::ClientContext cctx;
    CHECK(c.client->CloseSession(&cctx, close, &closed).error_code() ==
          grpc::StatusCode::FAILED_PRECONDITION);
  }
  ctx.TryCancel();
  while (reader->Read(&resp)) {
  }
  reader->Finish();
  c.WaitIdle(sid);
}

TEST_CASE("generate: a GPU failure mid-turn is UNAVAILABLE, session usable") {
  Cluster c;
  c.AddNodes({1000}, {'A', 'B', 'C'});
  c.gpu->fail_after = 2;
  std::string sid = c.NewSession();
  auto r = c.Generate(sid, "hi", 5);
  CHECK(r.status.error_code() == grpc::StatusCode::UNAVAILABLE);
  CHECK(r.status.error_message().find("gpu0") != std::string::npos);
  CHECK(r.tokens.size() == 2);
  v1::Session s = c.Get(sid);
  CHECK(s.num_tokens() == 5);
  CHECK(s.state() == "idle");

  c.gpu->fail_after = -1;
  auto r2 = c.Generate(sid, "k", 1);
  REQUIRE(r2.status.ok());
  auto runs = c.gpu->runs();
  CHECK(runs[1].pos_start() == 4);
}

TEST_CASE("close: frees the home and later calls are NOT_FOUND") {
  Cluster c;
  c.AddNodes({1000}, {'A'});
  std::string sid = c.NewSession();
  REQUIRE(c.Generate(sid, "hi", 1).status.ok());
  uint64_t key = c.gpu->runs()[0].session();
  v1::CloseSessionRequest close;
  close.set_session_id(sid);
  v1::CloseSessionResponse closed;
  {
    grpc::ClientContext ctx;
    REQUIRE(c.client->CloseSession(&ctx, close, &closed).ok());
  }
  CHECK(c.karat->freed() == std::vector<uint64_t>{key});
  {
    grpc::ClientContext ctx;
    CHECK(c.client->CloseSession(&ctx, close, &closed).error_code() ==
          grpc::StatusCode::NOT_FOUND);
  }
  CHECK(c.Generate(sid, "hi", 1).status.error_code() ==
        grpc::StatusCode::NOT_FOUND);
  v1::GetSessionRequest get;
  get.set_session_id(sid);
  v1::Session s;
  grpc::ClientContext ctx;
  CHECK(c.client->GetSession(&ctx, get, &s).error_code() ==
        grpc::StatusCode::NOT_FOUND);
}

}  // namespace
}  // namespace karat::coordinator
