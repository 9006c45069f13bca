// gqa_block (MODEL.md, MiniMax-M3 style): block top-k over the mean index
// key of each block of `block_size` tokens, per KV-head group.
#include <algorithm>
#include <cmath>

#include <immintrin.h>

#include "common/huge_page_vector.h"
#include "common/numeric.h"
#include "common/simd_reduce.h"
#include "common/sparse_attention.h"

// GCC 12 reports its own AVX-512 intrinsic headers (_mm512_undefined_*)
// as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace karat {
namespace {

// Per block and KV head the fp32 sum of the block's cached (bf16) index keys
// in position order, and the block's token count.
class BlockState final : public MethodLayerState {
 public:
  HugePageVector<float> sums;  // blocks x Hkv x Di
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
    // score[g,b] = sum_{h in g} q_i[h] . (sum_b / count_b), evaluated as
    // (qg . sum_b) * (1 / count_b) with qg = sum_{h in g} q_i[h] (heads in
    // increasing order): the dot runs over 16-channel chunks, one fma chain
    // per lane, zero-padded to a multiple of 16, then a fixed halving
    // reduction (BlockScore). One pass over the block sums serves every
    // query head of every group.
    const int chunks = (di + 15) / 16;
    const __mmask16 tail =
        (di % 16) == 0 ? __mmask16(0xFFFF) : __mmask16((1u << (di % 16)) - 1);
    thread_local std::vector<float> qg_buf, score_buf;
    qg_buf.assign(size_t(hkv) * chunks * 16, 0.0f);
    score_buf.resize(size_t(hkv) * cur);
    for (int g = 0; g < hkv; ++g) {
      float* qg = &qg_buf[size_t(g) * chunks * 16];
      for (int h = g * group; h < (g + 1) * group; ++h) {
        const float* qi = q + size_t(h) * shapes_.q_dim + d;
        for (int c = 0; c < di; ++c) qg[c] += qi[c];
      }
    }
    float* score = score_buf.data();
    if (chunks == 2 && tail == __mmask16(0xFFFF) && hkv <= 8) {
      __m512 qv[16];
      for (int g = 0; g < hkv; ++g) {
        qv[2 * g] = _mm512_loadu_ps(&qg_buf[size_t(g) * 32]);
        qv[2 * g + 1] = _mm512_loadu_ps(&qg_buf[size_t(g) * 32 + 16]);
      }
      int b = 0;
      if (hkv == 2) {
        // Eight blocks at a time: 16 (group, block) dots reduced together;
        // group g's blocks b..b+7 form lanes 8g..8g+7.
        for (; b + 8 <= cur; b += 8) {
          __m512 acc[16];
          for (int bb = 0; bb < 8; ++bb) {
            const float* sb = &st->sums[size_t(b + bb) * per_block];
            for (int g = 0; g < 2; ++g) {
              __m512 a =
                  _mm512_mul_ps(qv[2 * g], _mm512_loadu_ps(sb + 32 * g));
              acc[ReduceSlot(8 * g + bb)] = _mm512_fmadd_ps(
                  qv[2 * g + 1], _mm512_loadu_ps(sb + 32 * g + 16), a);
            }
          }
          __m512 inv;
          {
            alignas(64) float iv[16];
            for (int bb = 0; bb < 8; ++bb) {
              iv[bb] = iv[8 + bb] = 1.0f / float(st->counts[b + bb]);
            }
            inv = _mm512_load_ps(iv);
          }
          const __m512 r = _mm512_mul_ps(ReduceAdd16(acc), inv);
          _mm256_storeu_ps(score + b, _mm512_castps512_ps256(r));
          _mm256_storeu_ps(score + size_t(cur) + b,
                           _mm512_extractf32x8_ps(r, 1));
        }
      }
      for (; b < cur; ++b) {
        const float* sb = &st->sums[size_t(b) * per_block];
        const float inv = 1.0f / float(st->counts[b]);
        for (int g = 0; g < hkv; ++g) {
          __m512 acc = _mm512_mul_ps(qv[2 * g], _mm512_loadu_ps(sb + 32 * g));
          acc = _mm512_fmadd_ps(qv[2 * g + 1],
                                _mm512_loadu_ps(sb + 32 * g + 16), acc);
          score[size_t(g) * cur + b] = _mm512_reduce_add_ps(acc) * inv;
        }
      }
    } else {
      for (int b = 0; b < cur; ++b) {
        const float* sb = &st->sums[size_t(b) * per_block];
        const float inv = 1.0f / float(st->counts[b]);
        for (int g = 0; g < hkv; ++g) {
          const float* qg = &qg_buf[size_t(g) * chunks * 16];
          const float* sg = sb + size_t(g) * di;
          __m512 acc = _mm512_setzero_ps();
          for (int j = 0; j < chunks; ++j) {
            const __mmask16 m = j + 1 == chunks ? tail : __mmask16(0xFFFF);
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * j),
                                  _mm512_maskz_loadu_ps(m, sg + 16 * j), acc);
          }
          score[size_t(g) * cur + b] = _mm512_reduce_add_ps(acc) * inv;
        }
      }
    }
    std::vector<int32_t> top;
    for (int g = 0; g < hkv; ++g) {
      SelectTopK(score + size_t(g) * cur, cur, topk_, &top);
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
