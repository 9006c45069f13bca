// The DSA indexer's tile-unit (AMX-BF16) path, compiled only where the
// build targets the tile unit: the request for the tile state
// (RequestTileUnit), the dots of a 32-key block for any shape (TileDots,
// TileStoreDots, FinishKeyBlock), and the key-row path's widening of keys
// into their natural layout (LoadKeyRows). The key-row path's scores:
// attention_indexer_rows.cc.

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

// The tile path (AMX-BF16). TDPBF16PS computes, for a tile of 16 heads x
// 16 keys, C += Q K over 32 dims (16 code pairs) in one instruction; its
// internal accumulation is the hardware's own, fixed for given inputs and
// the same for every element of a tile. Scores go through it in 32-dim
// chunks in increasing order, from C = 0, whatever the shape, so the
// result depends only on (query, key); it runs about 10x faster than the
// vector unit's bf16 dot products on this hardware.
//
// Where the real shape's scan (64 heads x 128) spends its time, measured
// on one core with 16K keys in cache: the tile instructions alone ~12 ns a
// key (32 TDPBF16PS per 32 keys, ~12 ns each with their loads and stores),
// the decode and transpose alone ~11 ns, the head terms ~3 ns; together
// ~39 ns, more than the sum. Vector work between tile blocks hardly
// overlaps them and itself runs slower: in a stand-alone loop, 256
// load + vpermb + store groups took 0.24 us alone and added 0.79 us to a
// block of 32 TDPBF16PS, also when the block's results were waited for
// first or the tile state released in between. A variant with the keys as
// the A operand in their natural layout (no transpose; the head terms by
// a lane tree) was no faster (~42 ns a key), nor was decoding 4-64 blocks
// at a time between runs of tile blocks.
// Linux hands out the tile state only on request, once per process.
bool RequestTileUnit() {
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}
void TileDots(const KeyBlock& kb, const IndexQuery& iq, float* dots,
              bool store) {
  const int groups = (iq.heads + 15) / 16;
  const int steps = iq.pairs / 16;
  const size_t qstride = size_t(iq.pairs) * 4;
  const uint32_t* kt = kb.kt.data();
  for (int g = 0; g < groups; g += 2) {
    const bool two = g + 1 < groups;
    const uint32_t* q0 = &iq.q[size_t(g) * 16 * iq.pairs];
    const uint32_t* q1 = q0 + size_t(16) * iq.pairs;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int k = 0; k < steps; ++k) {
      const uint32_t* kk = kt + size_t(k) * 16 * kKeyBlock;
      _tile_loadd(6, kk, kKeyBlock * 4);
      _tile_loadd(7, kk + 16, kKeyBlock * 4);
      _tile_loadd(4, q0 + k * 16, qstride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (two) {
        _tile_loadd(5, q1 + k * 16, qstride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    if (!store) continue;
    float* d0 = dots + size_t(g) * 16 * kKeyBlock;
    _tile_stored(0, d0, kKeyBlock * 4);
    _tile_stored(1, d0 + 16, kKeyBlock * 4);
    if (two) {
      _tile_stored(2, d0 + 16 * kKeyBlock, kKeyBlock * 4);
      _tile_stored(3, d0 + 16 * kKeyBlock + 16, kKeyBlock * 4);
    }
  }
}

// The stores TileDots(..., store = false) left out.
void TileStoreDots(const IndexQuery& iq, float* dots) {
  _tile_stored(0, dots, kKeyBlock * 4);
  _tile_stored(1, dots + 16, kKeyBlock * 4);
  if (iq.heads > 16) {
    _tile_stored(2, dots + 16 * kKeyBlock, kKeyBlock * 4);
    _tile_stored(3, dots + 16 * kKeyBlock + 16, kKeyBlock * 4);
  }
}
// Head terms of the 32 keys of `kb` from their dots (dots[h * 32 + j],
// from TileDots), times the keys' scales; writes lanes [lo, hi) to
// out[lo .. hi).
void FinishKeyBlock(const KeyBlock& kb, const IndexQuery& iq, int lo, int hi,
                    float* out, const float* dots) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  const __m512 zero = _mm512_setzero_ps();
  for (int h = 0; h < iq.heads; ++h) {
    const __m512 c = _mm512_set1_ps(iq.coef[h]);
    const float* d = dots + size_t(h) * kKeyBlock;
    s0 = _mm512_fmadd_ps(c, _mm512_max_ps(_mm512_load_ps(d), zero), s0);
    s1 = _mm512_fmadd_ps(c, _mm512_max_ps(_mm512_load_ps(d + 16), zero), s1);
  }
  s0 = _mm512_mul_ps(s0, _mm512_load_ps(kb.scale));
  s1 = _mm512_mul_ps(s1, _mm512_load_ps(kb.scale + 16));
  StoreBlockLanes(out, lo, hi, s0, s1);
}
namespace {

// --- The key-row tile path (<= 8 heads, whole 32-dim chunks) ---------------
//
// For few heads the keys themselves are the A operand: a 32-dim chunk of
// a key, widened to 32 bf16, is one 64-byte A row (see PairDots for the
// tiles). The pages keep codes pair-major (kv_store.h), so LoadKeyRows
// first copies each key's code pairs back into key order; the measurements
// below predate that layout. C then holds keys x heads, and
// the head terms of each key are summed across lanes (HeadSums16).
//
// Widening without shuffles: a 16-bit word w of codes holds an even code
// in its low byte and the next (odd) code in its high byte. For a normal
// code in the high byte (exponent field e in 1-15, not NaN),
//   (sra(w, 4) & 0x87F0) | 0x3800 = sign | (112 + e) << 7 | m << 4,
// the bf16 of the code's value / 256; the even codes go the same way from
// the words one byte earlier. So a chunk's row holds the even dims, then
// the odd ones (RowDim), and the query's B rows follow that order with its
// values times 256: each product is the same exact value. A group of 64
// codes with one the bit moves do not cover (zero, subnormal, NaN) is
// widened through a table of the same bf16 values instead.
//
// For the tiny shape (8 heads x 32) that is about 4 vector operations per
// key to widen and 3 to reduce, against some 10 shuffles per key for the
// transposing path; at long contexts the scan is then bound by the misses
// in flight of the key runs (PrefetchKeys).
//
// Measured on the tiny shape, one core of a busy shared machine: with the
// keys in L2 (4K-8K keys) a key costs about 2.4 ns, of which (by leaving
// each part out) the reduction ~0.5, the prefetches ~0.35, the tile loads,
// TDPBF16PS and tile stores ~0.35 and the widening 0.3-1; a call costs
// ~3 us more (PrepareIndexQuery, buffers). At 128K keys the loop takes
// ~3 ns a key with the caches warm and 5-6 ns from DRAM. None of these
// shortened it (at 16K keys, nor at 128K where tried): whole in-page
// blocks widened in straight-line code (constants hoisted, one special-code
// test per block, the even codes by a shift or by the unaligned load,
// full-row stores) with whole-block prefetches and no page walk; widening
// 4 or 6 blocks ahead instead of 2; L2 prefetches of every line, or 1024
// keys ahead. Grouping the widening, tile and reduction phases over 2-8
// pairs was up to 2x slower. What did shorten the scan from DRAM (128K
// keys) was longer key runs: the same keys in pages of 256 tokens took 17%
// less time; in pages of 1024 tokens, or packed in pages of index keys
// alone, 21% less (measured when KV pages also held their tokens' keys;
// they now sit in index pages of their own, kv_store.h).

// The bf16 bytes of every code's value / 256 (as Fp8Bf16Bytes, for
// vpermi2b), and the word order of a row (RowDim).
struct Fp8RowBytes {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
  alignas(64) uint16_t row[32];
  Fp8RowBytes() {
    for (int c = 0; c < 128; ++c) {
      const uint16_t b =
          FloatToBf16(Fp8E4M3ToFloat(uint8_t(c)) * (1.0f / 256.0f));
      lo[c] = uint8_t(b & 0xFF);
      hi[c] = uint8_t(b >> 8);
    }
    for (int i = 0; i < 32; ++i) row[i] = uint16_t(RowDim(i));
  }
};
const Fp8RowBytes& Fp8RowTables() {
  static const Fp8RowBytes t;
  return t;
}

// Widens 64 codes (two 32-dim chunks) into two 64-byte rows at out[0..31]
// and out[32..63] (only the first when `two` is false): `w` holds the
// codes, `v` the words one byte earlier (loaded from one byte before, or
// w << 8), whose high bytes are the even codes.
inline void WidenChunks(__m512i w, __m512i v, uint16_t* out, bool two) {
  const __m512i keep = _mm512_set1_epi16(short(0x87F0));
  const __m512i exp = _mm512_set1_epi16(0x3800);
  // (a & b) | c
  const __m512i odd =
      _mm512_ternarylogic_epi32(_mm512_srai_epi16(w, 4), keep, exp, 0xEA);
  const __m512i even =
      _mm512_ternarylogic_epi32(_mm512_srai_epi16(v, 4), keep, exp, 0xEA);
  auto* o = reinterpret_cast<__m256i*>(out);
  _mm256_store_si256(o, _mm512_castsi512_si256(even));
  _mm256_store_si256(o + 1, _mm512_castsi512_si256(odd));
  if (two) {
    _mm256_store_si256(o + 2, _mm512_extracti64x4_epi64(even, 1));
    _mm256_store_si256(o + 3, _mm512_extracti64x4_epi64(odd, 1));
  }
}

// The same rows through the byte tables, for any codes (`count`: 64, or 32
// for one chunk). Returns whether any of them is NaN.
__attribute__((always_inline)) inline bool WidenChunksByTable(
    const uint8_t* codes, int count, uint16_t* out) {
  const Fp8RowBytes& t = Fp8RowTables();
  const __m512i order = _mm512_load_si512(Fp8Bytes().order);
  const __m512i row = _mm512_load_si512(t.row);
  const __mmask64 m = count >= 64 ? ~__mmask64(0) : __mmask64(0xFFFFFFFFull);
  __m512i c = _mm512_maskz_loadu_epi8(m, codes);
  const __m512i low7 = _mm512_set1_epi8(0x7F);
  const bool nan =
      _mm512_mask_cmpeq_epi8_mask(m, _mm512_and_si512(c, low7), low7) != 0;
  c = _mm512_permutexvar_epi8(order, c);
  const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(t.lo), c,
                                              _mm512_load_si512(t.lo + 64));
  __m512i hi = _mm512_permutex2var_epi8(_mm512_load_si512(t.hi), c,
                                        _mm512_load_si512(t.hi + 64));
  hi = _mm512_ternarylogic_epi32(hi, c, _mm512_set1_epi8(char(0x80)), 0xF8);
  _mm512_store_si512(
      out, _mm512_permutexvar_epi16(row, _mm512_unpacklo_epi8(lo, hi)));
  if (count >= 64) {
    _mm512_store_si512(
        out + 32, _mm512_permutexvar_epi16(row, _mm512_unpackhi_epi8(lo, hi)));
  }
  return nan;
}
}  // namespace

// Widens keys [s0, s0 + b) (b <= 32; `p` is s0's position) into rows: key
// j's chunk k at kb->rows[j * dim + 32 k], in RowDim order; rows past b
// are zero. Also their scales (0 past b). The pages keep the codes pair-
// major (kv_store.h); they are first put back in key order in `codes`
// (room for 32 keys).
void LoadKeyRows(const LayerView& view, KeyPos p, int b, int dim,
                 uint8_t* codes, KeyRows* kb) {
  const KvLayout& l = *view.layout;
  uint16_t* rows = kb->rows;
  const __m512i one = _mm512_set1_epi8(1);
  const __m512i high = _mm512_set1_epi8(0x70);
  kb->has_nan = false;
  for (int j = 0; j < b;) {
    const int run = std::min(b - j, l.index_tokens_per_page - p.off);
    const int s0 = p.page * l.index_tokens_per_page + p.off;
    for (int k = 0; k < run; ++k) {
      view.IndexKeyCodes(s0 + k, codes + size_t(j + k) * dim);
    }
    const float* sc = view.IndexScales(p.page) + p.off;
    for (int k = 0; k < run; k += 16) {
      const __mmask16 m = FirstLanes16(run - k);
      _mm512_mask_storeu_ps(&kb->scale[j + k], m,
                            _mm512_maskz_loadu_ps(m, sc + k));
    }
    j += run;
    p.Advance(run, l.index_tokens_per_page);
  }
  const int bytes = b * dim;
  // The first group shifts its even codes up instead of loading the byte
  // before the codes.
  int i = 0;
  for (; i + 64 <= bytes; i += 64) {
    const __m512i w = _mm512_loadu_si512(codes + i);
    const __m512i v =
        i == 0 ? _mm512_slli_epi16(w, 8) : _mm512_loadu_si512(codes + i - 1);
    // (code + 1) & 0x70 is 0 for zero, subnormal and NaN codes (and for
    // normal codes of exponent 1, which the tables widen just the same).
    if (__builtin_expect(
            _mm512_testn_epi8_mask(_mm512_add_epi8(w, one), high) == 0, 1)) {
      WidenChunks(w, v, rows + i, true);
    } else {
      kb->has_nan |= WidenChunksByTable(codes + i, 64, rows + i);
    }
  }
  if (i < bytes) {  // one 32-dim chunk left
    const __m512i w = _mm512_castsi256_si512(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i)));
    const __m512i v = _mm512_slli_epi16(w, 8);
    if (_mm512_mask_testn_epi8_mask(__mmask64(0xFFFFFFFFull),
                                    _mm512_add_epi8(w, one), high) == 0) {
      WidenChunks(w, v, rows + i, false);
    } else {
      kb->has_nan |= WidenChunksByTable(codes + i, 32, rows + i);
    }
  }
  if (b < kKeyBlock) {
    std::memset(rows + size_t(b) * dim, 0, size_t(kKeyBlock - b) * dim * 2);
    for (int i = b; i < kKeyBlock; ++i) kb->scale[i] = 0.0f;
  }
}
}  // namespace attention_internal
}  // namespace karat
#endif  // __AMX_BF16__ && __AMX_TILE__
