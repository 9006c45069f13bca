// gqa_block (MODEL.md, MiniMax-M3 style): block top-k over the mean index
// key of each block of `block_size` tokens, per KV-head group.
#include <algorithm>
#include <cmath>

#include "common/numeric.h"
#include "common/sparse_attention.h"

namespace karat {
namespace {

// Per block and KV head the fp32 sum of the block's cached (bf16) index keys
// in position order, and the block's token count.
class BlockState final : public MethodLayerState {
 public:
  std::vector<float> sums;  // blocks x Hkv x Di
  std::vector<int> counts;  // blocks
  size_t bytes() const override {
    return sums.size() * sizeof(float) + counts.size() * sizeof(int);
  }
};

class GqaBlockAttention final : public SparseAttention {
 public:
  GqaBlockAttention(const AttnShapes& s, const AttentionConfig& a)
      : SparseAttention(s), block_(a.block_size), topk_(a.topk_blocks) {}
  const char* name() const override { return "gqa_block"; }
  // MiniMax-style block selection runs on every layer.
  bool SparseLayer(int) const override { return true; }
  std::unique_ptr<MethodLayerState> NewLayerState() const override {
    return std::make_unique<BlockState>();
  }

  void OnAppend(const LayerView& view, int pos_start, int n,
                MethodLayerState* state, KernelCost* cost) const override {
    auto* st = static_cast<BlockState*>(state);
    const int hkv = shapes_.kv_heads, di = shapes_.block_index_dim;
    const size_t per_block = size_t(hkv) * di;
    const int b0 = pos_start / block_, b1 = (pos_start + n - 1) / block_;
    st->sums.resize(size_t(b1 + 1) * per_block);
    st->counts.resize(b1 + 1);
    std::vector<float> k(di);
    // Every touched block is summed again from its first token, so a
    // block's sum is always the same position-order chain.
    for (int b = b0; b <= b1; ++b) {
      float* sum = &st->sums[size_t(b) * per_block];
      std::fill(sum, sum + per_block, 0.0f);
      const int end = std::min((b + 1) * block_, view.length);
      for (int t = b * block_; t < end; ++t) {
        for (int g = 0; g < hkv; ++g) {
          Bf16ToFloat(view.Kv(t) + GqaEntry::IndexKey(shapes_, g), di,
                      k.data());
          float* sg = sum + size_t(g) * di;
          for (int c = 0; c < di; ++c) sg[c] += k[c];
        }
      }
      st->counts[b] = end - b * block_;
      cost->bytes += double(end - b * block_) * per_block * 2;
      cost->flops += double(end - b * block_) * per_block;
    }
  }

  void Select(const LayerView& view, int pos, const float* q,
              const MethodLayerState* state, std::vector<HeadSelection>* heads,
              KernelCost* cost) const override {
    const int cur = pos / block_;
    if (cur <= topk_) {  // every block is taken
      SelectDense(pos, heads);
      return;
    }
    const auto* st = static_cast<const BlockState*>(state);
    const int H = shapes_.heads, hkv = shapes_.kv_heads;
    const int di = shapes_.block_index_dim, d = shapes_.head_dim;
    const int group = H / hkv;
    const size_t per_block = size_t(hkv) * di;
    heads->resize(H);
    std::vector<float> score(cur), mean(di);
    std::vector<int32_t> top;
    for (int g = 0; g < hkv; ++g) {
      // score[g,b] = sum_{h in g} q_i[h] . mean_b, heads in increasing order.
      for (int b = 0; b < cur; ++b) {
        const float* sum = &st->sums[size_t(b) * per_block + size_t(g) * di];
        const float cnt = float(st->counts[b]);
        for (int c = 0; c < di; ++c) mean[c] = sum[c] / cnt;
        float acc = 0.0f;
        for (int h = g * group; h < (g + 1) * group; ++h) {
          const float* qi = q + size_t(h) * shapes_.q_dim + d;
          float dot = 0.0f;
          for (int c = 0; c < di; ++c) dot = std::fma(qi[c], mean[c], dot);
          acc += dot;
        }
        score[b] = acc;
      }
      SelectTopK(score.data(), cur, topk_, &top);
      top.push_back(cur);  // the current block, always taken
      HeadSelection& first = (*heads)[g * group];
      first.positions.clear();
      first.bias.clear();
      for (int32_t b : top) {
        const int end = std::min((b + 1) * block_, pos + 1);
        for (int t = b * block_; t < end; ++t) first.positions.push_back(t);
      }
      for (int h = g * group + 1; h < (g + 1) * group; ++h) {
        (*heads)[h] = first;
      }
    }
    cost->bytes += double(cur) * per_block * 4;
    cost->flops += double(cur) * H * di * 2;
  }

 private:
  const int block_, topk_;
};

}  // namespace

std::unique_ptr<SparseAttention> NewGqaBlockAttention(
    const AttnShapes& s, const AttentionConfig& a) {
  return std::make_unique<GqaBlockAttention>(s, a);
}

}  // namespace karat
