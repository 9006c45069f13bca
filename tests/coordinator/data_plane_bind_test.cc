// Where the daemons' data planes bind (docs/security.md "Data plane"): the
// policy from the cluster file (coordinator/data_plane_bind.h), the
// daemons' own default (common/transport.h DataPlaneBindNode), and the
// --fabric-node that `karatctl plan` gives each daemon.
#include "coordinator/data_plane_bind.h"

#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/transport.h"
#include "tools/karatctl/plan.h"

namespace karat::coordinator {
namespace {

cluster::ClusterConfig WithProvider(const std::string& provider) {
  cluster::ClusterConfig c;
  c.set_provider(provider);
  return c;
}

TEST_CASE(
    "DataPlaneBindAddress: loopback by default, the listen host, or "
    "the config's",
    "[coordinator][security]") {
  const cluster::ClusterConfig tcp = WithProvider("tcp");
  auto bind = [&](const cluster::ClusterConfig& c, const std::string& listen,
                  const std::string& fabric_node = "") {
    absl::StatusOr<std::string> b =
        DataPlaneBindAddress(c, listen, fabric_node, "gpu_nodes[0] (gpu0)");
    REQUIRE(b.ok());
    return *b;
  };
  // Every daemon on this host: loopback.
  CHECK(bind(tcp, "") == "127.0.0.1");
  CHECK(bind(tcp, "127.0.0.1:0") == "127.0.0.1");
  CHECK(bind(tcp, "localhost:7000") == "127.0.0.1");
  CHECK(bind(tcp, "[::1]:7000") == "::1");
  // A daemon on another host binds the address it serves gRPC on.
  CHECK(bind(tcp, "10.0.0.5:7000") == "10.0.0.5");
  // The config's choice wins.
  CHECK(bind(tcp, "10.0.0.5:7000", "192.168.1.2") == "192.168.1.2");
  // A wildcard listen address names no interface.
  for (const char* wildcard : {"0.0.0.0:7000", "[::]:7000"}) {
    absl::StatusOr<std::string> b =
        DataPlaneBindAddress(tcp, wildcard, "", "gpu_nodes[0] (gpu0)");
    CHECK(b.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(b.status().message()),
               Catch::Contains("gpu_nodes[0] (gpu0)") &&
                   Catch::Contains("fabric_node"));
  }
  CHECK(bind(tcp, "0.0.0.0:7000", "10.0.0.5") == "10.0.0.5");
  // shm binds no interface; other providers keep their default.
  CHECK(bind(WithProvider("shm"), "10.0.0.5:7000", "10.0.0.5").empty());
  CHECK(bind(WithProvider(""), "0.0.0.0:7000").empty());
  CHECK(bind(WithProvider("verbs"), "10.0.0.5:7000").empty());
  CHECK(bind(WithProvider("verbs"), "", "10.0.0.9") == "10.0.0.9");
}

TEST_CASE("a daemon started without --fabric-node keeps tcp on loopback",
          "[coordinator][security]") {
  CHECK(DataPlaneBindNode("tcp", "") == "127.0.0.1");
  CHECK(DataPlaneBindNode("tcp", "10.0.0.5") == "10.0.0.5");
  CHECK(DataPlaneBindNode("shm", "").empty());
  CHECK(DataPlaneBindNode("verbs", "").empty());
}

TEST_CASE("karatctl plan gives every tcp daemon its --fabric-node",
          "[coordinator][security]") {
  const std::string path =
      (std::filesystem::temp_directory_path() /
       ("karat-plan-" + std::to_string(getpid()) + ".textproto"))
          .string();
  auto write = [&](const std::string& text) {
    std::ofstream out(path, std::ios::trunc);
    out << text;
  };
  const std::string nodes = R"(
    gpu_nodes { name: "gpu0" listen: "10.0.0.1:7001" }
    gpu_nodes { name: "gpu1" listen: "10.0.0.2:7001" fabric_node: "10.1.0.2" }
    karat_nodes { name: "karat0" devices { capacity_bytes: 1048576 } }
  )";
  write("provider: \"tcp\"\n" + nodes);
  absl::StatusOr<std::string> plan = PlanText(path);
  REQUIRE(plan.ok());
  CHECK_THAT(*plan, Catch::Contains("gpu gpu0 ") &&
                        Catch::Contains("--listen 10.0.0.1:7001 --fabric-node "
                                        "10.0.0.1\n"));
  CHECK_THAT(*plan, Catch::Contains("--fabric-node 10.1.0.2\n"));
  CHECK_THAT(*plan, Catch::Contains("--listen 127.0.0.1:0 --fabric-node "
                                    "127.0.0.1\n"));
  // shm: no --fabric-node at all.
  write("provider: \"shm\"\n" + nodes);
  plan = PlanText(path);
  REQUIRE(plan.ok());
  CHECK_THAT(*plan, !Catch::Contains("--fabric-node"));
  // A wildcard listen address without fabric_node is refused, naming both.
  write(R"(provider: "tcp"
    gpu_nodes { name: "gpu0" listen: "0.0.0.0:7001" }
    karat_nodes { name: "karat0" devices { capacity_bytes: 1048576 } })");
  plan = PlanText(path);
  CHECK(plan.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(plan.status().message()),
             Catch::Contains(path) && Catch::Contains("gpu0") &&
                 Catch::Contains("fabric_node"));
  std::remove(path.c_str());
}

}  // namespace
}  // namespace karat::coordinator
