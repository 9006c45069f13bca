#include "common/attention.h"

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
#include "common/status_macros.h"

// GCC 12 reports its own AVX-512 intrinsic headers (_mm512_undefined_*)
// as (maybe-)uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace karat {
namespace {

float Bf16(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

AttnShapes MakeAttnShapes(const ModelConfig& c) {
  AttnShapes s;
  s.heads = c.num_attention_heads;
  if (c.attention.type == AttentionType::kMlaDsa) {
    s.kv_lora = c.kv_lora_rank;
    s.rope = c.qk_rope_head_dim;
    s.kv_dim = s.kv_lora + s.rope;
    s.q_dim = s.kv_dim;
    s.out_dim = s.kv_lora;
    s.index_heads = c.index_n_heads;
    s.index_dim = c.index_head_dim;
    s.index_topk = c.index_topk;
    s.softmax_scale =
        1.0f / std::sqrt(float(c.qk_nope_head_dim + c.qk_rope_head_dim));
  } else {
    s.kv_heads = c.num_key_value_heads;
    s.head_dim = c.head_dim;
    if (c.attention.type == AttentionType::kGqaBlock) {
      s.block_index_dim = c.index_head_dim;
    }
    s.kv_dim = (2 * c.head_dim + s.block_index_dim) * s.kv_heads;
    s.q_dim = c.head_dim + s.block_index_dim;
    s.out_dim = c.head_dim;
    s.softmax_scale = 1.0f / std::sqrt(float(c.head_dim));
  }
  return s;
}

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

// A std::vector whose data is 64-byte aligned (full-vector aligned loads).
template <typename T>
struct Aligned64Allocator {
  using value_type = T;
  Aligned64Allocator() = default;
  template <typename U>
  Aligned64Allocator(const Aligned64Allocator<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  bool operator==(const Aligned64Allocator&) const { return true; }
};
template <typename T>
using AlignedVector = std::vector<T, Aligned64Allocator<T>>;

constexpr int kKeyBlock = 32;

constexpr int kHeadBlock = 8;
constexpr int kFmaHeadBlock = 12;

// Pads Di to whole 16-pair tiles of the transpose.
int PaddedIndexDim(int dim) { return (dim + 31) / 32 * 32; }
// Queries of up to this many (padded) code pairs and kHeadBlock heads are
// scored one block at a time with the keys widened as they are used
// (ScoreBlocksWidening).
constexpr int kMaxIndexPairs = 64;

// bf16 bits of fp8 codes 0..127: the low and the high byte (the sign, bit
// 7 of the code, is ORed into the high byte). Two 64-byte halves each, for
// vpermi2b.
struct Fp8Bf16Bytes {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
  alignas(64) uint8_t order[64];  // see DecodeCodes64
  Fp8Bf16Bytes() {
    for (int c = 0; c < 128; ++c) {
      const uint16_t b = FloatToBf16(Fp8E4M3ToFloat(uint8_t(c)));
      lo[c] = uint8_t(b & 0xFF);
      hi[c] = uint8_t(b >> 8);
    }
    // vpunpck{l,h}bw interleave within 128-bit lanes. Placing code 8L+i
    // at byte 16L+i and code 32+8L+i at byte 16L+8+i (L = lane, i < 8)
    // makes the low unpack yield codes 0..31 and the high one 32..63.
    for (int L = 0; L < 4; ++L) {
      for (int i = 0; i < 8; ++i) {
        order[16 * L + i] = uint8_t(8 * L + i);
        order[16 * L + 8 + i] = uint8_t(32 + 8 * L + i);
      }
    }
  }
};
const Fp8Bf16Bytes& Fp8Bytes() {
  static const Fp8Bf16Bytes t;
  return t;
}

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

// The key-row tile path (see ScoreKeyRows) serves up to this many heads
// and dimensions that are whole 32-dim chunks, at most kRowMaxChunks.
constexpr int kRowHeads = 8;
constexpr int kRowMaxChunks = 2;
// From this many queries on, the row path scores a segment with the keys as
// the tile unit's B operand (see ScoreKeyRows).
constexpr int kKeysAsBMinQueries = 8;
bool KeyRowShape(int heads, int dim) {
  return heads <= kRowHeads && dim % 32 == 0 && dim <= 32 * kRowMaxChunks;
}

// Position i of a 32-dim chunk of a key row holds dim 2 i (i < 16) or
// 2 (i - 16) + 1: the order in which the row path's widening leaves the
// codes (even codes, then odd ones).
inline int RowDim(int i) { return i < 16 ? 2 * i : 2 * (i - 16) + 1; }

// A query prepared for the scan: bf16 code pairs per head (padded dim) and
// the per-head coefficients c[h]; for the key-row path also its codes
// times 256 in the tile unit's pair-interleaved B layout, and c[h] twice
// over 16 lanes.
// Which of the scan's paths a query is prepared for (CurrentIndexPath).
enum class IndexPath { kTiles, kBf16, kFma };

struct IndexQuery {
  IndexPath path = IndexPath::kBf16;
  int heads = 0;
  int pairs = 0;            // padded dim / 2
  std::vector<uint32_t> q;  // heads (padded to 16) x pairs; not key-row
  std::vector<float> coef;  // heads
  // kFma only: heads x pairs x {odd, even} dims as fp32.
  AlignedVector<float> qf;
  // Key-row path only: per 32-dim chunk two B tiles of 16 pair rows x 16
  // columns x 2 bf16, the heads in columns 0-7 of the first ([Q | 0]) and
  // 8-15 of the second ([0 | Q]), zero elsewhere and for absent heads; and
  // coef16[l] = c[l % 8] (0 past the heads).
  AlignedVector<uint16_t> qb;
  alignas(64) float coef16[16] = {};
};

bool UseTileUnit();
IndexPath CurrentIndexPath();

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

// Decoded keys of one block: pair p of key j at kt[p * 32 + j] (bf16
// pairs), and the keys' scales; for the FMA form also the pairs widened to
// fp32 (WidenKeyBlock).
struct KeyBlock {
  AlignedVector<uint32_t> kt;  // pairs x 32
  // Pair p at kf[p * 64 ..]: the odd dim of keys 0-31, then the even dim.
  AlignedVector<float> kf;
  alignas(64) float scale[kKeyBlock];
  KeyBlock(int dp, bool fp32 = false)
      : kt(size_t(dp / 2) * kKeyBlock), kf(fp32 ? size_t(dp) * kKeyBlock : 0) {}
};

// One stored block of keys as a scan visits it (kv_store.h: an index page
// keeps its keys in blocks of kIndexKeyBlock slots): its index page, its
// block there, the position of its slot 0, and its slots [lo, hi) that lie
// in the range scanned.
struct ScanBlock {
  int page, block, first, lo, hi;
};
static_assert(kIndexKeyBlock == kKeyBlock);

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

// Blocks this many ahead of the one being widened are prefetched (their
// rows and scales).
constexpr int kPrefetchBlocks = 4;
// A query of at most kHeadBlock heads (ScoreBlocksWidening) spends only
// ~30 ns on a dsa-tiny block (16 rows x 16 dot products), so it requests
// blocks this many bytes ahead (16 blocks of 1 KiB there), into L1.
constexpr size_t kWideningAheadBytes = 16 << 10;

// The constants of the widening, loaded once per block.
struct RowWidening {
  __m512i tlo0, tlo1, thi0, thi1, sign, affine_lo, affine_hi, exp_bias, low7,
      bias, first_normal;
  RowWidening() {
    const Fp8Bf16Bytes& t = Fp8Bytes();
    tlo0 = _mm512_load_si512(t.lo);
    tlo1 = _mm512_load_si512(t.lo + 64);
    thi0 = _mm512_load_si512(t.hi);
    thi1 = _mm512_load_si512(t.hi + 64);
    sign = _mm512_set1_epi8(char(0x80));
    // gf2p8affine: result bit i = parity(matrix byte 7 - i AND code).
    // lo: code bits 0-3 -> bits 4-7. hi: code bits 4-6 -> bits 0-2 (e / 2),
    // bit 7 -> bit 7 (sign).
    affine_lo = _mm512_set1_epi64(0x0000000001020408ll);
    affine_hi = _mm512_set1_epi64(0x1020400000000080ll);
    exp_bias = _mm512_set1_epi8(60);  // (e + 120) / 2 = 60 + e / 2
    low7 = _mm512_set1_epi8(0x7F);
    bias = _mm512_set1_epi8(char(129));
    first_normal = _mm512_set1_epi8(char(137));
  }
  // Widens one 64-byte pair row: keys 0-15's bf16 pairs into *k0, keys
  // 16-31's into *k1.
  //
  // Normal codes (exponent field 1-15, not NaN) widen by bit moves: bf16 =
  // sign | (60 + e / 2) << 8 | (e & 1) << 7 | m << 4, two GF(2) affine maps
  // and a byte add (no shuffles). When any code of the 64 is zero,
  // subnormal or NaN, the byte tables widen them instead; both give the
  // same bits for normal codes. (code & 0x7F) + 129 wraps below 137 exactly
  // for the codes the bit moves do not cover (0-7 and 127).
  template <bool kByteTables>
  inline void Row(const uint8_t* row, __m512i* k0, __m512i* k1) const {
    const __m512i cd = _mm512_load_si512(row);
    const __m512i u = _mm512_add_epi8(_mm512_and_si512(cd, low7), bias);
    __m512i lo, hi;
    if (!kByteTables &&
        __builtin_expect(_mm512_cmplt_epu8_mask(u, first_normal) == 0, 1)) {
      lo = _mm512_gf2p8affine_epi64_epi8(cd, affine_lo, 0);
      hi = _mm512_add_epi8(_mm512_gf2p8affine_epi64_epi8(cd, affine_hi, 0),
                           exp_bias);
    } else {
      lo = _mm512_permutex2var_epi8(tlo0, cd, tlo1);
      hi = _mm512_permutex2var_epi8(thi0, cd, thi1);
      hi = _mm512_ternarylogic_epi32(hi, cd, sign, 0xF8);
    }
    *k0 = _mm512_unpacklo_epi8(lo, hi);
    *k1 = _mm512_unpackhi_epi8(lo, hi);
  }
};

// Widens the `stored` pair rows of a block (kv_store.h: pair p of the 32
// keys in one 64-byte row, in IndexKeySlot order) into kt[p * 32 ..], and
// zeroes rows [stored, pairs) (the padding to whole 16-pair tiles). The
// slot order is the one in which the widening's byte interleave, which
// works within 128-bit lanes, leaves the keys in natural order: lane L of a
// row holds slots 8 L .. 8 L + 7, of which the low half (keys 4 L .. 4 L +
// 3) goes to the first vector and the high half (keys 16 + 4 L ..) to the
// second. The widening (CodeWidening): by bit moves, with the byte tables
// for the 64 codes of a row that hold a zero, subnormal or NaN code; or
// kByteTables, by the tables alone. Same bits.
template <bool kByteTables>
inline void WidenPairRows(const uint8_t* rows, int stored, int pairs,
                          uint32_t* kt) {
  const RowWidening w;
  for (int p = 0; p < stored; ++p) {
    __m512i k0, k1;
    w.Row<kByteTables>(rows + size_t(p) * 64, &k0, &k1);
    _mm512_store_si512(kt + size_t(p) * kKeyBlock, k0);
    _mm512_store_si512(kt + size_t(p) * kKeyBlock + 16, k1);
  }
  for (int p = stored; p < pairs; ++p) {
    _mm512_store_si512(kt + size_t(p) * kKeyBlock, _mm512_setzero_si512());
    _mm512_store_si512(kt + size_t(p) * kKeyBlock + 16, _mm512_setzero_si512());
  }
}

// The lines of one stored block (its pair rows, then its scales),
// requested into L2 a few at a time between a block's head groups instead
// of all at once. A burst of 64
// requests (one dsv32 block) overruns the core's outstanding-miss capacity;
// the scan then slowed as its keys moved from L2 to L3 and DRAM (one core
// of an AMD EPYC without AMX: 42 ns a key at 4K keys, 50-54 ns at
// 128K-512K). Spread over the 8 head groups of a 64-head block: 45-49 ns
// at 128K, 46-51 at 512K (against 49-52 and 51-54, four alternated runs);
// karat-bench-kernels' two-core dsv32 scan at 128K went from 1.34-1.45x
// to 1.59-1.72x the FMA peak. (Those figures are from when the requests
// went to L1 and blocks were transposed as they were decoded.) Prefetches
// only: the same bits.
class SpreadPrefetch {
 public:
  SpreadPrefetch() = default;
  // The rows and scales of stored block `b`.
  SpreadPrefetch(const LayerView& view, const ScanBlock& b)
      : p_(reinterpret_cast<const char*>(view.IndexKeyBlock(b.page, b.block))),
        scales_(reinterpret_cast<const char*>(
            view.IndexBlockScales(b.page, b.block))),
        bytes_(view.layout->IndexBlockBytes()) {}
  // The lines are to be requested over `groups` calls of Step().
  void Split(int groups) {
    if (bytes_ == 0) return;  // nothing to request
    step_ = (bytes_ / 64 + groups - 1) / std::max(groups, 1) * 64;
  }
  void Step() {
    for (const size_t e = std::min(bytes_, off_ + step_); off_ < e; off_ += 64)
      PrefetchLineL2(p_ + off_);
  }
  // Whatever Step() has not requested yet, and the scales.
  void Finish() {
    for (; off_ < bytes_; off_ += 64) PrefetchLineL2(p_ + off_);
    if (scales_ != nullptr) {
      PrefetchLineL2(scales_);
      PrefetchLineL2(scales_ + 64);
      scales_ = nullptr;
    }
  }

 private:
  const char* p_ = nullptr;
  const char* scales_ = nullptr;
  size_t bytes_ = 0, step_ = 0, off_ = 0;
};

// Requests a stored block's rows and scales into L1 (the tile path and
// ScoreBlocksWidening; the other vector paths request them into L2 through
// SpreadPrefetch).
inline void PrefetchKeyBlock(const LayerView& view, const ScanBlock& b) {
  const char* rows =
      reinterpret_cast<const char*>(view.IndexKeyBlock(b.page, b.block));
  const char* sc =
      reinterpret_cast<const char*>(view.IndexBlockScales(b.page, b.block));
  const size_t bytes = view.layout->IndexBlockBytes();
  for (size_t off = 0; off < bytes; off += 64) PrefetchLine(rows + off);
  PrefetchLine(sc);
  PrefetchLine(sc + 64);
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

// Stores lanes [lo, hi) of a block's scores (s0: lanes 0-15, s1: 16-31)
// at out[lo .. hi).
inline void StoreBlockLanes(float* out, int lo, int hi, __m512 s0, __m512 s1) {
  if (lo == 0 && hi == kKeyBlock) {
    _mm512_storeu_ps(out, s0);
    _mm512_storeu_ps(out + 16, s1);
    return;
  }
  const uint32_t lanes = uint32_t((uint64_t(1) << hi) - (uint64_t(1) << lo));
  _mm512_mask_storeu_ps(out, __mmask16(lanes & 0xFFFF), s0);
  _mm512_mask_storeu_ps(out + 16, __mmask16(lanes >> 16), s1);
}

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

// ScoreBlocksWidening for iq.heads (1 .. kHeadBlock) heads.
template <bool kByteTables, int HB = 1>
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

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
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
constexpr bool kHaveTileUnit = true;

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  // `head_rows`: rows of the query (A) and accumulator (C) tiles, 0-5;
  // the key tiles (B, 6-7) always hold 16 code pairs.
  explicit TileConfig(int head_rows = 16) {
    for (int i = 0; i < 8; ++i) {
      colsb[i] = 64;
      rows[i] = uint8_t(i < 6 ? head_rows : 16);
    }
  }
};

// Linux hands out the tile state only on request, once per process.
bool RequestTileUnit() {
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Per 32-key block: dots[h * 32 + j] = q[h] . k[j] for every (padded) head.
// With store = false (only for heads <= 32: one pass over the groups) the
// results stay in accumulator tiles 0-3 for TileStoreDots, so that other
// work can run while the tile unit finishes.
void TileDots(const KeyBlock& kb, const IndexQuery& iq, float* dots,
              bool store = true) {
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

// A key position as (index page, offset in the page), advanced without
// dividing.
struct KeyPos {
  int page = 0, off = 0;
  KeyPos(int s, int tpp) : page(s / tpp), off(s % tpp) {}
  void Advance(int n, int tpp) {
    off += n;
    while (off >= tpp) {
      off -= tpp;
      ++page;
    }
  }
};

// Keys the row path prefetches into L1 ahead of the ones it widens
// (every line), and into L2 further ahead (one line in four: that starts
// the L2 streamer on each run without holding more L1 fill buffers).
// Measured on the tiny shape, one core: 48-80 keys ahead beat 32 and
// 96-384 for L1; the sparse L2 prefetch 256-1024 keys ahead takes another
// 5-10% off at 64K-128K keys, prefetching every line that far ahead adds
// time. (When the keys already sit in L2, at 16K, the prefetches cost
// about 10%.)
constexpr int kRowPrefetchAhead = 2 * kKeyBlock;
constexpr int kRowFarAhead = 16 * kKeyBlock;

// Prefetches the stored blocks (rows and scales) that start among the n
// keys from `p`, and the one `p` lies in when it is a block's first slot:
// every line into L1, or (kL2) one line in four into L2.
template <bool kL2>
inline void PrefetchKeys(const LayerView& view, KeyPos p, int n, int dim) {
  const KvLayout& l = *view.layout;
  const size_t bytes = l.IndexBlockBytes();
  while (n > 0) {
    const int run = std::min(n, l.index_tokens_per_page - p.off);
    for (int blk = (p.off + kKeyBlock - 1) / kKeyBlock;
         blk * kKeyBlock < p.off + run; ++blk) {
      const char* k =
          reinterpret_cast<const char*>(view.IndexKeyBlock(p.page, blk));
      const char* sc =
          reinterpret_cast<const char*>(view.IndexBlockScales(p.page, blk));
      if (kL2) {
        for (size_t off = 0; off < bytes; off += 256) PrefetchLineL2(k + off);
        PrefetchLineL2(sc);
      } else {
        for (size_t off = 0; off < bytes; off += 64) PrefetchLine(k + off);
        PrefetchLine(sc);
        PrefetchLine(sc + 64);
      }
    }
    n -= run;
    p.page++;
    p.off = 0;
  }
}

// Prefetches keys up to `target` (exclusive) from `*reached` (whose
// position is `*pos`) and advances both.
template <bool kL2>
inline void PrefetchUpTo(const LayerView& view, int target, int dim,
                         int* reached, KeyPos* pos) {
  if (target <= *reached) return;
  PrefetchKeys<kL2>(view, *pos, target - *reached, dim);
  pos->Advance(target - *reached, view.layout->index_tokens_per_page);
  *reached = target;
}

// A block of keys widened for the row path: key j's chunk k at rows[j *
// dim + 32 k] (in RowDim order), and the keys' scales.
struct KeyRows {
  uint16_t* rows = nullptr;  // 32 x dim bf16, 64-byte aligned
  alignas(64) float scale[kKeyBlock] = {};
  bool has_nan = false;  // some key has a NaN code
};

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

bool UseTileUnit() { return kHaveTileUnit && g_tile_unit; }

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

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
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
#endif

// The vector path: scores the 32 keys of `kb` for query `iq` with
// vdpbf16ps or, in the FMA form, with fp32 FMAs; writes lanes [lo, hi) to
// out[lo .. hi). `ahead` is stepped once per head group and finished at
// the end.
void ScoreKeyBlock(const KeyBlock& kb, const IndexQuery& iq, int lo, int hi,
                   float* out, SpreadPrefetch ahead = SpreadPrefetch()) {
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
}

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

// --- Gather + Attend (absorbed MLA, §III-D) ----------------------------------
//
// Arithmetic: see MlaAttend in attention.h; blocking and splitting do not
// change it. Two paths: the vector unit's (below) and, where the kernel
// grants it, the matrix tile unit's (AttendChunkTiles; about twice as fast
// on the 128-head shape, which is compute-bound, and somewhat faster on
// the small one).
//
// Vector path. Per fixed chunk of 256 selected entries (split over cores
// by chunk), two passes. Scores: 16 selected entries at a time are
// gathered from their pages and transposed as bf16 pairs into an L1 tile
// (one lane per entry); every head's fma chains run over the tile, 8
// heads at a time so that 8 independent chains fill both FMA ports, each
// pair of dims widened to fp32 as it is read (one instruction a dim).
// Weighted sum: the chunk's entries are read again (now cache-resident),
// 32 dims as one vector of pairs, widened into even and odd dims, and
// each widened vector feeds 8 heads' accumulators. The chunks' (max,
// denominator, unnormalised sum) are then merged in chunk order (on the
// calling thread unless the merge is large). The gathered data crosses
// memory once; the cores take chunks as they finish the previous one.
//
// Measured on dsa-tiny's shape (8 heads, 128 + 16; 2048 entries of 128K),
// on a busy shared 2-core machine: one core takes ~225-250 us from DRAM,
// about the sum of reading the entries alone (~75 us: one core's misses in
// flight, not the bandwidth, bound 2048 scattered 288-byte entries) and of
// the same call with its entries in cache (~105-160 us, the arithmetic:
// ~2x its FLOPs at the core's FMA peak; by samples ~33% weighted sums, 24%
// score FMAs, 21% the transposes, 11% softmax, 9% the chunk requests).
// Two cores take ~65 us with the entries in cache, but when the machine
// is busy the second core often joins only after the first has taken
// every chunk. There, requesting the next chunk's lines one at a time
// from inside the score and weighted-sum loops (every 1, 2 or 3
// iterations) instead of all at once before the chunk made no difference
// beyond the noise (one core, from DRAM); on an AMD EPYC (Zen 5) VM,
// requests spread that way (AttendChunk) cut two cores' cold call by a
// sixth.
// On two cores, from DRAM (best of 20, caches evicted by a 1 GiB read):
// the entries alone 34-43 us in most runs, the call 118-175 us, the call
// with its entries read just before (into the other core's cache for half
// the chunks) 100-147 us, warm 59-111 us. Per core and call, timed inside: the
// score passes ~46-70 us, the weighted sums ~22-33 us, the softmax ~5-7 us.
// So the cold arithmetic itself runs slower than warm, and it did so too
// with each chunk's lines loaded (not prefetched) just before it: 78-113 us
// of chunk work per core against 57-86 warm. Also tried on that machine,
// no change beyond the noise: the next chunk's lines queued and requested
// one per weighted-sum entry and 16 per score step (both cores).

namespace {

constexpr int kEntryBlock = 16;
// Entries per softmax chunk (MlaAttend): a fixed size, so the result
// does not depend on the number of cores.
constexpr int kAttendChunk = kMlaAttendChunk;

// One dimension of TileScores' chains: entries' values x0 (0..15) and x1
// (16..31) times head i's q[d].
template <int HB>
inline void TileScoreStep(__m512 x0, __m512 x1, const float* q, int q_dim,
                          int d, __m512* acc0, __m512* acc1) {
#pragma GCC unroll 16
  for (int i = 0; i < HB; ++i) {
    const __m512 qd = _mm512_set1_ps(q[size_t(i) * q_dim + d]);
    acc0[i] = _mm512_fmadd_ps(qd, x0, acc0[i]);
    acc1[i] = _mm512_fmadd_ps(qd, x1, acc1[i]);
  }
}

// Scores of up to 32 entries over a LoadEntryPairTile tile (ld 32: entries
// 0..15 at +0, 16..31 at +16), widened pair by pair. Ticks `l1` (into L1)
// once per pair of dimensions.
template <int HB>
[[gnu::noinline]] void TileScores(const uint32_t* tile, int kv_dim,
                                  const float* q, int q_dim, float scale,
                                  float* s, size_t s_stride, bool second,
                                  EntryRequests* l1) {
  EntryRequests req = *l1;  // a local copy stays in registers
  const __m512i hi = _mm512_set1_epi32(int(0xFFFF0000u));
  __m512 acc0[HB], acc1[HB];
#pragma GCC unroll 16
  for (int i = 0; i < HB; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  int d = 0;
  for (; d + 2 <= kv_dim; d += 2) {
    req.Tick<true>();
    const __m512i v0 = _mm512_load_si512(tile + size_t(d) * 16);
    const __m512i v1 = _mm512_load_si512(tile + size_t(d) * 16 + 16);
    TileScoreStep<HB>(_mm512_castsi512_ps(_mm512_slli_epi32(v0, 16)),
                      _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16)), q, q_dim,
                      d, acc0, acc1);
    TileScoreStep<HB>(_mm512_castsi512_ps(_mm512_and_si512(v0, hi)),
                      _mm512_castsi512_ps(_mm512_and_si512(v1, hi)), q, q_dim,
                      d + 1, acc0, acc1);
  }
  if (d < kv_dim) {
    const __m512i v0 = _mm512_load_si512(tile + size_t(d) * 16);
    const __m512i v1 = _mm512_load_si512(tile + size_t(d) * 16 + 16);
    TileScoreStep<HB>(_mm512_castsi512_ps(_mm512_slli_epi32(v0, 16)),
                      _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16)), q, q_dim,
                      d, acc0, acc1);
  }
  *l1 = req;
  const __m512 sc = _mm512_set1_ps(scale);
#pragma GCC unroll 16
  for (int i = 0; i < HB; ++i) {
    _mm512_storeu_ps(s + size_t(i) * s_stride, _mm512_mul_ps(acc0[i], sc));
    if (second) {
      _mm512_storeu_ps(s + size_t(i) * s_stride + 16,
                       _mm512_mul_ps(acc1[i], sc));
    }
  }
}

// o[h][d0 .. d0 + 16 NV) = sum_j p[h][j] e_j for heads [h, h + HB) (fma
// chain in selection order); entries widened from bf16 as they are read.
template <int NV, int HB>
void WeightedSum(const uint16_t* const* entries, int nsel, const float* p,
                 size_t p_stride, int d0, int width, float* o,
                 size_t o_stride) {
  __m512 acc[HB][NV];
#pragma GCC unroll 32
  for (int h = 0; h < HB; ++h) {
#pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) acc[h][i] = _mm512_setzero_ps();
  }
  for (int j = 0; j < nsel; ++j) {
    const uint16_t* e = entries[j] + d0;
    __m512 ph[HB];
#pragma GCC unroll 16
    for (int h = 0; h < HB; ++h) ph[h] = _mm512_set1_ps(p[h * p_stride + j]);
#pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) {
      const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(e + 16 * i))),
          16));
#pragma GCC unroll 16
      for (int h = 0; h < HB; ++h) {
        acc[h][i] = _mm512_fmadd_ps(ph[h], v, acc[h][i]);
      }
    }
  }
#pragma GCC unroll 16
  for (int h = 0; h < HB; ++h) {
#pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) {
      const int cnt = std::min(16, width - 16 * i);
      const __mmask16 mk = FirstLanes16(cnt);
      _mm512_mask_storeu_ps(o + h * o_stride + 16 * i, mk, acc[h][i]);
    }
  }
}

// WeightedSum's sums for 8 heads and 32 dims (the same fma chains) with
// each entry's 32 dims read as one vector of bf16 pairs and widened in two
// instructions, even dims (shift left by 16) and odd dims (low halves
// cleared), into accumulators of even and of odd dims that are interleaved
// once at the end. WeightedSum's widening (a zero-extending load and a
// shift per 16 dims) issues on the ports the FMAs need. Ticks `l2` (into
// L2) once per entry.
[[gnu::noinline]] void WeightedSumPairs(const uint16_t* const* entries,
                                        int nsel, const float* p,
                                        size_t p_stride, int d0, float* o,
                                        size_t o_stride, EntryRequests* l2) {
  constexpr int HB = 8;
  EntryRequests req = *l2;
  const __m512i hi = _mm512_set1_epi32(int(0xFFFF0000u));
  __m512 even[HB], odd[HB];
#pragma GCC unroll 8
  for (int h = 0; h < HB; ++h) even[h] = odd[h] = _mm512_setzero_ps();
  for (int j = 0; j < nsel; ++j) {
    req.Tick<false>();
    const __m512i v = _mm512_loadu_si512(entries[j] + d0);
    const __m512 ve = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    const __m512 vo = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
#pragma GCC unroll 8
    for (int h = 0; h < HB; ++h) {
      const __m512 ph = _mm512_set1_ps(p[h * p_stride + j]);
      even[h] = _mm512_fmadd_ps(ph, ve, even[h]);
      odd[h] = _mm512_fmadd_ps(ph, vo, odd[h]);
    }
  }
  *l2 = req;
  // Dim 2k is even's lane k, dim 2k + 1 odd's.
  const __m512i lo_idx =
      _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi_idx = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27,
                                          11, 26, 10, 25, 9, 24, 8);
#pragma GCC unroll 8
  for (int h = 0; h < HB; ++h) {
    _mm512_storeu_ps(o + h * o_stride,
                     _mm512_permutex2var_ps(even[h], lo_idx, odd[h]));
    _mm512_storeu_ps(o + h * o_stride + 16,
                     _mm512_permutex2var_ps(even[h], hi_idx, odd[h]));
  }
}

// Dims [d0, d0 + 32) of entries [0, n), widened from bf16 once into
// wide[j * 32 ..], for WeightedSumWide; ticks `l2` (into L2) once per
// entry.
void WidenEntryChunk(const uint16_t* const* entries, int n, int d0, float* wide,
                     EntryRequests* l2) {
  EntryRequests req = *l2;
  for (int j = 0; j < n; ++j) {
    req.Tick<false>();
    const uint16_t* e = entries[j] + d0;
    for (int i = 0; i < 2; ++i) {
      _mm512_store_si512(
          wide + size_t(j) * 32 + 16 * i,
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                reinterpret_cast<const __m256i*>(e + 16 * i))),
                            16));
    }
  }
  *l2 = req;
}

// WeightedSum for 8 heads and 32 dims over a chunk WidenEntryChunk left in
// `wide`: the same fma chains, with the entries widened once for every
// head group.
void WeightedSumWide(const float* wide, int nsel, const float* p,
                     size_t p_stride, float* o, size_t o_stride) {
  constexpr int HB = 8;
  __m512 acc[HB][2];
#pragma GCC unroll 8
  for (int h = 0; h < HB; ++h) acc[h][0] = acc[h][1] = _mm512_setzero_ps();
  for (int j = 0; j < nsel; ++j) {
    const __m512 v0 = _mm512_load_ps(wide + size_t(j) * 32);
    const __m512 v1 = _mm512_load_ps(wide + size_t(j) * 32 + 16);
#pragma GCC unroll 8
    for (int h = 0; h < HB; ++h) {
      const __m512 ph = _mm512_set1_ps(p[h * p_stride + j]);
      acc[h][0] = _mm512_fmadd_ps(ph, v0, acc[h][0]);
      acc[h][1] = _mm512_fmadd_ps(ph, v1, acc[h][1]);
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < HB; ++h) {
    _mm512_storeu_ps(o + h * o_stride, acc[h][0]);
    _mm512_storeu_ps(o + h * o_stride + 16, acc[h][1]);
  }
}

// Dims [from, lora) of heads [h, h + HB): whole vectors, then a scalar
// tail (the same fma chains).
template <int HB>
void WeightedSumTail(const uint16_t* const* entries, int nsel, const float* p,
                     size_t p_stride, int from, int lora, float* o,
                     size_t o_stride) {
  int d0 = from;
  for (; d0 + 16 <= lora; d0 += 16) {
    WeightedSum<1, HB>(entries, nsel, p, p_stride, d0, 16, o + d0, o_stride);
  }
  if (d0 < lora) {
    const int width = lora - d0;
    for (int h = 0; h < HB; ++h) {
      alignas(64) float acc[16] = {};
      for (int j = 0; j < nsel; ++j) {
        const uint16_t* e = entries[j] + d0;
        const float pj = p[h * p_stride + j];
        for (int i = 0; i < width; ++i) {
          acc[i] = std::fma(pj, Bf16(e[i]), acc[i]);
        }
      }
      std::memcpy(o + h * o_stride + d0, acc, size_t(width) * 4);
    }
  }
}

template <int HB>
void WeightedSumHeads(const uint16_t* const* entries, int nsel, const float* p,
                      size_t p_stride, int lora, float* o, size_t o_stride) {
  // The widening loads read 16 values at a time; entries are padded in
  // their page only to the end of the KV section, so the last partial
  // vector of a row goes through the masked path (NV of the tail = 1).
  int d0 = 0;
  for (; d0 + 128 <= lora; d0 += 128) {
    WeightedSum<8, HB>(entries, nsel, p, p_stride, d0, 128, o + d0, o_stride);
  }
  for (; d0 + 16 <= lora; d0 += 16) {
    WeightedSum<1, HB>(entries, nsel, p, p_stride, d0, 16, o + d0, o_stride);
  }
  if (d0 < lora) {
    // Tail narrower than a vector: widen through a padded copy.
    const int width = lora - d0;
    for (int h = 0; h < HB; ++h) {
      alignas(64) float acc[16] = {};
      for (int j = 0; j < nsel; ++j) {
        const uint16_t* e = entries[j] + d0;
        const float pj = p[h * p_stride + j];
        for (int i = 0; i < width; ++i) {
          acc[i] = std::fma(pj, Bf16(e[i]), acc[i]);
        }
      }
      std::memcpy(o + h * o_stride + d0, acc, size_t(width) * 4);
    }
  }
}

}  // namespace

float KernelExp(float x) {
  if (x != x) return x;
  if (x < -104.0f) return 0.0f;
  const float xc = std::min(x, 88.0f);
  const float n = std::nearbyint(xc * kExpLog2e);
  float r = std::fma(n, -kExpLn2Hi, xc);
  r = std::fma(n, -kExpLn2Lo, r);
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = std::fma(p, r, kExpPoly[i]);
  float y = std::fma(p, r * r, r);
  y = y + 1.0f;
  return std::ldexp(y, int(n));
}

namespace {

// Heads [0, HN) of a chunk's softmax (rows s + i * s_stride of n scores):
// m[i] = max, the numerators KernelExp(s - m[i]) in place and z[i] their
// 16-lane sum (lane tree). The heads' exps are independent, so HN of them
// are in flight at once (one head at a time, each exp's chain of ~15
// dependent operations left the FP units mostly idle).
template <int HN>
void ChunkSoftmax(float* s, size_t s_stride, int n, float* m, float* z) {
  const int nb = (n + 15) / 16;
  __m512 vm[HN], vz[HN];
#pragma GCC unroll 8
  for (int i = 0; i < HN; ++i) {
    vm[i] = _mm512_set1_ps(-INFINITY);
    vz[i] = _mm512_setzero_ps();
  }
  for (int blk = 0; blk < nb; ++blk) {
    const __mmask16 valid = FirstLanes16(std::min(16, n - blk * 16));
#pragma GCC unroll 8
    for (int i = 0; i < HN; ++i) {
      vm[i] = _mm512_mask_max_ps(vm[i], valid, vm[i],
                                 _mm512_loadu_ps(s + i * s_stride + blk * 16));
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < HN; ++i) {
    m[i] = _mm512_reduce_max_ps(vm[i]);
    vm[i] = _mm512_set1_ps(m[i]);
  }
  for (int blk = 0; blk < nb; ++blk) {
    const __mmask16 valid = FirstLanes16(std::min(16, n - blk * 16));
#pragma GCC unroll 8
    for (int i = 0; i < HN; ++i) {
      float* sb = s + i * s_stride + blk * 16;
      const __m512 p = _mm512_maskz_mov_ps(
          valid, KernelExp16(_mm512_sub_ps(_mm512_loadu_ps(sb), vm[i])));
      _mm512_storeu_ps(sb, p);
      vz[i] = _mm512_add_ps(vz[i], p);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < HN; ++i) z[i] = LaneTreeSum(vz[i]);
}

// One chunk of the selection (entries ent[0, n), n <= kAttendChunk) for
// every head: scores, the chunk's max m[h], p = KernelExp(s - m[h]), the
// 16-lane denominator z[h] and the unnormalised sums o[h][0, lora) (stride
// lora). The entries the core computes next, nxt[0, nn) (the next chunk it
// claimed; none if nn is 0), are requested meanwhile (EntryRequests,
// spread over the loops): during each 32-entry tile's scores, the entries
// of the tile kAhead tiles on into L1 (in the chunk's last tiles, the next
// chunk's first ones; in a core's first chunk, `first`, the tiles between
// too), and during the weighted sums the next chunk's others into L2.
// Requested all at once before each tile and chunk instead, the misses of
// an entry mostly did not overlap the arithmetic: on an AMD EPYC (Zen 5)
// VM, dsa-tiny's 2048 entries of 128K, from DRAM, took 72-78 us on two
// cores against ~30 warm and ~25 to merely read them; spread, 62-66 us.
// Without the L1 requests, with only the entries evicted: 40 us against
// 29; without the L2 ones, 30 against 29. s: heads x kAttendChunk
// scratch; tile: the transposed entry tile; wide: kAttendChunk x 32
// floats; l1, l2: the requests' state.
void AttendChunk(const uint16_t* const* ent, int n, const uint16_t* const* nxt,
                 int nn, bool first, const float* q, const AttnShapes& shapes,
                 float* s, uint32_t* tile, float* wide, float* m, float* z,
                 float* o, EntryRequests* l1, EntryRequests* l2) {
  // Tiles between a tile and the one whose entries are requested into L1
  // during its scores: 2 measured ~2% faster than 1 on two cores with the
  // entries evicted (dsa-tiny 2048 of 128K, six alternated runs: 27.5 us
  // median against 28.0), 3 no better.
  constexpr int kAhead = 2;
  const int heads = shapes.heads, kv_dim = shapes.kv_dim;
  const size_t s_stride = kAttendChunk;
  const size_t entry_bytes = size_t(kv_dim) * 2;
  // Scores, 32 entries (two 16-entry blocks) per tile.
  for (int j0 = 0; j0 < n; j0 += 32) {
    const bool second = j0 + 16 < n;
    // Entries [lo, j0 + 32 (kAhead + 1)), of this chunk and then the next:
    // the tile kAhead after this one (and, in a core's first chunk, the
    // ones between).
    const int lo = j0 == 0 && first ? 32 : j0 + 32 * kAhead;
    const int hi = j0 + 32 * (kAhead + 1);
    const int here = std::clamp(n - lo, 0, hi - lo);
    const int from = std::max(0, lo - n);
    const int there = std::max(0, std::min(nn, hi - n) - from);
    l1->Start(ent + std::min(lo, n), here, there > 0 ? nxt + from : nullptr,
              there, entry_bytes, (kv_dim + 1) / 2);
    LoadEntryPairTile(ent + j0, std::min(kEntryBlock, n - j0), kv_dim, tile,
                      32);
    if (second) {
      LoadEntryPairTile(ent + j0 + 16, std::min(kEntryBlock, n - j0 - 16),
                        kv_dim, tile + 16, 32);
    }
    int h = 0;
    for (; h + 8 <= heads; h += 8) {
      TileScores<8>(tile, kv_dim, q + size_t(h) * shapes.q_dim, shapes.q_dim,
                    shapes.softmax_scale, s + h * s_stride + j0, s_stride,
                    second, l1);
    }
    for (; h < heads; ++h) {
      TileScores<1>(tile, kv_dim, q + size_t(h) * shapes.q_dim, shapes.q_dim,
                    shapes.softmax_scale, s + h * s_stride + j0, s_stride,
                    second, l1);
    }
  }
  // The chunk's softmax numerators, 8 heads at a time.
  int h = 0;
  for (; h + 8 <= heads; h += 8) {
    ChunkSoftmax<8>(s + h * s_stride, s_stride, n, m + h, z + h);
  }
  for (; h < heads; ++h)
    ChunkSoftmax<1>(s + h * s_stride, s_stride, n, m + h, z + h);
  // Weighted sums: each loaded entry vector feeds 8 heads. With several
  // groups of 8, each 32-dim slice of the entries is widened once, into
  // `wide`, for all of them; with one, as it is read.
  const int lora = shapes.kv_lora;
  const size_t os = size_t(lora);
  const int full_groups = heads / 8;
  const int chunks = lora / 32;
  // The next chunk's entries that the last tiles' scores did not request.
  const int requested = std::max(0, (n - 1) / 32 * 32 + 32 * (kAhead + 1) - n);
  l2->Start(nxt + std::min(requested, nn), nn - requested, nullptr, 0,
            entry_bytes, std::max(chunks, 1) * n);
  for (int c = 0; c < chunks && full_groups > 1; ++c) {
    WidenEntryChunk(ent, n, c * 32, wide, l2);
    for (int g = 0; g < full_groups; ++g) {
      WeightedSumWide(wide, n, s + size_t(g) * 8 * s_stride, s_stride,
                      o + size_t(g) * 8 * os + c * 32, os);
    }
  }
  for (int g = 0; g < full_groups; ++g) {
    for (int c = 0; c < chunks && full_groups == 1; ++c) {
      WeightedSumPairs(ent, n, s + size_t(g) * 8 * s_stride, s_stride, c * 32,
                       o + size_t(g) * 8 * os + c * 32, os, l2);
    }
    if (chunks * 32 < lora) {
      WeightedSumTail<8>(ent, n, s + size_t(g) * 8 * s_stride, s_stride,
                         chunks * 32, lora, o + size_t(g) * 8 * os, os);
    }
  }
  h = full_groups * 8;
  for (; h + 3 <= heads; h += 3) {
    WeightedSumHeads<3>(ent, n, s + h * s_stride, s_stride, lora, o + h * os,
                        os);
  }
  for (; h < heads; ++h) {
    WeightedSumHeads<1>(ent, n, s + h * s_stride, s_stride, lora, o + h * os,
                        os);
  }
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
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

constexpr int kParts = 3;

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

// Sizes of the tile path's operands for one shape.
struct TileAttendDims {
  int heads, kv_dim, lora;
  int kp;              // kv_dim padded to 32 (one A tile row per 32 dims)
  int cols;            // query columns, kParts x heads, padded to 32
  int lp;              // lora padded to 32
  int mtiles;          // 16-row blocks of the kParts x heads numerator rows
  size_t entry_bytes;  // one entry (kv_dim bf16)
  // The weighted sums keep their accumulators in tiles over the whole
  // chunk (the chunk's pair-interleaved entries live in L2). Running them
  // one 32-entry block at a time instead, with the accumulators stored and
  // reloaded between blocks so that the scratch stays in L1, measured
  // more than twice as slow, even at 8 heads (~35 TSC ticks per entry
  // against ~15): the reloads of just-stored tiles stall.
  explicit TileAttendDims(const AttnShapes& s)
      : heads(s.heads),
        kv_dim(s.kv_dim),
        lora(s.kv_lora),
        kp((s.kv_dim + 31) / 32 * 32),
        cols((kParts * s.heads + 31) / 32 * 32),
        lp((s.kv_lora + 31) / 32 * 32),
        mtiles((kParts * s.heads + 15) / 16),
        entry_bytes(size_t(s.kv_dim) * 2) {}
};

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

// Per-thread scratch of the tile path.
struct TileAttendScratch {
  AlignedVector<uint16_t> erow;  // 2 x 32 x kp: entry rows, two blocks
  AlignedVector<uint16_t> ev;    // pairs x 2 lp: the chunk's entries
                                 // pair-interleaved
  AlignedVector<float> sbuf;     // 2 x 32 x cols: score accumulators
  AlignedVector<float> se;       // 32 x heads padded to 16: combined scores
  AlignedVector<float> s;        // heads x kAttendChunk: scores, then p
  AlignedVector<uint16_t> p3;    // mtiles * 16 x kAttendChunk: p's parts
  AlignedVector<float> o3;       // mtiles * 16 x lp: weighted sums' parts
  void Size(const TileAttendDims& t) {
    erow.resize(size_t(64) * t.kp);
    ev.resize(size_t(kAttendChunk) * t.lp);
    sbuf.resize(size_t(2 * 32) * t.cols);
    se.resize(size_t(32) * ((t.heads + 15) / 16 * 16));
    s.resize(size_t(t.heads) * kAttendChunk);
    p3.resize(size_t(t.mtiles) * 16 * kAttendChunk, 0);
    o3.resize(size_t(t.mtiles) * 16 * t.lp);
  }
};

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
#endif  // __AMX_BF16__ && __AMX_TILE__
}  // namespace

bool MlaAttendUsesTileUnit() { return UseTileUnit(); }

void MlaAttend(const LayerView& view, const int32_t* sel, int nsel,
               const float* q, const AttnShapes& shapes, float* o_lat,
               CorePool* pool, AttendUnit unit) {
  const int heads = shapes.heads, lora = shapes.kv_lora;
  const size_t os = size_t(shapes.out_dim);
  if (nsel <= 0) {
    for (int h = 0; h < heads; ++h) {
      std::fill(o_lat + h * os, o_lat + h * os + lora, 0.0f);
    }
    return;
  }
  pool = PoolFor(pool, double(nsel) * heads * (shapes.kv_dim + lora));
  const int nchunks = (nsel + kAttendChunk - 1) / kAttendChunk;
  // Reused per calling thread: a fresh buffer would be mapped and
  // page-faulted on every call, which costs more than the work.
  thread_local std::vector<const uint16_t*> entries;
  thread_local AlignedVector<float> partial;    // chunk x head x lora
  thread_local std::vector<float> maxes, sums;  // chunk x head
  entries.resize(nsel);
  partial.resize(size_t(nchunks) * heads * lora);
  maxes.resize(size_t(nchunks) * heads);
  sums.resize(size_t(nchunks) * heads);
  const uint16_t** entries_out = entries.data();
  const uint16_t* const* ent = entries_out;
  float* part = partial.data();
  float* mx = maxes.data();
  float* zs = sums.data();
  const size_t tile_size = size_t((shapes.kv_dim + 31) / 32) * 16 * 32;
  const size_t s_size = size_t(heads) * kAttendChunk;
  // Fixed chunks, whatever the split over cores; each core takes the next
  // chunk when it is done with one, so a core slowed by other work does
  // not hold the rest up (which core computes a chunk does not matter).
  std::atomic<int> next{0};
  const int parts = pool != nullptr ? std::min(pool->cores(), nchunks) : 1;
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  // Below the threshold the tile path's fixed costs (the query's parts, a
  // whole 32-entry block, the configuration) outweigh its speed.
  const bool tiles =
      UseTileUnit() &&
      (unit == AttendUnit::kTileUnit ||
       (unit == AttendUnit::kAuto && MlaAttendTileWorthIt(heads, nsel)));
#else
  const bool tiles = false;
#endif
  // Chunk c's entry addresses (a page-table lookup each), into
  // entries_out; returns its entry count (0 past the last chunk).
  auto addresses = [&](int c) {
    if (c >= nchunks) return 0;
    const int j0 = c * kAttendChunk;
    const int n = std::min(kAttendChunk, nsel - j0);
    view.KvEntries(sel + j0, n, entries_out + j0);
    return n;
  };
  if (tiles) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    const TileAttendDims t(shapes);
    thread_local AlignedVector<uint16_t> qrows;
    thread_local AlignedVector<uint32_t> qbuf;
    qrows.resize(size_t(t.cols) * t.kp);
    qbuf.resize(size_t(t.cols) * t.kp / 2);
    PrepareTileQuery(q, shapes.q_dim, t, qrows.data(), qbuf.data());
    const uint32_t* qb = qbuf.data();
    ParallelFor(pool, parts, 1, [&](int64_t, int64_t) {
      thread_local TileAttendScratch scratch;
      scratch.Size(t);
      // Each core claims its next chunk before working on the current one,
      // so that the next chunk's entries can be prefetched meanwhile.
      int c = next.fetch_add(1, std::memory_order_relaxed);
      int n = addresses(c);
      while (c < nchunks) {
        const int c2 = next.fetch_add(1, std::memory_order_relaxed);
        const int n2 = addresses(c2);
        AttendChunkTiles(ent + size_t(c) * kAttendChunk, n,
                         ent + size_t(std::min(c2, nchunks - 1)) * kAttendChunk,
                         n2, qb, shapes, t, &scratch, mx + c * heads,
                         zs + c * heads, part + size_t(c) * heads * lora);
        c = c2;
        n = n2;
      }
      _tile_release();
    });
#endif
  } else {
    ParallelFor(pool, parts, 1, [&](int64_t, int64_t) {
      thread_local AlignedVector<uint32_t> tile;
      thread_local AlignedVector<float> scratch, wide;
      thread_local EntryRequests l1, l2;
      tile.resize(tile_size);
      scratch.resize(s_size);
      wide.resize(size_t(kAttendChunk) * 32);
      // A core claims its next chunk before computing the current one, so
      // that the next chunk's entries, scattered over the pages, are
      // requested while it computes (AttendChunk).
      int c = next.fetch_add(1, std::memory_order_relaxed);
      int n = addresses(c);
      bool first = true;
      while (c < nchunks) {
        const int c_next = next.fetch_add(1, std::memory_order_relaxed);
        const int n_next = addresses(c_next);
        const int j0 = c * kAttendChunk;
        const uint16_t* const* ent_next =
            n_next > 0 ? ent + size_t(c_next) * kAttendChunk : nullptr;
        AttendChunk(ent + j0, n, ent_next, n_next, first, q, shapes,
                    scratch.data(), tile.data(), wide.data(), mx + c * heads,
                    zs + c * heads, part + size_t(c) * heads * lora, &l1, &l2);
        first = false;
        c = c_next;
        n = n_next;
      }
    });
  }
  // Merge the chunks in order, split by heads where that is worth waking
  // the cores for.
  ParallelFor(
      PoolFor(pool, double(nchunks) * heads * lora), heads, 1,
      [&](int64_t b, int64_t e) {
        for (int64_t h = b; h < e; ++h) {
          float mh = -INFINITY;
          for (int c = 0; c < nchunks; ++c)
            mh = std::max(mh, mx[c * heads + h]);
          // The chunks' weights, kept per calling thread (merge_w),
          // 16 at a time (KernelExp16 is KernelExp lane for lane;
          // the scalar one's ldexp took most of the merge).
          thread_local std::vector<float> merge_w;
          merge_w.resize(size_t(nchunks + 15) / 16 * 16);
          for (int c = 0; c < nchunks; ++c) merge_w[c] = mx[c * heads + h] - mh;
          for (int c0 = 0; c0 < nchunks; c0 += 16) {
            _mm512_storeu_ps(&merge_w[c0],
                             KernelExp16(_mm512_loadu_ps(&merge_w[c0])));
          }
          float z = 0.0f;
          for (int c = 0; c < nchunks; ++c) {
            z = std::fma(merge_w[c], zs[c * heads + h], z);
          }
          const __m512 inv = _mm512_set1_ps(1.0f / z);
          float* out = o_lat + h * os;
          const float* w = merge_w.data();
          // Up to 8 vectors of dims at a time, so that 8 fma
          // chains (each over the chunks in order) run at once.
          for (int d0 = 0; d0 < lora; d0 += 128) {
            const int nv = std::min(8, (lora - d0 + 15) / 16);
            __m512 acc[8];
            for (int v = 0; v < 8; ++v) acc[v] = _mm512_setzero_ps();
            for (int c = 0; c < nchunks; ++c) {
              const __m512 wc = _mm512_set1_ps(w[c]);
              const float* pc = part + (size_t(c) * heads + h) * lora + d0;
              for (int v = 0; v < nv; ++v) {
                const __mmask16 mk =
                    FirstLanes16(std::min(16, lora - d0 - 16 * v));
                acc[v] = _mm512_fmadd_ps(
                    wc, _mm512_maskz_loadu_ps(mk, pc + 16 * v), acc[v]);
              }
            }
            for (int v = 0; v < nv; ++v) {
              const __mmask16 mk =
                  FirstLanes16(std::min(16, lora - d0 - 16 * v));
              _mm512_mask_storeu_ps(out + d0 + 16 * v, mk,
                                    _mm512_mul_ps(acc[v], inv));
            }
          }
        }
      });
}

absl::Status RunIndexer(const AttnShapes& shapes, int layer, int pos_start,
                        int n, const IndexInputs& in, SessionCache* cache,
                        SelectionState* sel, CorePool* pool, KernelCost* cost) {
  if (shapes.index_dim == 0) {
    return absl::FailedPreconditionError("the model has no DSA indexer");
  }
  if (pos_start < 0 || n <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad segment: pos_start ", pos_start, ", n ", n));
  }
  if (pos_start > cache->length(layer)) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, " holds ", cache->length(layer),
                     " positions; a segment cannot start at ", pos_start));
  }
  const int hi = shapes.index_heads, di = shapes.index_dim;
  RETURN_IF_ERROR(
      cache->WriteIndexKeyRun(layer, pos_start, n, in.k_codes, in.k_scales));
  // Index keys of this layer are valid up to pos_start + n; the KV entries
  // follow in RunAttention, which sets the layer's length.
  const LayerView view = cache->View(layer);
  sel->pos_start = pos_start;
  sel->per_token.resize(n);
  // The segment's queries scan together: each key block is decoded once
  // for every query whose causal prefix holds it, and each (query, key)
  // score is computed exactly as a lone query would (see IndexerScore).
  // Queries go in chunks so the score buffer stays bounded.
  constexpr int kQueryChunk = 64;
  std::vector<int> limit;
  std::vector<float*> outs;
  thread_local std::vector<float> scores;  // reused: see MlaAttend
  double bytes = 0, flops = 0;
  for (int c0 = 0; c0 < n; c0 += kQueryChunk) {
    const int nq = std::min(kQueryChunk, n - c0);
    const int ctx_max = pos_start + c0 + nq;
    limit.resize(nq);
    outs.resize(nq);
    scores.resize(size_t(nq) * ctx_max);
    for (int i = 0; i < nq; ++i) {
      limit[i] = pos_start + c0 + i + 1;
      outs[i] = &scores[size_t(i) * ctx_max];
      flops += 2.0 * limit[i] * hi * di;
    }
    IndexerScoreQueries(view, nq, in.q_codes + size_t(c0) * hi * di,
                        in.q_scales + size_t(c0) * hi,
                        in.weights + size_t(c0) * hi, hi, di, limit.data(),
                        outs.data(), pool);
    if (nq == 1) {  // a decode step: its Select takes the cores
      SelectTopK(outs[0], limit[0], shapes.index_topk, &sel->per_token[c0],
                 pool);
    } else {
      ParallelFor(pool, nq, 1, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          SelectTopK(outs[i], limit[i], shapes.index_topk,
                     &sel->per_token[c0 + i]);
        }
      });
    }
    bytes += double(ctx_max) * (di + 4) + double(nq) * hi * (di + 8);
  }
  if (cost != nullptr) {
    cost->bytes += bytes;
    cost->flops += flops;
  }
  return absl::OkStatus();
}

absl::Status RunAttention(const AttnShapes& shapes, int layer, int pos_start,
                          int n, const AttnInputs& in, SessionCache* cache,
                          const SelectionState* sel, float* out, CorePool* pool,
                          KernelCost* cost) {
  if (shapes.kv_dim == 0) {
    return absl::UnimplementedError(
        "only the mla_dsa attention form is served by this build");
  }
  if (shapes.kv_heads > 0) {
    return absl::FailedPreconditionError(
        "GQA attention forms run through RunAttentionLayer "
        "(common/sparse_attention.h)");
  }
  if (pos_start < 0 || n <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad segment: pos_start ", pos_start, ", n ", n));
  }
  if (pos_start > cache->length(layer)) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, " holds ", cache->length(layer),
                     " positions; a segment cannot start at ", pos_start));
  }
  if (sel != nullptr &&
      (sel->pos_start != pos_start || int(sel->per_token.size()) != n)) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, ": no index selection for positions ",
                     pos_start, "..", pos_start + n - 1));
  }
  RETURN_IF_ERROR(cache->WriteKvRun(layer, pos_start, n, in.kv));
  cache->SetLength(layer, pos_start + n);
  const LayerView view = cache->View(layer);
  auto attend_token = [&](int i, CorePool* p, std::vector<int32_t>* dense) {
    const int32_t* positions;
    int count;
    if (sel != nullptr) {
      positions = sel->per_token[i].data();
      count = static_cast<int>(sel->per_token[i].size());
    } else {
      dense->resize(pos_start + i + 1);
      std::iota(dense->begin(), dense->end(), 0);
      positions = dense->data();
      count = static_cast<int>(dense->size());
    }
    MlaAttend(view, positions, count,
              in.q + size_t(i) * shapes.heads * shapes.q_dim, shapes,
              out + size_t(i) * shapes.heads * shapes.out_dim, p);
  };
  // One token splits its heads over the cores; a segment splits its tokens.
  // Either way each output element gets the same arithmetic.
  if (n == 1) {
    std::vector<int32_t> dense;
    attend_token(0, pool, &dense);
  } else {
    ParallelFor(pool, n, 1, [&](int64_t b, int64_t e) {
      std::vector<int32_t> dense;
      for (int64_t i = b; i < e; ++i) attend_token(int(i), nullptr, &dense);
    });
  }
  if (cost != nullptr) {
    double entries = 0;
    for (int i = 0; i < n; ++i) {
      entries += sel != nullptr ? double(sel->per_token[i].size())
                                : double(pos_start + i + 1);
    }
    cost->bytes +=
        entries * shapes.kv_dim * 2 +
        double(n) * shapes.heads * (shapes.q_dim + shapes.out_dim) * 4;
    cost->flops += entries * shapes.heads *
                   (2.0 * shapes.kv_dim + 2.0 * shapes.kv_lora + 4.0);
  }
  return absl::OkStatus();
}

}  // namespace karat
