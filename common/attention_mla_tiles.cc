// Gather + Attend on the matrix tile unit (AMX-BF16), compiled only where
// the build targets it: the query's parts as the B operand
// (PrepareTileQuery) and one chunk of the selection for every head
// (AttendChunkTiles), for MlaAttend (attention_mla.cc).

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

// --- The tile-unit path (MlaAttendUsesTileUnit) ---
//
// Scores: entries are the A operand in their natural layout (row = entry,
// 32 bf16 dims per tile row), copied from their pages 32 at a time into an
// L1 block; the query parts are the B operand (dim pairs x columns, column
// part * H + h), prepared once per call. One accumulator tile holds 16
// entries x 16 columns; the columns are combined into ((hi + mid) + lo) *
// scale per (entry, head) and transposed to head-major rows for the
// softmax (the vector path's code). Weighted sum: the numerators' parts
// are the A operand (row part * H + h, 32 entries per tile row), the
// entries' latent part the B operand, two consecutive entries interleaved
// by 16-bit element (a vpermt2w per 16 dims, while copying). Tile
// registers: 0-3 accumulators (2 x 2 blocks), 4-5 A, 6-7 B, so every tile
// load feeds two TDPBF16PS. The copies are interleaved with the tile
// instructions (a few entry pairs after each group of four), so that the
// core copies the next block while the tile unit works on this one; the
// entries of the chunk a core takes next are prefetched into L2 meanwhile.
// Measured here (noisy shared machine, one core, 2048 entries from L2):
// dsa-tiny's shape 93-100 us against the vector path's 100-118 (per
// entry: scores with the copies ~60 TSC ticks, softmax ~10, weighted sums
// ~15; the TDPBF16PS alone, at the measured tile peak, would take ~22),
// dsv32's (128 heads, compute-bound) about 1.9x faster. The tiny shape's
// time goes to the score phase: the copies (every entry is written twice
// into the scratch: rows for the scores, interleaved pairs for the
// weighted sum) and the TDPBF16PS, per 16 entries and 32 dims two for the
// scores (the three parts make 24 query columns, more than one 16-column
// tile) and one and a half for the weighted sum (24 numerator rows: a
// 16-row and an 8-row tile); the tile unit does not overlap the core's
// copies as much as its own throughput would allow.
// What bounds the tile loops here is the tile loads, not TDPBF16PS. In a
// stand-alone loop of 2 x 2 blocks (four 1 KB TILELOADDs per four
// TDPBF16PS) one core took ~10.4 ns per TDPBF16PS with both operands in
// L1, 68% of the load-free rate (7.1 ns; three loads per four: 7.1), and
// ~20 ns with one operand in L2, whatever it prefetched. dsv32's operands
// (the query parts, 442 KB; a chunk's interleaved entries, 256 KB) live in
// L2, and the whole call ran at ~23 ns per TDPBF16PS: only blocking that
// keeps both operands of the inner loop in L1 would go faster.

struct alignas(64) AttendTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  // Rows of the first (tiles 0, 1, 4) and second (2, 3, 5) A / C blocks;
  // the B tiles (6, 7) always hold 16 pairs.
  AttendTileConfig(int rows0, int rows1) {
    for (int i = 0; i < 8; ++i) colsb[i] = 64;
    rows[0] = rows[1] = rows[4] = uint8_t(rows0);
    rows[2] = rows[3] = rows[5] = uint8_t(rows1 > 0 ? rows1 : rows0);
    rows[6] = rows[7] = 16;
  }
};

// ldtilecfg's intrinsic declares a read of 8 bytes only: the compiler must
// be told that the whole block is read, or it may drop stores to it.
inline void LoadTileConfig(const AttendTileConfig* cfg) {
  asm volatile("" : : "r"(cfg) : "memory");
  _tile_loadconfig(cfg);
}

// Exact three-part split of 16 fp32 values into values that are exact in
// bf16 (x = hi + mid + lo; each part keeps the next 8 significant bits).
inline void SplitParts(__m512 x, __m512* hi, __m512* mid, __m512* lo) {
  const __m512i top = _mm512_set1_epi32(int(0xFFFF0000u));
  *hi = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), top));
  const __m512 r = _mm512_sub_ps(x, *hi);
  *mid = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(r), top));
  *lo = _mm512_sub_ps(r, *mid);
}

// 32 values exact in bf16 (a: 0..15, b: 16..31) as 32 bf16.
inline __m512i PackBf16(__m512 a, __m512 b) {
  return (__m512i)_mm512_cvtne2ps_pbh(b, a);
}
}  // namespace

// The query parts as the score's B operand: qb[r * cols + c] holds the bf16
// pair (dims 2r, 2r + 1) of column c = part * H + h; zero past kv_dim and
// past kParts x H columns. `rows` is scratch (cols x kp bf16).
void PrepareTileQuery(const float* q, int q_dim, const TileAttendDims& t,
                      uint16_t* rows, uint32_t* qb) {
  // Rows past kParts x H stay zero; the others are written whole below.
  std::memset(rows + size_t(kParts * t.heads) * t.kp, 0,
              size_t(t.cols - kParts * t.heads) * t.kp * 2);
  for (int h = 0; h < t.heads; ++h) {
    for (int d0 = 0; d0 < t.kv_dim; d0 += 32) {
      auto load = [&](int d) {
        const int cnt = std::max(0, std::min(16, t.kv_dim - d));
        const __mmask16 m = FirstLanes16(cnt);
        return _mm512_maskz_loadu_ps(m, q + size_t(h) * q_dim + d);
      };
      __m512 a[kParts], b[kParts];
      SplitParts(load(d0), &a[0], &a[1], &a[2]);
      SplitParts(load(d0 + 16), &b[0], &b[1], &b[2]);
      for (int p = 0; p < kParts; ++p) {
        _mm512_store_si512(rows + size_t(p * t.heads + h) * t.kp + d0,
                           PackBf16(a[p], b[p]));
      }
    }
  }
  // Rows of 16 pairs -> columns: a 32-bit transpose per 16 x 16 block.
  const int pairs = t.kp / 2;
  for (int c0 = 0; c0 < t.cols; c0 += 16) {
    for (int r0 = 0; r0 < pairs; r0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        r[i] = _mm512_load_si512(rows + size_t(c0 + i) * t.kp + 2 * r0);
      }
      Transpose16(r);
      for (int i = 0; i < 16; ++i) {
        _mm512_store_si512(qb + size_t(r0 + i) * t.cols + c0, r[i]);
      }
    }
  }
}
namespace {

// A chunk's copy into the scratch, a few entry pairs at a time, so that it
// can be interleaved with tile instructions: entries j, j + 1 go to rows
// j, j + 1 (modulo erow_ring) of erow (kp each; zero rows past n) and,
// their first lp dims interleaved by element, to row j / 2 (modulo
// ev_ring; 0: none) of ev (2 lp). Either may be null. Alongside, the
// entries at the same index in `pf` (pf_n of them) are prefetched into L2,
// and the chunk's own entries 8 ahead into L1.
struct ChunkCopy {
  const uint16_t* const* ent = nullptr;
  int n = 0;
  uint16_t* erow = nullptr;
  int erow_ring = 0;
  uint16_t* ev = nullptr;
  int ev_ring = 0;
  const uint16_t* const* pf = nullptr;
  int pf_n = 0;
  int j = 0;    // next entry (even)
  int end = 0;  // copy up to here (a multiple of 32)

  // Copies up to `pairs` pairs below `end`.
  void Run(const TileAttendDims& t, int pairs) {
    if (j >= end) return;
    // vpermt2w indices: elements 0..15 (16..31) of a and b interleaved.
    alignas(64) static const struct Idx {
      uint16_t lo[32], hi[32];
      Idx() {
        for (int i = 0; i < 16; ++i) {
          lo[2 * i] = uint16_t(i);
          lo[2 * i + 1] = uint16_t(32 + i);
          hi[2 * i] = uint16_t(16 + i);
          hi[2 * i + 1] = uint16_t(48 + i);
        }
      }
    } idx;
    const __m512i ilo = _mm512_load_si512(idx.lo);
    const __m512i ihi = _mm512_load_si512(idx.hi);
    constexpr int kAhead = 8;
    const int width = erow != nullptr ? t.kp : t.lp;
    for (int p = 0; p < pairs && j < end; ++p, j += 2) {
      for (int jj = j + kAhead; jj < std::min(n, j + kAhead + 2); ++jj) {
        PrefetchEntryLines<true>(ent[jj], t.entry_bytes);
      }
      for (int k = j; k < std::min(pf_n, j + 2); ++k) {
        PrefetchEntryLines<false>(pf[k], t.entry_bytes);
      }
      const uint16_t* a = j < n ? ent[j] : nullptr;
      const uint16_t* b = j + 1 < n ? ent[j + 1] : nullptr;
      uint16_t* ra =
          erow != nullptr ? erow + size_t(j % erow_ring) * t.kp : nullptr;
      uint16_t* v =
          ev != nullptr ? ev + size_t(j / 2 % ev_ring) * 2 * t.lp : nullptr;
      for (int d0 = 0; d0 < width; d0 += 32) {
        const int cnt = std::min(32, t.kv_dim - d0);
        const __mmask32 m =
            cnt >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << cnt) - 1);
        const __m512i va = a != nullptr ? _mm512_maskz_loadu_epi16(m, a + d0)
                                        : _mm512_setzero_si512();
        const __m512i vb = b != nullptr ? _mm512_maskz_loadu_epi16(m, b + d0)
                                        : _mm512_setzero_si512();
        if (ra != nullptr) {
          _mm512_store_si512(ra + d0, va);
          _mm512_store_si512(ra + t.kp + d0, vb);
        }
        if (v != nullptr && d0 < t.lp) {
          _mm512_store_si512(v + 2 * d0,
                             _mm512_permutex2var_epi16(va, ilo, vb));
          _mm512_store_si512(v + 2 * d0 + 32,
                             _mm512_permutex2var_epi16(va, ihi, vb));
        }
      }
    }
  }
};
}  // namespace

// One chunk on the tile unit: as AttendChunk (m, z, o of every head). `pf`
// (pf_n entries, none at the end) is the chunk this core takes next,
// prefetched into L2 meanwhile. The tile configuration is loaded here; the
// caller releases the unit.
void AttendChunkTiles(const uint16_t* const* ent, int n,
                      const uint16_t* const* pf, int pf_n, const uint32_t* qb,
                      const AttnShapes& shapes, const TileAttendDims& t,
                      TileAttendScratch* sc, float* m, float* z, float* o) {
  const int heads = t.heads;
  const int padded = (n + 31) / 32 * 32;
  uint16_t* erow = sc->erow.data();
  uint16_t* ev = sc->ev.data();
  // The copy for the scores: block 0 first, then block b + 1 while the
  // tile unit scores block b (two blocks of rows in turn); with it the
  // chunk's pair-interleaved entries for the weighted sums.
  ChunkCopy cur;
  cur.ent = ent;
  cur.n = n;
  cur.erow = erow;
  cur.erow_ring = 64;
  cur.ev = ev;
  cur.ev_ring = kAttendChunk / 2;
  cur.pf = pf;
  cur.pf_n = pf_n;
  cur.end = 32;
  cur.Run(t, 16);

  // Scores, 32 entries x 32 columns per accumulator block.
  static const AttendTileConfig full(16, 16);
  LoadTileConfig(&full);
  float* sbuf = sc->sbuf.data();
  float* se = sc->se.data();
  float* s = sc->s.data();
  const size_t s_stride = kAttendChunk;
  const int h16 = (heads + 15) / 16 * 16;
  const int esteps = t.kp / 32;
  const size_t erow_b = size_t(t.kp) * 2, qb_b = size_t(t.cols) * 4;
  const __m512 scale = _mm512_set1_ps(shapes.softmax_scale);
  // Per entry and head of block j0 (accumulators in sbuf half j0 / 32 % 2):
  // ((hi + mid) + lo) * scale, entry-major, then transposed to head-major.
  auto combine = [&](int j0) {
    const float* sb = sbuf + size_t(j0 / 32 % 2) * 32 * t.cols;
    for (int j = 0; j < 32; ++j) {
      const float* row = sb + size_t(j) * t.cols;
      for (int h0 = 0; h0 < h16; h0 += 16) {
        const int cnt = std::min(16, heads - h0);
        const __mmask16 mk = FirstLanes16(cnt);
        __m512 v = _mm512_add_ps(_mm512_maskz_loadu_ps(mk, row + h0),
                                 _mm512_maskz_loadu_ps(mk, row + heads + h0));
        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, row + 2 * heads + h0));
        _mm512_store_ps(se + size_t(j) * h16 + h0, _mm512_mul_ps(v, scale));
      }
    }
    for (int half = 0; half < 2; ++half) {
      for (int h0 = 0; h0 < h16; h0 += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) {
          r[i] = _mm512_castps_si512(
              _mm512_load_ps(se + size_t(16 * half + i) * h16 + h0));
        }
        Transpose16(r);
        for (int i = 0; i < std::min(16, heads - h0); ++i) {
          _mm512_store_si512(s + size_t(h0 + i) * s_stride + j0 + 16 * half,
                             r[i]);
        }
      }
    }
  };
  // Software pipeline: while the tile unit scores block j0, the core
  // copies block j0 + 32 (a few pairs after each group of four
  // TDPBF16PS) and finishes block j0 - 32.
  {
    const int groups = (t.cols / 32) * esteps;
    const int per_group = (16 + groups - 1) / groups;
    for (int j0 = 0; j0 < padded; j0 += 32) {
      const bool copy = j0 + 32 < padded;
      cur.end = std::min(padded, j0 + 64);
      const uint16_t* e0 = erow + size_t(j0 % 64) * t.kp;
      float* sb = sbuf + size_t(j0 / 32 % 2) * 32 * t.cols;
      for (int c0 = 0; c0 < t.cols; c0 += 32) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int k = 0; k < esteps; ++k) {
          _tile_loadd(4, e0 + 32 * k, erow_b);
          _tile_loadd(5, e0 + 16 * size_t(t.kp) + 32 * k, erow_b);
          const uint32_t* bq = qb + size_t(16 * k) * t.cols + c0;
          _tile_loadd(6, bq, qb_b);
          _tile_loadd(7, bq + 16, qb_b);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
          if (copy) cur.Run(t, per_group);
        }
        if (c0 + 32 >= t.cols) {
          if (copy) cur.Run(t, 16);
          if (j0 > 0) combine(j0 - 32);
        }
        _tile_stored(0, sb + c0, qb_b);
        _tile_stored(1, sb + c0 + 16, qb_b);
        _tile_stored(2, sb + 16 * size_t(t.cols) + c0, qb_b);
        _tile_stored(3, sb + 16 * size_t(t.cols) + c0 + 16, qb_b);
      }
    }
  }
  combine(padded - 32);

  // The chunk's softmax numerators (as AttendChunk), split into parts:
  // p3[(part * H + h) * kAttendChunk + j], zero for j in [n, padded).
  uint16_t* p3 = sc->p3.data();
  const int nb16 = (n + 15) / 16;
  for (int h = 0; h < heads; ++h) {
    float* sh = s + h * s_stride;
    __m512 vm = _mm512_set1_ps(-INFINITY);
    for (int blk = 0; blk < nb16; ++blk) {
      const int cnt = std::min(16, n - blk * 16);
      const __mmask16 valid = FirstLanes16(cnt);
      vm = _mm512_mask_max_ps(vm, valid, vm, _mm512_load_ps(sh + blk * 16));
    }
    const float mh = _mm512_reduce_max_ps(vm);
    const __m512 vmh = _mm512_set1_ps(mh);
    __m512 vz = _mm512_setzero_ps();
    for (int blk = 0; blk < padded / 16; blk += 2) {
      __m512 p[2];
      for (int u = 0; u < 2; ++u) {
        const int cnt = std::max(0, std::min(16, n - (blk + u) * 16));
        const __mmask16 valid = FirstLanes16(cnt);
        p[u] = _mm512_maskz_mov_ps(
            valid, KernelExp16(_mm512_sub_ps(
                       _mm512_load_ps(sh + (blk + u) * 16), vmh)));
        vz = _mm512_add_ps(vz, p[u]);
      }
      __m512 a[kParts], b[kParts];
      SplitParts(p[0], &a[0], &a[1], &a[2]);
      SplitParts(p[1], &b[0], &b[1], &b[2]);
      for (int pt = 0; pt < kParts; ++pt) {
        _mm512_store_si512(
            p3 + size_t(pt * heads + h) * kAttendChunk + blk * 16,
            PackBf16(a[pt], b[pt]));
      }
    }
    m[h] = mh;
    z[h] = LaneTreeSum(vz);
  }

  // Weighted sums: (part * H + h) x 16 dims per accumulator.
  float* o3 = sc->o3.data();
  const int rows_total = kParts * heads;
  const int nb = padded / 32;
  const size_t p3_b = size_t(kAttendChunk) * 2, ev_b = size_t(t.lp) * 4,
               o3_b = size_t(t.lp) * 4;
  int loaded0 = 16, loaded1 = 16;
  for (int mt = 0; mt < t.mtiles; mt += 2) {
    const int r0 = std::min(16, rows_total - 16 * mt);
    const int r1 =
        mt + 1 < t.mtiles ? std::min(16, rows_total - 16 * (mt + 1)) : 0;
    if (r0 != loaded0 || (r1 != 0 && r1 != loaded1)) {
      static thread_local AttendTileConfig cfg(16, 16);
      cfg = AttendTileConfig(r0, r1);
      LoadTileConfig(&cfg);
      loaded0 = r0;
      loaded1 = r1 != 0 ? r1 : r0;
    }
    const uint16_t* a0 = p3 + size_t(16 * mt) * kAttendChunk;
    const uint16_t* a1 = a0 + size_t(16) * kAttendChunk;
    for (int d0 = 0; d0 < t.lp; d0 += 32) {
      _tile_zero(0);
      _tile_zero(1);
      if (r1 > 0) {
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int k = 0; k < nb; ++k) {
        _tile_loadd(4, a0 + 32 * k, p3_b);
        const uint16_t* bv = ev + size_t(16 * k) * 2 * t.lp + 2 * d0;
        _tile_loadd(6, bv, ev_b);
        _tile_loadd(7, bv + 32, ev_b);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (r1 > 0) {
          _tile_loadd(5, a1 + 32 * k, p3_b);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      float* c = o3 + size_t(16 * mt) * t.lp + d0;
      _tile_stored(0, c, o3_b);
      _tile_stored(1, c + 16, o3_b);
      if (r1 > 0) {
        _tile_stored(2, c + size_t(16) * t.lp, o3_b);
        _tile_stored(3, c + size_t(16) * t.lp + 16, o3_b);
      }
    }
  }
  // o[h][d] = (hi + mid) + lo.
  const int lora = t.lora;
  for (int h = 0; h < heads; ++h) {
    const float* p0 = o3 + size_t(h) * t.lp;
    const float* p1 = o3 + size_t(heads + h) * t.lp;
    const float* p2 = o3 + size_t(2 * heads + h) * t.lp;
    for (int d0 = 0; d0 < lora; d0 += 16) {
      const int cnt = std::min(16, lora - d0);
      const __mmask16 mk = FirstLanes16(cnt);
      const __m512 v = _mm512_add_ps(
          _mm512_add_ps(_mm512_load_ps(p0 + d0), _mm512_load_ps(p1 + d0)),
          _mm512_load_ps(p2 + d0));
      _mm512_mask_storeu_ps(o + size_t(h) * lora + d0, mk, v);
    }
  }
}
}  // namespace attention_internal
}  // namespace karat
#endif  // __AMX_BF16__ && __AMX_TILE__
