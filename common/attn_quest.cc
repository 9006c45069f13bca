// gqa_dense, method `quest` (MODEL.md; Tang et al., "Quest: Query-Aware
// Sparsity for Efficient Long-Context LLM Inference", §3): per page of
// `page_size` tokens (the method's page, not the store's) and KV head the
// per-channel min and max of the cached keys; each query head takes the
// pages with the highest upper bound of q . k.
#include <algorithm>
#include <cmath>
#include <limits>

#include "common/numeric.h"
#include "common/sparse_attention.h"

namespace karat {

float QuestBound(const float* q, const float* min, const float* max, int d) {
  float u = 0.0f;
  for (int i = 0; i < d; ++i) u += std::max(q[i] * max[i], q[i] * min[i]);
  return u;
}

namespace {

class QuestState final : public MethodLayerState {
 public:
  std::vector<float> min, max;  // pages x Hkv x d
  size_t bytes() const override {
    return (min.size() + max.size()) * sizeof(float);
  }
};

class QuestAttention final : public SparseAttention {
 public:
  QuestAttention(const AttnShapes& s, const AttentionConfig& a)
      : SparseAttention(s), page_(a.page_size), budget_(a.page_budget) {}
  const char* name() const override { return "gqa_dense/quest"; }
  std::unique_ptr<MethodLayerState> NewLayerState() const override {
    return std::make_unique<QuestState>();
  }

  void OnAppend(const LayerView& view, int pos_start, int n,
                MethodLayerState* state, KernelCost* cost) const override {
    auto* st = static_cast<QuestState*>(state);
    const int hkv = shapes_.kv_heads, d = shapes_.head_dim;
    const size_t per_page = size_t(hkv) * d;
    const int p0 = pos_start / page_, p1 = (pos_start + n - 1) / page_;
    st->min.resize(size_t(p1 + 1) * per_page);
    st->max.resize(size_t(p1 + 1) * per_page);
    std::vector<float> k(d);
    for (int p = p0; p <= p1; ++p) {
      float* mn = &st->min[size_t(p) * per_page];
      float* mx = &st->max[size_t(p) * per_page];
      std::fill(mn, mn + per_page, std::numeric_limits<float>::infinity());
      std::fill(mx, mx + per_page, -std::numeric_limits<float>::infinity());
      const int end = std::min((p + 1) * page_, view.length);
      for (int t = p * page_; t < end; ++t) {
        for (int g = 0; g < hkv; ++g) {
          Bf16ToFloat(view.Kv(t) + GqaEntry::K(shapes_, g), d, k.data());
          for (int c = 0; c < d; ++c) {
            mn[g * d + c] = std::min(mn[g * d + c], k[c]);
            mx[g * d + c] = std::max(mx[g * d + c], k[c]);
          }
        }
      }
      cost->bytes += double(end - p * page_) * per_page * 2;
      cost->flops += double(end - p * page_) * per_page * 2;
    }
  }

  void Select(const LayerView& view, int pos, const float* q,
              const MethodLayerState* state, std::vector<HeadSelection>* heads,
              KernelCost* cost) const override {
    const int cur = pos / page_;
    if (cur + 1 <= budget_) {  // the pages number at most page_budget
      SelectDense(pos, heads);
      return;
    }
    const auto* st = static_cast<const QuestState*>(state);
    const int H = shapes_.heads, hkv = shapes_.kv_heads, d = shapes_.head_dim;
    const int group = H / hkv;
    const size_t per_page = size_t(hkv) * d;
    heads->resize(H);
    std::vector<float> bound(cur);
    std::vector<int32_t> top;
    for (int h = 0; h < H; ++h) {
      const int g = h / group;
      const float* qh = q + size_t(h) * shapes_.q_dim;
      for (int p = 0; p < cur; ++p) {
        const size_t o = size_t(p) * per_page + size_t(g) * d;
        bound[p] = QuestBound(qh, &st->min[o], &st->max[o], d);
      }
      SelectTopK(bound.data(), cur, budget_ - 1, &top);
      top.push_back(cur);  // the page holding the token, always taken
      HeadSelection& sel = (*heads)[h];
      sel.positions.clear();
      sel.bias.clear();
      for (int32_t p : top) {
        const int end = std::min((p + 1) * page_, pos + 1);
        for (int t = p * page_; t < end; ++t) sel.positions.push_back(t);
      }
    }
    cost->bytes += double(cur) * per_page * 2 * sizeof(float);
    cost->flops += double(cur) * H * d * 3;
  }

 private:
  const int page_, budget_;
};

}  // namespace

std::unique_ptr<SparseAttention> NewQuestAttention(const AttnShapes& s,
                                                   const AttentionConfig& a) {
  return std::make_unique<QuestAttention>(s, a);
}

}  // namespace karat
