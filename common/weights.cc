#include "common/weights.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/stable_hash.h"
#include "common/status_macros.h"

namespace karat {
namespace {

constexpr const char kLshHyperplanes[] = "model.lsh_hyperplanes";
constexpr const char kEmbed[] = "model.embed_tokens.weight";

// The status for a failed system call: errno's code and text after `what`.
absl::Status ErrnoError(int err, const std::string& what) {
  return absl::Status(absl::ErrnoToStatusCode(err),
                      absl::StrCat(what, ": ", std::strerror(err)));
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// xoshiro256** seeded through splitmix64, one stream per (seed, tensor name)
// so that adding or reordering tensors changes no other tensor's values.
class NormalStream {
 public:
  NormalStream(uint64_t seed, const std::string& name) {
    uint64_t x = seed ^ SplitMix64(Fnv1a64(name));
    for (uint64_t& w : s_) {
      x += 0x9E3779B97F4A7C15ull;
      w = SplitMix64(x);
    }
  }

  // Standard normal via Box-Muller, two values per pair of uniforms.
  double Next() {
    if (have_spare_) {
      have_spare_ = false;
      return spare_;
    }
    // u1 in (0, 1] so that log(u1) is finite.
    const double u1 = static_cast<double>((NextU64() >> 11) + 1) * 0x1.0p-53;
    const double u2 = static_cast<double>(NextU64() >> 11) * 0x1.0p-53;
    const double r = std::sqrt(-2.0 * std::log(u1));
    const double theta = 2.0 * M_PI * u2;
    spare_ = r * std::sin(theta);
    have_spare_ = true;
    return r * std::cos(theta);
  }

 private:
  static uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t NextU64() {
    const uint64_t result = Rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = Rotl(s_[3], 45);
    return result;
  }

  uint64_t s_[4];
  bool have_spare_ = false;
  double spare_ = 0.0;
};

class SpecList {
 public:
  void Add(std::string name, std::vector<int64_t> shape) {
    specs_.push_back({std::move(name), std::move(shape)});
  }
  std::vector<TensorSpec> Take() { return std::move(specs_); }

 private:
  std::vector<TensorSpec> specs_;
};

void AddFfn(SpecList* s, const std::string& prefix, int64_t hidden,
            int64_t inter) {
  s->Add(prefix + "gate_proj.weight", {inter, hidden});
  s->Add(prefix + "up_proj.weight", {inter, hidden});
  s->Add(prefix + "down_proj.weight", {hidden, inter});
}

absl::Status WriteTextFile(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) {
      std::remove(tmp.c_str());
      return ErrnoError(errno, absl::StrCat(tmp, ": cannot write"));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    return ErrnoError(err, absl::StrCat("rename ", tmp, " -> ", path));
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<TensorSpec> ExpectedTensors(const ModelConfig& c) {
  SpecList s;
  const int64_t hidden = c.hidden_size;
  const int64_t vocab = c.vocab_size;
  const int64_t h = c.num_attention_heads;
  s.Add(kEmbed, {vocab, hidden});
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const std::string layer = absl::StrCat("model.layers.", l, ".");
    const std::string attn = layer + "self_attn.";
    s.Add(layer + "input_layernorm.weight", {hidden});
    switch (c.attention.type) {
      case AttentionType::kMlaDsa: {
        const int64_t q_lora = c.q_lora_rank, kv_lora = c.kv_lora_rank;
        const int64_t nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim;
        const int64_t v = c.v_head_dim;
        s.Add(attn + "q_a_proj.weight", {q_lora, hidden});
        s.Add(attn + "q_a_layernorm.weight", {q_lora});
        s.Add(attn + "q_b_proj.weight", {h * (nope + rope), q_lora});
        s.Add(attn + "kv_a_proj_with_mqa.weight", {kv_lora + rope, hidden});
        s.Add(attn + "kv_a_layernorm.weight", {kv_lora});
        s.Add(attn + "kv_b_proj.weight", {h * (nope + v), kv_lora});
        s.Add(attn + "o_proj.weight", {hidden, h * v});
        if (c.HasIndexer(l)) {
          const int64_t hi = c.index_n_heads, di = c.index_head_dim;
          s.Add(attn + "indexer.wq_b.weight", {hi * di, q_lora});
          s.Add(attn + "indexer.wk.weight", {di, hidden});
          s.Add(attn + "indexer.k_norm.weight", {di});
          s.Add(attn + "indexer.k_norm.bias", {di});
          s.Add(attn + "indexer.weights_proj.weight", {hi, hidden});
        }
        break;
      }
      case AttentionType::kGqaBlock:
      case AttentionType::kGqaDense: {
        const int64_t d = c.head_dim, hkv = c.num_key_value_heads;
        s.Add(attn + "q_proj.weight", {h * d, hidden});
        s.Add(attn + "k_proj.weight", {hkv * d, hidden});
        s.Add(attn + "v_proj.weight", {hkv * d, hidden});
        s.Add(attn + "o_proj.weight", {hidden, h * d});
        if (c.attention.type == AttentionType::kGqaBlock) {
          const int64_t di = c.index_head_dim;
          s.Add(attn + "index_q_proj.weight", {h * di, hidden});
          s.Add(attn + "index_k_proj.weight", {hkv * di, hidden});
        }
        break;
      }
    }
    s.Add(layer + "post_attention_layernorm.weight", {hidden});
    const std::string mlp = layer + "mlp.";
    if (c.IsMoeLayer(l)) {
      s.Add(mlp + "gate.weight", {c.n_routed_experts, hidden});
      for (int e = 0; e < c.n_routed_experts; ++e) {
        AddFfn(&s, absl::StrCat(mlp, "experts.", e, "."), hidden,
               c.moe_intermediate_size);
      }
      if (c.n_shared_experts > 0) {
        AddFfn(&s, mlp + "shared_experts.", hidden,
               int64_t{c.moe_intermediate_size} * c.n_shared_experts);
      }
    } else {
      AddFfn(&s, mlp, hidden, c.intermediate_size);
    }
  }
  s.Add("model.norm.weight", {hidden});
  s.Add("lm_head.weight", {vocab, hidden});
  if (c.attention.type == AttentionType::kGqaDense &&
      c.attention.method == AttentionMethod::kMagicPig) {
    s.Add(kLshHyperplanes,
          {int64_t{c.attention.lsh_bits} * c.attention.lsh_tables, c.head_dim});
  }
  return s.Take();
}

int RoutedExpertOfTensor(const std::string& name) {
  static constexpr std::string_view kExperts = ".mlp.experts.";
  const size_t at = name.find(kExperts);
  if (at == std::string::npos) return -1;
  return int(std::strtol(name.c_str() + at + kExperts.size(), nullptr, 10));
}

int64_t ExpertWeightBytes(const ModelConfig& c, int expert) {
  int64_t bytes = 0;
  for (const TensorSpec& spec : ExpectedTensors(c)) {
    if (RoutedExpertOfTensor(spec.name) != expert) continue;
    int64_t n = 1;
    for (int64_t d : spec.shape) n *= d;
    bytes += n * static_cast<int64_t>(sizeof(float));
  }
  return bytes;
}

int64_t RankWeightBytes(const ModelConfig& c, int rank, int ranks) {
  const int64_t experts = c.n_routed_experts;
  const int64_t first = ranks > 0 ? experts * rank / ranks : 0;
  const int64_t last = ranks > 0 ? experts * (rank + 1) / ranks : experts;
  int64_t bytes = 0;
  for (const TensorSpec& spec : ExpectedTensors(c)) {
    const int64_t e = RoutedExpertOfTensor(spec.name);
    if (e >= 0 && (e < first || e >= last)) continue;
    int64_t n = 1;
    for (int64_t d : spec.shape) n *= d;
    bytes += n * static_cast<int64_t>(sizeof(float));
  }
  return bytes;
}

namespace {

// LoadModel's body; `want` (null: every tensor) picks the tensors to load.
absl::StatusOr<ModelFiles> LoadModelTensors(
    const std::string& model_dir,
    const std::function<bool(const std::string&)>& want,
    const std::function<absl::Status(const ModelConfig&)>& check_config) {
  ModelFiles files;
  ASSIGN_OR_RETURN(files.config, LoadModelConfig(model_dir));
  if (check_config) RETURN_IF_ERROR(check_config(files.config));
  const std::string path = model_dir + "/model.safetensors";
  ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> st,
                   SafetensorsFile::Open(path));
  for (TensorSpec& spec : ExpectedTensors(files.config)) {
    if (want && !want(spec.name)) continue;
    const TensorView* view = st->Find(spec.name);
    if (view == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": tensor '", spec.name, "' missing (", model_dir,
          "/config.json requires shape ", ShapeString(spec.shape), ")"));
    }
    if (view->shape != spec.shape) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor '", spec.name, "' has shape ",
                       ShapeString(view->shape), " but ", model_dir,
                       "/config.json requires ", ShapeString(spec.shape)));
    }
    Tensor t;
    t.shape = std::move(spec.shape);
    t.data = view->ToFloat();
    files.tensors.emplace(std::move(spec.name), std::move(t));
  }
  return files;
}

}  // namespace

absl::StatusOr<ModelFiles> LoadModel(const std::string& model_dir) {
  return LoadModelTensors(model_dir, nullptr, nullptr);
}

absl::StatusOr<ModelFiles> LoadExpertWeights(const std::string& model_dir,
                                             const std::vector<int>& experts) {
  std::set<int> wanted(experts.begin(), experts.end());
  return LoadModelTensors(
      model_dir,
      [&wanted](const std::string& name) {
        const int e = RoutedExpertOfTensor(name);
        return e >= 0 && wanted.count(e) > 0;
      },
      [&wanted, &model_dir](const ModelConfig& config) {
        for (int e : wanted) {
          if (e < 0 || e >= config.n_routed_experts) {
            return absl::InvalidArgumentError(absl::StrCat(
                "expert ", e, " is outside [0, ", config.n_routed_experts,
                ") of the model in ", model_dir));
          }
        }
        return absl::OkStatus();
      });
}

std::map<std::string, Tensor> GenerateWeights(const ModelConfig& config,
                                              uint64_t seed) {
  std::vector<TensorSpec> specs = ExpectedTensors(config);
  std::vector<Tensor> tensors(specs.size());
  // Each tensor has its own stream, so the values do not depend on how the
  // tensors are spread over threads.
#pragma omp parallel for schedule(dynamic)
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& spec = specs[i];
    Tensor& t = tensors[i];
    int64_t n = 1;
    for (int64_t d : spec.shape) n *= d;
    t.shape = spec.shape;
    t.data.resize(static_cast<size_t>(n));
    const std::string& name = spec.name;
    double mean = 0.0, stddev;
    if (name == kEmbed || name == kLshHyperplanes) {
      stddev = 1.0;
    } else if (name.ends_with(".bias")) {
      stddev = 0.02;
    } else if (spec.shape.size() == 1) {
      // RMSNorm and LayerNorm gains.
      mean = 1.0;
      stddev = 0.02;
    } else {
      stddev = 1.0 / std::sqrt(static_cast<double>(spec.shape[1]));
    }
    NormalStream rng(seed, name);
    for (float& x : t.data) x = static_cast<float>(mean + stddev * rng.Next());
  }
  std::map<std::string, Tensor> out;
  for (size_t i = 0; i < specs.size(); ++i) {
    out.emplace(std::move(specs[i].name), std::move(tensors[i]));
  }
  return out;
}

absl::Status WriteModel(const std::string& model_dir, const ModelConfig& config,
                        const std::map<std::string, Tensor>& tensors,
                        DType dtype) {
  RETURN_IF_ERROR(ValidateModelConfig(config, model_dir + "/config.json"));
  std::error_code ec;
  std::filesystem::create_directories(model_dir, ec);
  if (ec) {
    return ErrnoError(ec.value(),
                      absl::StrCat(model_dir, ": cannot create directory"));
  }
  std::vector<TensorToWrite> to_write;
  to_write.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    if (n < 0 || static_cast<size_t>(n) != t.data.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", name, "': shape ", ShapeString(t.shape),
                       " holds ", n, " values but data has ", t.data.size()));
    }
    to_write.push_back({name, t.shape, t.data.data()});
  }
  RETURN_IF_ERROR(
      WriteTextFile(model_dir + "/config.json", ModelConfigToJson(config)));
  return WriteSafetensors(model_dir + "/model.safetensors", to_write, dtype,
                          {{"format", "pt"}});
}

}  // namespace karat
