// gqa_dense, method `quest` (MODEL.md; Tang et al., "Quest: Query-Aware
// Sparsity for Efficient Long-Context LLM Inference", §3): per page of
// `page_size` tokens (the method's page, not the store's) and KV head the
// per-channel min and max of the cached keys; each query head takes the
// pages with the highest upper bound of q . k.
#include <algorithm>
#include <cmath>
#include <limits>

#include <immintrin.h>

#include "common/huge_page_vector.h"
#include "common/numeric.h"
#include "common/simd_reduce.h"
#include "common/sparse_attention.h"

// GCC 12 reports its own AVX-512 intrinsic headers (_mm512_undefined_*)
// as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace karat {

// Channel i adds max(q_i M_i, q_i m_i) to lane i % 16 (channels padded with
// zeros to a multiple of 16); the 16 lanes are then summed by halving
// (lane i + lane i+8, then +4, +2, +1). Select's vector kernel evaluates
// exactly this.
float QuestBound(const float* q, const float* min, const float* max, int d) {
  float lane[16] = {};
  const int padded = (d + 15) / 16 * 16;
  for (int i = 0; i < padded; ++i) {
    lane[i % 16] += i < d ? std::max(q[i] * max[i], q[i] * min[i]) : 0.0f;
  }
  for (int w = 8; w >= 1; w /= 2) {
    for (int i = 0; i < w; ++i) lane[i] += lane[i + w];
  }
  return lane[0];
}

namespace {

class QuestState final : public MethodLayerState {
 public:
  // Per page and KV head the d channel minima, then the d maxima: one
  // stream in page order for Select.
  HugePageVector<float> bounds;  // pages x Hkv x [min d | max d]
  size_t bytes() const override {
    return bounds.size() * sizeof(float);
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
    const size_t per_page = size_t(hkv) * 2 * d;
    const int p0 = pos_start / page_, p1 = (pos_start + n - 1) / page_;
    st->bounds.resize(size_t(p1 + 1) * per_page);
    std::vector<float> k(d);
    for (int p = p0; p <= p1; ++p) {
      float* page = &st->bounds[size_t(p) * per_page];
      for (int g = 0; g < hkv; ++g) {
        std::fill(page + size_t(g) * 2 * d, page + size_t(g) * 2 * d + d,
                  std::numeric_limits<float>::infinity());
        std::fill(page + size_t(g) * 2 * d + d, page + size_t(g + 1) * 2 * d,
                  -std::numeric_limits<float>::infinity());
      }
      const int end = std::min((p + 1) * page_, view.length);
      for (int t = p * page_; t < end; ++t) {
        for (int g = 0; g < hkv; ++g) {
          Bf16ToFloat(view.Kv(t) + GqaEntry::K(shapes_, g), d, k.data());
          float* mn = page + size_t(g) * 2 * d;
          float* mx = mn + d;
          for (int c = 0; c < d; ++c) {
            mn[c] = std::min(mn[c], k[c]);
            mx[c] = std::max(mx[c], k[c]);
          }
        }
      }
      cost->bytes += double(end - p * page_) * hkv * d * 2;
      cost->flops += double(end - p * page_) * hkv * d * 2;
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
    const size_t per_page = size_t(hkv) * 2 * d;
    heads->resize(H);
    // One pass over the pages' min/max serves every query head: per page
    // and KV head the group's bounds (QuestBound's arithmetic, 16 channels
    // a vector) land in bound[h * cur + p].
    const int chunks = (d + 15) / 16;
    const __mmask16 tail =
        (d % 16) == 0 ? __mmask16(0xFFFF) : __mmask16((1u << (d % 16)) - 1);
    thread_local std::vector<float> bound_buf, q_buf;
    bound_buf.resize(size_t(H) * cur);
    q_buf.assign(size_t(H) * chunks * 16, 0.0f);
    for (int h = 0; h < H; ++h) {
      std::copy(q + size_t(h) * shapes_.q_dim, q + size_t(h) * shapes_.q_dim + d,
                &q_buf[size_t(h) * chunks * 16]);
    }
    float* bound = bound_buf.data();
    const float* qp = q_buf.data();
    if (chunks == 4 && tail == __mmask16(0xFFFF) && group == 4) {
      // max(q M, q m) is q M where q >= 0 (M >= m, and rounding keeps the
      // order) and q m elsewhere: one blend by the sign of q instead of a
      // second product and a max. Where the two are equal but for the sign
      // of zero, the lane sum, which starts at +0 and is never -0, does not
      // see the difference, so every bound keeps QuestBound's bits.
      thread_local std::vector<__mmask16> pos_buf;
      pos_buf.resize(size_t(H) * 4);
      for (int h = 0; h < H; ++h) {
        for (int j = 0; j < 4; ++j) {
          pos_buf[size_t(h) * 4 + j] = _mm512_cmp_ps_mask(
              _mm512_loadu_ps(qp + size_t(h) * 64 + 16 * j),
              _mm512_setzero_ps(), _CMP_GE_OQ);
        }
      }
      // Four pages at a time, one KV head after the other (the four pages'
      // metadata, 4 KiB in one run, stays in L1 between them): 16 (head,
      // page) sums reduced together; head k's bounds of pages p..p+3 form
      // lane group k.
      // The stream is also prefetched a few pages ahead: on its own the
      // hardware prefetcher keeps too few lines in flight for one core.
      const int p4 = cur / 4 * 4;
      constexpr int kAheadPages = 16;
      for (int p = 0; p < p4; p += 4) {
        if (p + kAheadPages < cur) {
          const int pf_end = std::min(cur, p + kAheadPages + 4);
          const char* a = reinterpret_cast<const char*>(
              &st->bounds[size_t(p + kAheadPages) * per_page]);
          const size_t bytes =
              size_t(pf_end - p - kAheadPages) * per_page * sizeof(float);
          for (size_t off = 0; off < bytes; off += 64) {
            _mm_prefetch(a + off, _MM_HINT_T0);
          }
        }
        for (int g = 0; g < hkv; ++g) {
          const float* qg = qp + size_t(g * group) * 64;
          const __mmask16* mg = &pos_buf[size_t(g * group) * 4];
          __m512 acc[16];
          for (int pp = 0; pp < 4; ++pp) {
            const size_t o = size_t(p + pp) * per_page + size_t(g) * 2 * d;
            const float* mn = &st->bounds[o];
            const float* mx = mn + d;
            __m512 vmn[4], vmx[4];
            for (int j = 0; j < 4; ++j) {
              vmn[j] = _mm512_loadu_ps(mn + 16 * j);
              vmx[j] = _mm512_loadu_ps(mx + 16 * j);
            }
            for (int k = 0; k < 4; ++k) {
              __m512 a = _mm512_setzero_ps();
              for (int j = 0; j < 4; ++j) {
                const __m512 qv = _mm512_loadu_ps(qg + k * 64 + 16 * j);
                const __m512 bound =
                    _mm512_mask_blend_ps(mg[k * 4 + j], vmn[j], vmx[j]);
                a = _mm512_add_ps(a, _mm512_mul_ps(qv, bound));
              }
              acc[ReduceSlot(4 * k + pp)] = a;
            }
          }
          const __m512 r = ReduceAdd16(acc);
          float* b0 = bound + size_t(g * group) * cur + p;
          _mm_storeu_ps(b0, _mm512_castps512_ps128(r));
          _mm_storeu_ps(b0 + cur, _mm512_extractf32x4_ps(r, 1));
          _mm_storeu_ps(b0 + 2 * size_t(cur), _mm512_extractf32x4_ps(r, 2));
          _mm_storeu_ps(b0 + 3 * size_t(cur), _mm512_extractf32x4_ps(r, 3));
        }
      }
      for (int p = p4; p < cur; ++p) {
        for (int g = 0; g < hkv; ++g) {
          const float* qg = qp + size_t(g * group) * 64;
          const size_t o = size_t(p) * per_page + size_t(g) * 2 * d;
          const float* mn = &st->bounds[o];
          const float* mx = mn + d;
          for (int k = 0; k < group; ++k) {
            __m512 acc = _mm512_setzero_ps();
            for (int j = 0; j < 4; ++j) {
              const __m512 qv = _mm512_loadu_ps(qg + k * 64 + 16 * j);
              acc = _mm512_add_ps(
                  acc,
                  _mm512_max_ps(_mm512_mul_ps(qv, _mm512_loadu_ps(mn + 16 * j)),
                                _mm512_mul_ps(qv, _mm512_loadu_ps(mx + 16 * j))));
            }
            bound[size_t(g * group + k) * cur + p] = _mm512_reduce_add_ps(acc);
          }
        }
      }
    } else {
      for (int p = 0; p < cur; ++p) {
        for (int g = 0; g < hkv; ++g) {
          const size_t o = size_t(p) * per_page + size_t(g) * 2 * d;
          const float* mn = &st->bounds[o];
          const float* mx = mn + d;
          for (int h = g * group; h < (g + 1) * group; ++h) {
            const float* qh = qp + size_t(h) * chunks * 16;
            __m512 acc = _mm512_setzero_ps();
            for (int j = 0; j < chunks; ++j) {
              const __mmask16 m = j + 1 == chunks ? tail : __mmask16(0xFFFF);
              const __m512 qv = _mm512_loadu_ps(qh + 16 * j);
              acc = _mm512_add_ps(
                  acc,
                  _mm512_max_ps(
                      _mm512_mul_ps(qv, _mm512_maskz_loadu_ps(m, mn + 16 * j)),
                      _mm512_mul_ps(qv, _mm512_maskz_loadu_ps(m, mx + 16 * j))));
            }
            bound[size_t(h) * cur + p] = _mm512_reduce_add_ps(acc);
          }
        }
      }
    }
    std::vector<int32_t> top;
    for (int h = 0; h < H; ++h) {
      SelectTopK(bound + size_t(h) * cur, cur, budget_ - 1, &top);
      top.push_back(cur);  // the page holding the token, always taken
      HeadSelection& sel = (*heads)[h];
      sel.positions.clear();
      sel.bias.clear();
      for (int32_t p : top) {
        const int end = std::min((p + 1) * page_, pos + 1);
        for (int t = p * page_; t < end; ++t) sel.positions.push_back(t);
      }
    }
    cost->bytes += double(cur) * per_page * sizeof(float);
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
