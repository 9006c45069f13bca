// gqa_dense, method `magicpig` (MODEL.md; Chen et al., "MagicPIG: LSH
// Sampling for Efficient LLM Generation", §4): SimHash tables over centred
// keys; a key is retrieved when it shares the query's bucket in at least two
// of L tables, and its logit is corrected by its retrieval probability
// (importance sampling); sink and local tokens are attended exactly.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

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

// x^n for n >= 0 by repeated squaring: Select evaluates two such powers per
// retrieved token and head, where std::pow took ~a third of its time.
double IntPow(double x, int n) {
  double r = 1.0;
  for (; n > 0; n >>= 1) {
    if (n & 1) r *= x;
    x *= x;
  }
  return r;
}

}  // namespace

double MagicPigRetrievalProbability(double theta, int bits, int tables) {
  const double p = IntPow(1.0 - theta / M_PI, bits);
  return 1.0 - IntPow(1.0 - p, tables - 1) * (tables * p + 1.0 - p);
}

namespace {

class PigState final : public MethodLayerState {
 public:
  // The centring mean is fixed at the end of the session's first prefill;
  // until then the layer attends densely and no key is hashed.
  bool fixed = false;
  int fixed_length = 0;     // the layer's length when the mean was fixed
  std::vector<float> mean;  // Hkv x d
  // Per KV head, every position's L buckets: one byte each for K <= 8,
  // table-major in blocks of kCodeBlock positions (ByteCodeIndex: table j
  // of a block's 64 positions is one 64-byte row, which Select compares
  // with the query's bucket at once); four bytes each otherwise, position-
  // major. Select streams one KV head's at a time.
  std::vector<HugePageVector<uint8_t>> codes;
  std::vector<float> norms;  // positions x Hkv: |centred key|
  size_t bytes() const override {
    size_t code_bytes = 0;
    for (const auto& c : codes) code_bytes += c.size();
    return mean.size() * sizeof(float) + code_bytes +
           norms.size() * sizeof(float);
  }
};

// Bytes of one stored bucket: K <= 8 bits fit in a byte.
int CodeWidth(int bits) { return bits <= 8 ? 1 : 4; }

// Positions per block of byte buckets.
constexpr int kCodeBlock = 64;

// Where byte bucket j of position t sits among a KV head's codes.
inline size_t ByteCodeIndex(int t, int j, int tables) {
  return size_t(t / kCodeBlock) * kCodeBlock * tables + size_t(j) * kCodeBlock +
         size_t(t % kCodeBlock);
}

// Bytes of a KV head's codes for positions [0, n).
inline size_t CodeBytes(int n, int tables, int width) {
  return width == 1
             ? size_t((n + kCodeBlock - 1) / kCodeBlock) * kCodeBlock * tables
             : size_t(n) * tables * width;
}

class MagicPigAttention final : public SparseAttention {
 public:
  MagicPigAttention(const AttnShapes& s, const AttentionConfig& a,
                    std::vector<float> planes)
      : SparseAttention(s),
        bits_(a.lsh_bits),
        tables_(a.lsh_tables),
        sink_(a.sink),
        local_(a.local),
        planes_(std::move(planes)),
        planes_t_(
            TransposePlanes(planes_, a.lsh_bits * a.lsh_tables, s.head_dim)) {}
  const char* name() const override { return "gqa_dense/magicpig"; }
  std::unique_ptr<MethodLayerState> NewLayerState() const override {
    return std::make_unique<PigState>();
  }

  void OnAppend(const LayerView& view, int pos_start, int n,
                MethodLayerState* state, KernelCost* cost) const override {
    auto* st = static_cast<PigState*>(state);
    if (!st->fixed) return;
    HashKeys(view, pos_start, pos_start + n, st, cost, nullptr);
  }

  // The mean comes from the first prefill's keys; codes and norms are per
  // position and rehashed on append.
  bool SurvivesTruncation(const MethodLayerState* state,
                          int length) const override {
    const auto* st = static_cast<const PigState*>(state);
    return !st->fixed || st->fixed_length <= length;
  }

  void OnPrefillEnd(const LayerView& view, MethodLayerState* state,
                    KernelCost* cost, CorePool* pool) const override {
    auto* st = static_cast<PigState*>(state);
    if (st->fixed) return;
    const int hkv = shapes_.kv_heads, d = shapes_.head_dim;
    // Mean of the first prefill's keys without the sink and local tokens
    // (fp32 sum in position order); an empty range leaves the keys as is.
    const int lo = std::min(sink_, view.length);
    const int hi = std::max(lo, view.length - local_);
    st->mean.assign(size_t(hkv) * d, 0.0f);
    std::vector<float> k(d);
    for (int t = lo; t < hi; ++t) {
      for (int g = 0; g < hkv; ++g) {
        Bf16ToFloat(view.Part(t, GqaEntry::KPart(shapes_, g)), d, k.data());
        for (int c = 0; c < d; ++c) st->mean[size_t(g) * d + c] += k[c];
      }
    }
    if (hi > lo) {
      for (float& m : st->mean) m /= float(hi - lo);
    }
    st->fixed = true;
    st->fixed_length = view.length;
    HashKeys(view, 0, view.length, st, cost, pool);
  }

  void Select(const LayerView& view, int pos, const float* q,
              const MethodLayerState* state, std::vector<HeadSelection>* heads,
              KernelCost* cost, CorePool* pool) const override {
    const auto* st = static_cast<const PigState*>(state);
    const int mid_end = pos - local_ + 1;  // middle: [sink, mid_end)
    if (!st->fixed || mid_end <= sink_) {
      SelectDense(pos, heads);
      return;
    }
    const int H = shapes_.heads, hkv = shapes_.kv_heads, d = shapes_.head_dim;
    heads->resize(H);
    // Per head: its buckets, |q|, and the sink tokens first.
    thread_local std::vector<uint32_t> qcodes;
    thread_local std::vector<uint8_t> qbytes;
    thread_local std::vector<float> qnorm;
    qcodes.resize(size_t(H) * tables_);
    qnorm.resize(H);
    for (int h = 0; h < H; ++h) {
      const float* qh = q + size_t(h) * shapes_.q_dim;
      Hash(qh, &qcodes[size_t(h) * tables_]);
      float qn = 0.0f;
      for (int c = 0; c < d; ++c) qn = std::fma(qh[c], qh[c], qn);
      qnorm[h] = std::sqrt(qn);
      HeadSelection& sel = (*heads)[h];
      sel.positions.clear();
      sel.bias.clear();
      for (int t = 0; t < sink_; ++t) {
        sel.positions.push_back(t);
        sel.bias.push_back(0.0f);
      }
    }
    const int width = CodeWidth(bits_);
    const size_t row = size_t(tables_) * width;  // bytes per token
    if (width == 1) {
      qbytes.resize(qcodes.size());
      for (size_t i = 0; i < qcodes.size(); ++i) {
        qbytes[i] = static_cast<uint8_t>(qcodes[i]);
      }
    }
    // The calling thread's buffers, named here: inside the pool's loop a
    // thread_local would be the worker's own.
    const PigQuery pq{q, qcodes.data(), qbytes.data(), qnorm.data()};
    // The middle tokens, in token ranges over the pool's cores where the
    // scan repays waking them: each range's retrieved tokens, in order,
    // then the ranges' in order, so the selections are the same.
    CorePool* split = PoolFor(pool, double(mid_end - sink_) * H * tables_);
    const int parts =
        split != nullptr ? std::min(split->cores(), mid_end - sink_) : 1;
    if (parts <= 1) {
      RetrieveRange(view, *st, pq, sink_, mid_end, heads);
    } else {
      thread_local std::vector<std::vector<HeadSelection>> part_sel;
      std::vector<std::vector<HeadSelection>>& ps = part_sel;
      ps.resize(size_t(parts));
      for (auto& p : ps) {
        p.resize(H);
        for (HeadSelection& sel : p) {
          sel.positions.clear();
          sel.bias.clear();
        }
      }
      const int span = mid_end - sink_;
      split->ParallelFor(parts, 1, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          const int t0 = sink_ + int(int64_t(span) * i / parts);
          const int t1 = sink_ + int(int64_t(span) * (i + 1) / parts);
          RetrieveRange(view, *st, pq, t0, t1, &ps[size_t(i)]);
        }
      });
      for (int h = 0; h < H; ++h) {
        HeadSelection& sel = (*heads)[h];
        for (const auto& p : ps) {
          const HeadSelection& part = p[size_t(h)];
          sel.positions.insert(sel.positions.end(), part.positions.begin(),
                               part.positions.end());
          sel.bias.insert(sel.bias.end(), part.bias.begin(), part.bias.end());
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      HeadSelection& sel = (*heads)[h];
      for (int t = mid_end; t <= pos; ++t) {
        sel.positions.push_back(t);
        sel.bias.push_back(0.0f);
      }
    }
    cost->bytes += double(mid_end - sink_) * hkv * row;
    cost->flops += double(H) * tables_ * bits_ * d * 2;
  }

 private:
  // The calling thread's query data for RetrieveRange.
  struct PigQuery {
    const float* q;          // H x q_dim
    const uint32_t* qcodes;  // H x L buckets
    const uint8_t* qbytes;   // the same, a byte each (K <= 8)
    const float* qnorm;      // H: |q|
  };

  // The positions of [t_begin, t_end) whose byte buckets (ByteCodeIndex
  // layout) equal the query's in at least two tables, for each of the G
  // heads of a KV group, in increasing order, appended to (*hit)[i]. `qv`:
  // per table j and head i, the head's bucket in all 64 bytes of row
  // j G + i. A block of 64 positions at a time: per table, one 64-byte row
  // against each head's bucket (xor, then min with 1: a mismatch counted in
  // each position's byte lane); retrieved where at most L - 2 tables
  // mismatch (L <= 255).
  template <int G>
  void ScanByteBlocks(const uint8_t* codes, const uint8_t* qv, int t_begin,
                      int t_end, std::vector<std::vector<int>>* hit) const {
    const __m512i one = _mm512_set1_epi8(1);
    const __m512i most = _mm512_set1_epi8(static_cast<char>(tables_ - 2));
    const size_t block_bytes = size_t(kCodeBlock) * tables_;
    for (int b = t_begin / kCodeBlock; b * kCodeBlock < t_end; ++b) {
      const int first = b * kCodeBlock;
      const int lo = std::max(t_begin - first, 0);
      const int hi = std::min(t_end - first, kCodeBlock);
      const __mmask64 lanes =
          (hi == 64 ? ~__mmask64(0) : (__mmask64(1) << hi) - 1) &
          ~((__mmask64(1) << lo) - 1);
      const uint8_t* rows = codes + size_t(b) * block_bytes;
      // Two blocks ahead: the rows are read once, in order.
      if ((b + 2) * kCodeBlock < t_end) {
        for (size_t off = 0; off < block_bytes; off += 64) {
          PrefetchLine(rows + 2 * block_bytes + off);
        }
      }
      __m512i miss[G];
      for (int i = 0; i < G; ++i) miss[i] = _mm512_setzero_si512();
      for (int j = 0; j < tables_; ++j) {
        const __m512i k = _mm512_loadu_si512(rows + size_t(j) * kCodeBlock);
        const uint8_t* qj = qv + size_t(j) * G * 64;
        for (int i = 0; i < G; ++i) {
          const __m512i q = _mm512_loadu_si512(qj + size_t(i) * 64);
          miss[i] = _mm512_add_epi8(
              miss[i], _mm512_min_epu8(_mm512_xor_si512(k, q), one));
        }
      }
      for (int i = 0; i < G; ++i) {
        for (uint64_t m = _mm512_mask_cmple_epu8_mask(lanes, miss[i], most);
             m != 0; m &= m - 1) {
          (*hit)[i].push_back(first + __builtin_ctzll(m));
        }
      }
    }
  }

  // ScanByteBlocks<G> for G = group (1 .. 8).
  template <int G = 1>
  void ScanByteBlocksOfGroup(int group, const uint8_t* codes, const uint8_t* qv,
                             int t_begin, int t_end,
                             std::vector<std::vector<int>>* hit) const {
    if constexpr (G < 8) {
      if (group > G) {
        ScanByteBlocksOfGroup<G + 1>(group, codes, qv, t_begin, t_end, hit);
        return;
      }
    }
    ScanByteBlocks<G>(codes, qv, t_begin, t_end, hit);
  }

  // The middle tokens [t_begin, t_end) that share at least two of the
  // query's buckets, per head in increasing position, appended to
  // (*out)[h] with their logit offsets.
  void RetrieveRange(const LayerView& view, const PigState& st,
                     const PigQuery& pq, int t_begin, int t_end,
                     std::vector<HeadSelection>* out) const {
    const int H = shapes_.heads, hkv = shapes_.kv_heads, d = shapes_.head_dim;
    const int group = H / hkv;
    // A middle token retrieved for head h: its logit offset from the angle
    // between the query and the centred key, whose dot product `dot` is
    // the fma chain over increasing c of q[c] (k[c] - mean[c]) from +0.
    auto retrieve = [&](int h, int g, int t, float dot) {
      const float qn = pq.qnorm[h];
      const float kn = st.norms[size_t(t) * hkv + g];
      double cosv =
          qn > 0.0f && kn > 0.0f ? double(dot) / (double(qn) * kn) : 0.0;
      cosv = std::clamp(cosv, -1.0, 1.0);
      const double w =
          MagicPigRetrievalProbability(std::acos(cosv), bits_, tables_);
      HeadSelection& sel = (*out)[h];
      sel.positions.push_back(t);
      sel.bias.push_back(static_cast<float>(-std::log(w + 1e-4)));
    };
    // The middle tokens, once per KV head for all of its query heads: a
    // token is retrieved when its bucket equals the query's in at least two
    // tables. Byte buckets (K <= 8): 64 positions at a time
    // (ScanByteBlocks). 32-bit buckets: 16 tables to a vector; the query's
    // buckets in registers where they fit. The retrieved tokens are collected
    // first and their offsets computed after, each token's key requested a few
    // tokens ahead: those keys are scattered over the cache.
    const int width = CodeWidth(bits_);
    const size_t row = size_t(tables_) * width;  // bytes per token
    const int nv = (tables_ + 15) / 16;
    thread_local std::vector<std::vector<int>> hit;
    hit.resize(group);
    for (int g = 0; g < hkv; ++g) {
      for (auto& v : hit) v.clear();
      const uint8_t* codes = st.codes[g].data();
      if (width == 1 && tables_ <= 255 && group <= 8) {
        // Each head's bucket of table j in all 64 byte lanes.
        thread_local std::vector<uint8_t> qv;
        qv.resize(size_t(tables_) * group * 64);
        for (int j = 0; j < tables_; ++j) {
          for (int i = 0; i < group; ++i) {
            std::memset(&qv[(size_t(j) * group + i) * 64],
                        pq.qbytes[(size_t(g) * group + i) * tables_ + j], 64);
          }
        }
        ScanByteBlocksOfGroup(group, codes, qv.data(), t_begin, t_end, &hit);
      } else if (width == 1) {
        for (int t = t_begin; t < t_end; ++t) {
          for (int i = 0; i < group; ++i) {
            const uint8_t* qc = &pq.qbytes[(size_t(g) * group + i) * tables_];
            int hits = 0;
            for (int j = 0; j < tables_; ++j) {
              hits += codes[ByteCodeIndex(t, j, tables_)] == qc[j];
            }
            if (hits >= 2) hit[i].push_back(t);
          }
        }
      } else if (nv <= 2 && group <= 8) {
        const uint32_t* qg = &pq.qcodes[size_t(g) * group * tables_];
        const __mmask16 m0 = FirstLanes16(tables_);
        const __mmask16 m1 =
            tables_ > 16 ? FirstLanes16(tables_ - 16) : __mmask16(0);
        __m512i q0[8], q1[8];
        for (int i = 0; i < group; ++i) {
          q0[i] = _mm512_maskz_loadu_epi32(m0, qg + size_t(i) * tables_);
          q1[i] = _mm512_maskz_loadu_epi32(m1, qg + size_t(i) * tables_ + 16);
        }
        for (int t = t_begin; t < t_end; ++t) {
          const auto* kc = reinterpret_cast<const uint32_t*>(codes + t * row);
          PrefetchEntryLines<true>(kc + 16 * tables_, row);
          const __m512i k0 = _mm512_maskz_loadu_epi32(m0, kc);
          const __m512i k1 = _mm512_maskz_loadu_epi32(m1, kc + 16);
          for (int i = 0; i < group; ++i) {
            const int hits =
                __builtin_popcount(
                    _mm512_mask_cmpeq_epi32_mask(m0, k0, q0[i])) +
                __builtin_popcount(_mm512_mask_cmpeq_epi32_mask(m1, k1, q1[i]));
            if (hits >= 2) hit[i].push_back(t);
          }
        }
      } else {
        const uint32_t* qg = &pq.qcodes[size_t(g) * group * tables_];
        for (int t = t_begin; t < t_end; ++t) {
          const auto* kc = reinterpret_cast<const uint32_t*>(codes + t * row);
          for (int i = 0; i < group; ++i) {
            const uint32_t* qc = qg + size_t(i) * tables_;
            int hits = 0;
            for (int v = 0; v < nv; ++v) {
              const __mmask16 m = FirstLanes16(tables_ - 16 * v);
              hits += __builtin_popcount(_mm512_mask_cmpeq_epi32_mask(
                  m, _mm512_maskz_loadu_epi32(m, kc + 16 * v),
                  _mm512_maskz_loadu_epi32(m, qc + 16 * v)));
            }
            if (hits >= 2) hit[i].push_back(t);
          }
        }
      }
      // The retrieved tokens' dot products 16 at a time: their keys
      // transposed and widened into an L1 tile (one lane per token), each
      // lane's chain the scalar one; the next 16 keys and key norms
      // requested meanwhile (the norms are scattered too: a miss each).
      const float* mean = &st.mean[size_t(g) * d];
      float* tile = EntryTileScratch(d);
      const int k_part = GqaEntry::KPart(shapes_, g);
      for (int i = 0; i < group; ++i) {
        const std::vector<int>& ts = hit[i];
        const int h = g * group + i;
        const float* qh = pq.q + size_t(h) * shapes_.q_dim;
        const int n = static_cast<int>(ts.size());
        for (int j = 0; j < std::min(n, 16); ++j) {
          PrefetchLine(&st.norms[size_t(ts[j]) * hkv + g]);
        }
        for (int j0 = 0; j0 < n; j0 += 16) {
          const int cnt = std::min(16, n - j0);
          for (int j = j0 + 16; j < std::min(n, j0 + 32); ++j) {
            PrefetchEntryLines<true>(view.Part(ts[j], k_part), size_t(d) * 2);
            PrefetchLine(&st.norms[size_t(ts[j]) * hkv + g]);
          }
          const uint16_t* kp[16];
          for (int j = 0; j < cnt; ++j) kp[j] = view.Part(ts[j0 + j], k_part);
          LoadEntryTile(kp, cnt, d, tile, 16);
          __m512 acc = _mm512_setzero_ps();
          for (int c = 0; c < d; ++c) {
            acc = _mm512_fmadd_ps(
                _mm512_set1_ps(qh[c]),
                _mm512_sub_ps(_mm512_load_ps(tile + size_t(c) * 16),
                              _mm512_set1_ps(mean[c])),
                acc);
          }
          alignas(64) float dots[16];
          _mm512_store_ps(dots, acc);
          for (int j = 0; j < cnt; ++j) retrieve(h, g, ts[j0 + j], dots[j]);
        }
      }
    }
  }

  // Bucket of `x` in every table: per table j, bit b set where plane j K + b
  // has dot > 0 with x, the dot being the fma chain over increasing c from +0
  // (plane[c] x[c]). Sixteen planes a vector (planes_t_), four vectors' chains
  // interleaved.
  void Hash(const float* x, uint32_t* codes) const {
    const int nvec = (tables_ * bits_ + 15) / 16;
    std::fill(codes, codes + tables_, 0u);
    int v0 = 0;
    for (; v0 + 4 <= nvec; v0 += 4) QueryPlaneSigns<4>(x, v0, codes);
    for (; v0 < nvec; ++v0) QueryPlaneSigns<1>(x, v0, codes);
  }

  // Hash()'s planes [16 v0, 16 (v0 + kN)): their bits set in `codes`.
  template <int kN>
  void QueryPlaneSigns(const float* x, int v0, uint32_t* codes) const {
    const int d = shapes_.head_dim, planes = tables_ * bits_;
    const size_t ld = size_t(planes + 15) / 16 * 16;
    __m512 dot[kN];
    for (int i = 0; i < kN; ++i) dot[i] = _mm512_setzero_ps();
    for (int c = 0; c < d; ++c) {
      const __m512 xc = _mm512_set1_ps(x[c]);
      const float* row = &planes_t_[size_t(c) * ld + size_t(v0) * 16];
      for (int i = 0; i < kN; ++i) {
        dot[i] = _mm512_fmadd_ps(_mm512_loadu_ps(row + 16 * i), xc, dot[i]);
      }
    }
    for (int i = 0; i < kN; ++i) {
      const int k0 = (v0 + i) * 16;
      const __mmask16 positive = _mm512_mask_cmp_ps_mask(
          FirstLanes16(planes - k0), dot[i], _mm512_setzero_ps(), _CMP_GT_OQ);
      for (uint32_t m = positive; m != 0; m &= m - 1) {
        const int k = k0 + __builtin_ctz(m);
        codes[k / bits_] |= uint32_t(1) << (k % bits_);
      }
    }
  }

  // planes ([n][d]) as [d][n rounded up to 16], the padding zero.
  static std::vector<float> TransposePlanes(const std::vector<float>& planes,
                                            int n, int d) {
    const size_t ld = size_t(n + 15) / 16 * 16;
    std::vector<float> t(size_t(d) * ld, 0.0f);
    for (int k = 0; k < n; ++k) {
      for (int c = 0; c < d; ++c) {
        t[size_t(c) * ld + k] = planes[size_t(k) * d + c];
      }
    }
    return t;
  }

  // With `pool`, the blocks of 16 tokens are split over its cores (each
  // token's buckets and norm depend on that token alone).
  void HashKeys(const LayerView& view, int from, int to, PigState* st,
                KernelCost* cost, CorePool* pool) const {
    const int hkv = shapes_.kv_heads, d = shapes_.head_dim;
    const int width = CodeWidth(bits_);
    st->codes.resize(hkv);
    for (auto& c : st->codes) c.resize(CodeBytes(to, tables_, width));
    st->norms.resize(size_t(to) * hkv);
    // 16 tokens at a time per KV head: their keys transposed and widened
    // into an L1 tile (one lane per token) and centred there, then every
    // hyperplane's fma chain runs over it in lanes: per token the same
    // chains, in the same order, as Hash() and the scalar centring compute.
    const int blocks = (to - from + 15) / 16;
    ParallelFor(pool, int64_t(hkv) * blocks, 1, [&](int64_t w0, int64_t w1) {
      thread_local std::vector<uint32_t> code_buf;
      code_buf.resize(size_t(tables_) * 16);
      float* tile = EntryTileScratch(d);
      for (int64_t w = w0; w < w1; ++w) {
        const int g = int(w / blocks);
        const int t0 = from + int(w % blocks) * 16;
        const float* mean = &st->mean[size_t(g) * d];
        const int cnt = std::min(16, to - t0);
        const uint16_t* kp[16];
        for (int j = 0; j < cnt; ++j) {
          kp[j] = view.Part(t0 + j, GqaEntry::KPart(shapes_, g));
        }
        LoadEntryTile(kp, cnt, d, tile, 16);
        __m512 nn = _mm512_setzero_ps();
        for (int c = 0; c < d; ++c) {
          const __m512 x = _mm512_sub_ps(_mm512_load_ps(tile + size_t(c) * 16),
                                         _mm512_set1_ps(mean[c]));
          _mm512_store_ps(tile + size_t(c) * 16, x);
          nn = _mm512_fmadd_ps(x, x, nn);
        }
        alignas(64) float norm[16];
        _mm512_store_ps(norm, _mm512_sqrt_ps(nn));
        for (int j = 0; j < cnt; ++j) {
          st->norms[size_t(t0 + j) * hkv + g] = norm[j];
        }
        // Hyperplanes kPlanes at a time: independent chains, interleaved
        // so that the FMA latency is hidden.
        std::fill(code_buf.begin(), code_buf.end(), 0u);
        const int planes = tables_ * bits_;
        int k0 = 0;
        for (; k0 + kPlanes <= planes; k0 += kPlanes) {
          PlaneSigns<kPlanes>(k0, tile, d, code_buf.data());
        }
        for (; k0 < planes; ++k0) PlaneSigns<1>(k0, tile, d, code_buf.data());
        uint8_t* codes = st->codes[g].data();
        for (int j = 0; j < cnt; ++j) {
          for (int tb = 0; tb < tables_; ++tb) {
            const uint32_t code = code_buf[size_t(tb) * 16 + j];
            if (width == 1) {
              codes[ByteCodeIndex(t0 + j, tb, tables_)] =
                  static_cast<uint8_t>(code);
            } else {
              std::memcpy(&codes[(size_t(t0 + j) * tables_ + tb) * 4], &code,
                          4);
            }
          }
        }
      }
    });
    cost->bytes += double(to - from) * hkv * d * 2;
    cost->flops += double(to - from) * hkv * tables_ * bits_ * d * 2;
  }

  // Hyperplanes [k0, k0 + kN) over a tile of 16 centred keys: per key the
  // fma chain of Hash(), from +0 over increasing channels; bit k % bits_ of
  // table k / bits_'s code (code_buf[table * 16 + lane]) set where it is
  // positive.
  static constexpr int kPlanes = 8;
  template <int kN>
  void PlaneSigns(int k0, const float* tile, int d, uint32_t* code_buf) const {
    __m512 dot[kN];
    for (int i = 0; i < kN; ++i) dot[i] = _mm512_setzero_ps();
    const float* plane = &planes_[size_t(k0) * d];
    for (int c = 0; c < d; ++c) {
      const __m512 x = _mm512_load_ps(tile + size_t(c) * 16);
      for (int i = 0; i < kN; ++i) {
        dot[i] = _mm512_fmadd_ps(_mm512_set1_ps(plane[size_t(i) * d + c]), x,
                                 dot[i]);
      }
    }
    for (int i = 0; i < kN; ++i) {
      const int k = k0 + i;
      uint32_t* code = &code_buf[size_t(k / bits_) * 16];
      const __m512i bit = _mm512_set1_epi32(int(1u << (k % bits_)));
      _mm512_storeu_si512(
          code, _mm512_mask_or_epi32(
                    _mm512_loadu_si512(code),
                    _mm512_cmp_ps_mask(dot[i], _mm512_setzero_ps(), _CMP_GT_OQ),
                    _mm512_loadu_si512(code), bit));
    }
  }

  const int bits_, tables_, sink_, local_;
  const std::vector<float> planes_;    // K*L x d
  const std::vector<float> planes_t_;  // d x K*L (rounded up to 16)
};

}  // namespace

std::unique_ptr<SparseAttention> NewMagicPigAttention(
    const AttnShapes& s, const AttentionConfig& a,
    std::vector<float> hyperplanes) {
  return std::make_unique<MagicPigAttention>(s, a, std::move(hyperplanes));
}

}  // namespace karat
