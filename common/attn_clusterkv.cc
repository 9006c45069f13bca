// gqa_dense, method `clusterkv` (MODEL.md; Liu et al., "ClusterKV: Manipulating
// LLM KV Cache in Semantic Space for Recallable Compression", §3): after each
// turn's prefill the tokens not yet clustered are grouped per KV head by
// k-means under cosine similarity; a query takes whole clusters, best
// q . centroid first, up to a token budget.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

#include "common/core_pool.h"
#include "common/numeric.h"
#include "common/simd_reduce.h"
#include "common/sparse_attention.h"

// GCC 12 reports its own AVX-512 intrinsic headers (_mm512_undefined_*)
// as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace karat {
namespace {

struct Cluster {
  std::vector<float> centroid;   // d
  std::vector<int32_t> members;  // increasing positions
};

class ClusterState final : public MethodLayerState {
 public:
  int clustered_upto = 0;  // positions [sink, clustered_upto) are clustered
  std::vector<std::vector<Cluster>> heads;  // per KV head, creation order
  // Per KV head, its centroids transposed for Select, 16 clusters to a
  // block: [block][channel][16] (zeros past the last cluster).
  std::vector<std::vector<float>> centroids_t;
  size_t bytes() const override {
    size_t n = 0;
    for (const auto& t : centroids_t) n += t.size() * sizeof(float);
    for (const auto& h : heads) {
      for (const Cluster& c : h) {
        n += c.centroid.size() * sizeof(float) +
             c.members.size() * sizeof(int32_t);
      }
    }
    return n;
  }
};

float Dot(const float* a, const float* b, int d) {
  float s = 0.0f;
  for (int c = 0; c < d; ++c) s = std::fma(a[c], b[c], s);
  return s;
}

// Centroid j (d channels at c) into a transposed matrix t, 16 centroids to
// a block with each block's channels contiguous: t[((j / 16) d + ch) 16 +
// j % 16], the layout the assignment and Select read one vector at a time.
void PutTransposed(const float* c, size_t j, int d, float* t) {
  for (int ch = 0; ch < d; ++ch) t[((j / 16) * d + ch) * 16 + j % 16] = c[ch];
}

// Assigns each of the n rows x[i] (norm xn[i]) to the centroid of highest
// cosine similarity, cos = den > 0 ? (x_i . c_j) / den : 0 with den = xn[i]
// * cn[j] and the dot an fma chain over increasing channels from +0; ties
// (and NaN) keep the lower centroid, and a row whose every cos is NaN goes
// to centroid 0: what scanning j upwards with `cos > best` gives. The
// centroids are transposed, 16 to a vector (one lane each; each 16's
// channels contiguous), and kRows rows share each centroid load; each lane
// keeps its own best, and the lanes' bests are combined by value, then by the
// lowest index. The k-means of one KV head's 16K-token prefill (1024
// clusters, 10 rounds) takes ~0.15 s here, against ~6 s one centroid at a
// time; the assignment is the whole cost (n x k x d per round).
void AssignToCentroids(const float* x, const float* xn, int n,
                       const float* cent, const float* cn, int k, int d,
                       int* assign, CorePool* pool) {
  constexpr int kRows = 8;
  const int kpad = (k + 15) / 16 * 16;
  std::vector<float> ct_buf(size_t(d) * kpad, 0.0f), cnp_buf(kpad, 0.0f);
  for (int j = 0; j < k; ++j) {
    PutTransposed(cent + size_t(j) * d, j, d, ct_buf.data());
    cnp_buf[j] = cn[j];
  }
  const float* ct = ct_buf.data();
  const float* cnp = cnp_buf.data();
  // Rows in blocks of kRows, the blocks split over the pool's cores: each
  // row's choice depends on that row alone.
  ParallelFor(pool, (n + kRows - 1) / kRows, 1, [&](int64_t b0, int64_t b1) {
    const __m512i lane =
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int i0 = int(b0) * kRows; i0 < std::min<int64_t>(n, b1 * kRows);
         i0 += kRows) {
      const int rows = std::min(kRows, n - i0);
      __m512 best[kRows];
      __m512i best_j[kRows];
      for (int r = 0; r < kRows; ++r) {
        best[r] = _mm512_set1_ps(-INFINITY);
        best_j[r] = _mm512_setzero_si512();
      }
      for (int j0 = 0; j0 < k; j0 += 16) {
        __m512 acc[kRows];
        for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
        for (int c = 0; c < d; ++c) {
          const __m512 v = _mm512_loadu_ps(&ct[(size_t(j0 / 16) * d + c) * 16]);
          for (int r = 0; r < kRows; ++r) {
            const int i = std::min(i0 + r, n - 1);
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[size_t(i) * d + c]), v,
                                     acc[r]);
          }
        }
        const __mmask16 valid = FirstLanes16(k - j0);
        const __m512 cnv = _mm512_loadu_ps(&cnp[j0]);
        const __m512i jv = _mm512_add_epi32(lane, _mm512_set1_epi32(j0));
        for (int r = 0; r < rows; ++r) {
          const __m512 den = _mm512_mul_ps(_mm512_set1_ps(xn[i0 + r]), cnv);
          const __mmask16 pos =
              _mm512_cmp_ps_mask(den, _mm512_setzero_ps(), _CMP_GT_OQ);
          const __m512 cosv = _mm512_maskz_div_ps(pos, acc[r], den);
          const __mmask16 up =
              _mm512_mask_cmp_ps_mask(valid, cosv, best[r], _CMP_GT_OQ);
          best[r] = _mm512_mask_mov_ps(best[r], up, cosv);
          best_j[r] = _mm512_mask_mov_epi32(best_j[r], up, jv);
        }
      }
      for (int r = 0; r < rows; ++r) {
        const float m = _mm512_reduce_max_ps(best[r]);
        const __mmask16 at =
            _mm512_cmp_ps_mask(best[r], _mm512_set1_ps(m), _CMP_EQ_OQ);
        assign[i0 + r] = _mm512_mask_reduce_min_epi32(at, best_j[r]);
      }
    }
  });
}

class ClusterKvAttention final : public SparseAttention {
 public:
  ClusterKvAttention(const AttnShapes& s, const AttentionConfig& a)
      : SparseAttention(s),
        sink_(a.sink),
        size_(a.cluster_size),
        budget_(a.cluster_budget),
        iters_(a.kmeans_iters) {}
  const char* name() const override { return "gqa_dense/clusterkv"; }
  std::unique_ptr<MethodLayerState> NewLayerState() const override {
    auto st = std::make_unique<ClusterState>();
    st->clustered_upto = sink_;
    st->heads.resize(shapes_.kv_heads);
    return st;
  }

  // Clusters cover [sink, clustered_upto): they hold no dropped position
  // only when the cut is at or beyond their end.
  bool SurvivesTruncation(const MethodLayerState* state,
                          int length) const override {
    return static_cast<const ClusterState*>(state)->clustered_upto <= length;
  }

  void OnPrefillEnd(const LayerView& view, MethodLayerState* state,
                    KernelCost* cost, CorePool* pool) const override {
    auto* st = static_cast<ClusterState*>(state);
    const int from = st->clustered_upto, to = view.length;
    const int n = to - from;
    if (n <= 0) return;
    const int k = (n + size_ - 1) / size_;
    const int d = shapes_.head_dim;
    std::vector<float> x(size_t(n) * d), xn(n), cent(size_t(k) * d), cn(k);
    std::vector<int> assign(n);
    for (int g = 0; g < shapes_.kv_heads; ++g) {
      for (int i = 0; i < n; ++i) {
        float* xi = &x[size_t(i) * d];
        Bf16ToFloat(view.Part(from + i, GqaEntry::KPart(shapes_, g)), d, xi);
        xn[i] = std::sqrt(Dot(xi, xi, d));
      }
      // Initial centroids: evenly spaced tokens.
      for (int j = 0; j < k; ++j) {
        const int i = int(int64_t(j) * n / k);
        std::copy_n(&x[size_t(i) * d], d, &cent[size_t(j) * d]);
      }
      auto assign_all = [&] {
        for (int j = 0; j < k; ++j) {
          cn[j] = std::sqrt(Dot(&cent[size_t(j) * d], &cent[size_t(j) * d], d));
        }
        AssignToCentroids(x.data(), xn.data(), n, cent.data(), cn.data(), k, d,
                          assign.data(), pool);
      };
      auto update_all = [&] {
        std::vector<float> sum(size_t(k) * d, 0.0f);
        std::vector<int> count(k, 0);
        for (int i = 0; i < n; ++i) {
          float* s = &sum[size_t(assign[i]) * d];
          const float* xi = &x[size_t(i) * d];
          for (int c = 0; c < d; ++c) s[c] += xi[c];
          ++count[assign[i]];
        }
        for (int j = 0; j < k; ++j) {
          if (count[j] == 0) continue;  // an empty cluster keeps its centroid
          for (int c = 0; c < d; ++c) {
            cent[size_t(j) * d + c] = sum[size_t(j) * d + c] / float(count[j]);
          }
        }
      };
      // kmeans_iters rounds of (assign, update); the membership is the last
      // assignment, so every centroid is the mean of its members. With 0
      // rounds the tokens are assigned to the initial centroids.
      assign_all();
      for (int r = 0; r < iters_; ++r) {
        if (r > 0) assign_all();
        update_all();
      }
      std::vector<Cluster> fresh(k);
      for (int j = 0; j < k; ++j) {
        fresh[j].centroid.assign(&cent[size_t(j) * d],
                                 &cent[size_t(j) * d] + d);
      }
      for (int i = 0; i < n; ++i) fresh[assign[i]].members.push_back(from + i);
      for (Cluster& c : fresh) {
        if (!c.members.empty()) st->heads[g].push_back(std::move(c));
      }
    }
    st->clustered_upto = to;
    st->centroids_t.resize(shapes_.kv_heads);
    for (int g = 0; g < shapes_.kv_heads; ++g) {
      const std::vector<Cluster>& cl = st->heads[g];
      std::vector<float>& t = st->centroids_t[g];
      t.assign((cl.size() + 15) / 16 * 16 * size_t(d), 0.0f);
      for (size_t j = 0; j < cl.size(); ++j) {
        PutTransposed(cl[j].centroid.data(), j, d, t.data());
      }
    }
    cost->bytes += double(n) * shapes_.kv_heads * d * 2;
    cost->flops += double(n) * k * d * 2 * (iters_ + 1) * shapes_.kv_heads;
  }

  void Select(const LayerView& view, int pos, const float* q,
              const MethodLayerState* state, std::vector<HeadSelection>* heads,
              KernelCost* cost, CorePool* pool) const override {
    const auto* st = static_cast<const ClusterState*>(state);
    const int clustered = std::max(0, st->clustered_upto - sink_);
    if (clustered <= budget_ || pos < st->clustered_upto) {
      SelectDense(pos, heads);
      return;
    }
    const int H = shapes_.heads, d = shapes_.head_dim;
    const int group = H / shapes_.kv_heads;
    heads->resize(H);
    // Heads are independent: split over the pool's cores where the
    // centroids to score repay waking them (the same selections).
    // Centroids scored, over every query head.
    double centroids = 0;
    for (const auto& cl : st->heads) centroids += double(cl.size()) * group;
    ParallelFor(PoolFor(pool, centroids * d), H, 1, [&](int64_t b, int64_t e) {
      SelectHeads(*st, pos, q, int(b), int(e), heads);
    });
    cost->flops += centroids * d * 2;
    cost->bytes += centroids * d * 4;
  }

 private:
  // Select's take for query heads [h_begin, h_end) into (*heads)[h].
  void SelectHeads(const ClusterState& state, int pos, const float* q,
                   int h_begin, int h_end,
                   std::vector<HeadSelection>* heads) const {
    const ClusterState* st = &state;
    const int d = shapes_.head_dim;
    const int group = shapes_.heads / shapes_.kv_heads;
    thread_local std::vector<float> score;
    thread_local std::vector<int> order;
    for (int h = h_begin; h < h_end; ++h) {
      const std::vector<Cluster>& cl = st->heads[h / group];
      const float* qh = q + size_t(h) * shapes_.q_dim;
      const int k = int(cl.size());
      // score[j] = q . centroid_j, the fma chain over increasing channels
      // from +0, 16 clusters to a vector, four vectors' chains interleaved
      // (one chain at a time waited on the FMA latency: a 128K context's
      // 8K clusters took ~30 us a head).
      const int nblk = (k + 15) / 16;
      score.resize(size_t(nblk) * 16);
      const float* ct = st->centroids_t[h / group].data();
      int b0 = 0;
      for (; b0 + 4 <= nblk; b0 += 4) {
        const float* blk = ct + size_t(b0) * d * 16;
        __m512 acc[4];
        for (int i = 0; i < 4; ++i) acc[i] = _mm512_setzero_ps();
        for (int c = 0; c < d; ++c) {
          const __m512 qc = _mm512_set1_ps(qh[c]);
          for (int i = 0; i < 4; ++i) {
            acc[i] = _mm512_fmadd_ps(
                qc, _mm512_loadu_ps(blk + (size_t(i) * d + c) * 16), acc[i]);
          }
        }
        for (int i = 0; i < 4; ++i) {
          _mm512_storeu_ps(&score[size_t(b0 + i) * 16], acc[i]);
        }
      }
      for (; b0 < nblk; ++b0) {
        const float* blk = ct + size_t(b0) * d * 16;
        __m512 acc = _mm512_setzero_ps();
        for (int c = 0; c < d; ++c) {
          acc = _mm512_fmadd_ps(_mm512_set1_ps(qh[c]),
                                _mm512_loadu_ps(blk + size_t(c) * 16), acc);
        }
        _mm512_storeu_ps(&score[size_t(b0) * 16], acc);
      }
      // Clusters best score first, ties to the lower cluster (what a stable
      // sort by score gives). The take ends within budget_ clusters (each
      // holds a token at least), so only that many are ordered, unless a
      // NaN score leaves no strict order: then all of them, stably.
      bool nan = false;
      for (int j = 0; j < k; ++j) nan |= std::isnan(score[j]);
      if (!nan && budget_ < k) {
        // The budget_-th best score t (a selection over a copy of the
        // scores: plain float compares, not the clusters' order through
        // their indices), then the clusters above t and, in increasing
        // order, as many at t as are left: the first budget_ clusters in
        // that order, which the sort below puts in it.
        auto before = [&](int a, int b) {
          return score[a] > score[b] || (score[a] == score[b] && a < b);
        };
        thread_local std::vector<float> sorted;
        sorted.assign(score.begin(), score.begin() + k);
        std::nth_element(sorted.begin(), sorted.begin() + (budget_ - 1),
                         sorted.end(), std::greater<float>());
        const float t = sorted[size_t(budget_ - 1)];
        order.clear();
        int at_t = budget_;
        for (int j = 0; j < k; ++j) at_t -= score[j] > t;
        for (int j = 0; j < k; ++j) {
          if (score[j] > t || (score[j] == t && at_t-- > 0)) order.push_back(j);
        }
        std::sort(order.begin(), order.end(), before);
      } else {
        order.resize(k);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
          return score[a] > score[b];  // stable: ties to the lower cluster
        });
      }
      HeadSelection& sel = (*heads)[h];
      sel.positions.clear();
      sel.bias.clear();
      int left = budget_;
      for (int j : order) {
        if (left == 0) break;
        const auto& m = cl[j].members;
        const int take = std::min(left, int(m.size()));
        sel.positions.insert(sel.positions.end(), m.begin(), m.begin() + take);
        left -= take;
      }
      for (int t = 0; t < sink_ && t <= pos; ++t) sel.positions.push_back(t);
      for (int t = st->clustered_upto; t <= pos; ++t) {
        sel.positions.push_back(t);
      }
      std::sort(sel.positions.begin(), sel.positions.end());
    }
  }

  const int sink_, size_, budget_, iters_;
};

}  // namespace

std::unique_ptr<SparseAttention> NewClusterKvAttention(
    const AttnShapes& s, const AttentionConfig& a) {
  return std::make_unique<ClusterKvAttention>(s, a);
}

}  // namespace karat
