#include "common/linear.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#include "common/kernel_cost.h"

// GCC 12 reports its own AVX-512 intrinsic headers (_mm512_undefined_*)
// as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace karat {
namespace {

constexpr int kPanel = 16;            // outputs per packed panel (one zmm)
constexpr int kSeg = kLinearSegment;  // reduction segment length

// Register tile: kMaxRows batch rows x kMaxVecs panels. 6 x 4 = 24 zmm
// accumulators, leaving room for the 4 weight vectors and a broadcast; each
// step loads 4 weight vectors and 6 scalars for 24 FMAs, well under the two
// loads per cycle the core sustains.
constexpr int kMaxRows = 6;
constexpr int kMaxVecs = 4;

// Row blocks from which a product widens bf16 weights once per panel group
// into an fp32 scratch instead of in the tiles. In the tiles the widening
// costs ~5-15% against fp32 weights at any batch (weights in cache; from
// memory the halved bytes pay it back); the scratch, which a whole group
// passes through L2 to fill, costs 25-45% at 2-3 row blocks, ~10% at 11 and
// ~0-5% at 43 (karat-bench-linear's batches 12-18, 64, 256).
constexpr int kWidenRowBlocks = 16;

// Below this many flops a product runs on the calling thread: waking the
// OpenMP team costs more than it saves.
constexpr double kParallelMinFlops = 1 << 19;

// Independent segments a tile runs side by side. A small tile (one batch row
// and few panels) has too few accumulators to cover the FMA latency on its
// own; running several segments of the same elements at once multiplies its
// independent chains without changing any chain (each segment still starts
// from zero and the segments are still summed in order).
constexpr int SegmentsInFlight(int rows, int vecs) {
  const int tile = rows * vecs;
  if (tile * 8 <= 16) return 8;
  if (tile * 4 <= 16) return 4;
  if (tile * 2 <= 16) return 2;
  return 1;
}

// Vector flavours the tiles are written against. Full panels use zmm (16
// outputs). A last panel holding at most 8 outputs is packed 8 wide and runs
// on ymm: the same per-lane arithmetic, half the weight bytes to load.
struct Zmm {
  using T = __m512;
  static constexpr int kLanes = 16;
  static T Zero() { return _mm512_setzero_ps(); }
  static T Load(const float* p) { return _mm512_load_ps(p); }
  // A bf16 pair row (see LinearWeight::PackedRow): the first input's
  // weights, widened to fp32 exactly, and the second's.
  static T Even(const uint32_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_load_si512(p), 16));
  }
  static T Odd(const uint32_t* p) {
    return _mm512_castsi512_ps(_mm512_and_si512(
        _mm512_load_si512(p), _mm512_set1_epi32(int(0xFFFF0000u))));
  }
  static T Set1(float v) { return _mm512_set1_ps(v); }
  static T Fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T Add(T a, T b) { return _mm512_add_ps(a, b); }
  static void Store(float* p, T v, int lanes) {
    if (lanes == kLanes) {
      _mm512_storeu_ps(p, v);
    } else {
      _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << lanes) - 1u), v);
    }
  }
};

struct Ymm {
  using T = __m256;
  static constexpr int kLanes = 8;
  static T Zero() { return _mm256_setzero_ps(); }
  static T Load(const float* p) { return _mm256_load_ps(p); }
  static T Even(const uint32_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_load_si256(reinterpret_cast<const __m256i*>(p)), 16));
  }
  static T Odd(const uint32_t* p) {
    return _mm256_castsi256_ps(
        _mm256_and_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(p)),
                         _mm256_set1_epi32(int(0xFFFF0000u))));
  }
  static T Set1(float v) { return _mm256_set1_ps(v); }
  static T Fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T Add(T a, T b) { return _mm256_add_ps(a, b); }
  static void Store(float* p, T v, int lanes) {
    if (lanes == kLanes) {
      _mm256_storeu_ps(p, v);
    } else {
      _mm256_mask_storeu_ps(p, static_cast<__mmask8>((1u << lanes) - 1u), v);
    }
  }
};

// Runs SP consecutive segments (first one at input index k0) of the tile
// over `len` steps each, one FMA chain per (segment, row, output lane).
// Panel rows are V::kLanes elements apart; panels are `ps` elements apart.
// W is the packed element: float (one input index per row) or uint32_t
// (bf16 pairs: two input indices per row, k0 even).
template <class V, int MR, int NV, int SP, class W>
__attribute__((always_inline)) inline void RunChains(
    const float* x, int64_t xs, const W* w, int64_t ps, int k0, int len,
    typename V::T (&acc)[SP][MR][NV]) {
  using T = typename V::T;
#pragma GCC unroll 8
  for (int s = 0; s < SP; ++s)
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[s][r][v] = V::Zero();
  // One input step: acc += wv * x[t] for every (segment, row, panel).
  auto step = [&](const float* xt, const T(&wv)[SP][NV]) {
#pragma GCC unroll 8
    for (int s = 0; s < SP; ++s) {
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const T xb = V::Set1(xt[r * xs + s * kSeg]);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v)
          acc[s][r][v] = V::Fma(wv[s][v], xb, acc[s][r][v]);
      }
    }
  };
  // Walking pointers with segment offsets as constants keep the address
  // arithmetic in displacements, so the loop needs one register per row and
  // per panel rather than one per (segment, row) and (segment, panel).
  const float* xt = x + k0;
  if constexpr (std::is_same_v<W, float>) {
    const float* wt = w + static_cast<int64_t>(k0) * V::kLanes;
    for (int t = 0; t < len; ++t, ++xt, wt += V::kLanes) {
      T wv[SP][NV];
#pragma GCC unroll 8
      for (int s = 0; s < SP; ++s)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v)
          wv[s][v] = V::Load(wt + v * ps + s * kSeg * V::kLanes);
      step(xt, wv);
    }
  } else {
    // Each pair row feeds two steps: its low halves (input t), then its
    // high halves (t + 1); an odd last input uses the low halves only.
    constexpr int kSegRows = kSeg / 2;
    const uint32_t* wt = w + static_cast<int64_t>(k0 / 2) * V::kLanes;
    for (int t = 0; t < len; t += 2, xt += 2, wt += V::kLanes) {
      T wv[SP][NV];
#pragma GCC unroll 8
      for (int s = 0; s < SP; ++s)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v)
          wv[s][v] = V::Even(wt + v * ps + s * kSegRows * V::kLanes);
      step(xt, wv);
      if (t + 1 == len) break;
#pragma GCC unroll 8
      for (int s = 0; s < SP; ++s)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v)
          wv[s][v] = V::Odd(wt + v * ps + s * kSegRows * V::kLanes);
      step(xt + 1, wv);
    }
  }
}

// Adds finished segment chains to the running totals in segment order.
// `first` is the index of acc[0]'s segment; segment 0 initialises the total.
template <class V, int MR, int NV, int SP>
__attribute__((always_inline)) inline void FoldChains(
    const typename V::T (&acc)[SP][MR][NV], int first,
    typename V::T (&tot)[MR][NV]) {
#pragma GCC unroll 8
  for (int s = 0; s < SP; ++s)
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v)
        tot[r][v] =
            (first + s == 0) ? acc[s][r][v] : V::Add(tot[r][v], acc[s][r][v]);
}

// One tile: MR rows of x (stride xs) times NV panels (panel stride ps floats)
// into y (stride ys), storing only the first `valid` outputs of the tile.
template <class V, int MR, int NV, class W>
void Tile(const float* x, int64_t xs, const W* w, int64_t ps, int in, float* y,
          int64_t ys, int valid) {
  using T = typename V::T;
  constexpr int SP = SegmentsInFlight(MR, NV);
  const int full = in / kSeg;
  const int rem = in % kSeg;
  T tot[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) tot[r][v] = V::Zero();
  int s = 0;
  if constexpr (SP > 1) {
    for (; s + SP <= full; s += SP) {
      T acc[SP][MR][NV];
      RunChains<V, MR, NV, SP, W>(x, xs, w, ps, s * kSeg, kSeg, acc);
      FoldChains<V, MR, NV, SP>(acc, s, tot);
    }
  }
  for (; s < full; ++s) {
    T acc[1][MR][NV];
    RunChains<V, MR, NV, 1, W>(x, xs, w, ps, s * kSeg, kSeg, acc);
    FoldChains<V, MR, NV, 1>(acc, s, tot);
  }
  if (rem > 0) {
    T acc[1][MR][NV];
    RunChains<V, MR, NV, 1, W>(x, xs, w, ps, full * kSeg, rem, acc);
    FoldChains<V, MR, NV, 1>(acc, full, tot);
  }
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    const int lanes = std::min(V::kLanes, valid - v * V::kLanes);
    if (lanes <= 0) break;
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      V::Store(y + r * ys + v * V::kLanes, tot[r][v], lanes);
    }
  }
}

template <class W>
using TileFn = void (*)(const float*, int64_t, const W*, int64_t, int, float*,
                        int64_t, int);

template <class W, int... I>
constexpr std::array<TileFn<W>, sizeof...(I)> MakeTileTable(
    std::integer_sequence<int, I...>) {
  return {&Tile<Zmm, I / kMaxVecs + 1, I % kMaxVecs + 1, W>...};
}

template <class W, int... I>
constexpr std::array<TileFn<W>, sizeof...(I)> MakeHalfTileTable(
    std::integer_sequence<int, I...>) {
  return {&Tile<Ymm, I + 1, 1, W>...};
}

// kTiles<W>[(rows - 1) * kMaxVecs + (vecs - 1)]: zmm tiles.
template <class W>
constexpr auto kTiles =
    MakeTileTable<W>(std::make_integer_sequence<int, kMaxRows * kMaxVecs>());
// kHalfTiles<W>[rows - 1]: the 8-wide last panel.
template <class W>
constexpr auto kHalfTiles =
    MakeHalfTileTable<W>(std::make_integer_sequence<int, kMaxRows>());

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// Rows of a full panel: one per input index (fp32) or per pair (bf16).
int64_t PanelSteps(int in, bool bf16) { return bf16 ? (in + 1) / 2 : in; }

// Widens one packed bf16 panel of `width` (16 or 8) outputs into fp32
// rows: `in` rows of `width` floats at dst (64-byte aligned).
void WidenPanel(const uint32_t* src, int in, int width, float* dst) {
  for (int t = 0; 2 * t < in; ++t) {
    const uint32_t* s = src + static_cast<int64_t>(t) * width;
    float* d = dst + static_cast<int64_t>(2 * t) * width;
    const bool odd = 2 * t + 1 < in;
    if (width == kPanel) {
      _mm512_store_ps(d, Zmm::Even(s));
      if (odd) _mm512_store_ps(d + width, Zmm::Odd(s));
    } else {
      _mm256_store_ps(d, Ymm::Even(s));
      if (odd) _mm256_store_ps(d + width, Ymm::Odd(s));
    }
  }
}

// Panel geometry of a weight: `full` 16-wide panels, then one 8-wide panel
// when the last outputs number 1 to 8.
struct Panels {
  explicit Panels(int out)
      : full(out % kPanel > 0 && out % kPanel <= kPanel / 2
                 ? out / kPanel
                 : (out + kPanel - 1) / kPanel),
        half(full * kPanel < out) {}
  int full;
  bool half;
};

}  // namespace

LinearWeight::LinearWeight(const float* w, int out, int in, Storage storage)
    : out_(std::max(out, 0)), in_(std::max(in, 0)) {
  const size_t n = static_cast<size_t>(out_) * in_;
  bf16_ =
      storage == Storage::kAuto && n > 0 &&
      std::all_of(w, w + n, [](float f) { return (Bits(f) & 0xFFFFu) == 0; });
  const Panels panels(out_);
  // A full panel has `steps` rows of 16 elements, the half panel `steps`
  // rows of 8, i.e. ceil(steps / 2) PackedRows.
  const int64_t steps = PanelSteps(in_, bf16_);
  const size_t rows = static_cast<size_t>(panels.full) * steps +
                      (panels.half ? (static_cast<size_t>(steps) + 1) / 2 : 0);
  packed_.assign(rows, PackedRow{});
  uint32_t* base = packed_.empty() ? nullptr : packed_.data()->v;
  for (int p = 0; p < panels.full + (panels.half ? 1 : 0); ++p) {
    const int width = p < panels.full ? kPanel : kPanel / 2;
    const int outputs = std::min(width, out_ - p * kPanel);
    uint32_t* dst = base + static_cast<int64_t>(p) * steps * kPanel;
    for (int j = 0; j < outputs; ++j) {
      const float* src = w + static_cast<int64_t>(p * kPanel + j) * in_;
      for (int i = 0; i < in_; ++i) {
        const uint32_t bits = Bits(src[i]);
        if (bf16_) {
          dst[static_cast<int64_t>(i / 2) * width + j] |=
              i % 2 == 0 ? bits >> 16 : bits & 0xFFFF0000u;
        } else {
          dst[static_cast<int64_t>(i) * width + j] = bits;
        }
      }
    }
  }
}

void LinearWeight::Apply(const float* x, int batch, float* y) const {
  Apply(x, in_, batch, y, out_, 0);
}

void LinearWeight::Apply(const float* x, int x_stride, int batch, float* y,
                         int y_stride) const {
  Apply(x, x_stride, batch, y, y_stride, 0);
}

void LinearWeight::Apply(const float* x, int x_stride, int batch, float* y,
                         int y_stride, int num_threads) const {
  if (batch <= 0 || out_ == 0) return;
  if (in_ == 0) {
    for (int b = 0; b < batch; ++b) {
      std::fill_n(y + static_cast<int64_t>(b) * y_stride, out_, 0.0f);
    }
    return;
  }
  const Panels panels(out_);
  const double flops = 2.0 * batch * out_ * in_;
  // For a GPU rank's timing model: the weights once, the rows in and out.
  // The emulated GPU holds fp32 weights (as RankWeightBytes counts its
  // memory), whichever form this host copy keeps.
  ChargeKernelCost(
      sizeof(float) * (double(out_) * in_ + double(batch) * (in_ + out_)),
      flops);
  int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
  if (flops < kParallelMinFlops) threads = 1;

  // Work items are (panel group, row block) tiles; the half panel, if any,
  // is a group of its own. Narrower panel groups give the threads enough
  // items to share when the batch is small; the tile shape only decides
  // which elements run together, never their order.
  const int row_blocks = (batch + kMaxRows - 1) / kMaxRows;
  const int extra = panels.half ? 1 : 0;
  int vecs = kMaxVecs;
  while (vecs > 1 && threads > 1 &&
         static_cast<int64_t>((panels.full + vecs - 1) / vecs + extra) *
                 row_blocks <
             2 * threads) {
    vecs /= 2;
  }
  const int full_groups = (panels.full + vecs - 1) / vecs;
  const int64_t items = static_cast<int64_t>(full_groups + extra) * row_blocks;
  if (threads > items) threads = static_cast<int>(items);

  const int64_t panel_elems = PanelSteps(in_, bf16_) * kPanel;
  const int out = out_;
  const int in = in_;
  // Runs row block `rb` against panel group `g`, whose first panel is at
  // `group` (the next ones `stride` elements apart): packed fp32 or bf16
  // pairs, or a group widened to fp32.
  auto run_tile = [&](const auto* group, int64_t stride, int g, int rb) {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(group)>>;
    const int row0 = rb * kMaxRows;
    const int rows = std::min(kMaxRows, batch - row0);
    const float* xr = x + static_cast<int64_t>(row0) * x_stride;
    float* yr = y + static_cast<int64_t>(row0) * y_stride;
    if (g == full_groups) {
      const int col0 = panels.full * kPanel;
      kHalfTiles<W>[rows - 1](xr, x_stride, group, 0, in, yr + col0, y_stride,
                              out - col0);
      return;
    }
    const int p0 = g * vecs;
    const int nv = std::min(vecs, panels.full - p0);
    const int col0 = p0 * kPanel;
    kTiles<W>[(rows - 1) * kMaxVecs + (nv - 1)](
        xr, x_stride, group, stride, in, yr + col0, y_stride,
        std::min(out - col0, nv * kPanel));
  };
  // Element offset of group g's first packed panel.
  auto group_offset = [&](int g) {
    return static_cast<int64_t>(g == full_groups ? panels.full : g * vecs) *
           panel_elems;
  };
  // Items [begin, end) in turn. Panel-major order: consecutive items share
  // a weight panel group, which stays in cache while the row blocks stream
  // by. bf16 weights are widened in the tiles, once per row block, or, from
  // kWidenRowBlocks row blocks on, once per group into this thread's fp32
  // scratch, on which the fp32 tiles then run.
  auto run_items = [&](int64_t begin, int64_t end) {
    const uint32_t* packed = packed_.data()->v;
    // The tiles on the packed panels themselves (fp32, or bf16 pairs).
    auto direct = [&](const auto* base) {
      for (int64_t item = begin; item < end; ++item) {
        const int g = static_cast<int>(item / row_blocks);
        run_tile(base + group_offset(g), panel_elems, g,
                 static_cast<int>(item % row_blocks));
      }
    };
    if (!bf16_) {
      direct(reinterpret_cast<const float*>(packed));
      return;
    }
    if (row_blocks < kWidenRowBlocks) {
      direct(packed);
      return;
    }
    thread_local std::vector<PackedRow> scratch;
    const int64_t wide_stride = static_cast<int64_t>(in) * kPanel;
    int widened = -1;
    for (int64_t item = begin; item < end; ++item) {
      const int g = static_cast<int>(item / row_blocks);
      if (g != widened) {
        const bool half = g == full_groups;
        const int nv = half ? 1 : std::min(vecs, panels.full - g * vecs);
        const size_t need = static_cast<size_t>(nv) * in;
        if (scratch.size() < need) scratch.resize(need);
        for (int k = 0; k < nv; ++k) {
          WidenPanel(
              packed + group_offset(g) + k * panel_elems, in,
              half ? kPanel / 2 : kPanel,
              reinterpret_cast<float*>(scratch.data()->v) + k * wide_stride);
        }
        widened = g;
      }
      run_tile(reinterpret_cast<const float*>(scratch.data()->v), wide_stride,
               g, static_cast<int>(item % row_blocks));
    }
  };
  if (threads <= 1) {
    run_items(0, items);
    return;
  }
  // Each thread takes a contiguous run of items (as a static schedule
  // would), so it widens each of its groups once.
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    run_items(items * t / n, items * (t + 1) / n);
  }
}

float LinearReferenceDot(const float* w_row, const float* x, int in) {
  float total = 0.0f;
  for (int s0 = 0; s0 < in; s0 += kSeg) {
    const int s1 = std::min(in, s0 + kSeg);
    float chain = 0.0f;
    for (int i = s0; i < s1; ++i) chain = std::fma(w_row[i], x[i], chain);
    total = (s0 == 0) ? chain : total + chain;
  }
  return total;
}

}  // namespace karat
