// gqa_dense, method `quest` (MODEL.md; Tang et al., "Quest: Query-Aware
// Sparsity for Efficient Long-Context LLM Inference", §3): per page of
// `page_size` tokens (the method's page, not the store's) and KV head the
// per-channel min and max of the cached keys; each query head takes the
// pages with the highest upper bound of q . k.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/core_pool.h"
#include "common/huge_page_vector.h"
#include "common/numeric.h"
#include "common/simd_reduce.h"
#include "common/sparse_attention.h"

// GCC 12 reports its own AVX-512 intrinsic headers (_mm512_undefined_*)
// as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace karat {

// max(q_i M_i, q_i m_i) is q_i M_i where q_i >= 0 (M_i >= m_i) and q_i m_i
// elsewhere (NaN q_i: q_i m_i). The terms are added in channel order, each
// with one rounding (an fma of the exact product), starting from +0.
// Select's vector kernel evaluates exactly this, one page a lane.
float QuestBound(const float* q, const float* min, const float* max, int d) {
  float acc = 0.0f;
  for (int i = 0; i < d; ++i) {
    acc = std::fma(q[i], q[i] >= 0 ? max[i] : min[i], acc);
  }
  return acc;
}

namespace {

// The metadata is stored kGroupPages pages at a time, transposed: per
// group, KV head and channel the group's minima, then its maxima, one page
// a lane. The scoring pass reads, per query head and channel, the vectors
// that the sign of q picks (the choice is an address, made once per
// Select) into one fma chain per page lane: no blends, no horizontal sums,
// and one forward stream over the whole metadata.
constexpr int kGroupPages = 64;
// Software prefetch distance of that stream (into L2): the hardware
// prefetcher alone keeps too few lines in flight for one core.
constexpr size_t kPrefetchAhead = 4096;

class QuestState final : public MethodLayerState {
 public:
  // groups x Hkv x d x [min | max] x kGroupPages. Lanes past the last
  // appended page are scored with the rest of their group but never
  // selected.
  HugePageVector<float> bounds;
  size_t bytes() const override { return bounds.size() * sizeof(float); }
};

// The bounds of one group's pages (from page `first`) for NH query heads of
// one KV head. `kv` is the KV head's [d][min | max][kGroupPages] block;
// pick[k * d + c] is the offset in `kv` of the vectors head k's q_c picks,
// q[k * d + c] that q_c. Each head's bounds go to top[k] (pages past its n
// left out) or, where top is null, to out[k * stride + lane]. Lines from
// `pf` on, while below `pf_end`, are prefetched: 8 a channel.
template <int NH>
void ScoreGroup(const float* kv, const int32_t* pick, const float* q, int d,
                const char* pf, const char* pf_end, int first, RunningTopK* top,
                float* out, size_t stride) {
  static_assert(kGroupPages == 64, "four vectors a head");
  static_assert(2 * kGroupPages * sizeof(float) == 8 * 64, "8 lines a channel");
  __m512 acc[NH][4];
  for (int k = 0; k < NH; ++k) {
    for (int j = 0; j < 4; ++j) acc[k][j] = _mm512_setzero_ps();
  }
  for (int c = 0; c < d; ++c) {
    if (pf < pf_end) {
      for (int l = 0; l < 8; ++l) _mm_prefetch(pf + 64 * l, _MM_HINT_T1);
    }
    pf += 2 * kGroupPages * sizeof(float);
    for (int k = 0; k < NH; ++k) {
      const float* v = kv + pick[k * d + c];
      const __m512 qv = _mm512_set1_ps(q[k * d + c]);
      for (int j = 0; j < 4; ++j) {
        acc[k][j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(v + 16 * j), acc[k][j]);
      }
    }
  }
  for (int k = 0; k < NH; ++k) {
    for (int j = 0; j < 4; ++j) {
      if (top != nullptr) {
        if (first + 16 * j < top[k].n()) {
          top[k].Offer16(acc[k][j], first + 16 * j);
        }
      } else {
        _mm512_storeu_ps(out + k * stride + 16 * j, acc[k][j]);
      }
    }
  }
}

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
    const size_t per_group = size_t(hkv) * d * 2 * kGroupPages;
    const int p0 = pos_start / page_, p1 = (pos_start + n - 1) / page_;
    st->bounds.resize((size_t(p1) / kGroupPages + 1) * per_group);
    std::vector<float> k(d);
    for (int p = p0; p <= p1; ++p) {
      float* group = &st->bounds[size_t(p / kGroupPages) * per_group];
      const int lane = p % kGroupPages;
      for (int g = 0; g < hkv; ++g) {
        for (int c = 0; c < d; ++c) {
          float* mn = group + (size_t(g) * d + c) * 2 * kGroupPages + lane;
          mn[0] = std::numeric_limits<float>::infinity();
          mn[kGroupPages] = -std::numeric_limits<float>::infinity();
        }
      }
      const int end = std::min((p + 1) * page_, view.length);
      for (int t = p * page_; t < end; ++t) {
        for (int g = 0; g < hkv; ++g) {
          Bf16ToFloat(view.Part(t, GqaEntry::KPart(shapes_, g)), d, k.data());
          float* mn = group + size_t(g) * d * 2 * kGroupPages + lane;
          for (int c = 0; c < d; ++c) {
            float* m = mn + size_t(c) * 2 * kGroupPages;
            m[0] = std::min(m[0], k[c]);
            m[kGroupPages] = std::max(m[kGroupPages], k[c]);
          }
        }
      }
      cost->bytes += double(end - p * page_) * hkv * d * 2;
      cost->flops += double(end - p * page_) * hkv * d * 2;
    }
  }

  void Select(const LayerView& view, int pos, const float* q,
              const MethodLayerState* state, std::vector<HeadSelection>* heads,
              KernelCost* cost, CorePool* pool) const override {
    const int cur = pos / page_;
    if (cur + 1 <= budget_) {  // the pages number at most page_budget
      SelectDense(pos, heads);
      return;
    }
    const auto* st = static_cast<const QuestState*>(state);
    const int H = shapes_.heads, hkv = shapes_.kv_heads, d = shapes_.head_dim;
    heads->resize(H);
    // KV heads are independent (each reads its own part of every group of
    // pages): split over the pool's cores where the bounds repay waking
    // them. The same selections.
    ParallelFor(PoolFor(pool, double(cur) * H * d), hkv, 1,
                [&](int64_t b, int64_t e) {
                  SelectKvHeads(*st, pos, q, int(b), int(e), heads);
                });
    cost->bytes += double(cur) * hkv * 2 * d * sizeof(float);
    cost->flops += double(cur) * H * d * 2;
  }

 private:
  // Select's take for the query heads of KV heads [g_begin, g_end), into
  // (*heads)[h] (sized already).
  void SelectKvHeads(const QuestState& state, int pos, const float* q,
                     int g_begin, int g_end,
                     std::vector<HeadSelection>* heads) const {
    const QuestState* st = &state;
    const int cur = pos / page_;
    const int H = shapes_.heads, hkv = shapes_.kv_heads, d = shapes_.head_dim;
    const int heads_per_kv = H / hkv;
    const int h_begin = g_begin * heads_per_kv, h_end = g_end * heads_per_kv;
    const size_t per_kv = size_t(d) * 2 * kGroupPages;
    const size_t per_group = size_t(hkv) * per_kv;
    const int groups = (cur + kGroupPages - 1) / kGroupPages;
    const size_t stride = size_t(groups) * kGroupPages;
    // Per query head and channel, q and the offset of the vector its sign
    // picks; then one pass over the groups serves every query head. For
    // the usual small budgets each head's top pages are kept as its bounds
    // come (RunningTopK); otherwise the bounds of head h land in
    // bound[h * stride + page] for SelectTopK.
    const int k = budget_ - 1;
    const bool running = k > 0 && k <= RunningTopK::kMaxK;
    thread_local std::vector<float> bound_buf, q_buf;
    thread_local std::vector<int32_t> pick_buf;
    thread_local std::vector<RunningTopK> tops;
    q_buf.resize(size_t(H) * d);
    pick_buf.resize(size_t(H) * d);
    for (int h = h_begin; h < h_end; ++h) {
      for (int c = 0; c < d; ++c) {
        const float x = q[size_t(h) * shapes_.q_dim + c];
        q_buf[size_t(h) * d + c] = x;
        pick_buf[size_t(h) * d + c] =
            int32_t((2 * c + (x >= 0 ? 1 : 0)) * kGroupPages);
      }
    }
    if (running) {
      tops.resize(H);
      for (auto& t : tops) t.Reset(k, cur);
    } else {
      bound_buf.resize(size_t(H) * stride);
    }
    const float* meta = st->bounds.data();
    const char* pf_end =
        reinterpret_cast<const char*>(meta + size_t(groups) * per_group);
    for (int G = 0; G < groups; ++G) {
      for (int g = g_begin; g < g_end; ++g) {
        const float* kv = meta + size_t(G) * per_group + size_t(g) * per_kv;
        const char* pf = reinterpret_cast<const char*>(kv) + kPrefetchAhead;
        for (int h0 = g * heads_per_kv; h0 < (g + 1) * heads_per_kv; h0 += 4) {
          const int nh = std::min(4, (g + 1) * heads_per_kv - h0);
          const int32_t* pick = &pick_buf[size_t(h0) * d];
          const float* qh = &q_buf[size_t(h0) * d];
          const int first = G * kGroupPages;
          RunningTopK* top = running ? &tops[h0] : nullptr;
          float* out =
              running ? nullptr : &bound_buf[size_t(h0) * stride + first];
          // The KV head's lines are prefetched once, with its first heads.
          const char* pf_stop = h0 == g * heads_per_kv ? pf_end : pf;
          switch (nh) {
            case 4:
              ScoreGroup<4>(kv, pick, qh, d, pf, pf_stop, first, top, out,
                            stride);
              break;
            case 3:
              ScoreGroup<3>(kv, pick, qh, d, pf, pf_stop, first, top, out,
                            stride);
              break;
            case 2:
              ScoreGroup<2>(kv, pick, qh, d, pf, pf_stop, first, top, out,
                            stride);
              break;
            default:
              ScoreGroup<1>(kv, pick, qh, d, pf, pf_stop, first, top, out,
                            stride);
              break;
          }
        }
      }
    }
    std::vector<int32_t> top;
    for (int h = h_begin; h < h_end; ++h) {
      if (running) {
        tops[h].Take(&top);
      } else {
        SelectTopK(&bound_buf[size_t(h) * stride], cur, k, &top);
      }
      top.push_back(cur);  // the page holding the token, always taken
      HeadSelection& sel = (*heads)[h];
      sel.positions.clear();
      sel.bias.clear();
      for (int32_t p : top) {
        const int end = std::min((p + 1) * page_, pos + 1);
        for (int t = p * page_; t < end; ++t) sel.positions.push_back(t);
      }
    }
  }

  const int page_, budget_;
};

}  // namespace

std::unique_ptr<SparseAttention> NewQuestAttention(const AttnShapes& s,
                                                   const AttentionConfig& a) {
  return std::make_unique<QuestAttention>(s, a);
}

}  // namespace karat
