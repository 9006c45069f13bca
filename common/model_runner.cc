// ModelRunner construction (Create: loading the weights per layer), its
// accessors, the weight loaders, LayerTraffic's per-segment views and
// SampleToken. Expert ownership and ApplyExpert are in
// model_runner_experts.cc, the forward pass in model_runner_step.cc,
// LocalAttentionBackend in local_attention_backend.cc.
#include "common/model_runner.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/linear.h"
#include "common/model_runner_internal.h"
#include "common/stable_hash.h"
#include "common/status_macros.h"

namespace karat {
namespace runner_internal {

std::vector<float> Vec(const ModelFiles& f, const std::string& name) {
  return f.at(name).data;
}
LinearWeight Lin(const ModelFiles& f, const std::string& name) {
  const Tensor& t = f.at(name);
  return LinearWeight(t.data.data(), int(t.rows()), int(t.cols()));
}
Ffn MakeFfn(const ModelFiles& f, const std::string& prefix) {
  Ffn ffn;
  ffn.gate = Lin(f, prefix + "gate_proj.weight");
  ffn.up = Lin(f, prefix + "up_proj.weight");
  ffn.down = Lin(f, prefix + "down_proj.weight");
  return ffn;
}

}  // namespace runner_internal

using runner_internal::Ffn;
using runner_internal::Layer;
using runner_internal::Lin;
using runner_internal::MakeFfn;
using runner_internal::Vec;

// --- LayerTraffic -------------------------------------------------------

IndexInputs LayerTraffic::IndexFor(int seg, const AttnShapes& s) const {
  const size_t r = offsets[seg];
  IndexInputs in;
  in.q_codes = index_q_codes.data() + r * s.index_heads * s.index_dim;
  in.q_scales = index_q_scales.data() + r * s.index_heads;
  in.weights = index_weights.data() + r * s.index_heads;
  in.k_codes = index_k_codes.data() + r * s.index_dim;
  in.k_scales = index_k_scales.data() + r;
  return in;
}

AttnInputs LayerTraffic::AttnFor(int seg, const AttnShapes& s) const {
  const size_t r = offsets[seg];
  AttnInputs in;
  in.q = q.data() + r * s.heads * s.q_dim;
  in.kv = kv.data() + r * s.kv_dim;
  return in;
}

float* LayerTraffic::OutFor(int seg, const AttnShapes& s) {
  return out.data() + size_t(offsets[seg]) * s.heads * s.out_dim;
}

// --- ModelRunner ----------------------------------------------------------

ModelRunner::ModelRunner() : impl_(new Impl) {}
ModelRunner::~ModelRunner() = default;
const ModelConfig& ModelRunner::config() const { return impl_->cfg; }
const AttnShapes& ModelRunner::shapes() const { return impl_->shapes; }
int ModelRunner::rank() const { return impl_->rank; }
int ModelRunner::ranks() const { return impl_->ranks; }

absl::StatusOr<std::unique_ptr<ModelRunner>> ModelRunner::Create(
    const ModelFiles& f, const RunnerOptions& options) {
  const ModelConfig& c = f.config;
  const bool gqa = c.attention.type != AttentionType::kMlaDsa;
  if (options.ranks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank count ", options.ranks, " must be at least 1"));
  }
  if (options.rank < 0 || options.rank >= options.ranks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", options.rank, " outside [0, ", options.ranks, ")"));
  }
  if (c.n_routed_experts % options.ranks != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "n_routed_experts (", c.n_routed_experts,
        ") is not a multiple of the GPU rank count (", options.ranks,
        "): experts are sharded across ranks in equal blocks"));
  }
  for (const TensorSpec& spec : ExpectedTensors(c)) {
    if (f.tensors.find(spec.name) == f.tensors.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("missing tensor '", spec.name, "'"));
    }
  }
  std::unique_ptr<ModelRunner> r(new ModelRunner());
  Impl& m = *r->impl_;
  m.cfg = c;
  m.shapes = MakeAttnShapes(c);
  m.rank = options.rank;
  m.ranks = options.ranks;
  m.experts_per_rank = c.n_routed_experts / options.ranks;
  m.first_expert = options.rank * m.experts_per_rank;
  {
    absl::MutexLock lock(&m.experts_mu);
    m.owner.resize(size_t(c.n_routed_experts));
    for (int e = 0; e < c.n_routed_experts; ++e)
      m.owner[size_t(e)] = e / m.experts_per_rank;
  }
  m.embed = Vec(f, "model.embed_tokens.weight");
  m.final_norm = Vec(f, "model.norm.weight");
  m.lm_head = Lin(f, "lm_head.weight");
  const int H = c.num_attention_heads, nope = c.qk_nope_head_dim,
            v = c.v_head_dim, lora = c.kv_lora_rank;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    const std::string a = p + "self_attn.";
    Layer L;
    L.in_norm = Vec(f, p + "input_layernorm.weight");
    L.post_norm = Vec(f, p + "post_attention_layernorm.weight");
    if (gqa) {
      L.q_proj = Lin(f, a + "q_proj.weight");
      L.k_proj = Lin(f, a + "k_proj.weight");
      L.v_proj = Lin(f, a + "v_proj.weight");
      L.o_proj = Lin(f, a + "o_proj.weight");
      if (c.attention.type == AttentionType::kGqaBlock) {
        L.index_q = Lin(f, a + "index_q_proj.weight");
        L.index_k = Lin(f, a + "index_k_proj.weight");
      }
    } else {
      L.q_a = Lin(f, a + "q_a_proj.weight");
      L.q_a_norm = Vec(f, a + "q_a_layernorm.weight");
      L.q_b = Lin(f, a + "q_b_proj.weight");
      L.kv_a = Lin(f, a + "kv_a_proj_with_mqa.weight");
      L.kv_a_norm = Vec(f, a + "kv_a_layernorm.weight");
      L.o_proj = Lin(f, a + "o_proj.weight");
      const Tensor& kvb = f.at(a + "kv_b_proj.weight");  // [H*(nope+v), lora]
      for (int h = 0; h < H; ++h) {
        const float* base = kvb.data.data() + size_t(h) * (nope + v) * lora;
        std::vector<float> ukt(size_t(lora) * nope);
        for (int i = 0; i < nope; ++i)
          for (int j = 0; j < lora; ++j)
            ukt[size_t(j) * nope + i] = base[size_t(i) * lora + j];
        L.uk_t.emplace_back(ukt.data(), lora, nope);
        L.uv.emplace_back(base + size_t(nope) * lora, v, lora);
      }
      L.has_indexer = c.HasIndexer(l);
      if (L.has_indexer) {
        L.iq = Lin(f, a + "indexer.wq_b.weight");
        L.ik = Lin(f, a + "indexer.wk.weight");
        L.iw = Lin(f, a + "indexer.weights_proj.weight");
        L.ik_norm_w = Vec(f, a + "indexer.k_norm.weight");
        L.ik_norm_b = Vec(f, a + "indexer.k_norm.bias");
      }
    }  // mla_dsa
    L.moe = c.IsMoeLayer(l);
    const std::string mlp = p + "mlp.";
    if (L.moe) {
      if (m.first_moe_layer < 0) m.first_moe_layer = l;
      L.router = Lin(f, mlp + "gate.weight");
      L.experts.resize(size_t(c.n_routed_experts));
      for (int e = m.first_expert; e < m.first_expert + m.experts_per_rank;
           ++e) {
        L.experts[size_t(e)] = std::make_shared<const Ffn>(
            MakeFfn(f, absl::StrCat(mlp, "experts.", e, ".")));
      }
      L.has_shared = c.n_shared_experts > 0;
      if (L.has_shared) L.shared = MakeFfn(f, mlp + "shared_experts.");
    } else {
      L.dense = MakeFfn(f, mlp);
    }
    m.layers.push_back(std::move(L));
  }
  return r;
}

// --- Sampling -------------------------------------------------------------

int32_t SampleToken(const std::vector<float>& logits, float temperature,
                    uint64_t seed, int64_t position) {
  const int V = static_cast<int>(logits.size());
  if (!(temperature > 0.0f)) {
    int best = 0;
    for (int i = 1; i < V; ++i) {
      if (logits[i] > logits[best]) best = i;
    }
    return best;
  }
  const uint64_t key = seed ^ (0x9E3779B97F4A7C15ull * uint64_t(position + 1));
  const double u = double(SplitMix64(key) >> 11) * 0x1.0p-53;
  float mx = -INFINITY;
  for (float l : logits) mx = std::max(mx, l / temperature);
  std::vector<double> p(V);
  double z = 0.0;
  for (int i = 0; i < V; ++i) {
    p[i] = std::exp(double(logits[i] / temperature - mx));
    z += p[i];
  }
  double cum = 0.0;
  for (int i = 0; i < V; ++i) {
    cum += p[i] / z;
    if (cum > u) return i;
  }
  // Rounding left the total just under u: the last id with mass.
  for (int i = V - 1; i >= 0; --i) {
    if (p[i] > 0.0) return i;
  }
  return V - 1;
}

}  // namespace karat
