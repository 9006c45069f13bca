// Gather + Attend (absorbed MLA, §III-D): the vector unit's chunk kernels
// (scores, softmax, weighted sums: AttendChunk), KernelExp, and MlaAttend,
// which splits the selection into chunks over the cores, runs them on the
// vector unit or the tile unit (attention_mla_tiles.cc) and merges them.

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

namespace {

float Bf16(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace
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
}  // namespace karat
