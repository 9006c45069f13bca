// The KARAT-node daemon over gRPC (no coordinator): KaratNode.Reserve spills
// a session past its full home device to the node's other device, FreeSession
// gives every page back, and GetStats carries the per-device metrics
// ("device.<i>.<name>") that `karatctl metrics` prints.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <memory>
#include <string>

#include "cluster.grpc.pb.h"
#include "common/kv_store.h"
#include "common/model_config.h"
#include "common/weights.h"
#include "karat_node/karat_node.h"

namespace karat {
namespace {

struct Node {
  std::unique_ptr<KaratNodeDaemon> daemon;
  std::unique_ptr<cluster::KaratNode::Stub> stub;
};

// Starts a node of two devices of `pages` pages each; a null daemon when
// this machine has no usable loopback provider.
Node StartNode(const std::string& model_dir, size_t page_bytes, int pages,
               bool spill) {
  KaratNodeOptions o;
  o.name = "karat-stats";
  o.model_dir = model_dir;
  o.provider = "tcp";
  o.fabric_node = "127.0.0.1";
  o.devices = 2;
  o.device_capacity_bytes = page_bytes * pages;
  o.tokens_per_page = 16;
  o.spill = spill;
  Node node;
  auto daemon = KaratNodeDaemon::Start(o);
  if (!daemon.ok() && absl::IsUnavailable(daemon.status())) {
    WARN("skipped: " << daemon.status());
    return node;
  }
  REQUIRE(daemon.ok());
  node.daemon = std::move(daemon).value();
  node.stub = cluster::KaratNode::NewStub(grpc::CreateChannel(
      node.daemon->grpc_address(), grpc::InsecureChannelCredentials()));
  return node;
}

grpc::Status Reserve(Node& node, uint64_t session, int device, int tokens) {
  grpc::ClientContext ctx;
  cluster::ReserveRequest r;
  r.set_session(session);
  r.set_device(device);
  r.set_tokens(tokens);
  cluster::ReserveResponse resp;
  return node.stub->Reserve(&ctx, r, &resp);
}

cluster::StatsResponse Stats(Node& node) {
  grpc::ClientContext ctx;
  cluster::StatsResponse resp;
  REQUIRE(node.stub->GetStats(&ctx, cluster::StatsRequest(), &resp).ok());
  return resp;
}

TEST_CASE(
    "KARAT node: Reserve spills to the other device; GetStats shows "
    "the device metrics",
    "[karat_node][loopback]") {
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("karat-node-stats-" + std::to_string(getpid())))
                              .string();
  const ModelConfig config = *PresetConfig("dsa-small");
  REQUIRE(WriteModel(dir + "/model", config, GenerateWeights(config, 1),
                     DType::kF32)
              .ok());
  const KvLayout layout = MakeKvLayout(config, 16);
  const size_t page = layout.page_bytes;
  const int layers = config.num_hidden_layers;
  // Pages per layer: KV pages of 16 tokens and index pages of 64 keys.
  REQUIRE(layout.PagesFor(16) == 2);
  REQUIRE(layout.PagesFor(32) == 3);
  REQUIRE(layout.PagesFor(64) == 5);
  REQUIRE(layout.PagesFor(96) == 8);

  SECTION("spill on") {
    // Each device holds 64 tokens (5 pages per layer).
    Node node = StartNode(dir + "/model", page, 5 * layers, true);
    if (node.daemon == nullptr) return;
    REQUIRE(Reserve(node, 1, 0, 64).ok());
    cluster::StatsResponse st = Stats(node);
    CHECK(st.stats().at("device.0.used_bytes") == double(page * layers * 5));
    CHECK(st.stats().at("device.1.used_bytes") == 0);
    CHECK(st.stats().at("device.0.spilled_bytes") == 0);

    // Three more pages per layer go to device 1.
    REQUIRE(Reserve(node, 1, 0, 96).ok());
    st = Stats(node);
    CHECK(st.stats().at("device.0.spilled_bytes") == double(page * layers * 3));
    CHECK(st.stats().at("device.1.hosted_bytes") == double(page * layers * 3));
    CHECK(st.stats().at("device.1.used_bytes") == double(page * layers * 3));
    REQUIRE(st.devices_size() == 2);
    CHECK(st.devices(1).used_bytes() == int64_t(page * layers * 3));
    CHECK(st.devices(0).sessions() == 1);
    CHECK(st.devices(1).sessions() == 0);
    for (const char* name : {"busy_seconds", "frames", "frame_errors",
                             "kernel_bytes", "cross_device_bytes",
                             "capacity_bytes", "metadata_bytes", "sessions"}) {
      INFO(name);
      CHECK(st.stats().count(std::string("device.0.") + name) == 1);
      CHECK(st.stats().count(std::string("device.1.") + name) == 1);
    }

    // The node has 2 pages per layer left: a new session of 3 per layer on
    // device 1 is refused and changes nothing; one of 2 fits.
    grpc::Status refused = Reserve(node, 2, 1, 32);
    CHECK(refused.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
    CHECK(Stats(node).stats().at("device.1.used_bytes") ==
          double(page * layers * 3));
    REQUIRE(Reserve(node, 2, 1, 16).ok());

    for (uint64_t s : {1, 2}) {
      grpc::ClientContext ctx;
      cluster::FreeSessionRequest r;
      r.set_session(s);
      cluster::FreeSessionResponse resp;
      REQUIRE(node.stub->FreeSession(&ctx, r, &resp).ok());
    }
    st = Stats(node);
    CHECK(st.stats().at("device.0.used_bytes") == 0);
    CHECK(st.stats().at("device.1.used_bytes") == 0);
    CHECK(st.stats().at("device.0.spilled_bytes") == 0);
    node.daemon->Shutdown();
  }

  SECTION("spill off") {
    Node node = StartNode(dir + "/model", page, 5 * layers, false);
    if (node.daemon == nullptr) return;
    REQUIRE(Reserve(node, 1, 0, 64).ok());
    // 96 tokens would not fit the device even empty.
    CHECK(Reserve(node, 1, 0, 96).error_code() ==
          grpc::StatusCode::OUT_OF_RANGE);
    CHECK(Stats(node).stats().at("device.1.used_bytes") == 0);
    node.daemon->Shutdown();
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace karat
