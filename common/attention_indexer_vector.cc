// The DSA indexer's vector path: a query prepared for the scan
// (PrepareIndexQuery), the stored key blocks a range covers (ScanBlocks),
// their widening (LoadKeyBlock, WidenKeyBlock) and their scores on the
// vector unit, by vdpbf16ps or fp32 FMAs (ScoreKeyBlock,
// ScoreBlocksWideningAnyHeads). The arithmetic: attention_indexer.cc.

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
namespace attention_internal {
namespace {

// Decodes up to 64 fp8 codes (`count`; missing ones read as code 0, +0.0)
// into 64 bf16 values at out[0..63].
inline void DecodeCodes64(const uint8_t* codes, int count, uint16_t* out) {
  const Fp8Bf16Bytes& t = Fp8Bytes();
  const __mmask64 m =
      count >= 64 ? ~__mmask64(0) : ((__mmask64(1) << count) - 1);
  __m512i c = _mm512_maskz_loadu_epi8(m, codes);
  c = _mm512_permutexvar_epi8(_mm512_load_si512(t.order), c);
  const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(t.lo), c,
                                              _mm512_load_si512(t.lo + 64));
  __m512i hi = _mm512_permutex2var_epi8(_mm512_load_si512(t.hi), c,
                                        _mm512_load_si512(t.hi + 64));
  hi = _mm512_ternarylogic_epi32(hi, c, _mm512_set1_epi8(char(0x80)), 0xF8);
  _mm512_storeu_si512(out, _mm512_unpacklo_epi8(lo, hi));
  _mm512_storeu_si512(out + 32, _mm512_unpackhi_epi8(lo, hi));
}
}  // namespace


// Builds what the scan's `path` reads: the key-row path (the tile unit and
// a KeyRowShape) only qb and coef16, the other paths q and coef, and the
// FMA form also qf.
void PrepareIndexQuery(const uint8_t* q_codes, const float* q_scales,
                       const float* weights, int heads, int dim, IndexPath path,
                       IndexQuery* out) {
  const int dp = PaddedIndexDim(dim);
  out->path = path;
  out->heads = heads;
  out->pairs = dp / 2;
  out->coef.resize(heads);
  const float dim_scale = 1.0f / std::sqrt(float(dim));
  for (int h = 0; h < heads; ++h) {
    out->coef[h] = (weights[h] * dim_scale) * q_scales[h];
  }
  out->qb.clear();
  out->qf.clear();
  if (path == IndexPath::kTiles && KeyRowShape(heads, dim)) {
    out->q.clear();
    const int chunks = dim / 32;
    // bf16 of every code's value times 256 (exact: a power-of-two
    // multiple of an fp8 value).
    static const struct Times256 {
      uint16_t v[256];
      Times256() {
        for (int c = 0; c < 256; ++c) {
          v[c] = FloatToBf16(Fp8E4M3ToFloat(uint8_t(c)) * 256.0f);
        }
      }
    } times256;
    // Pair row m of chunk k holds dims RowDim(2 m), RowDim(2 m + 1) as one
    // 32-bit word: head h's goes to column h of the [Q | 0] tile and
    // column 8 + h of the [0 | Q] tile.
    out->qb.assign(size_t(chunks) * 2 * 16 * 32, 0);
    for (int k = 0; k < chunks; ++k) {
      uint16_t* lo = &out->qb[size_t(2 * k) * 16 * 32];
      uint16_t* hi = lo + 16 * 32;
      for (int h = 0; h < heads; ++h) {
        const uint8_t* codes = q_codes + size_t(h) * dim + 32 * k;
        for (int m = 0; m < 16; ++m) {
          const uint16_t pair[2] = {times256.v[codes[RowDim(2 * m)]],
                                    times256.v[codes[RowDim(2 * m + 1)]]};
          std::memcpy(lo + (m * 16 + h) * 2, pair, sizeof(pair));
          std::memcpy(hi + (m * 16 + 8 + h) * 2, pair, sizeof(pair));
        }
      }
    }
    for (int l = 0; l < 16; ++l) {
      out->coef16[l] = l % 8 < heads ? out->coef[l % 8] : 0.0f;
    }
    return;
  }
  // Rows up to a multiple of 16 heads stay zero: the tile path reads whole
  // 16-row query tiles.
  out->q.assign(size_t((heads + 15) / 16 * 16) * out->pairs, 0);
  alignas(64) uint16_t row[64];
  for (int h = 0; h < heads; ++h) {
    uint16_t* dst =
        reinterpret_cast<uint16_t*>(&out->q[size_t(h) * out->pairs]);
    for (int d0 = 0; d0 < dp; d0 += 64) {
      DecodeCodes64(q_codes + size_t(h) * dim + d0,
                    std::max(0, std::min(64, dim - d0)), row);
      std::memcpy(dst + d0, row, size_t(std::min(64, dp - d0)) * 2);
    }
  }
  if (path == IndexPath::kFma) {
    // A bf16 pair word widens to fp32 by bit moves: the odd dim is its
    // high half, the even dim its low half shifted up.
    out->qf.resize(size_t(heads) * dp);
    for (size_t i = 0; i < size_t(heads) * out->pairs; ++i) {
      const uint32_t w = out->q[i];
      const uint32_t odd = w & 0xFFFF0000u, even = w << 16;
      std::memcpy(&out->qf[2 * i], &odd, 4);
      std::memcpy(&out->qf[2 * i + 1], &even, 4);
    }
  }
}

// The stored blocks that hold positions [begin, end), in position order.
void ScanBlocks(const KvLayout& l, int begin, int end,
                std::vector<ScanBlock>* out) {
  out->clear();
  if (begin >= end) return;
  const int itpp = l.index_tokens_per_page;
  // Divides once, for the first block, then steps through the pages: a
  // division per block took ~7% of a dsa-tiny decode scan.
  int page = begin / itpp, block = begin % itpp / kKeyBlock;
  int page_first = page * itpp;
  // (An index page holds whole blocks.)
  for (int pos = begin; pos < end;) {
    const int first = page_first + block * kKeyBlock;
    const int hi = std::min(kKeyBlock, end - first);
    out->push_back({page, block, first, pos - first, hi});
    pos = first + hi;
    if (++block * kKeyBlock >= itpp) {
      ++page;
      block = 0;
      page_first += itpp;
    }
  }
}
// Widens stored block `b` into kb (all 32 lanes; slots outside [b.lo,
// b.hi) hold whatever the page holds there, and their scores are never
// stored). A whole block is widened by the byte tables alone when
// `byte_tables` (CodeWidening::kByteTables).
void LoadKeyBlock(const LayerView& view, const ScanBlock& b, int dim,
                  bool byte_tables, KeyBlock* kb) {
  const uint8_t* rows = view.IndexKeyBlock(b.page, b.block);
  const int stored = view.layout->IndexPairs();
  const int pairs = PaddedIndexDim(dim) / 2;
  if (byte_tables) {
    WidenPairRows<true>(rows, stored, pairs, kb->kt.data());
  } else {
    WidenPairRows<false>(rows, stored, pairs, kb->kt.data());
  }
  const float* sc = view.IndexBlockScales(b.page, b.block);
  _mm512_store_ps(kb->scale, _mm512_load_ps(sc));
  _mm512_store_ps(kb->scale + 16, _mm512_load_ps(sc + 16));
}
namespace {

// The head terms of a block's 32 keys: s += c[h] * relu(dots of head h),
// heads in increasing order.
template <int HB>
inline void AddHeadTerms(const __m512* a0, const __m512* a1, const float* coef,
                         __m512* s0, __m512* s1) {
  const __m512 zero = _mm512_setzero_ps();
  for (int h = 0; h < HB; ++h) {
    const __m512 c = _mm512_set1_ps(coef[h]);
    *s0 = _mm512_fmadd_ps(c, _mm512_max_ps(a0[h], zero), *s0);
    *s1 = _mm512_fmadd_ps(c, _mm512_max_ps(a1[h], zero), *s1);
  }
}

template <int HB>
inline void ScoreHeads(const uint32_t* kt, int pairs, const uint32_t* q,
                       const float* coef, __m512* s0, __m512* s1) {
  __m512 a0[HB], a1[HB];
  for (int h = 0; h < HB; ++h) a0[h] = a1[h] = _mm512_setzero_ps();
  for (int p = 0; p < pairs; ++p) {
    const __m512bh k0 = (__m512bh)_mm512_load_si512(kt + size_t(p) * kKeyBlock);
    const __m512bh k1 =
        (__m512bh)_mm512_load_si512(kt + size_t(p) * kKeyBlock + 16);
    for (int h = 0; h < HB; ++h) {
      const __m512bh qb =
          (__m512bh)_mm512_set1_epi32(int(q[size_t(h) * pairs + p]));
      a0[h] = _mm512_dpbf16_ps(a0[h], qb, k0);
      a1[h] = _mm512_dpbf16_ps(a1[h], qb, k1);
    }
  }
  AddHeadTerms<HB>(a0, a1, coef, s0, s1);
}

// ScoreHeads with the block's pair rows widened as they are used (rows
// [stored, pairs) are zero), for a query of HB <= kHeadBlock heads whose
// code pairs are given pair-major (qt[p * HB + h]): the keys never go
// through kt, and the widening overlaps the dot products. The same
// arithmetic.
template <int HB, bool kByteTables>
inline void ScoreHeadsWidening(const uint8_t* rows, int stored, int pairs,
                               const uint32_t* qt, const float* coef,
                               __m512* s0, __m512* s1) {
  const RowWidening w;
  __m512 a0[HB], a1[HB];
  for (int h = 0; h < HB; ++h) a0[h] = a1[h] = _mm512_setzero_ps();
  auto dots = [&](const uint32_t* q, __m512i k0, __m512i k1) {
    for (int h = 0; h < HB; ++h) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(int(q[h]));
      a0[h] = _mm512_dpbf16_ps(a0[h], qb, (__m512bh)k0);
      a1[h] = _mm512_dpbf16_ps(a1[h], qb, (__m512bh)k1);
    }
  };
  for (int p = 0; p < stored; ++p) {
    __m512i k0, k1;
    w.Row<kByteTables>(rows + size_t(p) * 64, &k0, &k1);
    dots(qt + size_t(p) * HB, k0, k1);
  }
  for (int p = stored; p < pairs; ++p) {
    dots(qt + size_t(p) * HB, _mm512_setzero_si512(), _mm512_setzero_si512());
  }
  AddHeadTerms<HB>(a0, a1, coef, s0, s1);
}

// One query of HB <= kHeadBlock heads on the vdpbf16ps form, over stored
// blocks[0 .. n): scores each straight from its rows (ScoreHeadsWidening)
// and writes its lanes [lo, min(hi, limit - first)) to out; requests the
// block kWideningAheadBytes ahead (at least kPrefetchBlocks) into L1.
// Into L2 (prefetcht2) 4 blocks ahead, as before, the scan did not overlap
// its reads with its arithmetic on an AMD EPYC (Zen 5) VM: dsa-tiny's 128K
// keys from DRAM took 285-325 us on two cores (570 on one), against
// 105-130 us for the arithmetic alone (keys in cache) and 127-150 us to
// merely read the same blocks; into L1 16 blocks ahead, 100-155 us (one
// core 195-200 us, its warm time 185). L2 requests further ahead did not
// help, nor L1 requests 4 blocks ahead (150-175 us). Prefetches only: the
// same bits.
template <int HB, bool kByteTables>
void ScoreBlocksWidening(const LayerView& view, const ScanBlock* blocks, int n,
                         const IndexQuery& iq, int limit, float* out) {
  const int stored = view.layout->IndexPairs();
  alignas(64) uint32_t qt[kMaxIndexPairs * HB];
  for (int p = 0; p < iq.pairs; ++p) {
    for (int h = 0; h < HB; ++h)
      qt[p * HB + h] = iq.q[size_t(h) * iq.pairs + p];
  }
  const int ahead =
      std::max(kPrefetchBlocks,
               int(kWideningAheadBytes / view.layout->IndexBlockBytes()));
  for (int i = 0; i < n; ++i) {
    const ScanBlock& b = blocks[i];
    if (i + ahead < n) PrefetchKeyBlock(view, blocks[i + ahead]);
    const int hi = std::min(b.hi, limit - b.first);
    if (hi <= b.lo) continue;
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    const uint8_t* rows = view.IndexKeyBlock(b.page, b.block);
    if (stored == 16 && iq.pairs == 16) {  // Di = 32: a loop of known length
      ScoreHeadsWidening<HB, kByteTables>(rows, 16, 16, qt, iq.coef.data(), &s0,
                                          &s1);
    } else {
      ScoreHeadsWidening<HB, kByteTables>(rows, stored, iq.pairs, qt,
                                          iq.coef.data(), &s0, &s1);
    }
    const float* sc = view.IndexBlockScales(b.page, b.block);
    s0 = _mm512_mul_ps(s0, _mm512_load_ps(sc));
    s1 = _mm512_mul_ps(s1, _mm512_load_ps(sc + 16));
    StoreBlockLanes(out + b.first, b.lo, hi, s0, s1);
  }
}
}  // namespace

// ScoreBlocksWidening for iq.heads (1 .. kHeadBlock) heads.
template <bool kByteTables, int HB>
void ScoreBlocksWideningAnyHeads(const LayerView& view, const ScanBlock* blocks,
                                 int n, const IndexQuery& iq, int limit,
                                 float* out) {
  if constexpr (HB < kHeadBlock) {
    if (iq.heads > HB) {
      ScoreBlocksWideningAnyHeads<kByteTables, HB + 1>(view, blocks, n, iq,
                                                       limit, out);
      return;
    }
  }
  ScoreBlocksWidening<HB, kByteTables>(view, blocks, n, iq, limit, out);
}

template void ScoreBlocksWideningAnyHeads<true>(const LayerView& view,
                                                const ScanBlock* blocks, int n,
                                                const IndexQuery& iq, int limit,
                                                float* out);
template void ScoreBlocksWideningAnyHeads<false>(const LayerView& view,
                                                 const ScanBlock* blocks, int n,
                                                 const IndexQuery& iq,
                                                 int limit, float* out);

// The FMA form: the block's pairs widened to fp32 (kb->kf), by bit moves.
void WidenKeyBlock(int pairs, KeyBlock* kb) {
  const __m512i high = _mm512_set1_epi32(int(0xFFFF0000u));
  for (int p = 0; p < pairs; ++p) {
    const uint32_t* src = kb->kt.data() + size_t(p) * kKeyBlock;
    float* dst = kb->kf.data() + size_t(p) * 2 * kKeyBlock;
    for (int half = 0; half < 2; ++half) {
      const __m512i w = _mm512_load_si512(src + 16 * half);
      _mm512_store_si512(dst + 16 * half, _mm512_and_si512(w, high));
      _mm512_store_si512(dst + 32 + 16 * half, _mm512_slli_epi32(w, 16));
    }
  }
}
namespace {

// ScoreHeads in the FMA form: per pair the odd dim's product is added
// before the even one's, each with one rounding, as vdpbf16ps does.
template <int HB>
inline void ScoreHeadsFma(const float* kf, int pairs, const float* qf,
                          const float* coef, __m512* s0, __m512* s1) {
  __m512 a0[HB], a1[HB];
  for (int h = 0; h < HB; ++h) a0[h] = a1[h] = _mm512_setzero_ps();
  for (int p = 0; p < pairs; ++p) {
    const float* k = kf + size_t(p) * 2 * kKeyBlock;
    const __m512 ko0 = _mm512_load_ps(k), ko1 = _mm512_load_ps(k + 16);
    const __m512 ke0 = _mm512_load_ps(k + 32), ke1 = _mm512_load_ps(k + 48);
    for (int h = 0; h < HB; ++h) {
      const float* q = qf + (size_t(h) * pairs + p) * 2;
      const __m512 qo = _mm512_set1_ps(q[0]), qe = _mm512_set1_ps(q[1]);
      a0[h] = _mm512_fmadd_ps(qo, ko0, a0[h]);
      a1[h] = _mm512_fmadd_ps(qo, ko1, a1[h]);
      a0[h] = _mm512_fmadd_ps(qe, ke0, a0[h]);
      a1[h] = _mm512_fmadd_ps(qe, ke1, a1[h]);
    }
  }
  AddHeadTerms<HB>(a0, a1, coef, s0, s1);
}
}  // namespace

// The vector path: scores the 32 keys of `kb` for query `iq` with
// vdpbf16ps or, in the FMA form, with fp32 FMAs; writes lanes [lo, hi) to
// out[lo .. hi). `ahead` is stepped once per head group and finished at
// the end.
void ScoreKeyBlock(const KeyBlock& kb, const IndexQuery& iq, int lo, int hi,
                   float* out, SpreadPrefetch ahead) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  const int pairs = iq.pairs;
  auto heads = [&](auto hb, int h) {
    constexpr int HB = decltype(hb)::value;
    if (iq.path == IndexPath::kFma) {
      ScoreHeadsFma<HB>(kb.kf.data(), pairs, &iq.qf[size_t(h) * 2 * pairs],
                        &iq.coef[h], &s0, &s1);
    } else {
      ScoreHeads<HB>(kb.kt.data(), pairs, &iq.q[size_t(h) * pairs], &iq.coef[h],
                     &s0, &s1);
    }
  };
  // One Step() per head group of the two loops below.
  ahead.Split(iq.path == IndexPath::kFma
                  ? iq.heads / kFmaHeadBlock +
                        iq.heads % kFmaHeadBlock / kHeadBlock
                  : iq.heads / kHeadBlock);
  int h = 0;
  if (iq.path == IndexPath::kFma) {
    for (; h + kFmaHeadBlock <= iq.heads; h += kFmaHeadBlock) {
      ahead.Step();
      heads(std::integral_constant<int, kFmaHeadBlock>(), h);
    }
  }
  for (; h + kHeadBlock <= iq.heads; h += kHeadBlock) {
    ahead.Step();
    heads(std::integral_constant<int, kHeadBlock>(), h);
  }
  ahead.Finish();
  for (; h + 4 <= iq.heads; h += 4) heads(std::integral_constant<int, 4>(), h);
  for (; h < iq.heads; ++h) heads(std::integral_constant<int, 1>(), h);
  s0 = _mm512_mul_ps(s0, _mm512_load_ps(kb.scale));
  s1 = _mm512_mul_ps(s1, _mm512_load_ps(kb.scale + 16));
  StoreBlockLanes(out, lo, hi, s0, s1);
}

}  // namespace attention_internal
}  // namespace karat
