#include "common/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/numeric.h"
#include "common/status_macros.h"

namespace karat {
namespace {

// fp8 e4m3 code -> float, built once.
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) v[i] = Fp8E4M3ToFloat(uint8_t(i));
  }
};
const Fp8Table& Fp8Lut() {
  static const Fp8Table t;
  return t;
}

float Bf16(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

AttnShapes MakeAttnShapes(const ModelConfig& c) {
  AttnShapes s;
  s.heads = c.num_attention_heads;
  if (c.attention.type == AttentionType::kMlaDsa) {
    s.kv_lora = c.kv_lora_rank;
    s.rope = c.qk_rope_head_dim;
    s.kv_dim = s.kv_lora + s.rope;
    s.q_dim = s.kv_dim;
    s.out_dim = s.kv_lora;
    s.index_heads = c.index_n_heads;
    s.index_dim = c.index_head_dim;
    s.index_topk = c.index_topk;
    s.softmax_scale =
        1.0f / std::sqrt(float(c.qk_nope_head_dim + c.qk_rope_head_dim));
  }
  return s;
}

// Keys are scored in blocks of kBlock positions. Each block's decoded keys
// are laid out transposed ([dim][position]) so that the inner loops run
// across positions: every lane computes exactly the scalar chain
// dot = fma(q[d], k[d], dot) over increasing d, and the compiler vectorises
// without reassociating anything. The result is therefore the same as one
// position at a time, whatever the block boundaries.
constexpr int kBlock = 64;

void IndexerScore(const LayerView& view, int n, const uint8_t* q_codes,
                  const float* q_scales, const float* weights, int heads,
                  int dim, float* scores) {
  const float* lut = Fp8Lut().v;
  const float dim_scale = 1.0f / std::sqrt(float(dim));
  std::vector<float> q(size_t(heads) * dim);
  for (size_t i = 0; i < q.size(); ++i) q[i] = lut[q_codes[i]];
  std::vector<float> hw(heads);
  for (int h = 0; h < heads; ++h) hw[h] = weights[h] * dim_scale;
  std::vector<float> kt(size_t(dim) * kBlock);
  alignas(64) float ks[kBlock] = {}, dot[kBlock], acc[kBlock];
  for (int s0 = 0; s0 < n; s0 += kBlock) {
    const int b = std::min(kBlock, n - s0);
    for (int j = 0; j < b; ++j) {
      const uint8_t* kc = view.IndexKey(s0 + j);
      for (int d = 0; d < dim; ++d) kt[size_t(d) * kBlock + j] = lut[kc[d]];
      ks[j] = view.IndexScale(s0 + j);
    }
    for (int j = 0; j < kBlock; ++j) acc[j] = 0.0f;
    for (int h = 0; h < heads; ++h) {
      const float* qh = &q[size_t(h) * dim];
      for (int j = 0; j < kBlock; ++j) dot[j] = 0.0f;
      for (int d = 0; d < dim; ++d) {
        const float qd = qh[d];
        const float* col = &kt[size_t(d) * kBlock];
        for (int j = 0; j < kBlock; ++j) dot[j] = std::fma(qd, col[j], dot[j]);
      }
      const float qs = q_scales[h], w = hw[h];
      for (int j = 0; j < kBlock; ++j) {
        const float v = dot[j] * qs * ks[j];
        acc[j] = std::fma(w, v > 0.0f ? v : 0.0f, acc[j]);
      }
    }
    for (int j = 0; j < b; ++j) scores[s0 + j] = acc[j];
  }
}

void SelectTopK(const float* scores, int n, int k, std::vector<int32_t>* out) {
  out->clear();
  if (n <= 0) return;
  if (k >= n) {
    out->resize(n);
    std::iota(out->begin(), out->end(), 0);
    return;
  }
  if (k <= 0) return;
  std::vector<int32_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  // Higher score first; equal scores (-0.0 == +0.0) to the lower position.
  auto better = [scores](int32_t a, int32_t b) {
    if (scores[a] != scores[b]) return scores[a] > scores[b];
    return a < b;
  };
  std::nth_element(idx.begin(), idx.begin() + (k - 1), idx.end(), better);
  idx.resize(k);
  std::sort(idx.begin(), idx.end());
  *out = std::move(idx);
}

void MlaAttend(const LayerView& view, const int32_t* sel, int nsel,
               const float* q, const AttnShapes& shapes, float* o_lat) {
  const int kv_dim = shapes.kv_dim;
  const int lora = shapes.kv_lora;
  // Gather: decode the selected entries once for all heads, row-major (for
  // the weighted sum) and transposed (for the scores; see IndexerScore).
  const int npad = (nsel + 15) / 16 * 16;
  std::vector<float> ent(size_t(nsel) * kv_dim);
  std::vector<float> entt(size_t(kv_dim) * npad, 0.0f);
  for (int j = 0; j < nsel; ++j) {
    const uint16_t* e = view.Kv(sel[j]);
    float* dst = &ent[size_t(j) * kv_dim];
    for (int d = 0; d < kv_dim; ++d) {
      dst[d] = Bf16(e[d]);
      entt[size_t(d) * npad + j] = dst[d];
    }
  }
  std::vector<float> s(npad);
  for (int h = 0; h < shapes.heads; ++h) {
    const float* qh = q + size_t(h) * shapes.q_dim;
    std::fill(s.begin(), s.end(), 0.0f);
    for (int d = 0; d < kv_dim; ++d) {
      const float qd = qh[d];
      const float* col = &entt[size_t(d) * npad];
      for (int j = 0; j < npad; ++j) s[j] = std::fma(qd, col[j], s[j]);
    }
    float m = -INFINITY;
    for (int j = 0; j < nsel; ++j) {
      s[j] = s[j] * shapes.softmax_scale;
      m = std::max(m, s[j]);
    }
    float z = 0.0f;
    for (int j = 0; j < nsel; ++j) {
      s[j] = std::exp(s[j] - m);
      z += s[j];
    }
    float* oh = o_lat + size_t(h) * shapes.out_dim;
    std::fill(oh, oh + lora, 0.0f);
    const float inv = 1.0f / z;
    for (int j = 0; j < nsel; ++j) {
      const float p = s[j] * inv;
      const float* e = &ent[size_t(j) * kv_dim];
      for (int d = 0; d < lora; ++d) oh[d] = std::fma(p, e[d], oh[d]);
    }
  }
}

absl::Status RunIndexer(const AttnShapes& shapes, int layer, int pos_start,
                        int n, const IndexInputs& in, SessionCache* cache,
                        SelectionState* sel) {
  if (shapes.index_dim == 0) {
    return absl::FailedPreconditionError("the model has no DSA indexer");
  }
  if (pos_start < 0 || n <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad segment: pos_start ", pos_start, ", n ", n));
  }
  if (pos_start > cache->length(layer)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", layer, " holds ", cache->length(layer),
        " positions; a segment cannot start at ", pos_start));
  }
  const int hi = shapes.index_heads, di = shapes.index_dim;
  for (int i = 0; i < n; ++i) {
    RETURN_IF_ERROR(cache->WriteIndexKey(layer, pos_start + i,
                                         in.k_codes + size_t(i) * di,
                                         in.k_scales[i]));
  }
  // Index keys of this layer are valid up to pos_start + n; the KV entries
  // follow in RunAttention, which sets the layer's length.
  const LayerView view = cache->View(layer);
  sel->pos_start = pos_start;
  sel->per_token.resize(n);
  std::vector<float> scores(size_t(pos_start) + n);
  for (int i = 0; i < n; ++i) {
    const int ctx = pos_start + i + 1;
    IndexerScore(view, ctx, in.q_codes + size_t(i) * hi * di,
                 in.q_scales + size_t(i) * hi, in.weights + size_t(i) * hi, hi,
                 di, scores.data());
    SelectTopK(scores.data(), ctx, shapes.index_topk, &sel->per_token[i]);
  }
  return absl::OkStatus();
}

absl::Status RunAttention(const AttnShapes& shapes, int layer, int pos_start,
                          int n, const AttnInputs& in, SessionCache* cache,
                          const SelectionState* sel, float* out) {
  if (shapes.kv_dim == 0) {
    return absl::UnimplementedError(
        "only the mla_dsa attention form is served by this build");
  }
  if (pos_start < 0 || n <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad segment: pos_start ", pos_start, ", n ", n));
  }
  if (pos_start > cache->length(layer)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", layer, " holds ", cache->length(layer),
        " positions; a segment cannot start at ", pos_start));
  }
  if (sel != nullptr &&
      (sel->pos_start != pos_start || int(sel->per_token.size()) != n)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", layer, ": no index selection for positions ", pos_start,
        "..", pos_start + n - 1));
  }
  for (int i = 0; i < n; ++i) {
    RETURN_IF_ERROR(cache->WriteKv(layer, pos_start + i,
                                   in.kv + size_t(i) * shapes.kv_dim));
  }
  cache->SetLength(layer, pos_start + n);
  const LayerView view = cache->View(layer);
  std::vector<int32_t> dense;
  for (int i = 0; i < n; ++i) {
    const int32_t* positions;
    int count;
    if (sel != nullptr) {
      positions = sel->per_token[i].data();
      count = static_cast<int>(sel->per_token[i].size());
    } else {
      dense.resize(pos_start + i + 1);
      std::iota(dense.begin(), dense.end(), 0);
      positions = dense.data();
      count = static_cast<int>(dense.size());
    }
    MlaAttend(view, positions, count, in.q + size_t(i) * shapes.heads * shapes.q_dim,
              shapes, out + size_t(i) * shapes.heads * shapes.out_dim);
  }
  return absl::OkStatus();
}

}  // namespace karat
