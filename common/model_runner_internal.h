// Internal to the model runner (not part of its API): the elementwise
// numeric blocks, the per-layer weights (Ffn, Layer), the weight loaders and
// ModelRunner::Impl, shared by model_runner.cc (construction, sampling),
// model_runner_experts.cc (expert ownership, ApplyExpert) and
// model_runner_step.cc (ModelRunner::Step).
#ifndef KARAT_COMMON_MODEL_RUNNER_INTERNAL_H_
#define KARAT_COMMON_MODEL_RUNNER_INTERNAL_H_

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/linear.h"
#include "common/model_runner.h"

namespace karat {
namespace runner_internal {

// --- Elementwise blocks (MODEL.md "Common blocks"); fixed order per row. ---

inline void RmsNorm(const float* x, int n, const float* g, float eps, float* y) {
  float ss = 0.0f;
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / float(n) + eps);
  for (int i = 0; i < n; ++i) y[i] = x[i] * inv * g[i];
}

inline void LayerNorm(float* x, int n, const float* w, const float* b, float eps) {
  float mean = 0.0f;
  for (int i = 0; i < n; ++i) mean += x[i];
  mean /= float(n);
  float var = 0.0f;
  for (int i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
  var /= float(n);
  const float inv = 1.0f / std::sqrt(var + eps);
  for (int i = 0; i < n; ++i) x[i] = (x[i] - mean) * inv * w[i] + b[i];
}

// cos/sin of position * theta^(-2i/r), angle in double, rounded to fp32.
inline void RopeTable(double theta, int r, int64_t pos, float* cs, float* sn) {
  for (int i = 0; i < r / 2; ++i) {
    const double f = std::pow(theta, -2.0 * i / r);
    const double a = double(pos) * f;
    cs[i] = static_cast<float>(std::cos(a));
    sn[i] = static_cast<float>(std::sin(a));
  }
}

inline void RopeInterleaved(float* x, int r, const float* cs, const float* sn) {
  for (int i = 0; i < r / 2; ++i) {
    const float a = x[2 * i], b = x[2 * i + 1];
    x[2 * i] = a * cs[i] - b * sn[i];
    x[2 * i + 1] = a * sn[i] + b * cs[i];
  }
}

inline void RopeHalfSplit(float* x, int r, const float* cs, const float* sn) {
  const int h = r / 2;
  for (int i = 0; i < h; ++i) {
    const float a = x[i], b = x[i + h];
    x[i] = a * cs[i] - b * sn[i];
    x[i + h] = a * sn[i] + b * cs[i];
  }
}

// Walsh-Hadamard transform in Sylvester order, scaled by n^-0.5.
inline void Hadamard(float* x, int n) {
  for (int h = 1; h < n; h *= 2) {
    for (int i = 0; i < n; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
  const float s = 1.0f / std::sqrt(float(n));
  for (int i = 0; i < n; ++i) x[i] *= s;
}

inline float Silu(float x) { return x / (1.0f + std::exp(-x)); }

// A SwiGLU FFN: down(silu(gate x) * up x).
struct Ffn {
  LinearWeight gate, up, down;
  void Apply(const float* x, int rows, float* y, std::vector<float>* g,
             std::vector<float>* u) const {
    const int inter = gate.out();
    g->resize(size_t(rows) * inter);
    u->resize(size_t(rows) * inter);
    gate.Apply(x, rows, g->data());
    up.Apply(x, rows, u->data());
    for (size_t i = 0; i < g->size(); ++i) (*g)[i] = Silu((*g)[i]) * (*u)[i];
    down.Apply(g->data(), rows, y);
  }
};

struct Layer {
  std::vector<float> in_norm, post_norm;
  // MLA
  LinearWeight q_a, q_b, kv_a, o_proj;
  std::vector<float> q_a_norm, kv_a_norm;
  std::vector<LinearWeight> uk_t;  // per head [kv_lora, nope] = W_UK[h]^T
  std::vector<LinearWeight> uv;    // per head [v, kv_lora]
  // DSA indexer
  bool has_indexer = false;
  LinearWeight iq, ik, iw;
  std::vector<float> ik_norm_w, ik_norm_b;
  // GQA (gqa_block, gqa_dense); o_proj as above. Block indexer projections.
  LinearWeight q_proj, k_proj, v_proj, index_q, index_k;
  // FFN
  bool moe = false;
  Ffn dense;
  LinearWeight router;
  // By expert id: the routed experts whose weights this rank holds (its
  // own block, and those it took over), null for the others. Guarded by
  // ModelRunner::Impl::experts_mu.
  std::vector<std::shared_ptr<const Ffn>> experts;
  bool has_shared = false;
  Ffn shared;
};

std::vector<float> Vec(const ModelFiles& f, const std::string& name);
LinearWeight Lin(const ModelFiles& f, const std::string& name);
Ffn MakeFfn(const ModelFiles& f, const std::string& prefix);

}  // namespace runner_internal

// --- ModelRunner ----------------------------------------------------------

struct ModelRunner::Impl {
  ModelConfig cfg;
  AttnShapes shapes;
  std::vector<float> embed;  // [vocab, hidden]
  std::vector<runner_internal::Layer> layers;
  std::vector<float> final_norm;
  LinearWeight lm_head;
  int rank = 0;
  int ranks = 1;
  int experts_per_rank = 0;  // n_routed_experts / ranks
  int first_expert = 0;      // rank * experts_per_rank
  // Routed-expert ownership (SetExpertOwners); which experts' weights are
  // held is layers[l].experts (the same experts in every MoE layer).
  mutable absl::Mutex experts_mu;
  std::vector<int> owner ABSL_GUARDED_BY(experts_mu);  // by expert id
  absl::Mutex set_owners_mu;  // one SetExpertOwners at a time
  int first_moe_layer = -1;   // -1: no MoE layer

  bool OwnBlock(int e) const {
    return e >= first_expert && e < first_expert + experts_per_rank;
  }
  bool HeldLocked(int e) const ABSL_SHARED_LOCKS_REQUIRED(experts_mu) {
    return first_moe_layer >= 0 &&
           layers[size_t(first_moe_layer)].experts[size_t(e)] != nullptr;
  }
};

}  // namespace karat

#endif  // KARAT_COMMON_MODEL_RUNNER_INTERNAL_H_
