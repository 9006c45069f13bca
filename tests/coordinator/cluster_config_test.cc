#include "coordinator/cluster_config.h"

#include <catch2/catch.hpp>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/model_config.h"
#include "common/weights.h"

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

TEST_CASE("config: the security block is checked by field") {
  auto err = [](const std::string& text) {
    auto c = ParseClusterConfig(text, "s");
    REQUIRE_FALSE(c.ok());
    return std::string(c.status().message());
  };
  CHECK(err("gpu_nodes { name: \"coordinator\" }") ==
        "s: gpu_nodes[0].name: \"coordinator\" is the coordinator's name");
  CHECK(err("security { plaintext: true ca_cert: \"ca.crt\" }") ==
        "s: security.plaintext: contradicts the TLS and token files the "
        "block names");
  CHECK(err("security { admin_listen: \"7443\" }") ==
        "s: security.admin_listen: expected HOST:PORT");
  CHECK(err("security { idle_kv_evict_s: -1 }") ==
        "s: security.idle_kv_evict_s: must be >= 0 (0: never)");
  CHECK(err("security { default_limits { max_sessions: -2 } }") ==
        "s: security.default_limits: every limit must be >= 0");
  auto ok = ParseClusterConfig(
      "security { ca_cert: \"tls/ca.crt\" cert_dir: \"tls\" "
      "admin_listen: \"127.0.0.1:7443\" default_limits { max_sessions: 8 } }",
      "s");
  REQUIRE(ok.ok());
  CHECK(ok->security().default_limits().max_sessions() == 8);
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

// A config that parses with `extra` appended to one GPU node and one KARAT
// node; returns the error message ("" when valid).
std::string Refusal(const std::string& extra) {
  auto c = ParseClusterConfig(
      "gpu_nodes { name: \"g0\" }\n"
      "karat_nodes { name: \"k0\" devices { capacity_bytes: 1000 } }\n" +
          extra,
      "c");
  return c.ok() ? "" : std::string(c.status().message());
}

TEST_CASE("config: scale-out settings are checked by field") {
  CHECK(Refusal("") == "");
  CHECK(
      Refusal("mode: \"gpu_only\" gpu_nodes { name: \"g1\" hbm_bytes: 5 }") ==
      "c: gpu_nodes[0].hbm_bytes: must be > 0 in gpu_only mode (the rank's KV "
      "lives in it)");
  CHECK(Refusal("mode: \"tpu\"").find("c: mode: must be") == 0);
  CHECK(Refusal("scheduling { micro_batches: 3 }")
            .find("c: scheduling.micro_batches: must be 1 or 2") == 0);
  CHECK(Refusal("scheduling { micro_batches: 1 schedule: \"scms\" "
                "balance: \"count\" tbt_slo_ms: 50 }") == "");
  CHECK(Refusal("scheduling { schedule: \"fifo\" }")
            .find("c: scheduling.schedule: must be") == 0);
  CHECK(Refusal("scheduling { balance: \"random\" }")
            .find("c: scheduling.balance: must be") == 0);
  CHECK(Refusal("scheduling { tbt_slo_ms: -1 }")
            .find("c: scheduling.tbt_slo_ms") == 0);
  CHECK(Refusal("scheduling { queue_timeout_ms: -1 }")
            .find("c: scheduling.queue_timeout_ms") == 0);
  CHECK(Refusal("scheduling { step_cost { fixed_ms: 3 per_request_ms: 1 } "
                "step_cost_mode: \"fixed\" }") == "");
  CHECK(Refusal("scheduling { step_cost { per_request_ms: -1 } }") ==
        "c: scheduling.step_cost.per_request_ms: must be >= 0 and finite");
  CHECK(Refusal("scheduling { step_cost { per_context_token_ms: inf } }") ==
        "c: scheduling.step_cost.per_context_token_ms: must be >= 0 and "
        "finite");
  CHECK(Refusal("scheduling { step_cost_mode: \"guess\" }") ==
        "c: scheduling.step_cost_mode: must be \"learned\" or \"fixed\", "
        "got \"guess\"");
  CHECK(Refusal("gpu_nodes { name: \"g1\" hbm_bytes: -1 }") ==
        "c: gpu_nodes[1].hbm_bytes: must be >= 0");
  CHECK(Refusal("gpu_nodes { name: \"g1\" hbm_bandwidth_gbps: 900 "
                "tflops: 0.5 }") == "");
  CHECK(Refusal("gpu_nodes { name: \"g1\" hbm_bandwidth_gbps: -1 }") ==
        "c: gpu_nodes[1].hbm_bandwidth_gbps: must be >= 0 and finite");
  CHECK(Refusal("gpu_nodes { name: \"g1\" tflops: inf }") ==
        "c: gpu_nodes[1].tflops: must be >= 0 and finite");
  CHECK(Refusal("gpu_nodes { name: \"g1\" tflops: nan }") ==
        "c: gpu_nodes[1].tflops: must be >= 0 and finite");
  CHECK(Refusal("karat_nodes { name: \"k1\" devices { capacity_bytes: 1 "
                "bandwidth_gbps: 2 tflops: 0.1 } }") == "");
  CHECK(Refusal("karat_nodes { name: \"k1\" devices { capacity_bytes: 1 "
                "bandwidth_gbps: -2 } }") ==
        "c: karat_nodes[1].devices[0].bandwidth_gbps: must be >= 0 and finite");
  CHECK(Refusal("karat_nodes { name: \"k1\" devices { capacity_bytes: 1 "
                "tflops: inf } }") ==
        "c: karat_nodes[1].devices[0].tflops: must be >= 0 and finite");
  CHECK(Refusal("links { source: \"g0\" destination: \"*\" }\n"
                "links { source: \"g0\" destination: \"k0\" jitter_us: -2 }") ==
        "c: links[1].jitter_us: must be >= 0");
  CHECK(Refusal("links { source: \"\" destination: \"k0\" }") ==
        "c: links[0].source: must be a node name or *");
}

TEST_CASE("config: the request size limit and idle KV eviction") {
  CHECK(Refusal("coordinator { max_message_bytes: 8388608 }\n"
                "security { idle_kv_evict_s: 600 }") == "");
  CHECK(Refusal("coordinator { max_message_bytes: -1 }") ==
        "c: coordinator.max_message_bytes: must be >= 0 (0: 4 MiB)");
  CHECK(Refusal("security { idle_kv_evict_s: -5 }") ==
        "c: security.idle_kv_evict_s: must be >= 0 (0: never)");
}

TEST_CASE("config: a GPU node with every link to the KARAT nodes down") {
  CHECK(
      Refusal("links { source: \"g0\" destination: \"k0\" down: true }") ==
      "c: gpu_nodes[0]: GPU node \"g0\" has no link to any KARAT node that is "
      "not down (see links)");
  CHECK(Refusal("links { source: \"*\" destination: \"g0\" down: true }") !=
        "");
  // A more specific rule that is up wins over "*" -> "*" down.
  CHECK(Refusal("links { source: \"*\" destination: \"*\" down: true }\n"
                "links { source: \"g0\" destination: \"k0\" }\n"
                "links { source: \"k0\" destination: \"g0\" }") == "");
  // Of two equally specific rules the last applies, as on the nodes.
  CHECK(Refusal("links { source: \"g0\" destination: \"k0\" down: true }\n"
                "links { source: \"g0\" destination: \"k0\" }") == "");
  CHECK(Refusal("links { source: \"g0\" destination: \"k0\" }\n"
                "links { source: \"g0\" destination: \"k0\" down: true }") !=
        "");
  // In gpu_only mode the KARAT nodes are not used.
  CHECK(Refusal("mode: \"gpu_only\" gpu_nodes { name: \"g1\" hbm_bytes: 5 }\n"
                "links { source: \"*\" destination: \"*\" down: true }")
            .find("hbm_bytes") != std::string::npos);
}

TEST_CASE("config: experts per rank and HBM against the model") {
  auto model = PresetConfig("dsa-tiny");
  REQUIRE(model.ok());
  REQUIRE(model->n_routed_experts == 16);
  cluster::ClusterConfig config;
  for (int i = 0; i < 3; ++i)
    config.add_gpu_nodes()->set_name(absl::StrCat("g", i));
  absl::Status st = ValidateClusterConfigForModel(config, *model);
  CHECK(st.code() == absl::StatusCode::kInvalidArgument);
  CHECK(
      st.message() ==
      "gpu_nodes: 16 routed experts cannot be split evenly among 3 GPU ranks");
  config.mutable_gpu_nodes()->RemoveLast();
  CHECK(ValidateClusterConfigForModel(config, *model).ok());

  const int64_t rank1 = RankWeightBytes(*model, 1, 2);
  config.mutable_gpu_nodes(1)->set_hbm_bytes(rank1 - 1);
  st = ValidateClusterConfigForModel(config, *model);
  CHECK(st.message() == absl::StrCat("gpu_nodes[1].hbm_bytes: ", rank1 - 1,
                                     " bytes cannot hold the rank's ", rank1,
                                     " bytes of weights"));
  config.mutable_gpu_nodes(1)->set_hbm_bytes(rank1);
  CHECK(ValidateClusterConfigForModel(config, *model).ok());

  // A model without routed experts splits over any rank count.
  auto dense = PresetConfig("llama-tiny");
  REQUIRE(dense.ok());
  config.add_gpu_nodes()->set_name("g2");
  CHECK(ValidateClusterConfigForModel(config, *dense).ok());

  CHECK(CheckClusterConfigAgainstModel(config, "/nonexistent").code() ==
        absl::StatusCode::kNotFound);
}

TEST_CASE("RankWeightBytes: shared tensors on every rank, experts split") {
  auto model = PresetConfig("dsa-tiny");
  REQUIRE(model.ok());
  int64_t total = 0, expert_bytes = 0;
  for (const TensorSpec& t : ExpectedTensors(*model)) {
    int64_t n = 4;
    for (int64_t d : t.shape) n *= d;
    total += n;
    if (t.name.find(".mlp.experts.") != std::string::npos) expert_bytes += n;
  }
  REQUIRE(expert_bytes > 0);
  CHECK(RankWeightBytes(*model, 0, 1) == total);
  const int64_t shared = total - expert_bytes;
  int64_t sum = 0;
  for (int r = 0; r < 4; ++r) {
    const int64_t b = RankWeightBytes(*model, r, 4);
    CHECK(b == shared + expert_bytes / 4);
    sum += b;
  }
  CHECK(sum == 4 * shared + expert_bytes);
}

}  // namespace
}  // namespace karat::coordinator
