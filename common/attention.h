// KARAT-side attention for one layer of one segment (DESIGN.md §2 step 3):
// append the segment's new entries, then Score -> Select -> Gather -> Attend
// for each of its tokens. The KARAT-node daemon and the reference engine call
// the same functions, so they agree bit for bit.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "common/core_pool.h"
#include "common/kernel_cost.h"
#include "common/kv_store.h"
#include "common/model_config.h"

namespace karat {

// Sizes of the per-token data-plane arrays for one layer (MODEL.md: indexer
// query as fp8 codes + scales, attention Q and outputs as fp32, KV in bf16).
struct AttnShapes {
  int heads = 0;   // attention heads H
  int kv_dim = 0;  // kv_lora + rope (mla_dsa)
  int kv_lora = 0;
  int rope = 0;
  int q_dim = 0;        // per head: kv_lora + rope (absorbed)
  int out_dim = 0;      // per head: kv_lora (o_lat)
  int index_heads = 0;  // Hi
  int index_dim = 0;    // Di
  int index_topk = 0;
  float softmax_scale = 0;
  // GQA forms (gqa_block, gqa_dense): q_dim = head_dim (+ block_index_dim
  // for gqa_block: [q | q_i] per head), kv_dim = 2 x kv_heads x head_dim
  // (+ kv_heads x block_index_dim: [k | v | k_i]), out_dim = head_dim.
  int kv_heads = 0;         // Hkv
  int head_dim = 0;         // d
  int block_index_dim = 0;  // gqa_block Di
};
AttnShapes MakeAttnShapes(const ModelConfig& config);

// The GPU -> KARAT payload of one segment and layer, token-major. Spans
// point into a frame or into the GPU node's step buffers.
struct IndexInputs {  // frame kIndexQK; only on layers with an indexer
  const uint8_t* q_codes = nullptr;  // n x Hi x Di
  const float* q_scales = nullptr;   // n x Hi
  const float* weights = nullptr;    // n x Hi (already x Hi^-0.5)
  const uint8_t* k_codes = nullptr;  // n x Di
  const float* k_scales = nullptr;   // n
};
struct AttnInputs {              // frame kAttnQKV
  const float* q = nullptr;      // n x H x q_dim  ([q_abs | q_pe] per head)
  const uint16_t* kv = nullptr;  // n x kv_dim bf16
};

// KernelCost (common/kernel_cost.h): for the attention kernels, the bytes of
// cache entries and metadata read and the floating-point operations.

// Per-session state kept between layers of one step: the selection of the
// last layer that ran the indexer, per token of the segment (index reuse).
struct SelectionState {
  int pos_start = -1;
  std::vector<std::vector<int32_t>> per_token;
};

// Appends the indexer keys of tokens [pos_start, pos_start + n) to `layer`
// and computes each token's top-k (into `sel`). Positions >= pos_start
// already stored are dropped first (a resent position overwrites).
absl::Status RunIndexer(const AttnShapes& shapes, int layer, int pos_start,
                        int n, const IndexInputs& in, SessionCache* cache,
                        SelectionState* sel, CorePool* pool = nullptr,
                        KernelCost* cost = nullptr);

// Appends the KV entries and computes o_lat (n x H x out_dim) for each token,
// attending to the positions in `sel` (or to every position <= the token when
// `sel` is null: dense, for context <= index_topk or no indexer).
absl::Status RunAttention(const AttnShapes& shapes, int layer, int pos_start,
                          int n, const AttnInputs& in, SessionCache* cache,
                          const SelectionState* sel, float* out,
                          CorePool* pool = nullptr, KernelCost* cost = nullptr);

// --- Kernels (exposed for tests and benchmarks) ---

// DSA indexer scores of keys [0, n) of `view` for one query (MODEL.md:
// I[s] = sum_h w[h] Di^-0.5 ReLU(q[h] . k[s]) on decoded fp8 values). The
// exact arithmetic, shared by every path that scores (one query or a
// prefill segment, any split over cores):
//   dot[h,s] = sum over code pairs p in increasing order of
//              (dot + q[2p+1] k[2p+1]) + q[2p] k[2p]   (bf16 codes, exact
//              products, fp32 adds; one lane of vdpbf16ps)
//   acc = fma(c[h], max(dot[h,s], 0), acc) over h increasing, from +0,
//         with c[h] = (w[h] * Di^-0.5) * q_scale[h]
//   scores[s] = acc * k_scale[s]
// On hardware with a matrix tile unit (AMX-BF16, granted by the kernel) the
// dot[h,s] above are instead computed by TDPBF16PS tiles in 32-dim chunks
// in increasing order (IndexerUsesTileUnit()); the hardware fixes that
// arithmetic and it depends only on (query, key), but it has no simpler
// scalar model. Every process on one machine takes the same path.
// `pool` (optional) splits the keys by range; the result does not depend
// on it. Thread-compatible (no shared state).
void IndexerScore(const LayerView& view, int n, const uint8_t* q_codes,
                  const float* q_scales, const float* weights, int heads,
                  int dim, float* scores, CorePool* pool = nullptr);
// IndexerScore for `nq` queries at once, as a prefill segment scans
// (RunIndexer): query i (codes at q_codes + i * heads * dim, its scales and
// weights at + i * heads) scores keys [0, limit[i]) into out[i]; each key
// block is decoded once for every query whose prefix holds it. Every score
// has the same bits as IndexerScore gives the query alone.
void IndexerScoreQueries(const LayerView& view, int nq, const uint8_t* q_codes,
                         const float* q_scales, const float* weights, int heads,
                         int dim, const int* limit, float* const* out,
                         CorePool* pool = nullptr);
// Whether IndexerScore runs on the matrix tile unit (decided once per
// process; false while ForceIndexerVectorPath holds).
bool IndexerUsesTileUnit();
// How the vector path (no tile unit) forms the dots above: vdpbf16ps on bf16
// code pairs, or fp32 FMAs on codes widened to fp32, odd dim then even. Both
// give the same bits: the products of fp8 values are exact in fp32 and
// every nonzero partial sum is a multiple of 2^-18, so neither
// vdpbf16ps's flushing of denormals nor anything else can tell them apart.
// Which is faster depends on the core (vdpbf16ps issues at the FMA's rate
// on some, at a quarter of it on others), so the process measures both
// once, on first use, and takes the faster (IndexerDotsChoice).
enum class IndexerDots { kBf16Pairs, kFp32Fma };
IndexerDots IndexerVectorDots();
// The measurement behind IndexerVectorDots(): vdpbf16ps's and the FMA's
// instruction rates on this core (per second, one thread, 24 independent
// accumulators); kFp32Fma when the FMA issues more than 2.4 times as fast
// (it needs two instructions where vdpbf16ps needs one, plus the widening).
struct IndexerDotsChoice {
  double bf16_per_s = 0;
  double fma_per_s = 0;
  IndexerDots dots = IndexerDots::kBf16Pairs;
};
const IndexerDotsChoice& IndexerDotsMeasured();
// How the scan widens the fp8 codes of a whole key block whose dim is a
// multiple of 32 to bf16: by bit moves (two GF(2) affine maps and a byte
// add; the 64 codes of a register that hold a zero, subnormal or NaN code
// take the byte tables) or by byte table lookups (vpermi2b) alone. Same
// bits; which is faster depends on the core (the tables are quicker where
// byte permutes are cheap), so the process times both once, on first use,
// over one block of 32 keys x 128 dims in L1, and takes the tables when
// they are at least 5% faster.
enum class CodeWidening { kBitMoves, kByteTables };
struct CodeWideningChoice {
  double bit_moves_ns = 0;  // one block, best of three
  double byte_tables_ns = 0;
  CodeWidening widening = CodeWidening::kBitMoves;
};
const CodeWideningChoice& CodeWideningMeasured();
// What the indexer's scan and MLA's Attend run on in this process, in
// words, for a daemon's start-up log: e.g. "indexer on the vector unit with
// fp32 FMAs (they issue 4.0x as fast as vdpbf16ps here); fp8 codes widened
// by bit moves (...); attend on the vector unit".
std::string KernelUnitsDescription();
// Tests and benchmarks: makes the indexer run its vector path with `dots`
// even where the tile unit is granted; ResetIndexerPath() returns to the
// process's own choice. Takes effect for calls that start afterwards.
void ForceIndexerVectorPath(IndexerDots dots);
void ResetIndexerPath();
// Tests and benchmarks: makes the scan widen codes the given way;
// ResetCodeWidening() returns to the process's own choice.
void ForceCodeWidening(CodeWidening widening);
void ResetCodeWidening();
// Positions of the min(k, n) highest scores, ties to the lower position,
// -0.0 == +0.0; returned in increasing position order.
// `pool` (may be null) lends cores to the pass over all n scores where n is
// large (kParallelSelect); the result does not depend on it.
void SelectTopK(const float* scores, int n, int k, std::vector<int32_t>* out,
                CorePool* pool = nullptr);
// exp as the attention kernels compute it, a fixed function (vectorised
// lane for lane): NaN stays NaN; x < -104 gives 0; else, with x' = min(x,
// 88), n = nearbyint(x' * log2(e)), r = x' - n ln2 (two fmas, ln2 split
// hi/lo), p = Horner of the 6 Cephes expf coefficients in r (fma), y =
// fma(p, r * r, r) + 1, result ldexp(y, n). Within a few ulp of exp.
float KernelExp(float x);
// Absorbed MLA over the positions `sel` (increasing). The selection is cut
// into chunks of kMlaAttendChunk entries (the last may be shorter); per
// chunk c and head h:
//   dot = fma(q[d], e[d], dot) over increasing d, s = dot * scale;
//   m_c = max s over the chunk; p[j] = KernelExp(s[j] - m_c);
//   z_c = 16 partial sums (entry j of the chunk into lane j % 16, in
//   order) combined by lanes (l + l+8), (l + l+4), (l + l+2), (l + l+1);
//   o_c[d] = fma(p[j], e_j[d], o_c[d]) over the chunk's entries in order.
// Then, chunks in increasing order: M = max m_c, w_c = KernelExp(m_c - M),
// z = fma(w_c, z_c, z), a[d] = fma(w_c, o_c[d], a[d]) (from +0), and
// o[h][d] = a[d] * (1 / z). With one chunk w = 1 and o = o_c * (1 / z).
// That is the vector path. Where the kernel grants the matrix tile unit
// (AMX-BF16; MlaAttendUsesTileUnit()), each chunk's dot products and
// weighted sums run as TDPBF16PS instead, on fp32 operands split exactly
// into three bf16 parts (x = hi + mid + lo: hi = x with its low 16 bits
// cleared, mid = (x - hi) likewise, lo = x - hi - mid, each exact in
// bf16; the entries are bf16 already, so every product is exact in fp32):
//   S_part[h,j] = part(q[h]) . e_j over 32-dim steps in increasing order
//   (kv_dim padded with zeros), from 0; s = ((S_hi + S_mid) + S_lo) *
//   scale; m_c, p and z_c as above; O_part[h][d] = sum_j part(p[h][j])
//   e_j[d] over 32-entry steps in chunk order, from 0; o_c[h][d] =
//   (O_hi + O_mid) + O_lo; then the same merge. Within a TDPBF16PS the
//   accumulation order is the hardware's own (fixed for given inputs, no
//   simpler scalar model; denormal inputs read as zero), so this path
//   agrees with the vector path to fp32 rounding, not bit for bit.
// `unit`: kAuto takes the tile unit where it is granted and the call is
// large enough to repay its setup (MlaAttendTileWorthIt: at least 16 heads
// and heads x nsel >= kMlaAttendTileMinWork, e.g. 128 heads from 128
// entries; with dsa-tiny's 8 heads the three-part split fills the tiles
// poorly: 10-18% faster than the vector path on one core with the entries
// in cache, but 3-40% slower on two cores from DRAM, so it stays on the
// vector path), else the vector
// unit; the choice depends only on the shape and nsel, so every process on
// one machine makes the same one. kVector and kTileUnit force
// a path (kTileUnit falls back to the vector unit without a tile unit);
// tests use them to compare the two.
// `pool` (optional) splits the chunks, then the heads of the merge, over
// cores; the chunks are fixed, so the result does not depend on it.
constexpr int kMlaAttendChunk = 256;
constexpr double kMlaAttendTileMinWork = 16384;
constexpr int kMlaAttendTileMinHeads = 16;
inline bool MlaAttendTileWorthIt(int heads, int nsel) {
  return heads >= kMlaAttendTileMinHeads &&
         double(heads) * nsel >= kMlaAttendTileMinWork;
}
enum class AttendUnit { kAuto, kVector, kTileUnit };
void MlaAttend(const LayerView& view, const int32_t* sel, int nsel,
               const float* q, const AttnShapes& shapes, float* o_lat,
               CorePool* pool = nullptr, AttendUnit unit = AttendUnit::kAuto);
// Whether MlaAttend can run on the matrix tile unit (granted by the kernel;
// decided once per process).
bool MlaAttendUsesTileUnit();

}  // namespace karat
