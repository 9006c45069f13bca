// Internal declarations shared by the attention kernels' files: the DSA
// indexer's scan (attention_indexer.cc, attention_indexer_vector.cc,
// attention_indexer_tiles.cc, attention_indexer_rows.cc), top-k Select
// (attention_topk.cc) and the MLA attend (attention_mla.cc,
// attention_mla_tiles.cc). Not part of the API (that is attention.h).
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

#include "common/attention.h"
#include "common/numeric.h"
#include "common/simd_reduce.h"

namespace karat {
namespace attention_internal {

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
inline int PaddedIndexDim(int dim) { return (dim + 31) / 32 * 32; }
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
inline const Fp8Bf16Bytes& Fp8Bytes() {
  static const Fp8Bf16Bytes t;
  return t;
}

// The key-row tile path (see ScoreKeyRows) serves up to this many heads
// and dimensions that are whole 32-dim chunks, at most kRowMaxChunks.
constexpr int kRowHeads = 8;
constexpr int kRowMaxChunks = 2;
// From this many queries on, the row path scores a segment with the keys as
// the tile unit's B operand (see ScoreKeyRows).
constexpr int kKeysAsBMinQueries = 8;
inline bool KeyRowShape(int heads, int dim) {
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
// The process's choice of code widening (measured, or forced).
CodeWidening CurrentCodeWidening();

// Builds what the scan's `path` reads: the key-row path (the tile unit and
// a KeyRowShape) only qb and coef16, the other paths q and coef, and the
// FMA form also qf.
void PrepareIndexQuery(const uint8_t* q_codes, const float* q_scales,
                       const float* weights, int heads, int dim, IndexPath path,
                       IndexQuery* out);

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
                std::vector<ScanBlock>* out);

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
                  bool byte_tables, KeyBlock* kb);

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

// ScoreBlocksWidening for iq.heads (1 .. kHeadBlock) heads.
template <bool kByteTables, int HB = 1>
void ScoreBlocksWideningAnyHeads(const LayerView& view, const ScanBlock* blocks,
                                 int n, const IndexQuery& iq, int limit,
                                 float* out);

// The FMA form: the block's pairs widened to fp32 (kb->kf), by bit moves.
void WidenKeyBlock(int pairs, KeyBlock* kb);

// The vector path: scores the 32 keys of `kb` for query `iq` with
// vdpbf16ps or, in the FMA form, with fp32 FMAs; writes lanes [lo, hi) to
// out[lo .. hi). `ahead` is stepped once per head group and finished at
// the end.
void ScoreKeyBlock(const KeyBlock& kb, const IndexQuery& iq, int lo, int hi,
                   float* out, SpreadPrefetch ahead = SpreadPrefetch());

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
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
bool RequestTileUnit();

// Per 32-key block: dots[h * 32 + j] = q[h] . k[j] for every (padded) head.
// With store = false (only for heads <= 32: one pass over the groups) the
// results stay in accumulator tiles 0-3 for TileStoreDots, so that other
// work can run while the tile unit finishes.
void TileDots(const KeyBlock& kb, const IndexQuery& iq, float* dots,
              bool store = true);

// The stores TileDots(..., store = false) left out.
void TileStoreDots(const IndexQuery& iq, float* dots);

// Head terms of the 32 keys of `kb` from their dots (dots[h * 32 + j],
// from TileDots), times the keys' scales; writes lanes [lo, hi) to
// out[lo .. hi).
void FinishKeyBlock(const KeyBlock& kb, const IndexQuery& iq, int lo, int hi,
                    float* out, const float* dots);

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
                 uint8_t* codes, KeyRows* kb);

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
                  float* const* out);
#endif  // __AMX_BF16__ && __AMX_TILE__

// --- MLA attend -------------------------------------------------------------

// Entries per softmax chunk (MlaAttend): a fixed size, so the result
// does not depend on the number of cores.
constexpr int kAttendChunk = kMlaAttendChunk;

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
constexpr int kParts = 3;

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
                      uint16_t* rows, uint32_t* qb);

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
// One chunk on the tile unit: as AttendChunk (m, z, o of every head). `pf`
// (pf_n entries, none at the end) is the chunk this core takes next,
// prefetched into L2 meanwhile. The tile configuration is loaded here; the
// caller releases the unit.
void AttendChunkTiles(const uint16_t* const* ent, int n,
                      const uint16_t* const* pf, int pf_n, const uint32_t* qb,
                      const AttnShapes& shapes, const TileAttendDims& t,
                      TileAttendScratch* sc, float* m, float* z, float* o);
#endif  // __AMX_BF16__ && __AMX_TILE__

}  // namespace attention_internal
}  // namespace karat
