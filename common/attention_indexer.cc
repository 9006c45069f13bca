// The DSA indexer's scan (Score): the choice of path (tile unit, vdpbf16ps
// or fp32 FMAs; code widening), measured once per process or forced, the
// scan of a key range over the paths (ScoreKeyRange) and the public entry
// points (IndexerScore, IndexerScoreQueries, KernelUnitsDescription). The
// paths themselves: attention_indexer_vector.cc (vector unit),
// attention_indexer_tiles.cc and attention_indexer_rows.cc (tile unit).

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

// --- DSA indexer (Score, §III-D) -------------------------------------------
//
// Arithmetic (a fixed function of the inputs; every path below computes it
// bit for bit, whatever the block, split, batch or segment):
//   fp8 codes are exact in bf16. For key s and head h, over the code pairs
//   p = 0, 1, ... of the padded dimension (zero codes beyond Di):
//     dot = (dot + q[2p+1]*k[2p+1]) + q[2p]*k[2p]
//   with exact products and fp32 round-to-nearest adds, which is what one
//   lane of vdpbf16ps computes. Then, heads in increasing order,
//     acc = fma(c[h], max(dot, 0), acc),  c[h] = (w[h] * Di^-0.5) * q_scale[h]
//   and score = acc * k_scale[s]. Both scales are positive (MODEL.md: scale =
//   max(amax, 1e-4) / 448), so this equals MODEL.md's
//   sum_h w[h] Di^-0.5 ReLU(q_scale q . k_scale k) up to rounding.
//
// That is the vector path. It has two forms with the same bits
// (IndexerDots): vdpbf16ps on the code pairs, or fp32 FMAs on the codes
// widened to fp32 (the odd dim's product first, one rounding each; no
// partial sum is ever subnormal, so vdpbf16ps's flushing never applies).
// vdpbf16ps does two products per lane and instruction; it issues at the
// FMA's rate on AMD Zen 4/5 but at a quarter of it on Sapphire Rapids, so
// each process measures both once and takes the faster.
//
// Where the kernel grants the matrix tile unit (AMX), the dots come from
// TDPBF16PS instead, whose own internal accumulation replaces the chain
// above. On Sapphire Rapids the tile unit is an order of magnitude faster
// than either vector form. The tile unit runs one of two paths, chosen by
// the shape alone (KeyRowShape), never by block, split or batch:
//   * up to 8 heads and Di a multiple of 32 (at most 64), the key-row path
//     (ScoreKeyRows): the dots come from TDPBF16PS over 32-dim chunks in
//     increasing order, each chunk's dims in RowDim order, and then, per
//     key, t[h] = c[h] * max(dot[h], 0) (+0 for absent heads) and
//       acc = ((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7)),
//     score = acc * k_scale[s];
//   * otherwise TileDots, then the head terms in increasing order as above.
//
// Layout: keys are scored 32 at a time (one lane, or tile column, per key),
// a stored block of a page at a time. The pages keep each block's codes
// pair-major (kv_store.h: code pair p of its 32 keys in one 64-byte row),
// so widening a row to bf16, by bit moves or byte table lookups (vpermi2b),
// whichever the process measured faster (CodeWidening), gives code pair p
// of the 32 keys as two vectors, with no transpose: the vector path
// broadcasts the query's code pairs against them, and in memory (kt, 128
// bytes a pair) they are exactly the pair-interleaved (VNNI) layout the
// tile unit takes as its B operand. A query of at most kHeadBlock heads
// (a decode step of the small models) widens each row as its dot products
// use it (ScoreBlocksWidening); otherwise a block is widened once into kt
// for all queries of a segment (prefill) and all head groups. The vector
// path keeps 2 x kHeadBlock accumulators (vdpbf16ps) or 2 x kFmaHeadBlock
// (FMA; the block's pairs widened once more into an fp32 scratch,
// WidenKeyBlock) in registers over all pairs. The key-row path instead
// takes keys in their natural layout (one 64-byte tile row per 32-dim
// chunk), which it puts back together from the pair rows; see its section
// below.
namespace {

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
constexpr bool kHaveTileUnit = true;
#else
constexpr bool kHaveTileUnit = false;
#endif

// Requested while the program loads: the kernel enables the tile state
// only in threads created after the request, and the core pools start
// their threads early.
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
const bool g_tile_unit = RequestTileUnit();
#else
const bool g_tile_unit = false;
#endif
}  // namespace

bool UseTileUnit() { return kHaveTileUnit && g_tile_unit; }
namespace {

// One thread's rate of `op` (instructions per second) over 24 independent
// accumulators, timed over `rounds` rounds; the accumulators stay in
// registers (the unrolled loop).
template <typename Op>
double InstructionRate(Op op, int rounds) {
  __m512 acc[24];
  for (int i = 0; i < 24; ++i) acc[i] = _mm512_set1_ps(float(i));
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < rounds; ++r) {
#pragma GCC unroll 24
    for (int i = 0; i < 24; ++i) acc[i] = op(acc[i]);
  }
  const double s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  __m512 sum = acc[0];
  for (int i = 1; i < 24; ++i) sum = _mm512_add_ps(sum, acc[i]);
  volatile float sink = _mm512_reduce_add_ps(sum);
  (void)sink;
  return s > 0 ? 24.0 * rounds / s : 0.0;
}

IndexerDotsChoice MeasureIndexerDots() {
  // Operands that keep every accumulator normal and finite.
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3A803A80);  // 2^-10 twice
  const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
  auto bf16 = [&](__m512 x) { return _mm512_dpbf16_ps(x, a, a); };
  auto fma = [&](__m512 x) { return _mm512_fmadd_ps(x, half, one); };
  IndexerDotsChoice c;
  // A warm-up first: a core runs its first wide instructions slowly while
  // its clock and voltage settle. Then alternated, so that a change of
  // clock or load affects both alike; about a millisecond in all.
  InstructionRate(fma, 4000);
  for (int i = 0; i < 3; ++i) {
    c.bf16_per_s = std::max(c.bf16_per_s, InstructionRate(bf16, 4000));
    c.fma_per_s = std::max(c.fma_per_s, InstructionRate(fma, 8000));
  }
  c.dots = c.fma_per_s > 2.4 * c.bf16_per_s ? IndexerDots::kFp32Fma
                                            : IndexerDots::kBf16Pairs;
  return c;
}

// -1: the process's own choice; else a forced IndexerDots (vector path).
std::atomic<int> g_forced_dots{-1};

// The time to widen one block of 32 keys x 128 normal codes in L1
// (WidenPairRows), each way; the byte tables are taken when they are at
// least 5% faster (the bit moves spare the shuffle unit, which the tile
// path's loads keep busy on some cores).
CodeWideningChoice MeasureCodeWidening() {
  constexpr int kDim = 128, kRounds = 400;
  AlignedVector<uint8_t> codes(size_t(kKeyBlock) * kDim);
  for (size_t i = 0; i < codes.size(); ++i) {
    // Exponent field 1-15, not NaN: 8 <= code & 0x7F <= 126.
    codes[i] = uint8_t(8 + (i * 37) % 119) | uint8_t((i * 13) & 0x80);
  }
  AlignedVector<uint32_t> kt(size_t(kDim / 2) * kKeyBlock);
  auto time = [&](auto byte_tables) {
    const auto start = std::chrono::steady_clock::now();
    for (int r = 0; r < kRounds; ++r) {
      WidenPairRows<decltype(byte_tables)::value>(codes.data(), kDim / 2,
                                                  kDim / 2, kt.data());
      asm volatile("" : : "r"(kt.data()) : "memory");
    }
    return std::chrono::duration<double, std::nano>(
               std::chrono::steady_clock::now() - start)
               .count() /
           kRounds;
  };
  CodeWideningChoice c;
  time(std::false_type());  // warm-up: clock, caches, the tables' page
  time(std::true_type());
  c.bit_moves_ns = c.byte_tables_ns = 1e30;
  for (int i = 0; i < 3; ++i) {
    c.bit_moves_ns = std::min(c.bit_moves_ns, time(std::false_type()));
    c.byte_tables_ns = std::min(c.byte_tables_ns, time(std::true_type()));
  }
  c.widening = c.byte_tables_ns < 0.95 * c.bit_moves_ns
                   ? CodeWidening::kByteTables
                   : CodeWidening::kBitMoves;
  return c;
}

// -1: the process's own choice; else a forced CodeWidening.
std::atomic<int> g_forced_widening{-1};

CodeWidening CurrentCodeWidening() {
  const int forced = g_forced_widening.load(std::memory_order_relaxed);
  if (forced >= 0) return CodeWidening(forced);
  return CodeWideningMeasured().widening;
}
}  // namespace

IndexPath CurrentIndexPath() {
  const int forced = g_forced_dots.load(std::memory_order_relaxed);
  if (forced >= 0) {
    return IndexerDots(forced) == IndexerDots::kFp32Fma ? IndexPath::kFma
                                                        : IndexPath::kBf16;
  }
  if (UseTileUnit()) return IndexPath::kTiles;
  return IndexerDotsMeasured().dots == IndexerDots::kFp32Fma ? IndexPath::kFma
                                                             : IndexPath::kBf16;
}
namespace {


// Scores keys [k_begin, k_end) for every query i with limit[i] > key:
// out[i][s] for s < limit[i]. Keys are decoded once per block.
//
// The tile path is software-pipelined: block i + 2 is decoded (vector
// unit) while the tile unit computes block i's dots, and the head terms of
// block i are formed only after that, so neither unit waits for the
// other's results, and the tile loads read key blocks whose stores have
// long retired. Each block's arithmetic is unchanged.
void ScoreKeyRange(const LayerView& view, int dim, int k_begin, int k_end,
                   const IndexQuery* queries, int nq, const int* limit,
                   float* const* out) {
  const int dp = PaddedIndexDim(dim);
  int max_heads = 0, max_limit = 0;
  for (int i = 0; i < nq; ++i) {
    max_heads = std::max(max_heads, queries[i].heads);
    max_limit = std::max(max_limit, limit[i]);
  }
  // Keys at or past every query's limit are neither read nor scored.
  const int stop = std::min(k_end, max_limit);
  if (stop <= k_begin) return;
  const IndexPath path = queries[0].path;
  const bool tables = CurrentCodeWidening() == CodeWidening::kByteTables;
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  if (path == IndexPath::kTiles && KeyRowShape(max_heads, dim)) {
    ScoreKeyRows(view, dim, k_begin, stop, queries, nq, limit, out);
    return;
  }
#endif
  thread_local std::vector<ScanBlock> blocks;
  ScanBlocks(*view.layout, k_begin, stop, &blocks);
  const int nblocks = int(blocks.size());
  // The lanes of block i that query q scores: [lo, hi_q) (empty if
  // hi_q <= lo).
  auto lanes_to = [&](const ScanBlock& b, int q) {
    return std::min(b.hi, limit[q] - b.first);
  };
  if (path == IndexPath::kBf16 && nq == 1 && queries[0].heads <= kHeadBlock &&
      queries[0].pairs <= kMaxIndexPairs) {
    if (tables) {
      ScoreBlocksWideningAnyHeads<true>(view, blocks.data(), nblocks,
                                        queries[0], limit[0], out[0]);
    } else {
      ScoreBlocksWideningAnyHeads<false>(view, blocks.data(), nblocks,
                                         queries[0], limit[0], out[0]);
    }
    return;
  }
  if (path != IndexPath::kTiles) {
    const bool fma = path == IndexPath::kFma;
    KeyBlock kb(dp, fma);
    for (int blk = 0; blk < nblocks; ++blk) {
      const ScanBlock& b = blocks[blk];
      LoadKeyBlock(view, b, dim, tables, &kb);
      if (fma) WidenKeyBlock(dp / 2, &kb);
      // Requested over the first scoring query's head groups
      // (SpreadPrefetch).
      SpreadPrefetch ahead;
      if (blk + kPrefetchBlocks < nblocks) {
        ahead = SpreadPrefetch(view, blocks[blk + kPrefetchBlocks]);
      }
      for (int i = 0; i < nq; ++i) {
        const int hi = lanes_to(b, i);
        if (hi <= b.lo) continue;
        ScoreKeyBlock(kb, queries[i], b.lo, hi, out[i] + b.first, ahead);
        ahead = SpreadPrefetch();  // requested once, with the first query
      }
      ahead.Finish();
    }
    return;
  }
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  constexpr int kRing = 3;  // blocks decoded ahead: kRing - 1
  std::vector<KeyBlock> ring(size_t(std::min(kRing, nblocks)), KeyBlock(dp));
  AlignedVector<float> dots(size_t((max_heads + 15) / 16 * 16) * kKeyBlock);
  // Up to 8 heads: 8-row query and accumulator tiles, so TDPBF16PS works
  // on the heads there are (its time scales with the rows); each dot is
  // the same per-element computation either way.
  static const TileConfig config16(16), config8(8);
  _tile_loadconfig(max_heads <= 8 ? &config8 : &config16);
  const bool defer = max_heads <= 32;
  auto load = [&](int blk) {
    if (blk + kPrefetchBlocks < nblocks) {
      PrefetchKeyBlock(view, blocks[blk + kPrefetchBlocks]);
    }
    LoadKeyBlock(view, blocks[blk], dim, tables, &ring[blk % kRing]);
  };
  for (int blk = 0; blk < std::min(kRing - 1, nblocks); ++blk) load(blk);
  for (int blk = 0; blk < nblocks; ++blk) {
    const ScanBlock& b = blocks[blk];
    const KeyBlock& kb = ring[blk % kRing];
    bool ahead = false;
    for (int i = 0; i < nq; ++i) {
      const int hi = lanes_to(b, i);
      if (hi <= b.lo) continue;
      // The first query's dots are stored only after the next block's
      // decode, which runs while the tile unit computes them.
      const bool first = !ahead;
      TileDots(kb, queries[i], dots.data(), /*store=*/!(first && defer));
      if (first) {
        ahead = true;
        if (blk + kRing - 1 < nblocks) load(blk + kRing - 1);
        if (defer) TileStoreDots(queries[i], dots.data());
      }
      FinishKeyBlock(kb, queries[i], b.lo, hi, out[i] + b.first, dots.data());
    }
    if (!ahead && blk + kRing - 1 < nblocks) load(blk + kRing - 1);
  }
  _tile_release();
#endif
}

// The queries as a pool worker reads them: its own copy (per thread,
// reused), not the calling thread's. The scan reads every query's code
// pairs again for each block (dsv32: 16 KiB, per head group); on a worker
// they now come from memory only its own core touches. Read from the
// caller's allocation, two cores were slow for some placements of it and
// not others: on an AMD EPYC (Zen 5) VM, with one and the same query
// buffer, one core scanned 64K dsv32 keys in 2.2-2.4 ms while two cores
// took 2.9-3.8 ms for 128K instead of 2.3-2.5; which placements did so
// followed earlier allocations (karat-bench-kernels' 128K scan after the
// 1K and 16K rows' Selects), and neither the buffer's alignment nor the
// worker's own scratch explained it. With its own copy the worker was
// never slow. The copy is exact: the same bits.
const IndexQuery* OwnQueries(const IndexQuery* queries, int nq,
                             std::thread::id caller) {
  if (std::this_thread::get_id() == caller) return queries;
  thread_local std::vector<IndexQuery> own;
  own.assign(queries, queries + nq);
  return own.data();
}

}  // namespace
}  // namespace attention_internal

using namespace attention_internal;

bool IndexerUsesTileUnit() { return CurrentIndexPath() == IndexPath::kTiles; }

IndexerDots IndexerVectorDots() { return IndexerDotsMeasured().dots; }

const IndexerDotsChoice& IndexerDotsMeasured() {
  static const IndexerDotsChoice choice = MeasureIndexerDots();
  return choice;
}

std::string KernelUnitsDescription() {
  std::string s = "indexer on the ";
  if (IndexerUsesTileUnit()) {
    s += "tile unit (AMX)";
  } else {
    const IndexerDotsChoice& m = IndexerDotsMeasured();
    const double ratio = m.bf16_per_s > 0 ? m.fma_per_s / m.bf16_per_s : 0;
    s += m.dots == IndexerDots::kFp32Fma
             ? absl::StrFormat(
                   "vector unit with fp32 FMAs (they issue %.1fx "
                   "as fast as vdpbf16ps here)",
                   ratio)
             : absl::StrFormat(
                   "vector unit with vdpbf16ps (the FMA issues "
                   "only %.1fx as fast here)",
                   ratio);
  }
  const CodeWideningChoice& w = CodeWideningMeasured();
  const bool tables = w.widening == CodeWidening::kByteTables;
  s += absl::StrFormat(
      "; fp8 codes widened by %s (%.0f ns a block of 32 x 128, against %.0f)",
      tables ? "byte tables" : "bit moves",
      tables ? w.byte_tables_ns : w.bit_moves_ns,
      tables ? w.bit_moves_ns : w.byte_tables_ns);
  s += MlaAttendUsesTileUnit() ? "; attend on the tile unit (AMX)"
                               : "; attend on the vector unit";
  return s;
}

void ForceIndexerVectorPath(IndexerDots dots) {
  g_forced_dots.store(int(dots), std::memory_order_relaxed);
}

void ResetIndexerPath() { g_forced_dots.store(-1, std::memory_order_relaxed); }

const CodeWideningChoice& CodeWideningMeasured() {
  static const CodeWideningChoice choice = MeasureCodeWidening();
  return choice;
}

void ForceCodeWidening(CodeWidening widening) {
  g_forced_widening.store(int(widening), std::memory_order_relaxed);
}

void ResetCodeWidening() {
  g_forced_widening.store(-1, std::memory_order_relaxed);
}

void IndexerScoreQueries(const LayerView& view, int nq, const uint8_t* q_codes,
                         const float* q_scales, const float* weights, int heads,
                         int dim, const int* limit, float* const* out,
                         CorePool* pool) {
  if (nq <= 0) return;
  std::vector<IndexQuery> queries(nq);
  int max_limit = 0;
  double work = 0;
  const IndexPath path = CurrentIndexPath();
  for (int i = 0; i < nq; ++i) {
    PrepareIndexQuery(q_codes + size_t(i) * heads * dim,
                      q_scales + size_t(i) * heads, weights + size_t(i) * heads,
                      heads, dim, path, &queries[i]);
    max_limit = std::max(max_limit, limit[i]);
    work += double(limit[i]) * heads * dim;
  }
  const std::thread::id caller = std::this_thread::get_id();
  ParallelFor(
      PoolFor(pool, work), max_limit, kKeyBlock, [&](int64_t b, int64_t e) {
        ScoreKeyRange(view, dim, int(b), int(e),
                      OwnQueries(queries.data(), nq, caller), nq, limit, out);
      });
}

void IndexerScore(const LayerView& view, int n, const uint8_t* q_codes,
                  const float* q_scales, const float* weights, int heads,
                  int dim, float* scores, CorePool* pool) {
  IndexQuery iq;
  PrepareIndexQuery(q_codes, q_scales, weights, heads, dim, CurrentIndexPath(),
                    &iq);
  float* out[1] = {scores};
  const int limit[1] = {n};
  const std::thread::id caller = std::this_thread::get_id();
  ParallelFor(PoolFor(pool, double(n) * heads * dim), n, kKeyBlock,
              [&](int64_t b, int64_t e) {
                ScoreKeyRange(view, dim, int(b), int(e),
                              OwnQueries(&iq, 1, caller), 1, limit, out);
              });
}}  // namespace karat
