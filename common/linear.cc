#include "common/linear.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <utility>

#include "common/kernel_cost.h"

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
// Panel rows are V::kLanes floats apart; panels are `ps` floats apart.
template <class V, int MR, int NV, int SP>
__attribute__((always_inline)) inline void RunChains(
    const float* x, int64_t xs, const float* w, int64_t ps, int k0, int len,
    typename V::T (&acc)[SP][MR][NV]) {
#pragma GCC unroll 8
  for (int s = 0; s < SP; ++s)
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[s][r][v] = V::Zero();
  // Walking pointers with segment offsets as constants keep the address
  // arithmetic in displacements, so the loop needs one register per row and
  // per panel rather than one per (segment, row) and (segment, panel).
  const float* xt = x + k0;
  const float* wt = w + static_cast<int64_t>(k0) * V::kLanes;
  for (int t = 0; t < len; ++t, ++xt, wt += V::kLanes) {
#pragma GCC unroll 8
    for (int s = 0; s < SP; ++s) {
      typename V::T wv[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v)
        wv[v] = V::Load(wt + v * ps + s * kSeg * V::kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const typename V::T xb = V::Set1(xt[r * xs + s * kSeg]);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v)
          acc[s][r][v] = V::Fma(wv[v], xb, acc[s][r][v]);
      }
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
template <class V, int MR, int NV>
void Tile(const float* x, int64_t xs, const float* w, int64_t ps, int in,
          float* y, int64_t ys, int valid) {
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
      RunChains<V, MR, NV, SP>(x, xs, w, ps, s * kSeg, kSeg, acc);
      FoldChains<V, MR, NV, SP>(acc, s, tot);
    }
  }
  for (; s < full; ++s) {
    T acc[1][MR][NV];
    RunChains<V, MR, NV, 1>(x, xs, w, ps, s * kSeg, kSeg, acc);
    FoldChains<V, MR, NV, 1>(acc, s, tot);
  }
  if (rem > 0) {
    T acc[1][MR][NV];
    RunChains<V, MR, NV, 1>(x, xs, w, ps, full * kSeg, rem, acc);
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

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, int,
                        float*, int64_t, int);

template <int... I>
constexpr std::array<TileFn, sizeof...(I)> MakeTileTable(
    std::integer_sequence<int, I...>) {
  return {&Tile<Zmm, I / kMaxVecs + 1, I % kMaxVecs + 1>...};
}

template <int... I>
constexpr std::array<TileFn, sizeof...(I)> MakeHalfTileTable(
    std::integer_sequence<int, I...>) {
  return {&Tile<Ymm, I + 1, 1>...};
}

// kTiles[(rows - 1) * kMaxVecs + (vecs - 1)]: zmm tiles.
constexpr auto kTiles =
    MakeTileTable(std::make_integer_sequence<int, kMaxRows * kMaxVecs>());
// kHalfTiles[rows - 1]: the 8-wide last panel.
constexpr auto kHalfTiles =
    MakeHalfTileTable(std::make_integer_sequence<int, kMaxRows>());

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

LinearWeight::LinearWeight(const float* w, int out, int in)
    : out_(std::max(out, 0)), in_(std::max(in, 0)) {
  const Panels panels(out_);
  // Full panels: `in` rows of 16 floats; the half panel: `in` rows of 8
  // floats, i.e. ceil(in / 2) PackedRows.
  const size_t rows = static_cast<size_t>(panels.full) * in_ +
                      (panels.half ? (static_cast<size_t>(in_) + 1) / 2 : 0);
  packed_.assign(rows, PackedRow{});
  float* base = packed_.empty() ? nullptr : packed_.data()->v;
  for (int p = 0; p < panels.full + (panels.half ? 1 : 0); ++p) {
    const int width = p < panels.full ? kPanel : kPanel / 2;
    const int outputs = std::min(width, out_ - p * kPanel);
    float* dst = base + static_cast<int64_t>(p) * in_ * kPanel;
    for (int j = 0; j < outputs; ++j) {
      const float* src = w + static_cast<int64_t>(p * kPanel + j) * in_;
      for (int i = 0; i < in_; ++i)
        dst[static_cast<int64_t>(i) * width + j] = src[i];
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

  const float* packed = packed_.data()->v;
  const int64_t panel_floats = static_cast<int64_t>(in_) * kPanel;
  const int out = out_;
  const int in = in_;
  auto run_item = [&](int64_t item) {
    // Panel-major order: consecutive items of one thread share a weight
    // panel group, which stays in cache while the row blocks stream by.
    const int g = static_cast<int>(item / row_blocks);
    const int rb = static_cast<int>(item % row_blocks);
    const int row0 = rb * kMaxRows;
    const int rows = std::min(kMaxRows, batch - row0);
    const float* xr = x + static_cast<int64_t>(row0) * x_stride;
    float* yr = y + static_cast<int64_t>(row0) * y_stride;
    if (g == full_groups) {
      const int col0 = panels.full * kPanel;
      kHalfTiles[rows - 1](xr, x_stride, packed + panels.full * panel_floats, 0,
                           in, yr + col0, y_stride, out - col0);
      return;
    }
    const int p0 = g * vecs;
    const int nv = std::min(vecs, panels.full - p0);
    const int col0 = p0 * kPanel;
    kTiles[(rows - 1) * kMaxVecs + (nv - 1)](
        xr, x_stride, packed + p0 * panel_floats, panel_floats, in, yr + col0,
        y_stride, std::min(out - col0, nv * kPanel));
  };
  if (threads <= 1) {
    for (int64_t item = 0; item < items; ++item) run_item(item);
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t item = 0; item < items; ++item) run_item(item);
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
