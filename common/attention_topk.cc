// Select (§III-D): the k highest of the indexer's scores (SelectTopK), by
// a threshold from a sample, a parallel compress of the keys at or above
// it and an exact cut.

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <new>
#include <numeric>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/numeric.h"
#include "common/simd_reduce.h"
#include "common/attention_internal.h"
#include "common/status_macros.h"

// GCC 12 reports its own AVX-512 intrinsic headers (_mm512_undefined_*)
// as (maybe-)uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace karat {

using namespace attention_internal;

// --- Select (§III-D) ---------------------------------------------------------

namespace {

// Positions s in [0, n) with scores[s] >= t, in increasing order, into
// out[0 ..) and their scores into out_scores[0 ..) (room for n + 16 each);
// returns their count.
int CompressAtLeast(const float* scores, int n, float t, int32_t* out,
                    float* out_scores, int first = 0) {
  const __m512 vt = _mm512_set1_ps(t);
  __m512i idx = _mm512_add_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(first));
  const __m512i step = _mm512_set1_epi32(16);
  int s = 0, count = 0;
  for (; s + 16 <= n; s += 16) {
    const __m512 x = _mm512_loadu_ps(scores + s);
    const __mmask16 m = _mm512_cmp_ps_mask(x, vt, _CMP_GE_OQ);
    CompressStore16(out + count, m, idx);
    CompressStore16(out_scores + count, m, x);
    count += __builtin_popcount(m);
    idx = _mm512_add_epi32(idx, step);
  }
  for (; s < n; ++s) {
    if (scores[s] >= t) {
      out_scores[count] = scores[s];
      out[count++] = first + s;
    }
  }
  return count;
}

// From this many scores on, SelectTopK's compress runs on the pool's cores
// (each over the range of scores it has just written, in a scan split the
// same way), the ranges' candidates then put back in order.
constexpr int kParallelSelect = 32768;

// Small k: one pass that keeps the k best so far in a binary heap whose
// root is the worst of them (lowest score; of equal scores, the highest
// position). A later position enters only with a strictly higher score
// than the root, which is the tie rule; the vector compare skips 16
// positions at a time while nothing enters. O(n + entries x log k).
constexpr int kSmallTopK = 64;

void SelectTopKSmall(const float* scores, int n, int k,
                     std::vector<int32_t>* out) {
  float hv[kSmallTopK];
  int32_t hp[kSmallTopK];
  // a is worse than b.
  auto worse = [&](int a, int b) {
    return hv[a] < hv[b] || (!(hv[b] < hv[a]) && hp[a] > hp[b]);
  };
  auto sift_down = [&](int i) {
    for (;;) {
      const int l = 2 * i + 1, r = l + 1;
      int w = i;
      if (l < k && worse(l, w)) w = l;
      if (r < k && worse(r, w)) w = r;
      if (w == i) return;
      std::swap(hv[i], hv[w]);
      std::swap(hp[i], hp[w]);
      i = w;
    }
  };
  for (int i = 0; i < k; ++i) {
    hv[i] = scores[i];
    hp[i] = i;
  }
  for (int i = k / 2 - 1; i >= 0; --i) sift_down(i);
  auto offer = [&](int s) {
    const float x = scores[s];
    if (x > hv[0]) {
      hv[0] = x;
      hp[0] = s;
      sift_down(0);
    }
  };
  int s = k;
  for (; s < n && s % 16 != 0; ++s) offer(s);
  for (; s + 16 <= n; s += 16) {
    __mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(scores + s),
                                     _mm512_set1_ps(hv[0]), _CMP_GT_OQ);
    while (m != 0) {
      offer(s + __builtin_ctz(m));
      m &= m - 1;
    }
  }
  for (; s < n; ++s) offer(s);
  out->assign(hp, hp + k);
  std::sort(out->begin(), out->end());
}

// Larger k: a sampled threshold, then an exact cut among the positions
// at or above it (SelectTopK), from this many scores on.
constexpr int kMinSampledTopK = 512;

// The threshold is the sample's TopKSampleRank-th highest score: the rank
// k of n scores would have in a sample of m, plus 4 standard deviations
// and a margin, so that at least k pass with high probability.
int TopKSampleRank(int n, int k, int m) {
  const double expect = double(k) * m / n;
  return int(expect + 4.0 * std::sqrt(expect) + 8.0);
}

// The sample size (a power of 2, 64-4096) that minimises the expected
// work: m for the sample's cut (KthHighest), plus about n x rank / m for
// the exact cut among the candidates (the same per score). With k = 2048
// of 128K that is 2048; with dsa-tiny's k = 128 of 2K scores, 128 (the
// cut then takes ~430 candidates, not all 2K).
int TopKSampleSize(int n, int k) {
  int best = 64;
  double best_cost = 1e300;
  for (int m = 64; m <= 4096 && m <= n / 2; m *= 2) {
    const int rank = TopKSampleRank(n, k, m);
    if (rank >= m) continue;
    const double cost = m + double(n) * rank / m;
    if (cost < best_cost) {
      best_cost = cost;
      best = m;
    }
  }
  return best;
}

// Whether any of x[0, n) is NaN.
bool AnyNan(const float* x, int n) {
  __mmask16 nan = 0;
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m = FirstLanes16(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    nan |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
  }
  return nan != 0;
}

// A key whose unsigned order is the scores' order (-0.0 as +0.0): the
// sign bit flipped for positive values, every bit for negative ones.
inline __m512i OrderKey16(__m512 x) {
  const __m512i b = _mm512_castps_si512(_mm512_add_ps(x, _mm512_setzero_ps()));
  const __m512i neg = _mm512_srai_epi32(b, 31);
  return _mm512_xor_si512(
      b, _mm512_or_si512(neg, _mm512_set1_epi32(int(0x80000000u))));
}

// The k-th highest of vals[0, n) (0 < k <= n, no NaN), exactly: the
// largest key K with at least k keys >= K, built bit by bit from the top.
// Branch-free counting, where nth_element on scores in no particular order
// mispredicts about every other comparison. Only the keys that share K's
// bits decided so far can still decide the next bit: each pass counts
// those with the next bit set (the ones above them already count for K),
// and whenever they are at most a quarter of the buffer they are
// compressed into the other one, so on spread-out scores the passes
// shrink geometrically instead of each reading all n (32 passes); on
// scores that are mostly equal they stay as long as before.
float KthHighest(const float* vals, int n, int k) {
  const int nv = (n + 15) / 16;
  // Two buffers: the keys, then the narrowed ones. Pad lanes hold key 0,
  // below every score's key (-inf's is 0x007FFFFF): they never count.
  thread_local AlignedVector<uint32_t> buf[2];
  buf[0].resize(size_t(nv) * 16 + 16);
  buf[1].resize(size_t(nv) * 16 + 16);
  for (int i = 0; i < nv; ++i) {
    const __mmask16 m = FirstLanes16(n - 16 * i);
    _mm512_store_si512(
        buf[0].data() + 16 * i,
        _mm512_maskz_mov_epi32(
            m, OrderKey16(_mm512_maskz_loadu_ps(m, vals + 16 * i))));
  }
  const uint32_t* cur = buf[0].data();
  int len = nv * 16;  // keys in cur (a multiple of 16)
  int live = n;       // keys of scores in cur that share key's decided bits
  int rank = k;       // K is the rank-th highest of those
  uint32_t key = 0, decided = 0;
  for (int bit = 31; bit >= 0; --bit) {
    const __m512i d = _mm512_set1_epi32(int(decided));
    const __m512i p = _mm512_set1_epi32(int(key));
    const __m512i b = _mm512_set1_epi32(int(1u << bit));
    int count = 0;
    for (int i = 0; i < len; i += 16) {
      const __m512i x = _mm512_load_si512(cur + i);
      const __mmask16 same = _mm512_cmpeq_epi32_mask(_mm512_and_si512(x, d), p);
      count += __builtin_popcount(_mm512_mask_test_epi32_mask(same, x, b));
    }
    if (count >= rank) {
      key |= 1u << bit;
      live = count;
    } else {
      rank -= count;
      live -= count;
    }
    decided |= 1u << bit;
    if (bit > 0 && live * 4 <= len && len > 16) {
      // Keep only the keys that still share the decided bits.
      uint32_t* next = buf[cur == buf[0].data() ? 1 : 0].data();
      const __m512i d2 = _mm512_set1_epi32(int(decided));
      const __m512i p2 = _mm512_set1_epi32(int(key));
      int out = 0;
      for (int i = 0; i < len; i += 16) {
        const __m512i x = _mm512_load_si512(cur + i);
        const __mmask16 keep =
            _mm512_cmpeq_epi32_mask(_mm512_and_si512(x, d2), p2);
        CompressStore16(next + out, keep, x);
        out += __builtin_popcount(keep);
      }
      // Pad to whole vectors with key 0: it shares the decided bits only
      // while they are all 0, and never has the next bit set.
      _mm512_storeu_si512(next + out, _mm512_setzero_si512());
      len = (out + 15) / 16 * 16;
      cur = next;
    }
  }
  // Back from the key to the value.
  const uint32_t bits = (key & 0x80000000u) ? key ^ 0x80000000u : ~key;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

// Writes the positions cand[i] whose vals[i] > v and, of those equal to v,
// the lowest ones, k in all at most, in candidate order; returns how many
// (k when v is the k-th highest of vals). vals has room for 16 more, and
// out for k + 16 (CompressStore16).
int CutAt(const float* vals, const int32_t* cand, int n, int k, float v,
          int32_t* out) {
  const __m512 vv = _mm512_set1_ps(v);
  int above = 0;
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m = FirstLanes16(n - i);
    above += __builtin_popcount(
        _mm512_mask_cmp_ps_mask(m, _mm512_loadu_ps(vals + i), vv, _CMP_GT_OQ));
  }
  int ties = std::max(0, k - above);
  int count = 0;
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m = FirstLanes16(n - i);
    const __m512 x = _mm512_loadu_ps(vals + i);
    __mmask16 take = _mm512_mask_cmp_ps_mask(m, x, vv, _CMP_GT_OQ);
    __mmask16 eq = _mm512_mask_cmp_ps_mask(m, x, vv, _CMP_EQ_OQ);
    while (eq != 0 && ties > 0) {
      take |= eq & (-eq);  // the lowest remaining tie
      eq &= eq - 1;
      --ties;
    }
    if (count + __builtin_popcount(take) > k) break;  // not the k-th: stop
    CompressStore16(out + count, take, _mm512_maskz_loadu_epi32(m, cand + i));
    count += __builtin_popcount(take);
  }
  return count;
}

}  // namespace

void SelectTopK(const float* scores, int n, int k, std::vector<int32_t>* out,
                CorePool* pool) {
  out->clear();
  if (n <= 0) return;
  if (k >= n) {
    out->resize(n);
    std::iota(out->begin(), out->end(), 0);
    return;
  }
  if (k <= 0) return;
  if (k <= kSmallTopK) {
    SelectTopKSmall(scores, n, k, out);
    return;
  }
  // Candidates, in position order: those at or above a threshold taken
  // from a fixed, evenly spaced sample a little below the sample's k-th
  // score (a vector compress), so that with high probability at least k
  // pass; when fewer do, every position. The threshold only sets how much
  // work the exact cut below does, never its result.
  const int parts = pool != nullptr && n >= kParallelSelect
                        ? std::min({pool->cores(), n / kKeyBlock, 64})
                        : 1;
  // Each part compresses into its own stretch of the buffers, 16 apart (a
  // compress store writes whole vectors).
  const size_t room = size_t(n) + 16 * size_t(parts + 1);
  thread_local std::vector<int32_t> cand_buf;
  thread_local std::vector<float> vals;  // the candidates' scores
  if (cand_buf.size() < room) cand_buf.resize(room);
  if (vals.size() < room) vals.resize(room);
  int32_t* cand = cand_buf.data();
  float* cand_vals = vals.data();
  int nc = 0;
  if (n >= kMinSampledTopK && int64_t(k) * 4 <= n) {
    const int m = TopKSampleSize(n, k);
    const int shift = __builtin_ctz(unsigned(m));  // m is a power of 2
    for (int i = 0; i < m; ++i) vals[i] = scores[(int64_t(i) * n) >> shift];
    const int rank = TopKSampleRank(n, k, m);
    if (rank < m && !AnyNan(vals.data(), m)) {
      const float t = KthHighest(vals.data(), m, rank + 1);
      // Every candidate is >= t, so none is NaN.
      if (parts <= 1) {
        nc = CompressAtLeast(scores, n, t, cand, cand_vals);
      } else {
        // Ranges of whole key blocks, as the scan splits its keys.
        int counts[64];
        auto begin_of = [&](int p) {
          return int(int64_t(n / kKeyBlock) * p / parts) * kKeyBlock;
        };
        pool->ParallelFor(parts, 1, [&](int64_t b, int64_t e) {
          for (int64_t p = b; p < e; ++p) {
            const int s0 = begin_of(int(p));
            const int s1 = p + 1 == parts ? n : begin_of(int(p) + 1);
            const size_t at = size_t(s0) + 16 * size_t(p);
            counts[p] = CompressAtLeast(scores + s0, s1 - s0, t, cand + at,
                                        cand_vals + at, s0);
          }
        });
        for (int p = 0; p < parts; ++p) {
          const size_t at = size_t(begin_of(p)) + 16 * size_t(p);
          std::memmove(cand + nc, cand + at, size_t(counts[p]) * 4);
          std::memmove(cand_vals + nc, cand_vals + at, size_t(counts[p]) * 4);
          nc += counts[p];
        }
      }
    }
  }
  bool nan = false;
  if (nc < k) {
    nc = n;
    std::iota(cand, cand + n, 0);
    std::memcpy(vals.data(), scores, size_t(n) * sizeof(float));
    nan = AnyNan(scores, n);
  }
  // The exact cut: v = the k-th highest candidate score; take every
  // candidate above v and, of those equal to v (-0.0 == +0.0), the lowest
  // positions, in position order.
  float v;
  if (!nan) {
    v = KthHighest(vals.data(), nc, k);
  } else {
    // NaN scores (from NaN codes) have no place in the order: nth_element
    // cuts them as it always has.
    thread_local std::vector<float> sorted;
    sorted.assign(vals.begin(), vals.begin() + nc);
    std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(),
                     std::greater<float>());
    v = sorted[k - 1];
  }
  out->resize(size_t(k) + 16);
  const int got = CutAt(vals.data(), cand, nc, k, v, out->data());
  out->resize(size_t(got));
}
}  // namespace karat
