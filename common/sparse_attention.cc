#include "common/sparse_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/numeric.h"
#include "common/safetensors.h"
#include "common/status_macros.h"

namespace karat {
namespace {

// bf16 -> fp32 is exact: the bits move up by 16.
inline float Bf16(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

size_t AttentionSessionState::bytes() const {
  size_t n = 0;
  for (const auto& l : layers) {
    if (l != nullptr) n += l->bytes();
  }
  return n;
}

void SparseAttention::SelectDense(int pos,
                                  std::vector<HeadSelection>* heads) const {
  heads->resize(shapes_.heads);
  for (HeadSelection& h : *heads) {
    h.positions.resize(size_t(pos) + 1);
    for (int t = 0; t <= pos; ++t) h.positions[t] = t;
    h.bias.clear();
  }
}

void SparseAttention::Attend(const LayerView& view, const float* q,
                             const std::vector<HeadSelection>& heads,
                             float* out, KernelCost* cost) const {
  const AttnShapes& s = shapes_;
  const int d = s.head_dim;
  const int group = s.heads / s.kv_heads;
  // Gather: the selected keys of one KV head decoded once, transposed
  // ([channel][position]) so that the score loop runs across positions:
  // every lane computes the scalar chain dot = fma(q[c], k[c], dot) over
  // increasing c (see IndexerScore), so a score never depends on which
  // other positions are selected. Values row-major for the weighted sum.
  // Heads of a group with the same selection reuse the gathered entries.
  std::vector<float> kt, vr, sc;
  const std::vector<int32_t>* gathered = nullptr;
  int gathered_group = -1, npad = 0;
  double bytes = 0, flops = 0;
  for (int h = 0; h < s.heads; ++h) {
    const int g = h / group;
    const HeadSelection& sel = heads[h];
    const int n = static_cast<int>(sel.positions.size());
    const float* qh = q + size_t(h) * s.q_dim;
    float* oh = out + size_t(h) * s.out_dim;
    std::fill(oh, oh + d, 0.0f);
    if (n == 0) continue;  // cannot happen: the token itself is selected
    if (g != gathered_group || *gathered != sel.positions) {
      npad = (n + 15) / 16 * 16;
      kt.assign(size_t(d) * npad, 0.0f);
      vr.resize(size_t(n) * d);
      for (int j = 0; j < n; ++j) {
        const uint16_t* e = view.Kv(sel.positions[j]);
        const uint16_t* k = e + GqaEntry::K(s, g);
        const uint16_t* v = e + GqaEntry::V(s, g);
        float* vj = &vr[size_t(j) * d];
        for (int c = 0; c < d; ++c) kt[size_t(c) * npad + j] = Bf16(k[c]);
        for (int c = 0; c < d; ++c) vj[c] = Bf16(v[c]);
      }
      gathered = &sel.positions;
      gathered_group = g;
      bytes += double(n) * d * 2 * 2;
    }
    sc.assign(npad, 0.0f);
    for (int c = 0; c < d; ++c) {
      const float qc = qh[c];
      const float* col = &kt[size_t(c) * npad];
      for (int j = 0; j < npad; ++j) sc[j] = std::fma(qc, col[j], sc[j]);
    }
    float m = -INFINITY;
    for (int j = 0; j < n; ++j) {
      float v = sc[j] * s.softmax_scale;
      if (!sel.bias.empty()) v += sel.bias[j];
      sc[j] = v;
      m = std::max(m, v);
    }
    float z = 0.0f;
    for (int j = 0; j < n; ++j) {
      sc[j] = std::exp(sc[j] - m);
      z += sc[j];
    }
    const float inv = 1.0f / z;
    for (int j = 0; j < n; ++j) {
      const float p = sc[j] * inv;
      const float* v = &vr[size_t(j) * d];
      for (int c = 0; c < d; ++c) oh[c] = std::fma(p, v[c], oh[c]);
    }
    flops += double(n) * d * 4;
  }
  if (cost != nullptr) {
    cost->bytes += bytes;
    cost->flops += flops;
  }
}

absl::StatusOr<std::unique_ptr<SparseAttention>> NewSparseAttention(
    const ModelConfig& config, const MethodWeights& weights) {
  const AttnShapes shapes = MakeAttnShapes(config);
  const AttentionConfig& a = config.attention;
  // The registry: (type, method) -> implementation.
  switch (a.type) {
    case AttentionType::kMlaDsa:
      return absl::UnimplementedError(
          "mla_dsa is served by RunIndexer/RunAttention, not the GQA kernels");
    case AttentionType::kGqaBlock:
      return NewGqaBlockAttention(shapes, a);
    case AttentionType::kGqaDense:
      switch (a.method) {
        case AttentionMethod::kDense:
          return NewGqaDenseAttention(shapes);
        case AttentionMethod::kQuest:
          return NewQuestAttention(shapes, a);
        case AttentionMethod::kMagicPig: {
          const size_t want =
              size_t(a.lsh_bits) * a.lsh_tables * size_t(config.head_dim);
          if (weights.lsh_hyperplanes.size() != want) {
            return absl::InvalidArgumentError(absl::StrCat(
                "magicpig needs model.lsh_hyperplanes [", a.lsh_bits, "*",
                a.lsh_tables, ", ", config.head_dim, "] (", want,
                " values); got ", weights.lsh_hyperplanes.size()));
          }
          return NewMagicPigAttention(shapes, a, weights.lsh_hyperplanes);
        }
        case AttentionMethod::kClusterKv:
          return NewClusterKvAttention(shapes, a);
      }
  }
  return absl::InvalidArgumentError("unknown attention type or method");
}

absl::StatusOr<MethodWeights> LoadMethodWeights(const std::string& model_dir,
                                                const ModelConfig& config) {
  MethodWeights w;
  if (config.attention.type != AttentionType::kGqaDense ||
      config.attention.method != AttentionMethod::kMagicPig) {
    return w;
  }
  const std::string path = model_dir + "/model.safetensors";
  ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
  const char* name = "model.lsh_hyperplanes";
  const TensorView* t = file->Find(name);
  if (t == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": missing tensor '", name, "'"));
  }
  const int64_t rows =
      int64_t{config.attention.lsh_bits} * config.attention.lsh_tables;
  if (t->shape.size() != 2 || t->shape[0] != rows ||
      t->shape[1] != config.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", name,
                                                   "' must be [", rows, ", ",
                                                   config.head_dim, "]"));
  }
  w.lsh_hyperplanes = t->ToFloat();
  return w;
}

std::unique_ptr<AttentionSessionState> NewAttentionSessionState(
    const SparseAttention& method, int num_layers) {
  auto st = std::make_unique<AttentionSessionState>();
  st->layers.resize(num_layers);
  for (int l = 0; l < num_layers; ++l) {
    if (method.SparseLayer(l)) st->layers[l] = method.NewLayerState();
  }
  return st;
}

absl::Status RunAttentionLayer(const SparseAttention& method, int layer,
                               int pos_start, int n, const AttnInputs& in,
                               bool ends_prefill, SessionCache* cache,
                               AttentionSessionState* state, float* out,
                               KernelCost* cost) {
  const AttnShapes& s = method.shapes();
  if (pos_start < 0 || n <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad segment: pos_start ", pos_start, ", n ", n));
  }
  if (layer < 0 || layer >= int(state->layers.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " out of range"));
  }
  if (pos_start > cache->length(layer)) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, " holds ", cache->length(layer),
                     " positions; a segment cannot start at ", pos_start));
  }
  RETURN_IF_ERROR(cache->WriteKvRun(layer, pos_start, n, in.kv));
  cache->SetLength(layer, pos_start + n);
  const LayerView view = cache->View(layer);
  KernelCost local;
  KernelCost* c = cost != nullptr ? cost : &local;
  MethodLayerState* st = state->layers[layer].get();
  const bool sparse = method.SparseLayer(layer);
  if (sparse) method.OnAppend(view, pos_start, n, st, c);
  std::vector<HeadSelection> heads;
  for (int i = 0; i < n; ++i) {
    const int pos = pos_start + i;
    const float* q = in.q + size_t(i) * s.heads * s.q_dim;
    if (sparse) {
      method.Select(view, pos, q, st, &heads, c);
    } else {
      method.SelectDense(pos, &heads);
    }
    method.Attend(view, q, heads, out + size_t(i) * s.heads * s.out_dim, c);
  }
  if (sparse && ends_prefill) method.OnPrefillEnd(view, st, c);
  return absl::OkStatus();
}

}  // namespace karat
