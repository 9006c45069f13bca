// Both node daemons in one process over real gRPC and libfabric (tcp on
// loopback), registered with an in-process fake coordinator: a turn through
// GpuNode.RunTurn must stream the tokens that hand-run steps produce.
#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "cluster.grpc.pb.h"
#include "common/model_config.h"
#include "common/model_runner.h"
#include "common/weights.h"
#include "gpu_node/gpu_node.h"
#include "karat_node/karat_node.h"

namespace karat {
namespace {

class FakeCoordinator final : public cluster::Coordinator::Service {
 public:
  grpc::Status RegisterNode(grpc::ServerContext*,
                            const cluster::RegisterNodeRequest* request,
                            cluster::RegisterNodeResponse* response) override {
    absl::MutexLock lock(&mu_);
    nodes_.push_back(*request);
    response->set_node_id(uint32_t(nodes_.size() + 6));
    response->set_heartbeat_interval_ms(100);
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*,
                         const cluster::HeartbeatRequest* request,
                         cluster::HeartbeatResponse* response) override {
    absl::MutexLock lock(&mu_);
    ++heartbeats_;
    response->set_known(true);
    return grpc::Status::OK;
  }
  // The registration of the node with `role`, waiting for it.
  cluster::RegisterNodeRequest Await(const std::string& role,
                                     uint32_t* node_id) {
    for (int i = 0; i < 200; ++i) {
      {
        absl::MutexLock lock(&mu_);
        for (size_t k = 0; k < nodes_.size(); ++k) {
          if (nodes_[k].role() == role) {
            *node_id = uint32_t(k + 7);
            return nodes_[k];
          }
        }
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
    FAIL("no " << role << " node registered");
    return {};
  }
  int heartbeats() {
    absl::MutexLock lock(&mu_);
    return heartbeats_;
  }

 private:
  absl::Mutex mu_;
  std::vector<cluster::RegisterNodeRequest> nodes_ ABSL_GUARDED_BY(mu_);
  int heartbeats_ ABSL_GUARDED_BY(mu_) = 0;
};

TEST_CASE("node daemons serve a turn over gRPC and libfabric",
          "[gpu_node][loopback]") {
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("karat-node-daemons-" + std::to_string(getpid())))
                              .string();
  ModelFiles files;
  files.config = *PresetConfig("dsa-small");
  files.tensors = GenerateWeights(files.config, 1);
  REQUIRE(WriteModel(dir + "/model", files.config, files.tensors, DType::kF32)
              .ok());

  // What the turn must produce.
  const uint64_t session = 77;
  std::vector<int32_t> feed = {256};
  for (int i = 0; i < 30; ++i) feed.push_back('a' + i % 26);
  std::vector<int32_t> expected;
  {
    auto runner = ModelRunner::Create(files);
    REQUIRE(runner.ok());
    LocalAttentionBackend local(files.config, 16, size_t(64) << 20);
    REQUIRE(local.Init().ok());
    REQUIRE(local.Reserve(session, 128).ok());
    auto logits = (*runner)->Step({{session, 0, feed}}, &local);
    int pos = int(feed.size());
    for (;;) {
      REQUIRE(logits.ok());
      const int32_t t = SampleToken((*logits)[0], 0.5f, 9, pos);
      expected.push_back(t);
      if (t == 257 || expected.size() == 6) break;
      logits = (*runner)->Step({{session, pos, {t}}}, &local);
      ++pos;
    }
  }

  FakeCoordinator coordinator;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  builder.RegisterService(&coordinator);
  auto coordinator_server = builder.BuildAndStart();
  REQUIRE(port != 0);
  const std::string coordinator_address = "127.0.0.1:" + std::to_string(port);

  KaratNodeOptions ko;
  ko.coordinator = coordinator_address;
  ko.name = "karat-a";
  ko.model_dir = dir + "/model";
  ko.provider = "tcp";
  ko.fabric_node = "127.0.0.1";
  ko.devices = 2;
  ko.device_capacity_bytes = size_t(4) << 20;
  ko.tokens_per_page = 16;
  ko.port_file = dir + "/karat.addr";
  // A negative poll time or inline bound is refused; 0 (never poll after
  // traffic, only the sleeps; every frame on a device worker) still serves
  // the turn below. The cluster tests run the defaults.
  for (int which = 0; which < 2; ++which) {
    KaratNodeOptions bad = ko;
    (which == 0 ? bad.spin_us : bad.inline_max_context) = -1;
    CHECK(KaratNodeDaemon::Start(bad).status().code() ==
          absl::StatusCode::kInvalidArgument);
  }
  ko.spin_us = 0;
  ko.inline_max_context = 0;
  auto karat = KaratNodeDaemon::Start(ko);
  if (!karat.ok() && absl::IsUnavailable(karat.status())) {
    WARN("skipped: " << karat.status());
    return;
  }
  REQUIRE(karat.ok());

  GpuNodeOptions go;
  go.coordinator = coordinator_address;
  go.name = "gpu-a";
  go.model_dir = dir + "/model";
  go.provider = "tcp";
  go.fabric_node = "127.0.0.1";
  go.max_step_tokens = 8;
  go.threads = 1;
  go.attention_timeout = absl::Seconds(10);
  {
    GpuNodeOptions bad = go;
    bad.spin_us = -1;
    CHECK(GpuNodeDaemon::Start(bad).status().code() ==
          absl::StatusCode::kInvalidArgument);
  }
  auto gpu = GpuNodeDaemon::Start(go);
  REQUIRE(gpu.ok());

  {
    std::ifstream in(dir + "/karat.addr");
    std::string line;
    std::getline(in, line);
    CHECK(line == (*karat)->grpc_address());
  }
  uint32_t karat_id = 0, gpu_id = 0;
  const cluster::RegisterNodeRequest karat_reg =
      coordinator.Await("karat", &karat_id);
  const cluster::RegisterNodeRequest gpu_reg =
      coordinator.Await("gpu", &gpu_id);
  CHECK(karat_reg.name() == "karat-a");
  CHECK(karat_reg.devices_size() == 2);
  CHECK(karat_reg.grpc_address() == (*karat)->grpc_address());
  CHECK(!karat_reg.fabric_address().empty());
  CHECK(gpu_reg.model_fingerprint() == ModelFingerprint(files));

  auto karat_stub = cluster::KaratNode::NewStub(grpc::CreateChannel(
      (*karat)->grpc_address(), grpc::InsecureChannelCredentials()));
  auto gpu_stub = cluster::GpuNode::NewStub(grpc::CreateChannel(
      (*gpu)->grpc_address(), grpc::InsecureChannelCredentials()));

  {
    grpc::ClientContext ctx;
    cluster::ReserveRequest r;
    r.set_session(session);
    r.set_device(1);
    r.set_tokens(64);
    cluster::ReserveResponse resp;
    REQUIRE(karat_stub->Reserve(&ctx, r, &resp).ok());
    CHECK(resp.used_bytes() > 0);
    // The session is the device's only one.
    CHECK(resp.session_bytes() == resp.used_bytes());
  }
  {
    grpc::ClientContext ctx;
    cluster::ReserveRequest r;
    r.set_session(session + 1);
    r.set_device(0);
    r.set_tokens(1 << 20);
    cluster::ReserveResponse resp;
    // More than the node holds even empty.
    CHECK(karat_stub->Reserve(&ctx, r, &resp).error_code() ==
          grpc::StatusCode::OUT_OF_RANGE);
  }

  cluster::RunTurnRequest turn;
  turn.set_session(session);
  turn.set_seed(9);
  turn.set_temperature(0.5f);
  for (int32_t t : feed) turn.add_feed_tokens(t);
  turn.set_max_new_tokens(6);
  turn.mutable_placement()->set_node_id(karat_id);
  turn.mutable_placement()->set_node_name(karat_reg.name());
  turn.mutable_placement()->set_fabric_address(karat_reg.fabric_address());
  turn.mutable_placement()->set_device(1);
  {
    grpc::ClientContext ctx;
    auto reader = gpu_stub->RunTurn(&ctx, turn);
    cluster::RunTurnEvent e;
    std::vector<int32_t> got;
    std::vector<int32_t> fed;  // progress reports of the chunked prefill
    bool last = false;
    while (reader->Read(&e)) {
      if (e.progress()) {
        CHECK(got.empty());
        CHECK(e.prefill_total() == int32_t(feed.size()));
        fed.push_back(e.prefill_fed());
        continue;
      }
      got.push_back(e.token_id());
      CHECK(e.position() == int64_t(feed.size() + got.size() - 1));
      last = e.last();
    }
    grpc::Status status = reader->Finish();
    INFO(status.error_message());
    CHECK(status.ok());
    CHECK(last);
    CHECK(got == expected);
    // 31 feed tokens at most 8 a step: 8, 16, 24 stored before the last.
    CHECK(fed == std::vector<int32_t>{8, 16, 24});
  }
  {
    cluster::RunTurnRequest bad = turn;
    bad.set_max_new_tokens(0);
    grpc::ClientContext ctx;
    auto reader = gpu_stub->RunTurn(&ctx, bad);
    cluster::RunTurnEvent e;
    while (reader->Read(&e)) {
    }
    CHECK(reader->Finish().error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    grpc::ClientContext ctx;
    cluster::StatsResponse stats;
    REQUIRE(gpu_stub->GetStats(&ctx, cluster::StatsRequest(), &stats).ok());
    CHECK(stats.stats().at("tokens_prefilled") == double(feed.size()));
    CHECK(stats.stats().at("data_bytes_sent") > 0);
  }
  {
    grpc::ClientContext ctx;
    cluster::StatsResponse stats;
    REQUIRE(karat_stub->GetStats(&ctx, cluster::StatsRequest(), &stats).ok());
    CHECK(stats.stats().at("kv_bytes_ingested") > 0);
    CHECK(stats.stats().at("errors") == 0);
    REQUIRE(stats.devices_size() == 2);
    CHECK(stats.devices(1).sessions() == 1);
  }
  {
    grpc::ClientContext ctx;
    cluster::FreeSessionRequest r;
    r.set_session(session);
    cluster::FreeSessionResponse resp;
    CHECK(karat_stub->FreeSession(&ctx, r, &resp).ok());
  }
  const absl::Time t0 = absl::Now();
  while (coordinator.heartbeats() < 2 && absl::Now() - t0 < absl::Seconds(5)) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  CHECK(coordinator.heartbeats() >= 2);

  (*gpu)->Shutdown();
  (*karat)->Shutdown();
  coordinator_server->Shutdown();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace karat
