// karat-bench-kernels: the KARAT-side DSA kernels (Score, Select, Gather +
// Attend; §III-D) against this machine's limits, measured in the same run
// the way they are really reached:
//   * read bandwidth: both cores stream >= 1 GiB of huge pages
//     (MADV_HUGEPAGE) into several independent accumulators; one core
//     alone too. Each core's stream is capped by its misses in flight, so
//     the two-core figure is about twice one core's (more accumulators,
//     unrolling or software prefetch do not raise it);
//   * fp32 FMA and bf16 dot-product (vdpbf16ps) peaks: 24 independent
//     accumulators per thread, both cores; and, where the kernel grants it,
//     the matrix tile unit's (tdpbf16ps, 4 accumulator tiles per thread).
//     vdpbf16ps counts 64 FLOP per instruction; how fast it issues depends
//     on the core (the ratio to the FMA's is printed): on Sapphire Rapids a
//     quarter of the FMA's rate, so about half the fp32 FMA FLOP rate, and
//     the indexer uses the tile unit there where the kernel grants it; on
//     the AMD EPYC cores seen here, the FMA's rate: twice its FLOP rate.
//     Without the tile unit the indexer scores with vdpbf16ps or with fp32
//     FMAs, whichever the process measured faster (IndexerDotsMeasured,
//     printed; --indexer-dots forces one), and its rows are against that
//     instruction's peak. How whole key blocks' fp8 codes are widened (bit
//     moves or byte tables, CodeWideningMeasured) is printed too;
//     --widening forces one.
// Attend rows whose FLOPs alone, at the fp32 FMA peak, take more than twice
// the time to read their entries say so: the "<= 2x the read time" goal is
// out of reach for them. Where Attend runs on the tile unit (three bf16
// parts of each fp32 operand: three tile passes per fp32 product; only for
// large enough calls, see MlaAttend), its rows are against a third of the
// tile peak, and "attend-v" rows time the vector path on the same data for
// comparison.
// Then, per kernel and context length, tokens/s, GB/s, GFLOP/s and the
// percentage of the roofline bound min(BW x OI, peak), where peak is the
// rate of the arithmetic the kernel runs on (the tile unit or bf16 dot
// products for Score, fp32 FMA for Attend; Select against bandwidth).
// Shapes: the small models' indexer (8 heads x 32)
// and DeepSeek-V3.2's real one (64 heads x 128, fp8 keys), MLA entries of
// 128 + 16 (8 heads) and 512 + 64 (128 heads). KV and index keys live in the
// device page arena (huge pages), and every timed Score and Attend run
// follows a 1 GiB read sweep that evicts the caches, so they read from DRAM
// as a device would (Select reads the scores the scan just wrote, with the
// pool, as a device's decode step does: from 32K scores on its cores each
// compress their part); --warm
// times them with the caches as the previous run left them instead.
// Attend rows also give the time to merely read the same selected entries
// ("the gather alone": both cores, every line, prefetched ahead, cold like
// the attend): scattered entries of a few lines each read well below the
// streaming bandwidth the read-time ratio assumes; and the same attend
// repeated with its entries left in the caches ("warm", with its ratio to
// the read time): the arithmetic's share. After the sweep a cold attend
// comes near the sum of the two, but not because reading and arithmetic
// fail to overlap: MLA and GQA attend rows also give the call with only
// its entries evicted (clflushopt of their lines), and the gather alone
// timed that way, and there the attend comes near the larger of the two.
// The sweep leaves the address translations, page tables and scratch cold
// as well, which on this VM doubles the gather's own time; a device's
// decode loop keeps them warm.
// The read bandwidth has been seen to switch between ~52 and ~86 GB/s
// here, for seconds to minutes: each cold row keeps the fastest sweep of
// its own runs, and where that is under 90% of the limit, says so with its
// ratio against that bandwidth too. Whether Attend
// stays flat from 16K to 128K is judged on the same calls timed in
// alternation (each shape's summary line), not on the rows, which are
// timed one context after the other.
// Then every GQA form and method through its real code, for the next
// token after a prefill of each context (1K, 16K, 128K): its Score + Select
// (SparseAttention::Select) and the Gather + Attend all of them share
// (SparseAttention::Attend) over what it selected: gqa_block's block-mean
// scoring (mm-block: minimax-tiny, 8 q / 2 kv heads, Di 32, block 16),
// Quest's per-page min/max bound (ll-quest: llama-tiny-quest, 8 q / 2 kv x
// 64, page 16), MagicPIG's LSH tables (ll-magicpig: 8 bits x 32 tables, sink
// 4, local 64, random hyperplanes), ClusterKV's centroids (ll-clusterkv:
// clusters of 16, budget 128) and dense attention (ll-dense: llama-tiny,
// every position; no Select row). Each session's metadata is built as its
// prefill builds it (OnAppend, then OnPrefillEnd); where one build takes
// over a second the sessions share one copy (noted), and a context whose
// build would take over 30 s, judged from the previous context's as if it
// grew quadratically, is left out (noted; ClusterKV's k-means, quadratic
// in the prefill, takes ~10 s at 128K on two cores here). Builds get the
// pool, as a device's do.
// Each timed pass runs one Select (or one Attend) per session, eight
// sessions split over both cores, after a 1 GiB read sweep that evicts the
// caches, so metadata and entries come from DRAM. Every session has a KV
// cache of its own (copies of one: the same selections, in different
// memory), so no session reads entries another one's attend left in the
// caches. Attend rows also give the gather alone, as the MLA rows do: every
// session's selected key and value rows read in the same passes with no
// arithmetic (scattered rows of 128 bytes read well below the streaming
// bandwidth); and the attend once more with only those rows evicted
// (clflushopt) instead of the sweep, as in a device's decode loop, where
// the kernel's code, scratch, the selections and the page tables stay
// cached while each session's entries come from DRAM (and the gather
// alone that way). A pass is timed from
// when both cores are on it to when the last is done, not from
// ParallelFor's call to its return: the pool's wake-ups around it (8 us at
// best, ~30 us typically here, more on a busy machine) are not the kernel's
// time, and a 128K gqa_block pass is only ~300 us a core (Quest's ~1.2 ms).
// Rows are per Select or Attend, amortised over the sessions. GB/s counts
// what the stage reads (KernelCost: block sums and any block counts read,
// per-page min + max, LSH codes, centroids; for Attend the selected keys
// and values) once; Select's %bound is against the read bandwidth, Attend's
// against min(BW x OI, fp32 FMA peak). At 1K a session's metadata is 16-64
// KB, so that row is bound by the first misses' latency rather than by
// bandwidth. Not a test: prints a table.
#include <immintrin.h>

// GCC 12 reports its own AVX-512 intrinsic headers (_mm512_undefined_*)
// as (maybe-)uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/attention.h"
#include "common/core_pool.h"
#include "common/kv_store.h"
#include "common/model_config.h"
#include "common/numeric.h"
#include "common/sparse_attention.h"

namespace karat {
namespace {

constexpr int kCores = 2;
// Runs of a measurement that needs no cache sweep (best of).
constexpr int kQuickReps = 100;

double Now() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Best time of `fn` over at most `reps` runs (at least 3, then until
// `budget` seconds have passed), each after `prepare` (not timed).
double BestAfter(int reps, double budget, const std::function<void()>& prepare,
                 const std::function<void()>& fn) {
  double best = 1e30;
  const double t_end = Now() + budget;
  for (int r = 0; r < reps; ++r) {
    prepare();
    const double t0 = Now();
    fn();
    best = std::min(best, Now() - t0);
    if (r >= 2 && Now() > t_end) break;
  }
  return best;
}

// BestAfter with nothing to prepare.
double BestOf(int reps, double budget, const std::function<void()>& fn) {
  return BestAfter(
      reps, budget, [] {}, fn);
}

// Evicts every cache line of [p, p + bytes) from every level (clflushopt;
// the caller fences).
void EvictLines(const void* p, size_t bytes) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(63);
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + bytes;
  for (uintptr_t l = first; l < end; l += 64) {
    _mm_clflushopt(reinterpret_cast<void*>(l));
  }
}

// --- Machine limits ---------------------------------------------------------

// Read bandwidth of `pool`'s cores together: each streams its half of
// 1 GiB of huge pages into 8 independent accumulators. Measured with one
// core too: here one core's misses in flight (line fill buffers), not the
// memory, cap its stream, so two cores reading in parallel get about twice
// one core's figure; neither more accumulators, wider unrolling nor
// software prefetch raise it (they were tried).
double MeasureReadBandwidth(CorePool* pool) {
  const size_t bytes = size_t(1) << 30;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return 0;
  madvise(p, bytes, MADV_HUGEPAGE);
  std::memset(p, 1, bytes);
  const __m512i* v = static_cast<const __m512i*>(p);
  const int64_t nvec = int64_t(bytes / 64);
  const int cores = pool->cores();
  std::vector<int64_t> sink(size_t(cores) * 8);
  const double t = BestOf(8, 3.0, [&] {
    pool->ParallelFor(nvec, 1024, [&](int64_t b, int64_t e) {
      __m512i a[8];
      for (auto& x : a) x = _mm512_setzero_si512();
      for (int64_t i = b; i + 8 <= e; i += 8) {
        for (int k = 0; k < 8; ++k) {
          a[k] = _mm512_add_epi64(a[k], _mm512_load_si512(v + i + k));
        }
      }
      for (int k = 1; k < 8; ++k) a[0] = _mm512_add_epi64(a[0], a[k]);
      sink[(b * cores / nvec) * 8] = _mm512_reduce_add_epi64(a[0]);
    });
  });
  munmap(p, bytes);
  return double(bytes) / t / 1e9;
}

template <bool kBf16>
double MeasurePeak(CorePool* pool) {
  constexpr int kAcc = 24;
  const int64_t iters = 4 << 20;
  std::vector<float> sink(kCores * 16);
  const double t = BestOf(20, 1.0, [&] {
    pool->ParallelFor(kCores, 1, [&](int64_t b, int64_t e) {
      for (int64_t w = b; w < e; ++w) {
        __m512 a[kAcc];
#pragma GCC unroll 32
        for (int k = 0; k < kAcc; ++k) a[k] = _mm512_set1_ps(float(k + w));
        const __m512 x = _mm512_set1_ps(1.0000001f);
        const __m512 y = _mm512_set1_ps(-1e-7f);
        for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 32
          for (int k = 0; k < kAcc; ++k) {
            if constexpr (kBf16) {
              a[k] = _mm512_dpbf16_ps(a[k], (__m512bh)x, (__m512bh)y);
            } else {
              a[k] = _mm512_fmadd_ps(a[k], x, y);
            }
          }
        }
#pragma GCC unroll 32
        for (int k = 1; k < kAcc; ++k) a[0] = _mm512_add_ps(a[0], a[k]);
        sink[w * 16] = _mm512_reduce_add_ps(a[0]);
      }
    });
  });
  const double flops_per_op = kBf16 ? 64.0 : 32.0;  // per 512-bit instruction
  return double(kCores) * iters * kAcc * flops_per_op / t / 1e9;
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
// Peak of the matrix tile unit (TDPBF16PS, 16 x 16 x 32 per instruction),
// four independent accumulator tiles per thread. Valid only after
// IndexerUsesTileUnit() has obtained the tile state from the kernel.
double MeasureTilePeak(CorePool* pool) {
  struct alignas(64) Config {
    uint8_t palette = 1, start = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  };
  const int64_t iters = 1 << 18;
  alignas(64) static uint16_t a[16 * 32], b[16 * 32];
  for (int i = 0; i < 16 * 32; ++i) a[i] = b[i] = 0x3F80;
  const double t = BestOf(20, 1.0, [&] {
    // Static: ldtilecfg's intrinsic does not tell the compiler that it
    // reads the whole block, so stores to a local one may be dropped.
    static const Config config = [] {
      Config c;
      for (int i = 0; i < 8; ++i) {
        c.colsb[i] = 64;
        c.rows[i] = 16;
      }
      return c;
    }();
    pool->ParallelFor(kCores, 1, [&](int64_t, int64_t) {
      _tile_loadconfig(&config);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      _tile_loadd(4, a, 64);
      _tile_loadd(5, b, 64);
      for (int64_t i = 0; i < iters; ++i) {
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 5);
        _tile_dpbf16ps(2, 4, 5);
        _tile_dpbf16ps(3, 4, 5);
      }
      _tile_release();
    });
  });
  return double(kCores) * iters * 4 * (16.0 * 16 * 32 * 2) / t / 1e9;
}
#endif

// --- Stores -----------------------------------------------------------------

struct Shape {
  const char* name;
  int index_heads, index_dim;
  int heads, kv_lora, rope;
};

struct Store {
  KvLayout layout;
  std::unique_ptr<PageArena> arena;
  std::unique_ptr<SessionCache> cache;
  AttnShapes shapes;
};

uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
float Gauss(uint64_t* s) {  // cheap, deterministic, roughly normal
  float acc = 0;
  for (int i = 0; i < 4; ++i) {
    *s = Mix(*s);
    acc += float(*s >> 40) / float(1 << 24) - 0.5f;
  }
  return acc * 1.7f;
}

std::unique_ptr<Store> MakeStore(const Shape& sh, int tokens) {
  auto st = std::make_unique<Store>();
  ModelConfig c;
  c.num_hidden_layers = 1;
  c.attention.type = AttentionType::kMlaDsa;
  c.kv_lora_rank = sh.kv_lora;
  c.qk_rope_head_dim = sh.rope;
  c.index_head_dim = sh.index_dim;
  st->layout = MakeKvLayout(c, 64);
  const size_t pages = st->layout.PagesFor(tokens) + 1;
  st->arena =
      *PageArena::Create(pages * st->layout.page_bytes, st->layout.page_bytes);
  st->cache = std::make_unique<SessionCache>(&st->layout, st->arena.get());
  if (!st->cache->Reserve(tokens).ok()) return nullptr;
  AttnShapes& a = st->shapes;
  a.heads = sh.heads;
  a.kv_lora = sh.kv_lora;
  a.rope = sh.rope;
  a.kv_dim = a.q_dim = sh.kv_lora + sh.rope;
  a.out_dim = sh.kv_lora;
  a.index_heads = sh.index_heads;
  a.index_dim = sh.index_dim;
  a.index_topk = 2048;
  a.softmax_scale = 1.0f / std::sqrt(192.0f);
  uint64_t seed = 12345;
  std::vector<float> x(std::max(sh.index_dim, a.kv_dim));
  std::vector<uint8_t> codes(sh.index_dim);
  std::vector<uint16_t> kv(a.kv_dim);
  for (int t = 0; t < tokens; ++t) {
    for (int d = 0; d < sh.index_dim; ++d) x[d] = Gauss(&seed);
    const float s = QuantizeFp8(x.data(), sh.index_dim, codes.data());
    (void)st->cache->WriteIndexKey(0, t, codes.data(), s);
    for (int d = 0; d < a.kv_dim; ++d) x[d] = Gauss(&seed);
    FloatToBf16(x.data(), a.kv_dim, kv.data());
    (void)st->cache->WriteKv(0, t, kv.data());
  }
  st->cache->SetLength(0, tokens);
  return st;
}

struct Query {
  std::vector<uint8_t> codes;
  std::vector<float> scales, weights, q;
};
Query MakeQuery(const AttnShapes& a) {
  Query q;
  uint64_t seed = 777;
  q.codes.resize(size_t(a.index_heads) * a.index_dim);
  q.scales.resize(a.index_heads);
  q.weights.resize(a.index_heads);
  std::vector<float> x(a.index_dim);
  for (int h = 0; h < a.index_heads; ++h) {
    for (auto& v : x) v = Gauss(&seed);
    q.scales[h] =
        QuantizeFp8(x.data(), a.index_dim, &q.codes[size_t(h) * a.index_dim]);
    q.weights[h] = Gauss(&seed) / std::sqrt(float(a.index_heads));
  }
  q.q.resize(size_t(a.heads) * a.q_dim);
  for (auto& v : q.q) v = Gauss(&seed);
  return q;
}

struct Limits {
  double bw_gbps = 0, fp32_gflops = 0, bf16_gflops = 0, tile_gflops = 0;
  double bw_one_core_gbps = 0;
};

// Every limit, measured now.
Limits MeasureLimits(CorePool* pool, CorePool* one_core, bool tiles) {
  Limits l;
  l.bw_gbps = MeasureReadBandwidth(pool);
  l.bw_one_core_gbps = MeasureReadBandwidth(one_core);
  l.fp32_gflops = MeasurePeak<false>(pool);
  l.bf16_gflops = MeasurePeak<true>(pool);
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  if (tiles) l.tile_gflops = MeasureTilePeak(pool);
#endif
  return l;
}

enum class Kind { kScore, kSelect, kAttend, kMeta, kGqaAttend };

// One measured kernel run; printed against the limits at the end.
struct Row {
  Kind kind;
  const char* shape;
  int ctx;
  double seconds, tokens, bytes, flops;
  int topk;
  double scan_seconds;        // kSelect: the scan it selects from
  bool vector_path = false;   // kAttend: forced onto the vector unit
  bool on_tiles = false;      // kAttend: ran on the tile unit
  double gather_seconds = 0;  // kAttend: reading the same entries alone
  double warm_seconds = 0;    // kAttend: the same call, entries cached
  // Attend: the same call (kGqaAttend: passes) with only the selected
  // entries evicted (code, scratch, selections, page tables and address
  // translations left cached), and the gather alone that way.
  double entries_cold_seconds = 0;
  double entries_cold_gather_seconds = 0;
  // The fastest cache-evicting sweep among the row's own timed runs (0
  // with --warm): the bandwidth the machine gave while the row was timed.
  // It switches between two levels here, and the limits are the faster.
  double run_bw_gbps = 0;
};

// What the indexer's scan runs on: the tile unit, or the vector path in
// one of its two forms (IndexerDots).
enum class ScoreOn { kTiles, kBf16, kFma };

void PrintRow(const Row& r, const Limits& lim, ScoreOn score_on) {
  const double gbps = r.bytes / r.seconds / 1e9;
  char note[640];
  // Against the bandwidth of the row's own runs' sweeps, where they were
  // slower than the limit: the same ratio as the machine stood meanwhile.
  // Not where the row itself read faster than those sweeps: the bandwidth
  // switched between a sweep and the run it preceded, and neither level
  // is the row's.
  const bool slow_spell = r.run_bw_gbps > 0 &&
                          r.run_bw_gbps < 0.9 * lim.bw_gbps &&
                          gbps <= r.run_bw_gbps;
  if (r.kind == Kind::kSelect) {  // against bandwidth alone
    std::snprintf(note, sizeof note, "top-%d, %.2f%% of the scan", r.topk,
                  100.0 * r.seconds / r.scan_seconds);
    std::printf("%-8s %-10s %7d %10.1f %12.3e %8.1f %9s %8.1f %6.1f%%  %s\n",
                "select", r.shape, r.ctx, r.seconds * 1e6, r.tokens / r.seconds,
                gbps, "-", lim.bw_gbps, 100.0 * gbps / lim.bw_gbps, note);
    return;
  }
  const double gflops = r.flops / r.seconds / 1e9;
  if (r.kind == Kind::kGqaAttend) {  // the GQA forms' shared Attend
    const double bound =
        std::min(lim.bw_gbps * r.flops / r.bytes, lim.fp32_gflops);
    const double read_s = r.bytes / (lim.bw_gbps * 1e9);
    std::snprintf(
        note, sizeof note,
        "%d positions a head (mean), from DRAM, per token; %.2fx "
        "the read time; %.2fx the gather alone (%.1f us, %.2fx the "
        "read time); entries alone evicted %.1f us (%.2fx; %.2fx "
        "its gather alone, %.1f us; %.2fx the larger of that and "
        "the FLOPs at peak)",
        r.topk, r.seconds / read_s, r.seconds / r.gather_seconds,
        r.gather_seconds * 1e6, r.gather_seconds / read_s,
        r.entries_cold_seconds * 1e6, r.entries_cold_seconds / read_s,
        r.entries_cold_seconds / r.entries_cold_gather_seconds,
        r.entries_cold_gather_seconds * 1e6,
        r.entries_cold_seconds / std::max(r.entries_cold_gather_seconds,
                                          r.flops / (lim.fp32_gflops * 1e9)));
    if (slow_spell) {
      const size_t m = std::strlen(note);
      std::snprintf(note + m, sizeof note - m,
                    "; its passes' sweeps read %.1f GB/s: %.2fx that read time",
                    r.run_bw_gbps,
                    r.seconds / (r.bytes / (r.run_bw_gbps * 1e9)));
    }
    std::printf("%-8s %-10s %7d %10.1f %12.3e %8.1f %9.1f %8.1f %6.1f%%  %s\n",
                "attend", r.shape, r.ctx, r.seconds * 1e6, r.tokens / r.seconds,
                gbps, gflops, bound, 100.0 * gflops / bound, note);
    return;
  }
  if (r.kind == Kind::kMeta) {  // low intensity: against bandwidth x OI
    const double bound = lim.bw_gbps * r.flops / r.bytes;
    int m = std::snprintf(note, sizeof note, "metadata from DRAM, per Select");
    if (slow_spell && m > 0) {
      std::snprintf(note + m, sizeof note - m,
                    "; its passes' sweeps read %.1f GB/s: %.1f%% of that",
                    r.run_bw_gbps, 100.0 * gbps / r.run_bw_gbps);
    }
    std::printf("%-8s %-10s %7d %10.1f %12.3e %8.1f %9.1f %8.1f %6.1f%%  %s\n",
                "scoresel", r.shape, r.ctx, r.seconds * 1e6,
                r.tokens / r.seconds, gbps, gflops, bound,
                100.0 * gflops / bound, note);
    return;
  }
  const double oi = r.flops / r.bytes;
  double peak;
  if (r.kind == Kind::kScore) {
    // The indexer runs on the tile unit where the kernel grants it, else on
    // the vector unit's bf16 dot products or fp32 FMAs: the roofline uses
    // that peak.
    peak = score_on == ScoreOn::kTiles  ? lim.tile_gflops
           : score_on == ScoreOn::kBf16 ? lim.bf16_gflops
                                        : lim.fp32_gflops;
    const int m = std::snprintf(note, sizeof note, "%.2fx fp32 FMA peak",
                                gflops / lim.fp32_gflops);
    const double run_bound = std::min(r.run_bw_gbps * oi, peak);
    if (slow_spell && m > 0 && run_bound < std::min(lim.bw_gbps * oi, peak)) {
      std::snprintf(note + m, sizeof note - m,
                    "; its runs' sweeps read %.1f GB/s: %.1f%% of that bound",
                    r.run_bw_gbps, 100.0 * gflops / run_bound);
    }
  } else {
    // The tile unit does each fp32 product as three bf16 passes.
    peak = r.on_tiles ? std::max(lim.fp32_gflops, lim.tile_gflops / 3.0)
                      : lim.fp32_gflops;
    // Goal: <= 2x the time to read the entries. Where the FLOPs alone, at
    // that peak, take longer than that, it is out of reach.
    const double read_s = r.bytes / (lim.bw_gbps * 1e9);
    const double compute_s = r.flops / (peak * 1e9);
    const int n =
        std::snprintf(note, sizeof note, "%.2fx the read time of %.0f entries",
                      r.seconds / read_s, r.tokens);
    int m = n;
    if (compute_s > 2.0 * read_s && m > 0 && m < int(sizeof note)) {
      m += std::snprintf(note + m, sizeof note - m,
                         "; compute-bound: FLOPs at peak = %.2fx read time",
                         compute_s / read_s);
    }
    if (r.gather_seconds > 0 && m > 0 && m < int(sizeof note)) {
      m += std::snprintf(note + m, sizeof note - m,
                         "; %.2fx the gather alone (%.1f us)",
                         r.seconds / r.gather_seconds, r.gather_seconds * 1e6);
    }
    if (r.entries_cold_seconds > 0 && m > 0 && m < int(sizeof note)) {
      m += std::snprintf(
          note + m, sizeof note - m,
          "; entries alone evicted %.1f us (%.2fx; %.2fx its "
          "gather alone, %.1f us; %.2fx the larger of that and "
          "the FLOPs at peak)",
          r.entries_cold_seconds * 1e6, r.entries_cold_seconds / read_s,
          r.entries_cold_seconds / r.entries_cold_gather_seconds,
          r.entries_cold_gather_seconds * 1e6,
          r.entries_cold_seconds /
              std::max(r.entries_cold_gather_seconds, compute_s));
    }
    if (r.warm_seconds > 0 && m > 0 && m < int(sizeof note)) {
      m += std::snprintf(note + m, sizeof note - m, "; warm %.1f us (%.2fx)",
                         r.warm_seconds * 1e6, r.warm_seconds / read_s);
    }
    if (slow_spell && m > 0 && m < int(sizeof note)) {
      std::snprintf(note + m, sizeof note - m,
                    "; its runs' sweeps read %.1f GB/s: %.2fx that read time",
                    r.run_bw_gbps,
                    r.seconds / (r.bytes / (r.run_bw_gbps * 1e9)));
    }
  }
  const double bound = std::min(lim.bw_gbps * oi, peak);
  std::printf("%-8s %-10s %7d %10.1f %12.3e %8.1f %9.1f %8.1f %6.1f%%  %s\n",
              r.kind == Kind::kScore ? "score"
              : r.vector_path        ? "attend-v"
                                     : "attend",
              r.shape, r.ctx, r.seconds * 1e6, r.tokens / r.seconds, gbps,
              gflops, bound, 100.0 * gflops / bound, note);
}

// --- GQA scoring metadata (gqa_block, quest) --------------------------------

// 1 GiB read by both cores: evicts the caches before a timed pass.
class CacheFlusher {
 public:
  CacheFlusher() {
    p_ = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE,
              MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p_ == MAP_FAILED) {
      p_ = nullptr;
      return;
    }
    madvise(p_, kBytes, MADV_HUGEPAGE);
    std::memset(p_, 1, kBytes);
  }
  ~CacheFlusher() {
    if (p_ != nullptr) munmap(p_, kBytes);
  }
  void Flush(CorePool* pool) {
    if (p_ == nullptr) return;
    const __m512i* v = static_cast<const __m512i*>(p_);
    const int64_t nvec = int64_t(kBytes / 64);
    const double t0 = Now();
    pool->ParallelFor(nvec, 1024, [&](int64_t b, int64_t e) {
      __m512i a = _mm512_setzero_si512();
      for (int64_t i = b; i < e; ++i) {
        a = _mm512_add_epi64(a, _mm512_load_si512(v + i));
      }
      sink_ += _mm512_reduce_add_epi64(a) & 1;
    });
    const double gbps = double(kBytes) / (Now() - t0) / 1e9;
    best_gbps_ = std::max(best_gbps_, gbps);
    window_gbps_ = std::max(window_gbps_, gbps);
  }
  // The fastest sweep since StartWindow(): the bandwidth the machine gave
  // while one row's runs were timed (0 if none flushed).
  void StartWindow() { window_gbps_ = 0; }
  double window_gbps() const { return window_gbps_; }
  // The fastest sweep so far, in GB/s: each is a read of 1 GiB of huge
  // pages by every core, so the machine's read bandwidth is at least this.
  double best_gbps() const { return best_gbps_; }

 private:
  static constexpr size_t kBytes = size_t(1) << 30;
  void* p_ = nullptr;
  std::atomic<int64_t> sink_{0};
  double best_gbps_ = 0;
  double window_gbps_ = 0;
};

// Best time of `fn` over at most `reps` runs (at least 3, then until
// `budget` seconds have passed), each after evicting the caches: the
// kernels' data comes from DRAM, as a device's would, not from a cache
// that the previous run warmed.
double BestOfCold(int reps, double budget, CacheFlusher* flusher,
                  CorePool* pool, const std::function<void()>& fn) {
  return BestAfter(
      reps, budget,
      [&] {
        if (flusher != nullptr) flusher->Flush(pool);
      },
      fn);
}

// Reads the `n` rows of `bytes` bytes at `rows` on the calling thread,
// every line, 16 rows prefetched ahead, doing nothing with them.
void ReadRows(const uint8_t* const* rows, int n, size_t bytes) {
  __m512i acc = _mm512_setzero_si512();
  for (int j = 0; j < n; ++j) {
    if (j + 16 < n) {
      for (size_t off = 0; off < bytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rows[j + 16]) + off,
                     _MM_HINT_T0);
    }
    for (size_t off = 0; off < bytes; off += 64)
      acc = _mm512_add_epi64(acc, _mm512_loadu_si512(rows[j] + off));
  }
  // The sum is used, as far as the compiler knows: the loads stay.
  const int64_t sum = _mm512_reduce_add_epi64(acc);
  asm volatile("" : : "r"(sum));
}

// Reads the `n` entries of `bytes` bytes at `entries` on every core (each
// its share, as ReadRows does): what the scattered access of an attend
// costs before any arithmetic.
void GatherEntries(const uint8_t* const* entries, int n, size_t bytes,
                   CorePool* pool) {
  pool->ParallelFor(kCores, 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      const int lo = int(int64_t(n) * c / kCores);
      const int hi = int(int64_t(n) * (c + 1) / kCores);
      ReadRows(entries + lo, hi - lo, bytes);
    }
  });
}

// Times method `preset`'s Select at each context (kMeta rows; none where it
// scores nothing, as dense) and the shared Gather + Attend over the
// selection it made (kGqaAttend rows). Each context gets its own metadata,
// built as a session's prefill of `ctx` tokens builds it (OnAppend, then
// OnPrefillEnd), and the query is the next token's (position ctx). Where one
// build takes longer than kShareBuildSeconds, the sessions share one copy; a
// context whose build would take longer than kMaxBuildSeconds, judged from the
// previous one and growing up to quadratically (ClusterKV's k-means), is left
// out with a note in `notes`.
bool BenchGqaMethod(const char* preset, const char* label, const int* contexts,
                    int ncontexts, CorePool* pool, CacheFlusher* flusher,
                    std::vector<Row>* rows, std::vector<std::string>* notes) {
  constexpr double kShareBuildSeconds = 1.0;
  constexpr double kMaxBuildSeconds = 30.0;
  auto config = PresetConfig(preset);
  if (!config.ok()) return false;
  ModelConfig c = *config;
  c.num_hidden_layers = 1;
  const int tokens = contexts[ncontexts - 1] + 1;
  const AttnShapes a = MakeAttnShapes(c);
  uint64_t seed = 4242;
  MethodWeights weights;
  if (c.attention.method == AttentionMethod::kMagicPig) {
    weights.lsh_hyperplanes.resize(size_t(c.attention.lsh_bits) *
                                   c.attention.lsh_tables * c.head_dim);
    for (float& v : weights.lsh_hyperplanes) v = Gauss(&seed);
  }
  auto method = NewSparseAttention(c, weights);
  if (!method.ok()) return false;
  // Every session has a cache of its own, a copy of the first: the same
  // selections, each from memory of its own, so that no session's Attend
  // finds its entries in the caches because another read them (a shared
  // cache made 7 of the 8 attends of a pass warm).
  constexpr int kSessions = 8;
  const KvLayout layout = MakeKvLayout(c, 64);
  const size_t pages = layout.PagesFor(tokens) + 1;
  auto arena = PageArena::Create(kSessions * pages * layout.page_bytes,
                                 layout.page_bytes);
  if (!arena.ok()) return false;
  std::vector<std::unique_ptr<SessionCache>> caches;
  for (int s = 0; s < kSessions; ++s) {
    caches.push_back(std::make_unique<SessionCache>(&layout, arena->get()));
    if (!caches.back()->Reserve(tokens).ok()) return false;
  }
  std::vector<float> x(a.kv_dim);
  std::vector<uint16_t> kv(a.kv_dim);
  for (int t = 0; t < tokens; ++t) {
    for (auto& v : x) v = Gauss(&seed);
    FloatToBf16(x.data(), a.kv_dim, kv.data());
    for (auto& cache : caches) {
      if (!cache->WriteKv(0, t, kv.data()).ok()) return false;
    }
  }
  for (auto& cache : caches) cache->SetLength(0, tokens);
  std::vector<float> q(size_t(a.heads) * a.q_dim);
  for (auto& v : q) v = Gauss(&seed);
  std::vector<std::vector<HeadSelection>> heads(kSessions);
  std::vector<std::vector<float>> outs(
      kSessions, std::vector<float>(size_t(a.heads) * a.head_dim));
  // ParallelFor's ranges of the sessions (CorePool::ParallelFor's split).
  const int64_t chunk = (kSessions + pool->cores() - 1) / pool->cores();
  const int ranges = int((kSessions + chunk - 1) / chunk);
  // Best time of a pass running op(s) for every session, after a flush
  // (the 1 GiB sweep; or, with `evict`, only the lines of those rows).
  auto best_pass = [&](const std::function<void(int)>& op,
                       const std::vector<std::vector<const uint8_t*>>* evict =
                           nullptr) {
    double best = 1e30;
    const double t_end = Now() + 3.0;
    // A pass is a few milliseconds after a flush of tens: up to 60 passes
    // in the 3 s, so that a burst of other load on this shared machine
    // rarely spoils every one of them.
    for (int r = 0; r < 60; ++r) {
      if (evict != nullptr) {
        for (const auto& rows : *evict) {
          for (const uint8_t* row : rows) {
            EvictLines(row, size_t(a.head_dim) * 2);
          }
        }
        _mm_mfence();
      } else {
        flusher->Flush(pool);
      }
      // A pass is timed from the moment every core is on it until the last
      // one is done, each core's sessions back to back: not the wake-up of
      // a worker that fell asleep during the flush, nor the caller's when
      // it waits for the worker (a device runs these stages on its serving
      // thread, not through the pool).
      std::atomic<int> arrived{0};
      std::vector<double> start(ranges), end(ranges);
      pool->ParallelFor(kSessions, 1, [&](int64_t b, int64_t e) {
        const int64_t range = b / chunk;
        arrived.fetch_add(1);
        while (arrived.load() < ranges) _mm_pause();
        start[range] = Now();
        for (int64_t s = b; s < e; ++s) op(int(s));
        end[range] = Now();
      });
      best = std::min(best, *std::max_element(end.begin(), end.end()) -
                                *std::min_element(start.begin(), start.end()));
      if (r >= 4 && Now() > t_end) break;
    }
    return best;
  };
  double last_build = 0;
  int last_ctx = 0;
  for (int ci = 0; ci < ncontexts; ++ci) {
    const int ctx = contexts[ci];
    if (last_ctx > 0) {
      const double grow = double(ctx) / last_ctx;
      const double projected = last_build * grow * grow;
      if (projected > kMaxBuildSeconds) {
        notes->push_back(absl::StrFormat(
            "%s: left out from %d tokens on: building its metadata took %.1f "
            "s at %d tokens and grows up to quadratically (up to %.0f s)",
            label, ctx, last_build, last_ctx, projected));
        break;
      }
    }
    // The metadata of a prefill of ctx tokens.
    std::vector<std::unique_ptr<MethodLayerState>> states;
    const double t0 = Now();
    for (int s = 0; s < kSessions; ++s) {
      LayerView built = caches[s]->View(0);
      built.length = ctx;
      states.push_back((*method)->NewLayerState());
      KernelCost build;
      (*method)->OnAppend(built, 0, ctx, states.back().get(), &build);
      (*method)->OnPrefillEnd(built, states.back().get(), &build, pool);
      if (s == 0) {
        last_build = Now() - t0;
        last_ctx = ctx;
        if (last_build > kShareBuildSeconds) break;
      }
    }
    const bool shared = states.size() == 1;
    if (shared && ci + 1 == ncontexts) {
      notes->push_back(absl::StrFormat(
          "%s: from %d tokens on the sessions share one copy of the "
          "metadata (building it took %.1f s)",
          label, ctx, last_build));
    }
    auto state = [&](int s) { return states[shared ? 0 : s].get(); };
    // The next token's query (its entry stored, as a decode step has it).
    auto view = [&](int s) {
      LayerView v = caches[s]->View(0);
      v.length = ctx + 1;
      return v;
    };
    KernelCost cost;  // what one Select reads and computes
    (*method)->Select(view(0), ctx, q.data(), state(0), &heads[0], &cost,
                      nullptr);
    flusher->StartWindow();
    const double select = best_pass([&](int s) {
      KernelCost unused;
      (*method)->Select(view(s), ctx, q.data(), state(s), &heads[s], &unused,
                        nullptr);
    });
    // Per Select, amortised over the sessions run on both cores; none where
    // the method scores nothing (dense: every position).
    if (cost.bytes > 0) {
      rows->push_back({Kind::kMeta, label, ctx, select / kSessions, double(ctx),
                       cost.bytes, cost.flops, 0, 0});
      rows->back().run_bw_gbps = flusher->window_gbps();
    }
    KernelCost acost;  // what one Attend reads and computes
    (*method)->Attend(view(0), q.data(), heads[0], outs[0].data(), &acost);
    double selected = 0;
    for (const HeadSelection& h : heads[0]) selected += h.positions.size();
    flusher->StartWindow();
    const double t_attend = best_pass([&](int s) {
      KernelCost unused;
      (*method)->Attend(view(s), q.data(), heads[s], outs[s].data(), &unused);
    });
    rows->push_back({Kind::kGqaAttend, label, ctx, t_attend / kSessions,
                     double(ctx), acost.bytes, acost.flops,
                     int(selected / a.heads + 0.5), 0});
    rows->back().run_bw_gbps = flusher->window_gbps();
    // The gather alone: each session's selected key and value rows read
    // (every line, prefetched ahead) in the same passes, with no
    // arithmetic: what scattered rows of this size cost here.
    std::vector<std::vector<const uint8_t*>> rows_of(kSessions);
    const int group = a.heads / a.kv_heads;
    for (int s = 0; s < kSessions; ++s) {
      const LayerView v = view(s);
      for (int h = 0; h < a.heads; ++h) {
        const int g = h / group;
        // Heads of a group with the same positions read them once.
        if (h % group != 0 &&
            heads[s][h].positions == heads[s][h - 1].positions) {
          continue;
        }
        // The keys, then the values, as the attend reads them.
        for (const int part : {GqaEntry::KPart(a, g), GqaEntry::VPart(a, g)}) {
          for (int32_t pos : heads[s][h].positions) {
            rows_of[s].push_back(
                reinterpret_cast<const uint8_t*>(v.Part(pos, part)));
          }
        }
      }
    }
    rows->back().gather_seconds =
        best_pass([&](int s) {
          ReadRows(rows_of[s].data(), int(rows_of[s].size()),
                   size_t(a.head_dim) * 2);
        }) /
        kSessions;
    // The attend again with only its entries evicted: a device's decode
    // loop runs the same kernel over session after session, so its code,
    // scratch and page tables are warm, while each session's entries come
    // from DRAM. (The 1 GiB sweep above evicts all of them.)
    rows->back().entries_cold_seconds =
        best_pass(
            [&](int s) {
              KernelCost unused;
              (*method)->Attend(view(s), q.data(), heads[s], outs[s].data(),
                                &unused);
            },
            &rows_of) /
        kSessions;
    rows->back().entries_cold_gather_seconds =
        best_pass(
            [&](int s) {
              ReadRows(rows_of[s].data(), int(rows_of[s].size()),
                       size_t(a.head_dim) * 2);
            },
            &rows_of) /
        kSessions;
  }
  return true;
}

}  // namespace
}  // namespace karat

int main(int argc, char** argv) {
  using namespace karat;
  // --warm: time Score and Attend with the caches as the previous run left
  // them (earlier versions of this table), not cold.
  // --only NAME: just the rows of one shape (tiny, dsv32) or of the
  // metadata scoring (meta), for quicker comparisons while tuning a kernel.
  // --indexer-dots bf16|fma: the indexer's vector path in that form, even
  // where the tile unit is granted (to compare the forms on one core).
  // --widening bits|tables: the indexer widens whole key blocks' codes that
  // way (CodeWidening), whatever the process measured.
  bool warm = false;
  std::string only, dots, widening;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--warm") {
      warm = true;
    } else if (arg == "--indexer-dots" && i + 1 < argc &&
               (std::string(argv[i + 1]) == "bf16" ||
                std::string(argv[i + 1]) == "fma")) {
      dots = argv[++i];
    } else if (arg == "--widening" && i + 1 < argc &&
               (std::string(argv[i + 1]) == "bits" ||
                std::string(argv[i + 1]) == "tables")) {
      widening = argv[++i];
    } else if (arg == "--only" && i + 1 < argc &&
               (std::string(argv[i + 1]) == "tiny" ||
                std::string(argv[i + 1]) == "dsv32" ||
                std::string(argv[i + 1]) == "meta")) {
      only = argv[++i];
    } else {
      std::fprintf(stderr,
                   "usage: karat-bench-kernels [--warm] "
                   "[--only tiny|dsv32|meta] [--indexer-dots bf16|fma] "
                   "[--widening bits|tables]\n");
      return 2;
    }
  }
  CorePool pool(kCores);
  // Whether the kernel grants the tile unit, whatever --indexer-dots says.
  const bool tiles = IndexerUsesTileUnit();
  if (!dots.empty()) {
    ForceIndexerVectorPath(dots == "fma" ? IndexerDots::kFp32Fma
                                         : IndexerDots::kBf16Pairs);
  }
  const IndexerDotsChoice& measured = IndexerDotsMeasured();
  const ScoreOn score_on =
      IndexerUsesTileUnit() ? ScoreOn::kTiles
      : dots.empty() ? (measured.dots == IndexerDots::kFp32Fma ? ScoreOn::kFma
                                                               : ScoreOn::kBf16)
                     : (dots == "fma" ? ScoreOn::kFma : ScoreOn::kBf16);
  std::printf(
      "karat-bench-kernels: %d cores; the indexer scores on the %s%s; Attend "
      "runs on the %s\n",
      kCores,
      score_on == ScoreOn::kTiles  ? "tile unit (AMX)"
      : score_on == ScoreOn::kBf16 ? "vector unit with vdpbf16ps"
                                   : "vector unit with fp32 FMAs",
      dots.empty() ? "" : " (--indexer-dots)",
      MlaAttendUsesTileUnit() ? "tile unit (AMX, 3 bf16 parts)"
                              : "vector unit");
  std::printf(
      "  the process's own choice of the vector form, measured on one core: "
      "vdpbf16ps %.2f G/s, FMA %.2f G/s (%.2fx) -> %s\n",
      measured.bf16_per_s / 1e9, measured.fma_per_s / 1e9,
      measured.fma_per_s / measured.bf16_per_s,
      measured.dots == IndexerDots::kFp32Fma ? "fp32 FMAs" : "vdpbf16ps");
  if (!widening.empty()) {
    ForceCodeWidening(widening == "tables" ? CodeWidening::kByteTables
                                           : CodeWidening::kBitMoves);
  }
  const CodeWideningChoice& widen = CodeWideningMeasured();
  std::printf(
      "  and of the fp8 codes' widening, one block of 32 x 128 codes: bit "
      "moves %.0f ns, byte tables %.0f ns -> %s%s\n",
      widen.bit_moves_ns, widen.byte_tables_ns,
      widen.widening == CodeWidening::kByteTables ? "byte tables" : "bit moves",
      widening.empty()       ? ""
      : widening == "tables" ? "; byte tables forced (--widening)"
                             : "; bit moves forced (--widening)");
  // Limits before and after the kernels; the higher of each counts, so a
  // burst of other load during one measurement does not flatter the ratios.
  CorePool one_core(1);
  const Limits before = MeasureLimits(&pool, &one_core, tiles);

  const Shape shapes[] = {
      {"tiny", 8, 32, 8, 128, 16},
      {"dsv32", 64, 128, 128, 512, 64},
  };
  const int contexts[] = {1024, 16384, 131072};
  CacheFlusher flusher;
  CacheFlusher* const cold = warm ? nullptr : &flusher;
  std::printf("Score and Attend: %s\n",
              warm ? "--warm: caches as the previous run left them"
                   : "caches evicted before every timed run (data from DRAM)");
  std::vector<Row> rows;
  std::vector<std::string> summaries;
  for (const Shape& sh : shapes) {
    if (!only.empty() && only != sh.name) continue;
    auto st = MakeStore(sh, contexts[2]);
    if (st == nullptr) {
      std::printf("cannot allocate the %s store\n", sh.name);
      return 1;
    }
    const AttnShapes& a = st->shapes;
    const Query q = MakeQuery(a);
    const LayerView view = st->cache->View(0);
    std::vector<float> scores(contexts[2]);
    std::vector<double> fx, fy, attend_times;
    std::vector<std::vector<int32_t>> selections;  // per context
    double scan_128k = 0, select_128k = 0;
    for (const int ctx : contexts) {
      const int reps = ctx >= 131072 ? 10 : 40;
      // Score.
      flusher.StartWindow();
      const double ts = BestOfCold(reps, 2.0, cold, &pool, [&] {
        IndexerScore(view, ctx, q.codes.data(), q.scales.data(),
                     q.weights.data(), a.index_heads, a.index_dim,
                     scores.data(), &pool);
      });
      rows.push_back({Kind::kScore, sh.name, ctx, ts, double(ctx),
                      double(ctx) * (a.index_dim + 4),
                      2.0 * ctx * a.index_heads * a.index_dim, 0, 0});
      if (!warm) rows.back().run_bw_gbps = flusher.window_gbps();
      fx.push_back(ctx);
      fy.push_back(ts);
      // Select.
      std::vector<int32_t> sel;
      const double tsel = BestOf(reps, 1.0, [&] {
        SelectTopK(scores.data(), ctx, a.index_topk, &sel, &pool);
      });
      rows.push_back({Kind::kSelect, sh.name, ctx, tsel, double(ctx),
                      double(ctx) * 4, 0, a.index_topk, ts});
      if (ctx == contexts[2]) {
        scan_128k = ts;
        select_128k = tsel;
      }
      // Gather + Attend over the selection.
      std::vector<float> out(size_t(a.heads) * a.out_dim);
      flusher.StartWindow();
      const double tat = BestOfCold(reps, 2.0, cold, &pool, [&] {
        MlaAttend(view, sel.data(), int(sel.size()), q.q.data(), a, out.data(),
                  &pool);
      });
      rows.push_back(
          {Kind::kAttend, sh.name, ctx, tat, double(sel.size()),
           double(sel.size()) * a.kv_dim * 2,
           double(sel.size()) * a.heads * (2.0 * a.kv_dim + 2.0 * a.kv_lora), 0,
           0});
      if (!warm) rows.back().run_bw_gbps = flusher.window_gbps();
      rows.back().on_tiles = MlaAttendUsesTileUnit() &&
                             MlaAttendTileWorthIt(a.heads, int(sel.size()));
      std::vector<const uint8_t*> entries(sel.size());
      for (size_t j = 0; j < sel.size(); ++j)
        entries[j] = reinterpret_cast<const uint8_t*>(view.Kv(sel[j]));
      rows.back().gather_seconds = BestOfCold(reps, 2.0, cold, &pool, [&] {
        GatherEntries(entries.data(), int(entries.size()), size_t(a.kv_dim) * 2,
                      &pool);
      });
      // The same call with only its entries evicted (clflushopt of every
      // line they touch), as in a device's decode loop, where the kernel's
      // code, scratch, selection and page table stay cached. These runs
      // take tens of microseconds, not a 1 GiB sweep each: best of up to
      // kQuickReps (10 at 128K, as for the sweeps, left the best of a
      // noisy machine's runs 10-20% above its usual floor).
      if (!warm) {
        const size_t entry_bytes = size_t(a.kv_dim) * 2;
        auto evict = [&] {
          for (const uint8_t* e : entries) EvictLines(e, entry_bytes);
          _mm_mfence();
        };
        rows.back().entries_cold_seconds =
            BestAfter(kQuickReps, 2.0, evict, [&] {
              MlaAttend(view, sel.data(), int(sel.size()), q.q.data(), a,
                        out.data(), &pool);
            });
        rows.back().entries_cold_gather_seconds =
            BestAfter(kQuickReps, 2.0, evict, [&] {
              GatherEntries(entries.data(), int(entries.size()), entry_bytes,
                            &pool);
            });
      }
      // The same call repeated with its entries left in the caches: the
      // arithmetic's share of the cold time (not a goal).
      rows.back().warm_seconds = BestOf(kQuickReps, 1.0, [&] {
        MlaAttend(view, sel.data(), int(sel.size()), q.q.data(), a, out.data(),
                  &pool);
      });
      attend_times.push_back(tat);
      selections.push_back(sel);
      if (rows.back().on_tiles) {
        flusher.StartWindow();
        const double tv = BestOfCold(reps, 2.0, cold, &pool, [&] {
          MlaAttend(view, sel.data(), int(sel.size()), q.q.data(), a,
                    out.data(), &pool, AttendUnit::kVector);
        });
        rows.push_back(rows.back());
        rows.back().seconds = tv;
        rows.back().vector_path = true;
        rows.back().on_tiles = false;
        if (!warm) rows.back().run_bw_gbps = flusher.window_gbps();
        rows.back().warm_seconds = BestOf(reps, 1.0, [&] {
          MlaAttend(view, sel.data(), int(sel.size()), q.q.data(), a,
                    out.data(), &pool, AttendUnit::kVector);
        });
      }
    }
    // Score time against context: least-squares line and its fit.
    const double n = double(fx.size());
    double sx = 0, sy = 0, sxx = 0, sxy = 0;
    for (size_t i = 0; i < fx.size(); ++i) {
      sx += fx[i];
      sy += fy[i];
      sxx += fx[i] * fx[i];
      sxy += fx[i] * fy[i];
    }
    const double slope = (n * sxy - sx * sy) / (n * sxx - sx * sx);
    const double icpt = (sy - slope * sx) / n;
    double ss_res = 0, ss_tot = 0;
    for (size_t i = 0; i < fx.size(); ++i) {
      const double e = fy[i] - (icpt + slope * fx[i]);
      ss_res += e * e;
      ss_tot += (fy[i] - sy / n) * (fy[i] - sy / n);
    }
    // Attend flatness. The rows' attends are timed context after context,
    // seconds to minutes apart, so on a shared machine one may fall in a
    // slow period and the other not. Here the 16K..128K calls are timed in
    // alternation, cold, kFlatRounds each, and the best of each compared:
    // both see the same periods.
    constexpr int kFlatRounds = 12;
    std::vector<double> alternated(selections.size(), 1e30);
    std::vector<float> flat_out(size_t(a.heads) * a.out_dim);
    for (int r = 0; r < kFlatRounds; ++r) {
      for (size_t c = 1; c < selections.size(); ++c) {
        const std::vector<int32_t>& s = selections[c];
        alternated[c] =
            std::min(alternated[c], BestOfCold(1, 0.0, cold, &pool, [&] {
                       MlaAttend(view, s.data(), int(s.size()), q.q.data(), a,
                                 flat_out.data(), &pool);
                     }));
      }
    }
    const double amin =
        *std::min_element(alternated.begin() + 1, alternated.end());
    const double amax =
        *std::max_element(alternated.begin() + 1, alternated.end());
    const double rmin =
        *std::min_element(attend_times.begin() + 1, attend_times.end());
    const double rmax =
        *std::max_element(attend_times.begin() + 1, attend_times.end());
    char line[400];
    std::snprintf(
        line, sizeof line,
        "%s: score slope %.3f ns/token, intercept %.1f us, R^2 %.5f; attend "
        "at top-%d: max/min over 16K..128K %.2f timed alternately (%.1f / "
        "%.1f us; the rows': %.2f); select at 128K = %.2f%% of the scan",
        sh.name, slope * 1e9, icpt * 1e6, 1.0 - ss_res / ss_tot, a.index_topk,
        amax / amin, alternated[1] * 1e6, alternated.back() * 1e6, rmax / rmin,
        100.0 * select_128k / scan_128k);
    summaries.push_back(line);
  }

  if (only.empty() || only == "meta") {
    // Every GQA form and method: its Select, then the shared Attend over
    // what it selected (dense: every position).
    const struct {
      const char* preset;
      const char* label;
    } gqa[] = {{"minimax-tiny", "mm-block"},
               {"llama-tiny-quest", "ll-quest"},
               {"llama-tiny-magicpig", "ll-magicpig"},
               {"llama-tiny-clusterkv", "ll-clusterkv"},
               {"llama-tiny", "ll-dense"}};
    for (const auto& m : gqa) {
      if (!BenchGqaMethod(m.preset, m.label, contexts, 3, &pool, &flusher,
                          &rows, &summaries)) {
        std::printf("cannot set up %s (%s)\n", m.label, m.preset);
        return 1;
      }
    }
  }

  const Limits after = MeasureLimits(&pool, &one_core, tiles);
  Limits lim;
  // This machine's read bandwidth has been seen to switch between two
  // levels (~50 and ~85 GB/s on an AMD EPYC VM) within a run: the limit is
  // the best of the dedicated measurements and of every cache-evicting
  // sweep the run made in between, so that no row's bound comes from a
  // slow spell the row itself did not see.
  lim.bw_gbps = std::max({before.bw_gbps, after.bw_gbps, flusher.best_gbps()});
  lim.bw_one_core_gbps =
      std::max(before.bw_one_core_gbps, after.bw_one_core_gbps);
  lim.fp32_gflops = std::max(before.fp32_gflops, after.fp32_gflops);
  lim.bf16_gflops = std::max(before.bf16_gflops, after.bf16_gflops);
  lim.tile_gflops = std::max(before.tile_gflops, after.tile_gflops);
  std::printf(
      "limits (best of before/after): read %.1f GB/s (%d cores, 1 GiB, huge "
      "pages; before %.1f, after %.1f, best cache-evicting sweep %.1f; one "
      "core alone %.1f GB/s), fp32 FMA %.1f GFLOP/s, bf16 dot (vdpbf16ps) "
      "%.1f GFLOP/s, tile unit (tdpbf16ps) %.1f GFLOP/s\n",
      lim.bw_gbps, kCores, before.bw_gbps, after.bw_gbps, flusher.best_gbps(),
      lim.bw_one_core_gbps, lim.fp32_gflops, lim.bf16_gflops, lim.tile_gflops);
  // vdpbf16ps does 64 FLOP per 512-bit instruction against the FMA's 32;
  // its peak is only as high as its issue rate allows.
  const double bf16_vs_fma = lim.bf16_gflops / lim.fp32_gflops;
  std::printf(
      "  vdpbf16ps issues at %.2fx the FMA's instruction rate here (%.2fx its "
      "FLOP rate): %s\n\n",
      lim.bf16_gflops / 64.0 / (lim.fp32_gflops / 32.0), bf16_vs_fma,
      score_on == ScoreOn::kTiles ? "the indexer scores on the tile unit"
      : bf16_vs_fma >= 1.5
          ? "bf16 dot products outrun fp32 FMA on this core"
          : "the vector unit's bf16 dot products are no faster than fp32 FMA "
            "on this core");
  std::printf("%-8s %-10s %7s %10s %12s %8s %9s %8s %7s\n", "kernel", "shape",
              "context", "time_us", "tokens/s", "GB/s", "GFLOP/s", "bound",
              "%bound");
  for (size_t i = 0; i < rows.size(); ++i) {
    PrintRow(rows[i], lim, score_on);
    if (i + 1 == rows.size() || rows[i + 1].shape != rows[i].shape) {
      for (const auto& line : summaries) {
        if (line.rfind(rows[i].shape, 0) == 0)
          std::printf("%s\n", line.c_str());
      }
      std::printf("\n");
    }
  }
  return 0;
}
