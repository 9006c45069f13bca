// The DSA indexer's key-row tile path (up to 8 heads, whole 32-dim chunks;
// the tile unit only): the dots of pairs of key blocks as the A operand or,
// for many queries, as the B operand, their head terms, and the scan of a
// key range that way (ScoreKeyRows). The keys' widening (LoadKeyRows) and
// the path's description: attention_indexer_tiles.cc.

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

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
namespace karat {
namespace attention_internal {
namespace {

// Row path tiles, all 16 rows x 64 bytes: C (0, 1), A (2-3, and 6-7 for
// Di = 32) and the query's B tiles (LoadQueryTiles). A block's keys 0-15
// go through C 0 and keys 16-31 through C 1. Blocks are paired: the B
// tile [Q | 0] (heads in columns 0-7) takes the first block's keys and
// [0 | Q] (columns 8-15) the second's, so C row m collects key m (or
// 16 + m) of the first block in columns 0-7 and of the second in 8-15,
// and two tile stores take both blocks. An element's other products are
// then exact zeros, so each dot equals the key's own chunk products
// accumulated in chunk order, as scoring a block alone (SoloDots, keys in
// columns 0-7) gives them. A NaN code would turn those zero products
// into NaN, so a pair with one is scored block by block.
inline void LoadQueryTiles(const IndexQuery& iq, int chunks) {
  const uint16_t* qb = iq.qb.data();
  _tile_loadd(4, qb, 64);
  _tile_loadd(5, qb + 16 * 32, 64);
  if (chunks > 1) {
    _tile_loadd(6, qb + 2 * 16 * 32, 64);
    _tile_loadd(7, qb + 3 * 16 * 32, 64);
  }
}

// C 0 and 1 = the dots of blocks a (columns 0-7) and b (8-15).
inline void PairDots(const KeyRows& a, const KeyRows& b, int dim) {
  const size_t stride = size_t(dim) * 2;
  const uint16_t* al = a.rows;
  const uint16_t* ah = al + size_t(16) * dim;
  const uint16_t* bl = b.rows;
  const uint16_t* bh = bl + size_t(16) * dim;
  _tile_zero(0);
  _tile_zero(1);
  if (dim == 32) {
    _tile_loadd(2, al, stride);
    _tile_loadd(3, ah, stride);
    _tile_loadd(6, bl, stride);
    _tile_loadd(7, bh, stride);
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(1, 3, 4);
    _tile_dpbf16ps(0, 6, 5);
    _tile_dpbf16ps(1, 7, 5);
  } else {  // 64: B tiles 4-5 hold chunk 0, 6-7 chunk 1
    _tile_loadd(2, al, stride);
    _tile_loadd(3, ah, stride);
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(1, 3, 4);
    _tile_loadd(2, bl, stride);
    _tile_loadd(3, bh, stride);
    _tile_dpbf16ps(0, 2, 5);
    _tile_dpbf16ps(1, 3, 5);
    _tile_loadd(2, al + 32, stride);
    _tile_loadd(3, ah + 32, stride);
    _tile_dpbf16ps(0, 2, 6);
    _tile_dpbf16ps(1, 3, 6);
    _tile_loadd(2, bl + 32, stride);
    _tile_loadd(3, bh + 32, stride);
    _tile_dpbf16ps(0, 2, 7);
    _tile_dpbf16ps(1, 3, 7);
  }
}

// C 0 and 1 = the dots of block a alone (columns 0-7).
inline void SoloDots(const KeyRows& a, int dim) {
  const size_t stride = size_t(dim) * 2;
  const uint16_t* al = a.rows;
  const uint16_t* ah = al + size_t(16) * dim;
  _tile_zero(0);
  _tile_zero(1);
  _tile_loadd(2, al, stride);
  _tile_loadd(3, ah, stride);
  _tile_dpbf16ps(0, 2, 4);
  _tile_dpbf16ps(1, 3, 4);
  if (dim > 32) {
    _tile_loadd(2, al + 32, stride);
    _tile_loadd(3, ah + 32, stride);
    _tile_dpbf16ps(0, 2, 6);
    _tile_dpbf16ps(1, 3, 6);
  }
}

// dots: C 0 (16 x 16 fp32), then C 1.
constexpr int kPairDots = 2 * 16 * 16;
inline void StorePairDots(float* dots) {
  _tile_stored(0, dots, 64);
  _tile_stored(1, dots + 16 * 16, 64);
}

// Head sums of 16 rows of dots (row m: key x_m's heads in columns 0-7,
// y_m's in 8-15): x = x_0..15, y = y_0..15. With t[h] = c[h] *
// max(dot[h], 0) (absent heads give +0), each sum is
//   ((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7)).
inline void HeadSums16(const float* dots, __m512 c, __m512* x, __m512* y) {
  const __m512 zero = _mm512_setzero_ps();
  // Per 128-bit lane, adjacent elements are summed by pairing the even
  // and the odd elements of two registers.
  __m512 s[8];
  for (int i = 0; i < 8; ++i) {
    const __m512 a =
        _mm512_mul_ps(c, _mm512_max_ps(_mm512_load_ps(dots + 32 * i), zero));
    const __m512 d = _mm512_mul_ps(
        c, _mm512_max_ps(_mm512_load_ps(dots + 32 * i + 16), zero));
    s[i] = _mm512_add_ps(_mm512_shuffle_ps(a, d, 0x88),
                         _mm512_shuffle_ps(a, d, 0xDD));
  }
  __m512 t[4];
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * j], s[2 * j + 1], 0x88),
                         _mm512_shuffle_ps(s[2 * j], s[2 * j + 1], 0xDD));
  }
  // t[j], lane L, element e: heads 4 (L % 2) .. + 3 of x_(4 j + e) (L < 2)
  // or y_(4 j + e). Adding lanes 0 + 1 and 2 + 3 of t[0] and t[1] leaves
  // x 0-3, y 0-3, x 4-7, y 4-7; of t[2] and t[3], x 8-11, y 8-11, x 12-15,
  // y 12-15.
  __m512 f[2];
  for (int k = 0; k < 2; ++k) {
    f[k] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], 0xDD));
  }
  *x = _mm512_shuffle_f32x4(f[0], f[1], 0x88);
  *y = _mm512_shuffle_f32x4(f[0], f[1], 0xDD);
}

// The head sums of 16 keys from 8 rows of dots (row h: head h's dots of
// the 16 keys, 16 floats apart) and the heads' coefficients c[0..7]: per
// key, with t[h] = c[h] * max(dot[h], 0), ((t0 + t1) + (t2 + t3)) +
// ((t4 + t5) + (t6 + t7)), as HeadSums16 forms it across lanes.
inline __m512 HeadRowSums(const float* rows, const float* c) {
  const __m512 zero = _mm512_setzero_ps();
  __m512 t[8];
  for (int h = 0; h < 8; ++h) {
    t[h] = _mm512_mul_ps(_mm512_set1_ps(c[h]),
                         _mm512_max_ps(_mm512_load_ps(rows + 16 * h), zero));
  }
  return _mm512_add_ps(
      _mm512_add_ps(_mm512_add_ps(t[0], t[1]), _mm512_add_ps(t[2], t[3])),
      _mm512_add_ps(_mm512_add_ps(t[4], t[5]), _mm512_add_ps(t[6], t[7])));
}

// Writes the first b of a block's 32 head sums (keys 0-15 in lo, 16-31
// in hi) times the keys' scales to out.
inline void StoreScores(__m512 lo, __m512 hi, const float* scale, int b,
                        float* out) {
  lo = _mm512_mul_ps(lo, _mm512_load_ps(scale));
  hi = _mm512_mul_ps(hi, _mm512_load_ps(scale + 16));
  if (b == kKeyBlock) {
    _mm512_storeu_ps(out, lo);
    _mm512_storeu_ps(out + 16, hi);
  } else if (b > 0) {
    const __mmask16 m0 = FirstLanes16(b);
    const __mmask16 m1 = b <= 16 ? 0 : __mmask16((1u << (b - 16)) - 1);
    _mm512_mask_storeu_ps(out, m0, lo);
    _mm512_mask_storeu_ps(out + 16, m1, hi);
  }
}

// Scores of a pair (blocks a: b_a keys to out_a, b: b_b keys to out_b)
// from its dots.
inline void ReducePair(const float* dots, const IndexQuery& iq,
                       const KeyRows& a, int b_a, float* out_a,
                       const KeyRows& b, int b_b, float* out_b) {
  const __m512 c = _mm512_load_ps(iq.coef16);
  __m512 a0, b0, a1, b1;
  HeadSums16(dots, c, &a0, &b0);
  HeadSums16(dots + 16 * 16, c, &a1, &b1);
  StoreScores(a0, a1, a.scale, b_a, out_a);
  StoreScores(b0, b1, b.scale, b_b, out_b);
}

// Scores block a alone (b keys to out).
inline void ScoreSolo(const KeyRows& a, const IndexQuery& iq, int dim, int b,
                      float* out, float* dots) {
  SoloDots(a, dim);
  StorePairDots(dots);
  const __m512 c = _mm512_load_ps(iq.coef16);
  __m512 lo, hi, unused;
  HeadSums16(dots, c, &lo, &unused);
  HeadSums16(dots + 16 * 16, c, &hi, &unused);
  StoreScores(lo, hi, a.scale, b, out);
}
}  // namespace

// ScoreKeyRange for KeyRowShape queries on the tile unit. With one query
// it is software-pipelined by pairs of blocks: the tile unit computes pair
// i while pair i + 1 is widened (its dots are stored between the two
// blocks' widening), and pair i - 1's dots are reduced after, so neither
// unit waits on the other. (That order measured best.) With several
// queries (a prefill segment's) each block is widened once and scored for
// two queries per tile product (below): against one query per product, a
// 6000-token dsa-tiny prefill's share of samples in this function went from
// 7.3% to 3.4%. From kKeysAsBMinQueries queries on, the keys are the B
// operand and a query's head terms add up lane by lane; with one 32-dim
// chunk two sets of A and C tiles keep a pair's products queued while the
// last pair's dots are stored and reduced. 64 queries of 8 heads x 32 over
// 4096 keys, one core: 0.82-0.86 ns per (query, key), against 1.07-1.11
// with the keys as the A operand (0.97-1.04 without the second set); in a
// 6000-token dsa-tiny prefill (reference engine) this function's samples
// fell from 670-882 to 228-435 (three runs each).
void ScoreKeyRows(const LayerView& view, int dim, int k_begin, int stop,
                  const IndexQuery* queries, int nq, const int* limit,
                  float* const* out) {
  const int nblocks = (stop - k_begin + kKeyBlock - 1) / kKeyBlock;
  auto block_keys = [&](int blk) {
    return blk < nblocks
               ? std::min(kKeyBlock, stop - (k_begin + blk * kKeyBlock))
               : 0;
  };
  const int chunks = dim / 32;
  static const TileConfig config(16);
  _tile_loadconfig(&config);
  // Three pairs: the one reduced, the one on the tile unit, the one
  // widened.
  constexpr int kRing = 6;
  // One buffer for the ring's rows and, zero, those of `empty`, the
  // partner of an odd last block.
  const int nring = std::min(kRing, nblocks);
  AlignedVector<uint16_t> buffer(size_t(nring + 1) * kKeyBlock * dim);
  KeyRows ring[kRing], empty;
  for (int i = 0; i < nring; ++i) {
    ring[i].rows = buffer.data() + size_t(i) * kKeyBlock * dim;
  }
  empty.rows = buffer.data() + size_t(nring) * kKeyBlock * dim;
  AlignedVector<uint8_t> codes(size_t(kKeyBlock) * dim);
  auto slot = [&](int blk) -> const KeyRows& {
    return blk < nblocks ? ring[blk % kRing] : empty;
  };
  alignas(64) float dots[3][kPairDots];
  // Positions of the next block to widen and of the next keys to
  // prefetch into L1 and L2.
  const int itpp = view.layout->index_tokens_per_page;
  KeyPos next(k_begin, itpp);
  int near = std::min(stop, k_begin + kRowPrefetchAhead);
  int far = std::min(stop, k_begin + kRowFarAhead);
  KeyPos near_pos(near, itpp), far_pos(far, itpp);
  auto load = [&](int blk) {
    if (blk >= nblocks) return;
    const int b = block_keys(blk);
    const int end = k_begin + blk * kKeyBlock + b;
    PrefetchUpTo<false>(view, std::min(stop, end + kRowPrefetchAhead), dim,
                        &near, &near_pos);
    PrefetchUpTo<true>(view, std::min(stop, end + kRowFarAhead), dim, &far,
                       &far_pos);
    LoadKeyRows(view, next, b, dim, codes.data(), &ring[blk % kRing]);
    next.Advance(b, itpp);
  };
  auto start = [&](int blk) { return out[0] + k_begin + blk * kKeyBlock; };
  if (nq == 1) {
    LoadQueryTiles(queries[0], chunks);
    const int npairs = (nblocks + 1) / 2;
    load(0);
    load(1);
    int pending = -1;  // a pair whose dots await reduction
    for (int p = 0; p < npairs; ++p) {
      const int a = 2 * p, b = 2 * p + 1;
      const bool solo = slot(a).has_nan || slot(b).has_nan;
      if (!solo) PairDots(slot(a), slot(b), dim);
      load(a + 2);
      if (!solo) StorePairDots(dots[p % 2]);
      load(b + 2);
      if (pending >= 0) {
        ReducePair(dots[pending % 2], queries[0], slot(2 * pending),
                   block_keys(2 * pending), start(2 * pending),
                   slot(2 * pending + 1), block_keys(2 * pending + 1),
                   start(std::min(2 * pending + 1, nblocks - 1)));
        pending = -1;
      }
      if (!solo) {
        pending = p;
      } else {
        ScoreSolo(slot(a), queries[0], dim, block_keys(a), start(a), dots[2]);
        if (b < nblocks) {
          ScoreSolo(slot(b), queries[0], dim, block_keys(b), start(b), dots[2]);
        }
      }
    }
    if (pending >= 0) {
      ReducePair(dots[pending % 2], queries[0], slot(2 * pending),
                 block_keys(2 * pending), start(2 * pending),
                 slot(2 * pending + 1), block_keys(2 * pending + 1),
                 start(std::min(2 * pending + 1, nblocks - 1)));
    }
  } else {
    // Several queries (a prefill segment's), two to a B tile: query 2p's
    // heads in columns 0-7 (its [Q | 0] tile), 2p + 1's in 8-15 (its
    // [0 | Q] tile; zero for an odd last query). One TDPBF16PS then gives
    // both queries' dots of 16 keys, each element the same computation as
    // for the query alone (SoloDots: the same A row, the same B column, the
    // chunks in order), and the reduction uses both halves of its lanes.
    const int npairs = (nq + 1) / 2;
    constexpr int kTile = 16 * 32;  // uint16 elements of a B tile
    AlignedVector<uint16_t> pair_tiles(size_t(npairs) * chunks * kTile);
    AlignedVector<float> pair_coef(size_t(npairs) * 16);
    for (int p = 0; p < npairs; ++p) {
      const IndexQuery& qi = queries[2 * p];
      const IndexQuery* qj = 2 * p + 1 < nq ? &queries[2 * p + 1] : nullptr;
      for (int k = 0; k < chunks; ++k) {
        const uint16_t* lo = &qi.qb[size_t(2 * k) * kTile];
        uint16_t* dst = &pair_tiles[(size_t(p) * chunks + k) * kTile];
        for (int e = 0; e < kTile; e += 32) {
          __m512i v = _mm512_loadu_si512(lo + e);
          if (qj != nullptr) {
            v = _mm512_or_si512(
                v, _mm512_loadu_si512(&qj->qb[size_t(2 * k + 1) * kTile + e]));
          }
          _mm512_store_si512(dst + e, v);
        }
      }
      for (int l = 0; l < 16; ++l) {
        pair_coef[size_t(p) * 16 + l] =
            l < 8 ? qi.coef16[l] : (qj != nullptr ? qj->coef16[l] : 0.0f);
      }
    }
    // The keys of a block (from s0, b of them) that queries 2p and 2p + 1
    // score (<= 0: none).
    auto pair_keys = [&](int p, int s0, int b) {
      const int j = 2 * p + 1;
      return std::pair<int, int>(std::min(b, limit[2 * p] - s0),
                                 j < nq ? std::min(b, limit[j] - s0) : 0);
    };
    if (nq >= kKeysAsBMinQueries) {
      // Keys as the B operand: each pair's tiles transposed once into A
      // tiles (row h: head h of query 2p for h < 8, of 2p + 1 for h >= 8,
      // its pairs of codes in the key rows' order), and each block's key
      // rows transposed into B tiles (row q: pair q of 16 keys). C row h
      // then holds one head's dots of 16 keys, and a query's head terms
      // add up lane by lane, with no shuffles: about a third fewer vector
      // instructions per pair and block than the head sums across lanes
      // below, for two transposes per block and chunk. Each dot comes
      // from the same A row and B column with the roles swapped, which
      // TDPBF16PS computes to the same bits (products commute; a check of
      // 5.1 M elements of random, tiny and huge values found no
      // difference, and the tests compare every score with IndexerScore).
      for (int p = 0; p < npairs * chunks; ++p) {
        uint16_t* t = &pair_tiles[size_t(p) * kTile];
        __m512i r[16];
        for (int q = 0; q < 16; ++q) r[q] = _mm512_load_si512(t + 32 * q);
        Transpose16(r);
        for (int q = 0; q < 16; ++q) _mm512_store_si512(t + 32 * q, r[q]);
      }
      // Per chunk, keys 0-15 then 16-31.
      alignas(64) uint16_t key_tiles[kRowMaxChunks][2][kTile];
      struct PendingPair {
        int blk = -1, p = 0, slot = 0;
      } pending;
      int slot = 0;
      auto reduce = [&](const PendingPair& r) {
        const int s0 = k_begin + r.blk * kKeyBlock;
        const int i = 2 * r.p, j = 2 * r.p + 1;
        const auto [b_i, b_j] = pair_keys(r.p, s0, block_keys(r.blk));
        const KeyRows& kb = ring[r.blk % kRing];
        const float* d = dots[r.slot];
        const float* coef = &pair_coef[size_t(r.p) * 16];
        if (b_i > 0) {
          StoreScores(HeadRowSums(d, coef), HeadRowSums(d + 16 * 16, coef),
                      kb.scale, b_i, out[i] + s0);
        }
        if (b_j > 0) {
          StoreScores(HeadRowSums(d + 8 * 16, coef + 8),
                      HeadRowSums(d + 16 * 16 + 8 * 16, coef + 8), kb.scale,
                      b_j, out[j] + s0);
        }
      };
      // One chunk: a pending pair's results are still in its set's C tiles.
      auto store_reduce = [&](const PendingPair& r) {
        if (r.slot == 0) {
          StorePairDots(dots[0]);
        } else {
          _tile_stored(5, dots[1], 64);
          _tile_stored(6, dots[1] + 16 * 16, 64);
        }
        reduce(r);
      };
      for (int blk = 0; blk < nblocks; ++blk) {
        const int s0 = k_begin + blk * kKeyBlock, b = block_keys(blk);
        load(blk);
        const KeyRows& kb = ring[blk % kRing];
        for (int k = 0; k < chunks; ++k) {
          for (int half = 0; half < 2; ++half) {
            __m512i r[16];
            for (int q = 0; q < 16; ++q) {
              r[q] = _mm512_load_si512(kb.rows + size_t(16 * half + q) * dim +
                                       32 * k);
            }
            Transpose16(r);
            for (int q = 0; q < 16; ++q) {
              _mm512_store_si512(&key_tiles[k][half][32 * q], r[q]);
            }
          }
        }
        // B: chunk 0's keys in tiles 2 (0-15) and 3 (16-31), chunk 1's in
        // 6 and 7; A: the pair's chunks in 4 and 5.
        _tile_loadd(2, key_tiles[0][0], 64);
        _tile_loadd(3, key_tiles[0][1], 64);
        if (chunks > 1) {
          _tile_loadd(6, key_tiles[1][0], 64);
          _tile_loadd(7, key_tiles[1][1], 64);
        }
        for (int p = 0; p < npairs; ++p) {
          const auto [b_i, b_j] = pair_keys(p, s0, b);
          if (b_i <= 0 && b_j <= 0) continue;
          const uint16_t* tiles = &pair_tiles[size_t(p) * chunks * kTile];
          if (chunks == 1) {
            // Two sets of A and C tiles (4 -> 0, 1 and 7 -> 5, 6), so
            // that this pair's products are queued before the last
            // pair's results are stored.
            // (GCC's tile intrinsics paste their tile numbers into the
            // instruction text, so each set is written out.)
            if (slot == 0) {
              _tile_zero(0);
              _tile_zero(1);
              _tile_loadd(4, tiles, 64);
              _tile_dpbf16ps(0, 4, 2);
              _tile_dpbf16ps(1, 4, 3);
            } else {
              _tile_zero(5);
              _tile_zero(6);
              _tile_loadd(7, tiles, 64);
              _tile_dpbf16ps(5, 7, 2);
              _tile_dpbf16ps(6, 7, 3);
            }
            if (pending.blk >= 0) store_reduce(pending);
          } else {
            _tile_zero(0);
            _tile_zero(1);
            _tile_loadd(4, tiles, 64);
            _tile_dpbf16ps(0, 4, 2);
            _tile_dpbf16ps(1, 4, 3);
            _tile_loadd(5, tiles + kTile, 64);
            _tile_dpbf16ps(0, 5, 6);
            _tile_dpbf16ps(1, 5, 7);
            if (pending.blk >= 0) reduce(pending);
            StorePairDots(dots[slot]);
          }
          pending = PendingPair{blk, p, slot};
          slot ^= 1;
        }
      }
      if (pending.blk >= 0) {
        if (chunks == 1) {
          store_reduce(pending);
        } else {
          reduce(pending);
        }
      }
    } else {
      const size_t stride = size_t(dim) * 2;
      for (int blk = 0; blk < nblocks; ++blk) {
        const int s0 = k_begin + blk * kKeyBlock, b = block_keys(blk);
        load(blk);
        const KeyRows& kb = ring[blk % kRing];
        // The block's keys: chunk 0 in tiles 2 (keys 0-15) and 3 (16-31),
        // chunk 1 in 6 and 7; the pair's B tiles in 4 and 5.
        _tile_loadd(2, kb.rows, stride);
        _tile_loadd(3, kb.rows + size_t(16) * dim, stride);
        if (chunks > 1) {
          _tile_loadd(6, kb.rows + 32, stride);
          _tile_loadd(7, kb.rows + size_t(16) * dim + 32, stride);
        }
        for (int p = 0; p < npairs; ++p) {
          const int i = 2 * p, j = 2 * p + 1;
          const auto [b_i, b_j] = pair_keys(p, s0, b);
          if (b_i <= 0 && b_j <= 0) continue;
          const uint16_t* tiles = &pair_tiles[size_t(p) * chunks * kTile];
          _tile_zero(0);
          _tile_zero(1);
          _tile_loadd(4, tiles, 64);
          _tile_dpbf16ps(0, 2, 4);
          _tile_dpbf16ps(1, 3, 4);
          if (chunks > 1) {
            _tile_loadd(5, tiles + kTile, 64);
            _tile_dpbf16ps(0, 6, 5);
            _tile_dpbf16ps(1, 7, 5);
          }
          StorePairDots(dots[0]);
          const __m512 c = _mm512_load_ps(&pair_coef[size_t(p) * 16]);
          __m512 i_lo, j_lo, i_hi, j_hi;
          HeadSums16(dots[0], c, &i_lo, &j_lo);
          HeadSums16(dots[0] + 16 * 16, c, &i_hi, &j_hi);
          StoreScores(i_lo, i_hi, kb.scale, b_i, out[i] + s0);
          if (b_j > 0) StoreScores(j_lo, j_hi, kb.scale, b_j, out[j] + s0);
        }
      }
    }
  }
  _tile_release();
}
}  // namespace attention_internal
}  // namespace karat
#endif  // __AMX_BF16__ && __AMX_TILE__
