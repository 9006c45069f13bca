// NodeRegistrar against an in-process fake coordinator: registration waits
// for a coordinator that comes up late, heartbeats follow, and a coordinator
// that forgets the node gets a new registration.
#include "common/membership.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "cluster.grpc.pb.h"

namespace karat {
namespace {

class FakeCoordinator final : public cluster::Coordinator::Service {
 public:
  grpc::Status RegisterNode(grpc::ServerContext*,
                            const cluster::RegisterNodeRequest* request,
                            cluster::RegisterNodeResponse* response) override {
    const int n = ++registrations;
    response->set_node_id(uint32_t(100 + n));
    // A secret per registration, so that the test sees the latest one.
    response->set_data_plane_secret("secret-" + std::to_string(n));
    response->set_heartbeat_interval_ms(20);
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*,
                         const cluster::HeartbeatRequest* request,
                         cluster::HeartbeatResponse* response) override {
    ++heartbeats;
    last_stat = request->stats().count("x") ? request->stats().at("x") : -1;
    // Forget the node once, after its third heartbeat.
    response->set_known(!(heartbeats == 3));
    return grpc::Status::OK;
  }
  std::atomic<int> registrations{0};
  std::atomic<int> heartbeats{0};
  std::atomic<double> last_stat{0};
};

std::unique_ptr<grpc::Server> Serve(FakeCoordinator* service,
                                    const std::string& address, int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), port);
  builder.RegisterService(service);
  return builder.BuildAndStart();
}

bool WaitUntil(const std::function<bool()>& done) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

TEST_CASE("NodeRegistrar registers, heartbeats and re-registers",
          "[membership]") {
  // Find a free port, then leave it closed while the registrar starts.
  FakeCoordinator coordinator;
  int port = 0;
  Serve(&coordinator, "127.0.0.1:0", &port)->Shutdown();
  REQUIRE(port != 0);
  const std::string address = "127.0.0.1:" + std::to_string(port);

  std::atomic<int> callbacks{0};
  std::atomic<uint32_t> last_id{0};
  absl::Mutex secret_mu;
  std::string last_secret;
  RegistrarOptions options;
  options.coordinator = address;
  options.make_request = [] {
    cluster::RegisterNodeRequest r;
    r.set_name("n");
    r.set_role("karat");
    return r;
  };
  options.fill_heartbeat = [](cluster::HeartbeatRequest* r) {
    (*r->mutable_stats())["x"] = 5;
  };
  options.on_registered = [&](const cluster::RegisterNodeResponse& r) {
    ++callbacks;
    last_id = r.node_id();
    absl::MutexLock lock(&secret_mu);
    last_secret = r.data_plane_secret();
  };
  options.interval = absl::Milliseconds(20);
  options.max_backoff = absl::Milliseconds(400);
  auto registrar = NodeRegistrar::Start(options);
  REQUIRE(registrar.ok());
  CHECK(!(*registrar)->WaitRegistered(absl::Milliseconds(300)));
  CHECK(!(*registrar)->node_id().has_value());

  int port2 = 0;
  auto server = Serve(&coordinator, address, &port2);
  REQUIRE(port2 == port);
  CHECK((*registrar)->WaitRegistered(absl::Seconds(10)));
  CHECK(WaitUntil([&] { return coordinator.heartbeats >= 5; }));
  CHECK(coordinator.registrations == 2);  // forgotten once
  CHECK(callbacks == 2);
  CHECK(last_id == 102);
  {
    // The answer of the latest registration reaches the node.
    absl::MutexLock lock(&secret_mu);
    CHECK(last_secret == "secret-2");
  }
  CHECK((*registrar)->node_id() == std::optional<uint32_t>(102));
  CHECK(coordinator.last_stat == 5);

  (*registrar)->Stop();
  const int beats = coordinator.heartbeats;
  absl::SleepFor(absl::Milliseconds(100));
  CHECK(coordinator.heartbeats == beats);
  server->Shutdown();
}

TEST_CASE("NodeRegistrar refuses incomplete options", "[membership]") {
  RegistrarOptions options;
  CHECK(NodeRegistrar::Start(options).status().code() ==
        absl::StatusCode::kInvalidArgument);
  options.coordinator = "127.0.0.1:1";
  CHECK(NodeRegistrar::Start(options).status().code() ==
        absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace karat
