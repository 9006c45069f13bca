#include "common/weights.h"

#include <stdlib.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "absl/strings/match.h"
#include "common/numeric.h"

namespace karat {
namespace {

class TempDir {
 public:
  TempDir() {
    std::string tmpl =
        (std::filesystem::temp_directory_path() / "karat_wt_XXXXXX").string();
    REQUIRE(mkdtemp(tmpl.data()) != nullptr);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::map<std::string, std::vector<int64_t>> ShapeMap(const ModelConfig& c) {
  std::map<std::string, std::vector<int64_t>> m;
  for (const TensorSpec& s : ExpectedTensors(c)) {
    CHECK(m.emplace(s.name, s.shape).second);  // names are unique
  }
  return m;
}

TEST_CASE("ExpectedTensors follows MODEL.md for mla_dsa", "[weights]") {
  ModelConfig c = *PresetConfig("glm-small");  // 4 layers, reuse 2
  const auto m = ShapeMap(c);
  const int64_t H = c.num_attention_heads, D = c.hidden_size;
  using V = std::vector<int64_t>;
  CHECK(ExpectedTensors(c).front().name == "model.embed_tokens.weight");
  CHECK(m.at("model.embed_tokens.weight") == V{258, D});
  CHECK(m.at("lm_head.weight") == V{258, D});
  CHECK(m.at("model.norm.weight") == V{D});
  const std::string a = "model.layers.0.self_attn.";
  CHECK(m.at("model.layers.0.input_layernorm.weight") == V{D});
  CHECK(m.at("model.layers.3.post_attention_layernorm.weight") == V{D});
  CHECK(m.at(a + "q_a_proj.weight") == V{64, D});
  CHECK(m.at(a + "q_a_layernorm.weight") == V{64});
  CHECK(m.at(a + "q_b_proj.weight") == V{H * (16 + 8), 64});
  CHECK(m.at(a + "kv_a_proj_with_mqa.weight") == V{32 + 8, D});
  CHECK(m.at(a + "kv_a_layernorm.weight") == V{32});
  CHECK(m.at(a + "kv_b_proj.weight") == V{H * (16 + 16), 32});
  CHECK(m.at(a + "o_proj.weight") == V{D, H * 16});
  CHECK(m.at(a + "indexer.wq_b.weight") == V{4 * 16, 64});
  CHECK(m.at(a + "indexer.wk.weight") == V{16, D});
  CHECK(m.at(a + "indexer.k_norm.weight") == V{16});
  CHECK(m.at(a + "indexer.k_norm.bias") == V{16});
  CHECK(m.at(a + "indexer.weights_proj.weight") == V{4, D});
  // Indexer only on layers 0 and 2.
  CHECK(m.count("model.layers.1.self_attn.indexer.wk.weight") == 0);
  CHECK(m.count("model.layers.2.self_attn.indexer.wk.weight") == 1);
  CHECK(m.count("model.layers.3.self_attn.indexer.wq_b.weight") == 0);
  // Layer 0 dense, the rest MoE with one shared expert.
  CHECK(m.at("model.layers.0.mlp.gate_proj.weight") == V{256, D});
  CHECK(m.at("model.layers.0.mlp.down_proj.weight") == V{D, 256});
  CHECK(m.count("model.layers.0.mlp.gate.weight") == 0);
  CHECK(m.at("model.layers.1.mlp.gate.weight") == V{8, D});
  CHECK(m.at("model.layers.1.mlp.experts.7.up_proj.weight") == V{64, D});
  CHECK(m.at("model.layers.1.mlp.experts.0.down_proj.weight") == V{D, 64});
  CHECK(m.count("model.layers.1.mlp.experts.8.up_proj.weight") == 0);
  CHECK(m.at("model.layers.1.mlp.shared_experts.gate_proj.weight") == V{64, D});
  CHECK(m.count("model.layers.1.mlp.gate_proj.weight") == 0);
  c.n_shared_experts = 0;
  CHECK(ShapeMap(c).count(
            "model.layers.1.mlp.shared_experts.gate_proj.weight") == 0);
  c.n_shared_experts = 2;
  CHECK(ShapeMap(c).at("model.layers.1.mlp.shared_experts.down_proj.weight") ==
        V{D, 128});
}

TEST_CASE("ExpectedTensors follows MODEL.md for gqa", "[weights]") {
  using V = std::vector<int64_t>;
  ModelConfig mm = *PresetConfig("minimax-small");
  auto m = ShapeMap(mm);
  const std::string a = "model.layers.1.self_attn.";
  const int64_t D = mm.hidden_size, H = mm.num_attention_heads,
                Hkv = mm.num_key_value_heads, d = mm.head_dim,
                Di = mm.index_head_dim;
  CHECK(m.at(a + "q_proj.weight") == V{H * d, D});
  CHECK(m.at(a + "k_proj.weight") == V{Hkv * d, D});
  CHECK(m.at(a + "v_proj.weight") == V{Hkv * d, D});
  CHECK(m.at(a + "o_proj.weight") == V{D, H * d});
  CHECK(m.at(a + "index_q_proj.weight") == V{H * Di, D});
  CHECK(m.at(a + "index_k_proj.weight") == V{Hkv * Di, D});
  CHECK(m.count(a + "q_a_proj.weight") == 0);

  ModelConfig ll = *PresetConfig("llama-small");
  m = ShapeMap(ll);
  CHECK(m.count(a + "index_q_proj.weight") == 0);
  CHECK(m.count("model.lsh_hyperplanes") == 0);
  CHECK(m.at("model.layers.2.mlp.up_proj.weight") ==
        V{ll.intermediate_size, ll.hidden_size});
  CHECK(m.count("model.layers.2.mlp.gate.weight") == 0);

  ModelConfig mp = *PresetConfig("llama-small-magicpig");
  const auto specs = ExpectedTensors(mp);
  CHECK(specs.back().name == "model.lsh_hyperplanes");
  CHECK(
      specs.back().shape ==
      V{int64_t{mp.attention.lsh_bits} * mp.attention.lsh_tables, mp.head_dim});
}

TEST_CASE("the largest config accepted has a weight size that fits",
          "[weights]") {
  // Every size at its bound (common/model_config.h), with the indexer,
  // routed and shared experts in every layer but the first.
  ModelConfig c = *PresetConfig("dsa-tiny");
  c.hidden_size = kMaxModelDim;
  c.num_hidden_layers = kMaxLayers;
  c.num_attention_heads = kMaxHeads;
  c.q_lora_rank = c.kv_lora_rank = kMaxModelDim;
  c.qk_nope_head_dim = c.qk_rope_head_dim = c.v_head_dim = kMaxModelDim;
  c.index_n_heads = kMaxHeads;
  c.index_head_dim = kMaxModelDim;
  c.n_routed_experts = c.n_shared_experts = kMaxRoutedExperts;
  c.moe_intermediate_size = c.intermediate_size = kMaxModelDim;
  c.index_reuse_freq = 1;
  REQUIRE(ValidateModelConfig(c, "max").ok());
  // The byte count without overflow, to compare.
  __int128 bytes = 0;
  for (const TensorSpec& spec : ExpectedTensors(c)) {
    __int128 n = 4;
    for (int64_t d : spec.shape) n *= d;
    bytes += n;
  }
  CHECK(bytes < (__int128{1} << 59));
  CHECK(RankWeightBytes(c, 0, 1) == static_cast<int64_t>(bytes));
  c.num_hidden_layers = kMaxLayers + 1;
  CHECK_FALSE(ValidateModelConfig(c, "max").ok());
}

TEST_CASE("generated weights have the documented statistics", "[weights]") {
  ModelConfig c = *PresetConfig("dsa-small");
  auto w = GenerateWeights(c, 7);
  CHECK(w.size() == ExpectedTensors(c).size());
  auto stats = [&](const std::string& name) {
    const Tensor& t = w.at(name);
    double sum = 0, sq = 0;
    for (float x : t.data) sum += x;
    const double mean = sum / t.data.size();
    for (float x : t.data) sq += (x - mean) * (x - mean);
    return std::pair<double, double>(mean, std::sqrt(sq / t.data.size()));
  };
  auto [em, es] = stats("model.embed_tokens.weight");
  CHECK(std::fabs(em) < 0.05);
  CHECK(es == Approx(1.0).epsilon(0.05));
  auto [lm, ls] = stats("model.layers.1.mlp.experts.3.up_proj.weight");
  CHECK(std::fabs(lm) < 0.01);
  CHECK(ls == Approx(1.0 / std::sqrt(128.0)).epsilon(0.05));
  auto [dm, ds] = stats("model.layers.0.mlp.down_proj.weight");
  CHECK(ds == Approx(1.0 / std::sqrt(256.0)).epsilon(0.05));
  auto [nm, ns] = stats("model.layers.0.input_layernorm.weight");
  CHECK(nm == Approx(1.0).epsilon(0.01));
  CHECK(ns < 0.04);
  auto [bm, bs] = stats("model.layers.0.self_attn.indexer.k_norm.bias");
  CHECK(std::fabs(bm) < 0.02);
  CHECK(bs < 0.04);
  for (const auto& [name, t] : w) {
    for (float x : t.data) REQUIRE(std::isfinite(x));
  }
}

TEST_CASE("generation is deterministic per seed and tensor", "[weights]") {
  ModelConfig c = *PresetConfig("llama-small");
  auto a = GenerateWeights(c, 42);
  auto b = GenerateWeights(c, 42);
  auto d = GenerateWeights(c, 43);
  for (const auto& [name, t] : a) {
    CHECK(t.data == b.at(name).data);
    CHECK(t.data != d.at(name).data);
  }
  // Tensors of equal shape get different streams.
  CHECK(a.at("model.layers.0.mlp.gate_proj.weight").data !=
        a.at("model.layers.0.mlp.up_proj.weight").data);
  // A tensor's values do not depend on which other tensors exist.
  ModelConfig more = c;
  more.num_hidden_layers = 5;
  auto m = GenerateWeights(more, 42);
  CHECK(m.at("model.layers.1.self_attn.q_proj.weight").data ==
        a.at("model.layers.1.self_attn.q_proj.weight").data);

  // Same seed, same bytes on disk.
  TempDir d1, d2;
  REQUIRE(WriteModel(d1.path(), c, a, DType::kBF16).ok());
  REQUIRE(WriteModel(d2.path(), c, b, DType::kBF16).ok());
  CHECK(ReadBytes(d1.path() + "/model.safetensors") ==
        ReadBytes(d2.path() + "/model.safetensors"));
  CHECK(ReadBytes(d1.path() + "/config.json") ==
        ReadBytes(d2.path() + "/config.json"));
}

TEST_CASE("a written model loads back", "[weights]") {
  for (const char* preset :
       {"dsa-small", "glm-small", "minimax-small", "llama-small-magicpig"}) {
    const ModelConfig c = *PresetConfig(preset);
    const auto w = GenerateWeights(c, 1);
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      INFO(preset << " " << DTypeName(dtype));
      TempDir dir;
      const std::string model = dir.path() + "/model";  // created by WriteModel
      REQUIRE(WriteModel(model, c, w, dtype).ok());
      auto loaded = LoadModel(model);
      REQUIRE(loaded.ok());
      CHECK(ModelConfigToJson(loaded->config) == ModelConfigToJson(c));
      REQUIRE(loaded->tensors.size() == w.size());
      for (const auto& [name, t] : w) {
        const Tensor& got = loaded->at(name);
        REQUIRE(got.shape == t.shape);
        std::vector<float> expect = t.data;
        if (dtype == DType::kBF16) {
          RoundThroughBf16(expect.data(), expect.size());
        }
        REQUIRE(got.data == expect);
      }
      const Tensor& q = loaded->at("lm_head.weight");
      CHECK(q.rows() == 258);
      CHECK(q.cols() == c.hidden_size);
    }
  }
}

TEST_CASE("config and weights that disagree are refused", "[weights]") {
  ModelConfig c = *PresetConfig("dsa-small");
  auto w = GenerateWeights(c, 3);
  TempDir dir;
  const std::string tensor = "model.layers.1.self_attn.kv_b_proj.weight";

  SECTION("missing tensor") {
    w.erase(tensor);
    REQUIRE(WriteModel(dir.path(), c, w, DType::kBF16).ok());
    auto m = LoadModel(dir.path());
    REQUIRE_FALSE(m.ok());
    INFO(m.status().ToString());
    CHECK(absl::StrContains(m.status().message(), tensor));
    CHECK(absl::StrContains(m.status().message(), "model.safetensors"));
    CHECK(absl::StrContains(m.status().message(), "missing"));
  }
  SECTION("wrong shape") {
    Tensor& t = w.at(tensor);
    t.shape = {t.shape[1], t.shape[0]};
    REQUIRE(WriteModel(dir.path(), c, w, DType::kF32).ok());
    auto m = LoadModel(dir.path());
    REQUIRE_FALSE(m.ok());
    INFO(m.status().ToString());
    CHECK(absl::StrContains(m.status().message(), tensor));
    CHECK(absl::StrContains(m.status().message(), "[32, 128]"));
    CHECK(absl::StrContains(m.status().message(), "[128, 32]"));
  }
  SECTION("config for another model") {
    REQUIRE(WriteModel(dir.path(), c, w, DType::kBF16).ok());
    ModelConfig other = *PresetConfig("glm-small");  // 4 layers
    REQUIRE(WriteModel(dir.path() + "/x", other, {}, DType::kBF16).ok());
    std::filesystem::copy_file(
        dir.path() + "/x/config.json", dir.path() + "/config.json",
        std::filesystem::copy_options::overwrite_existing);
    auto m = LoadModel(dir.path());
    REQUIRE_FALSE(m.ok());
    CHECK(absl::StrContains(m.status().message(), "model.layers.3."));
  }
  SECTION("extra tensors are ignored") {
    w["model.extra.weight"] = Tensor{{2}, {1.0f, 2.0f}};
    REQUIRE(WriteModel(dir.path(), c, w, DType::kBF16).ok());
    auto m = LoadModel(dir.path());
    REQUIRE(m.ok());
    CHECK(m->tensors.count("model.extra.weight") == 0);
  }
  SECTION("malformed config names the file") {
    REQUIRE(WriteModel(dir.path(), c, w, DType::kBF16).ok());
    std::ofstream(dir.path() + "/config.json") << "{\"hidden_size\": 1";
    auto m = LoadModel(dir.path());
    REQUIRE_FALSE(m.ok());
    CHECK(absl::StrContains(m.status().message(), "config.json"));
  }
  SECTION("missing directory") {
    CHECK_FALSE(LoadModel(dir.path() + "/nothing").ok());
  }
  SECTION("WriteModel refuses mismatched data") {
    w.at(tensor).data.pop_back();
    CHECK_FALSE(WriteModel(dir.path(), c, w, DType::kBF16).ok());
  }
}

}  // namespace
}  // namespace karat
