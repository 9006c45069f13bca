#include "coordinator/cluster_config.h"

#include <catch2/catch.hpp>
#include <fstream>

namespace karat::coordinator {
namespace {

TEST_CASE("config: a valid one-box config parses") {
  auto c = ParseClusterConfig(R"(
    model_dir: "run/models/dsa-tiny"
    provider: "shm"
    coordinator { listen: "127.0.0.1:0" max_new_tokens_limit: 4096 }
    gpu_nodes { name: "gpu0" max_step_tokens: 256 max_batch: 64 threads: 1 }
    karat_nodes {
      name: "karat0" tokens_per_page: 64
      devices { capacity_bytes: 1073741824 cores: 1 }
      devices { capacity_bytes: 1073741824 cores: 1 }
    })",
                              "local.textproto");
  REQUIRE(c.ok());
  CHECK(c->karat_nodes(0).devices_size() == 2);
  CHECK(c->coordinator().max_new_tokens_limit() == 4096);
}

TEST_CASE("config: syntax errors name the file, line and column") {
  auto c = ParseClusterConfig("provider: \"shm\"\ngpu_nodes { nme: \"x\" }\n",
                              "bad.textproto");
  REQUIRE_FALSE(c.ok());
  CHECK(c.status().code() == absl::StatusCode::kInvalidArgument);
  std::string m(c.status().message());
  CHECK(m.rfind("bad.textproto:2:", 0) == 0);
  CHECK(m.find("nme") != std::string::npos);
}

TEST_CASE("config: invalid values name the field") {
  auto c = ParseClusterConfig(
      "karat_nodes { name: \"k\" devices { capacity_bytes: 0 } }", "x.txt");
  REQUIRE_FALSE(c.ok());
  CHECK(std::string(c.status().message()) ==
        "x.txt: karat_nodes[0].devices[0].capacity_bytes: must be > 0");
  auto dup = ParseClusterConfig(
      "gpu_nodes { name: \"a\" } gpu_nodes { name: \"a\" }", "y");
  REQUIRE_FALSE(dup.ok());
  CHECK(std::string(dup.status().message()).find("duplicate") !=
        std::string::npos);
}

TEST_CASE("config: loading a file") {
  std::string path = "coordinator_config_test.textproto";
  {
    std::ofstream out(path);
    out << "provider: \"shm\"\ncoordinator {\n  listen: 5\n}\n";
  }
  auto c = LoadClusterConfig(path);
  REQUIRE_FALSE(c.ok());
  CHECK(std::string(c.status().message()).rfind(path + ":3:", 0) == 0);
  auto missing = LoadClusterConfig("/nonexistent/cluster.textproto");
  CHECK(missing.status().code() == absl::StatusCode::kNotFound);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace karat::coordinator
