// gqa_block (MODEL.md, MiniMax-M3 style): block top-k over the mean index
// key of each block of `block_size` tokens, per KV-head group.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include "common/core_pool.h"
#include "common/huge_page_vector.h"
#include "common/numeric.h"
#include "common/simd_reduce.h"
#include "common/sparse_attention.h"

// GCC 12 reports its own AVX-512 intrinsic headers (_mm512_undefined_*)
// as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace karat {
namespace {

// Software prefetch distance of the block-sum stream (into L2): the
// hardware prefetcher alone keeps too few lines in flight for one core.
// Two 16-block steps (4 KiB each with two KV heads of 32 channels),
// requested block by block as the step reads its own. Measured with the
// steps read in line order (below), cold, eight sessions on two cores:
// 1 to 4 steps ahead into L2 or L1 all stream within the noise of each
// other; without software prefetch the medians were alike but the best
// runs slower (54 against 69-72 GB/s, five runs each).
constexpr size_t kPrefetchAhead = 8192;

// Per block and KV head the fp32 sum of the block's cached (bf16) index keys
// in position order, and the block's token count.
class BlockState final : public MethodLayerState {
 public:
  HugePageVector<float> sums;  // blocks x Hkv x Di
  std::vector<int> counts;     // blocks
  // Blocks 0 .. full - 1 hold block_size tokens each (every block but the
  // last one appended, in practice): their 1 / count is one constant, and
  // Select does not read their counts.
  int full = 0;
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
          Bf16ToFloat(view.Part(t, GqaEntry::IndexKeyPart(shapes_, g)), di,
                      k.data());
          float* sg = sum + size_t(g) * di;
          for (int c = 0; c < di; ++c) sg[c] += k[c];
        }
      }
      st->counts[b] = end - b * block_;
      cost->bytes += double(end - b * block_) * per_block * 2;
      cost->flops += double(end - b * block_) * per_block;
    }
    st->full = std::min(st->full, b0);
    while (st->full <= b1 && st->counts[st->full] == block_) ++st->full;
  }

  void Select(const LayerView& view, int pos, const float* q,
              const MethodLayerState* state, std::vector<HeadSelection>* heads,
              KernelCost* cost, CorePool* pool) const override {
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
    // reduction (as _mm512_reduce_add_ps). One pass over the block sums
    // serves every query head of every group.
    const int chunks = (di + 15) / 16;
    const __mmask16 tail =
        (di % 16) == 0 ? __mmask16(0xFFFF) : __mmask16((1u << (di % 16)) - 1);
    thread_local std::vector<float> qg_buf, score_buf;
    qg_buf.assign(size_t(hkv) * chunks * 16, 0.0f);
    for (int g = 0; g < hkv; ++g) {
      float* qg = &qg_buf[size_t(g) * chunks * 16];
      for (int h = g * group; h < (g + 1) * group; ++h) {
        const float* qi = q + size_t(h) * shapes_.q_dim + d;
        for (int c = 0; c < di; ++c) qg[c] += qi[c];
      }
    }
    // With two KV heads of 32 channels, 16 blocks a step: per group the 16
    // blocks' dots are reduced together (block b + L in lane L), scaled by
    // 1 / count (a vector division, correctly rounded like the scalar
    // one) and, for the usual small top-k, offered to the group's
    // RunningTopK instead of being stored.
    const bool fast16 = chunks == 2 && tail == __mmask16(0xFFFF) && hkv == 2;
    // A decode step's lone token splits the 16-block steps over the pool's
    // cores, each storing its steps' scores; SelectTopK then takes each
    // group's top-k from them, as RunningTopK would have (the same
    // positions).
    CorePool* split =
        fast16 && cur >= 32 ? PoolFor(pool, double(cur) * H * di) : nullptr;
    const bool running =
        split == nullptr && fast16 && topk_ > 0 && topk_ <= RunningTopK::kMaxK;
    thread_local std::vector<RunningTopK> tops;
    if (running) {
      tops.resize(hkv);
      for (auto& t : tops) t.Reset(topk_, cur);
    } else {
      score_buf.resize(size_t(hkv) * cur);
    }
    float* score = score_buf.data();
    // Blocks below `full` hold block_ tokens: 1 / block_ (the division
    // 1 / count gives for them), without reading their counts.
    const int full = std::min(st->full, cur);
    const float inv_full = 1.0f / float(block_);
    int64_t counts_read = 0;
    std::atomic<int64_t> step_counts_read{0};  // the steps' own, any core
    auto inv_of = [&](int b) {
      if (b < full) return inv_full;
      ++counts_read;
      return 1.0f / float(st->counts[b]);
    };
    if (chunks == 2 && tail == __mmask16(0xFFFF) && hkv <= 8) {
      __m512 qv[16];
      for (int g = 0; g < hkv; ++g) {
        qv[2 * g] = _mm512_loadu_ps(&qg_buf[size_t(g) * 32]);
        qv[2 * g + 1] = _mm512_loadu_ps(&qg_buf[size_t(g) * 32 + 16]);
      }
      // The 16-block steps of blocks [b_begin, b_end) (multiples of 16).
      auto steps = [&](int b_begin, int b_end) {
        const size_t block_bytes = per_block * sizeof(float);
        const char* base = reinterpret_cast<const char*>(st->sums.data());
        const char* pf_end = base + size_t(cur) * block_bytes;
        const __m512 inv16_full = _mm512_set1_ps(inv_full);
        int64_t counts = 0;
        for (int b = b_begin; b < b_end; b += 16) {
          // The step's 16 blocks are 64 lines; the lines a whole number of
          // steps further on are prefetched as this step reads its own,
          // in the same order.
          const char* pf = base + size_t(b) * block_bytes + kPrefetchAhead;
          const bool prefetch = pf + 16 * block_bytes <= pf_end;
          __m512 inv = inv16_full;
          if (b + 16 > full) {
            inv = _mm512_div_ps(
                _mm512_set1_ps(1.0f),
                _mm512_cvtepi32_ps(_mm512_loadu_si512(&st->counts[b])));
            counts += 16;
          }
          // Both groups' dots of a block at once, so the step's lines are
          // read in address order (a block's 4 lines, then the next
          // block's): reading one group's half of every block and then the
          // other's streamed ~22% slower from DRAM (eight sessions on two
          // cores, cold: 43 against 55 GB/s, medians of eight runs).
          __m512 acc0[16], acc1[16];
          for (int bb = 0; bb < 16; ++bb) {
            if (prefetch) {
              const char* l = pf + bb * block_bytes;
              for (int k = 0; k < 4; ++k) _mm_prefetch(l + 64 * k, _MM_HINT_T1);
            }
            const float* sb = &st->sums[size_t(b + bb) * per_block];
            acc0[ReduceSlot(bb)] =
                _mm512_fmadd_ps(qv[1], _mm512_loadu_ps(sb + 16),
                                _mm512_mul_ps(qv[0], _mm512_loadu_ps(sb)));
            acc1[ReduceSlot(bb)] =
                _mm512_fmadd_ps(qv[3], _mm512_loadu_ps(sb + 48),
                                _mm512_mul_ps(qv[2], _mm512_loadu_ps(sb + 32)));
          }
          const __m512 r[2] = {_mm512_mul_ps(ReduceAdd16(acc0), inv),
                               _mm512_mul_ps(ReduceAdd16(acc1), inv)};
          for (int g = 0; g < 2; ++g) {
            if (running) {
              tops[g].Offer16(r[g], b);
            } else {
              _mm512_storeu_ps(score + size_t(g) * cur + b, r[g]);
            }
          }
        }
        step_counts_read.fetch_add(counts, std::memory_order_relaxed);
      };
      int b = 0;
      if (fast16) {
        const int nsteps = cur / 16;
        if (split != nullptr) {
          ParallelFor(split, nsteps, 1, [&](int64_t s0, int64_t s1) {
            steps(int(s0) * 16, int(s1) * 16);
          });
        } else {
          steps(0, nsteps * 16);
        }
        b = nsteps * 16;
      }
      // Running: the last cur % 16 blocks' scores (fast16 only), offered
      // together.
      alignas(64) float rest[2][16] = {};
      const int b_rest = b;
      for (; b < cur; ++b) {
        const float* sb = &st->sums[size_t(b) * per_block];
        const float inv = inv_of(b);
        for (int g = 0; g < hkv; ++g) {
          __m512 acc = _mm512_mul_ps(qv[2 * g], _mm512_loadu_ps(sb + 32 * g));
          acc = _mm512_fmadd_ps(qv[2 * g + 1],
                                _mm512_loadu_ps(sb + 32 * g + 16), acc);
          const float x = _mm512_reduce_add_ps(acc) * inv;
          if (running) {
            rest[g][b - b_rest] = x;
          } else {
            score[size_t(g) * cur + b] = x;
          }
        }
      }
      if (running && b_rest < cur) {
        for (int g = 0; g < hkv; ++g) {
          tops[g].Offer16(_mm512_load_ps(rest[g]), b_rest);
        }
      }
    } else {
      for (int b = 0; b < cur; ++b) {
        const float* sb = &st->sums[size_t(b) * per_block];
        const float inv = inv_of(b);
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
      if (running) {
        tops[g].Take(&top);
      } else {
        SelectTopK(score + size_t(g) * cur, cur, topk_, &top);
      }
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
    cost->bytes +=
        double(cur) * per_block * 4 +
        double(counts_read + step_counts_read.load(std::memory_order_relaxed)) *
            4;
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
