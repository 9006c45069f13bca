#include "common/sparse_attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/core_pool.h"
#include "common/numeric.h"
#include "common/safetensors.h"
#include "common/simd_reduce.h"
#include "common/status_macros.h"

// GCC 12 reports its own AVX-512 intrinsic headers (_mm512_undefined_*)
// as (maybe-)uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace karat {

size_t AttentionSessionState::bytes() const {
  size_t n = 0;
  for (const auto& l : layers) {
    if (l != nullptr) n += l->bytes();
  }
  return n;
}

void SparseAttention::SelectDense(int pos,
                                  std::vector<HeadSelection>* heads) const {
  heads->resize(shapes_.heads);
  for (HeadSelection& h : *heads) {
    h.positions.resize(size_t(pos) + 1);
    for (int t = 0; t <= pos; ++t) h.positions[t] = t;
    h.bias.clear();
  }
}

namespace {

// p_j v_j summed over the selection into `kHeads` heads' outputs at once,
// for head_dim d = 16 kDv (kDv > 0), or any d with kDv = 0 (a slower loop
// over the vectors). Per output element o = fma(p_j, v_j, o) from +0 in
// increasing j: the scalar chain, one lane per channel. p[i][j] is head i's
// weight of entry j; v[j] its value row (bf16).
template <int kHeads, int kDv>
void WeightedValues(const uint16_t* const* v, int n, const float* const* p,
                    int d, float* const* out) {
  // The generic loop takes up to kMaxVectors channel vectors per pass over
  // the entries.
  constexpr int kMaxVectors = 16;
  constexpr int kVectors = kDv > 0 ? kDv : kMaxVectors;
  // Value rows are requested this many entries ahead: far enough for a
  // dense selection streaming from DRAM (~2 ns an entry at d = 64, so 8
  // ahead was well short of a miss), and the first ones before the loop,
  // for the short selections of the sparse methods.
  constexpr int kAhead = 32;
  const int dv = (d + 15) / 16;
  for (int base = 0; base < dv; base += kVectors) {
    const int nv = kDv > 0 ? kDv : std::min(kVectors, dv - base);
    const size_t row_bytes =
        size_t(std::min(d, 16 * (base + nv)) - 16 * base) * 2;
    __m512 acc[kHeads][kVectors];
    for (int i = 0; i < kHeads; ++i) {
      for (int c = 0; c < nv; ++c) acc[i][c] = _mm512_setzero_ps();
    }
    for (int j = 0; j < std::min(n, kAhead); ++j) {
      PrefetchEntryLines<true>(v[j] + 16 * base, row_bytes);
    }
    for (int j = 0; j < n; ++j) {
      if (j + kAhead < n) {
        PrefetchEntryLines<true>(v[j + kAhead] + 16 * base, row_bytes);
      }
      __m512 pj[kHeads];
      for (int i = 0; i < kHeads; ++i) pj[i] = _mm512_set1_ps(p[i][j]);
      for (int c = 0; c < nv; ++c) {
        const int ch = 16 * (base + c);
        const __m512 x = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(
                                  FirstLanes16(d - ch), v[j] + ch)),
                              16));
        for (int i = 0; i < kHeads; ++i) {
          acc[i][c] = _mm512_fmadd_ps(pj[i], x, acc[i][c]);
        }
      }
    }
    for (int i = 0; i < kHeads; ++i) {
      for (int c = 0; c < nv; ++c) {
        const int ch = 16 * (base + c);
        _mm512_mask_storeu_ps(out[i] + ch, FirstLanes16(d - ch), acc[i][c]);
      }
    }
  }
}

// WeightedValues for `heads` heads (any number), a few at a time.
template <int kDv>
void WeightedValuesHeads(const uint16_t* const* v, int n, const float* const* p,
                         int heads, int d, float* const* out) {
  // Accumulators: 4 heads x 4 vectors (d = 64), 2 x 8 (d = 128).
  constexpr int kBatch = kDv > 0 && kDv <= 4 ? 4 : kDv > 0 && kDv <= 8 ? 2 : 1;
  int h = 0;
  for (; h + kBatch <= heads; h += kBatch) {
    WeightedValues<kBatch, kDv>(v, n, p + h, d, out + h);
  }
  for (; h < heads; ++h) WeightedValues<1, kDv>(v, n, p + h, d, out + h);
}

// Score chains over a span of kScoreTiles tiles of 16 entries (LoadEntryTile
// layout, tile t at tile + t * tile_floats) for kHeads query heads (head i's
// query at q + i * q_stride): out[i * out_stride + 16 t + l] = fma chain
// over c of q_i[c] e_{16t+l}[c] from +0, as the scalar chain. The
// kHeads x kScoreTiles chains are independent and run interleaved, so the
// FMA latency is hidden (one chain at a time waits ~4 cycles per channel).
constexpr int kScoreTiles = 4;
constexpr int kScoreSpan = 16 * kScoreTiles;

// Ticks `l1` (into L1) once per channel.
template <int kHeads>
void ScoreSpan(const float* q, size_t q_stride, const float* tile,
               size_t tile_floats, int d, float* out, size_t out_stride,
               EntryRequests* l1) {
  EntryRequests req = *l1;  // a local copy stays in registers
  __m512 acc[kHeads][kScoreTiles];
  for (int i = 0; i < kHeads; ++i) {
    for (int t = 0; t < kScoreTiles; ++t) acc[i][t] = _mm512_setzero_ps();
  }
  for (int c = 0; c < d; ++c) {
    req.Tick<true>();
    __m512 x[kScoreTiles];
    for (int t = 0; t < kScoreTiles; ++t) {
      x[t] = _mm512_load_ps(tile + t * tile_floats + size_t(c) * 16);
    }
    for (int i = 0; i < kHeads; ++i) {
      const __m512 qc = _mm512_set1_ps(q[i * q_stride + c]);
      for (int t = 0; t < kScoreTiles; ++t) {
        acc[i][t] = _mm512_fmadd_ps(qc, x[t], acc[i][t]);
      }
    }
  }
  *l1 = req;
  for (int i = 0; i < kHeads; ++i) {
    for (int t = 0; t < kScoreTiles; ++t) {
      _mm512_storeu_ps(out + i * out_stride + 16 * t, acc[i][t]);
    }
  }
}

}  // namespace

void SparseAttention::AttendHeads(const LayerView& view, const float* q,
                                  const std::vector<HeadSelection>& heads,
                                  int h_begin, int h_end, float* out,
                                  KernelCost* cost) const {
  const AttnShapes& s = shapes_;
  const int d = s.head_dim;
  const int group = s.heads / s.kv_heads;
  // Per head h, over its selected positions j in increasing order:
  //   s_j = fma chain over c of q[c] k_j[c] from +0, then s_j * scale
  //   (+ bias_j); m = max_j s_j; p_j = KernelExp(s_j - m) (attention.h);
  //   z = 16 partial sums (p_j into lane j % 16, in increasing j) combined
  //   by the lane tree (LaneTreeSum), as MlaAttend's chunk denominators;
  //   p_j *= 1 / z; o[c] = fma chain over j of p_j v_j[c].
  // Heads of a KV group that select the same positions are served together:
  // their entries are gathered once, 16 at a time, transposed and widened
  // into an L1 tile (one lane per entry), over which every head's score
  // chains run (a score does not depend on which other positions are
  // selected); the weighted sums then read each value row once for all of
  // them. Every element's arithmetic is the scalar chain above.
  // The units: runs of heads [h0, h1) of one group with the same positions,
  // and where their entries' addresses start in kp_all / vp_all. Every
  // unit's addresses are computed before any arithmetic, so that the page
  // table's misses of all of them overlap (a unit at a time, each waited
  // for its own before its first keys could be requested).
  struct Unit {
    int h0, h1, first;
  };
  thread_local std::vector<Unit> units;
  thread_local std::vector<const uint16_t*> kp_all, vp_all;
  thread_local std::vector<float> sc_buf;
  thread_local std::vector<float*> p, o;
  thread_local EntryRequests l1;
  units.clear();
  int total = 0;
  for (int h0 = h_begin; h0 < h_end;) {
    const int g = h0 / group;
    const std::vector<int32_t>& pos = heads[h0].positions;
    int h1 = h0 + 1;
    while (h1 < (g + 1) * group && heads[h1].positions == pos) ++h1;
    units.push_back({h0, h1, total});
    total += int(pos.size());
    h0 = h1;
  }
  units.push_back({h_end, h_end, total});
  kp_all.resize(total);
  vp_all.resize(total);
  for (size_t u = 0; u + 1 < units.size(); ++u) {
    const int g = units[u].h0 / group;
    const int first = units[u].first, n = units[u + 1].first - first;
    const int32_t* pos = heads[units[u].h0].positions.data();
    view.PartRows(pos, n, GqaEntry::KPart(s, g), &kp_all[first]);
    view.PartRows(pos, n, GqaEntry::VPart(s, g), &vp_all[first]);
  }
  const size_t tile_floats = EntryTileFloats(d);
  float* tile = EntryTileScratch(d, kScoreTiles);
  double bytes = 0, flops = 0;
  const __m512 vscale = _mm512_set1_ps(s.softmax_scale);
  const size_t row_bytes = size_t(d) * 2;
  // One unit at a time. (Units of different groups with the same
  // positions, a dense layer's, were also run in lock-step, span by span
  // and value chunk by value chunk, while a position's rows of every head
  // shared its entry's lines; with each head's rows in runs of their own
  // (KvLayout parts), a unit reads two runs, and the lock-step showed no
  // consistent gain over three alternated runs.)
  const size_t nunits = units.size() - 1;
  for (size_t u = 0; u < nunits; ++u) {
    const std::vector<int32_t>& pos = heads[units[u].h0].positions;
    const int h0 = units[u].h0, h1 = units[u].h1;
    const int nh = h1 - h0;
    const int n = units[u + 1].first - units[u].first;
    const uint16_t* const* kp = kp_all.data() + units[u].first;
    const uint16_t* const* vp = vp_all.data() + units[u].first;
    for (int h = h0; h < h1; ++h) {
      float* oh = out + size_t(h) * s.out_dim;
      std::fill(oh, oh + d, 0.0f);
    }
    if (n == 0) continue;  // cannot happen: the token itself is selected
    const int npad = (n + kScoreSpan - 1) / kScoreSpan * kScoreSpan;
    if (u == 0) {
      for (int j = 0; j < std::min(n, kScoreSpan); ++j) {
        PrefetchEntryLines<true>(kp[j], row_bytes);
      }
    }
    bytes += double(n) * d * 2 * 2;
    sc_buf.resize(size_t(nh) * npad);
    // Scores, kScoreSpan entries (kScoreTiles tiles of 16) at a time. The
    // next span's keys are requested meanwhile: spread over the span's
    // score chains where the positions run contiguously (a dense layer),
    // at once otherwise. Spread, a dense layer's attend at 128K took
    // 4.8 ms on one core instead of 5.8 (6.7 without requests), but the
    // sparse methods' selections came out ~10% slower.
    const bool contiguous = pos[n - 1] - pos[0] == n - 1;
    // The next unit's first keys, requested during this unit's last span.
    const int next_first = units[u + 1].first;
    const int next_n = std::min(
        kScoreSpan,
        (u + 1 < nunits ? units[u + 2].first : next_first) - next_first);
    for (int j0 = 0; j0 < n; j0 += kScoreSpan) {
      const int ahead = std::clamp(n - (j0 + kScoreSpan), 0, kScoreSpan);
      if (!contiguous) {
        for (int j = j0 + kScoreSpan; j < j0 + kScoreSpan + ahead; ++j) {
          PrefetchEntryLines<true>(kp[j], row_bytes);
        }
      }
      const bool last = j0 + kScoreSpan >= n;
      l1.Start(kp + j0 + kScoreSpan, contiguous ? ahead : 0,
               last ? kp_all.data() + next_first : nullptr, last ? next_n : 0,
               row_bytes, d);
      for (int t = 0; t < kScoreTiles; ++t) {
        const int first = j0 + 16 * t;
        LoadEntryTile(kp + std::min(first, n - 1), std::clamp(n - first, 0, 16),
                      d, tile + t * tile_floats, 16);
      }
      float* sc = &sc_buf[j0];
      int i = 0;
      for (; i + 4 <= nh; i += 4) {
        ScoreSpan<4>(q + size_t(h0 + i) * s.q_dim, s.q_dim, tile, tile_floats,
                     d, sc + size_t(i) * npad, npad, &l1);
      }
      for (; i + 2 <= nh; i += 2) {
        ScoreSpan<2>(q + size_t(h0 + i) * s.q_dim, s.q_dim, tile, tile_floats,
                     d, sc + size_t(i) * npad, npad, &l1);
      }
      if (i < nh) {
        ScoreSpan<1>(q + size_t(h0 + i) * s.q_dim, s.q_dim, tile, tile_floats,
                     d, sc + size_t(i) * npad, npad, &l1);
      }
    }
    // Softmax weights, per head.
    p.resize(nh);
    o.resize(nh);
    for (int i = 0; i < nh; ++i) {
      const HeadSelection& sel = heads[h0 + i];
      float* sh = &sc_buf[size_t(i) * npad];
      p[i] = sh;
      o[i] = out + size_t(h0 + i) * s.out_dim;
      // max_ps(x, m) keeps m where x is NaN or equal, as std::max(m, x).
      __m512 vm = _mm512_set1_ps(-INFINITY);
      for (int j = 0; j < n; j += 16) {
        const __mmask16 valid = FirstLanes16(n - j);
        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sh + j), vscale);
        if (!sel.bias.empty()) {
          x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(valid, &sel.bias[j]));
        }
        _mm512_storeu_ps(sh + j, x);
        vm = _mm512_mask_max_ps(vm, valid, x, vm);
      }
      const float m = _mm512_reduce_max_ps(vm);
      const __m512 vmv = _mm512_set1_ps(m);
      __m512 vz = _mm512_setzero_ps();
      for (int j = 0; j < n; j += 16) {
        const __m512 e = _mm512_maskz_mov_ps(
            FirstLanes16(n - j),
            KernelExp16(_mm512_sub_ps(_mm512_loadu_ps(sh + j), vmv)));
        _mm512_storeu_ps(sh + j, e);
        vz = _mm512_add_ps(vz, e);
      }
      const float z = LaneTreeSum(vz);
      const __m512 inv = _mm512_set1_ps(1.0f / z);
      for (int j = 0; j < n; j += 16) {
        _mm512_storeu_ps(sh + j, _mm512_mul_ps(_mm512_loadu_ps(sh + j), inv));
      }
      flops += double(n) * d * 4;
    }
    // Weighted sums.
    switch ((d + 15) / 16) {
      case 4:
        WeightedValuesHeads<4>(vp, n, p.data(), nh, d, o.data());
        break;
      case 8:
        WeightedValuesHeads<8>(vp, n, p.data(), nh, d, o.data());
        break;
      default:
        WeightedValuesHeads<0>(vp, n, p.data(), nh, d, o.data());
        break;
    }
  }
  if (cost != nullptr) {
    cost->bytes += bytes;
    cost->flops += flops;
  }
}

absl::StatusOr<std::unique_ptr<SparseAttention>> NewSparseAttention(
    const ModelConfig& config, const MethodWeights& weights) {
  const AttnShapes shapes = MakeAttnShapes(config);
  const AttentionConfig& a = config.attention;
  // The registry: (type, method) -> implementation.
  switch (a.type) {
    case AttentionType::kMlaDsa:
      return absl::UnimplementedError(
          "mla_dsa is served by RunIndexer/RunAttention, not the GQA kernels");
    case AttentionType::kGqaBlock:
      return NewGqaBlockAttention(shapes, a);
    case AttentionType::kGqaDense:
      switch (a.method) {
        case AttentionMethod::kDense:
          return NewGqaDenseAttention(shapes);
        case AttentionMethod::kQuest:
          return NewQuestAttention(shapes, a);
        case AttentionMethod::kMagicPig: {
          const size_t want =
              size_t(a.lsh_bits) * a.lsh_tables * size_t(config.head_dim);
          if (weights.lsh_hyperplanes.size() != want) {
            return absl::InvalidArgumentError(absl::StrCat(
                "magicpig needs model.lsh_hyperplanes [", a.lsh_bits, "*",
                a.lsh_tables, ", ", config.head_dim, "] (", want,
                " values); got ", weights.lsh_hyperplanes.size()));
          }
          return NewMagicPigAttention(shapes, a, weights.lsh_hyperplanes);
        }
        case AttentionMethod::kClusterKv:
          return NewClusterKvAttention(shapes, a);
      }
  }
  return absl::InvalidArgumentError("unknown attention type or method");
}

absl::StatusOr<MethodWeights> LoadMethodWeights(const std::string& model_dir,
                                                const ModelConfig& config) {
  MethodWeights w;
  if (config.attention.type != AttentionType::kGqaDense ||
      config.attention.method != AttentionMethod::kMagicPig) {
    return w;
  }
  const std::string path = model_dir + "/model.safetensors";
  ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
  const char* name = "model.lsh_hyperplanes";
  const TensorView* t = file->Find(name);
  if (t == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": missing tensor '", name, "'"));
  }
  const int64_t rows =
      int64_t{config.attention.lsh_bits} * config.attention.lsh_tables;
  if (t->shape.size() != 2 || t->shape[0] != rows ||
      t->shape[1] != config.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", name,
                                                   "' must be [", rows, ", ",
                                                   config.head_dim, "]"));
  }
  w.lsh_hyperplanes = t->ToFloat();
  return w;
}

std::unique_ptr<AttentionSessionState> NewAttentionSessionState(
    const SparseAttention& method, int num_layers) {
  auto st = std::make_unique<AttentionSessionState>();
  st->layers.resize(num_layers);
  for (int l = 0; l < num_layers; ++l) {
    if (method.SparseLayer(l)) st->layers[l] = method.NewLayerState();
  }
  return st;
}

bool TruncateSessionKv(const SparseAttention* method,
                       const AttentionSessionState* state, SessionCache* cache,
                       int num_layers, int length) {
  length = std::max(length, 0);
  if (method != nullptr && state != nullptr) {
    for (int l = 0; l < num_layers && l < int(state->layers.size()); ++l) {
      const MethodLayerState* st = state->layers[l].get();
      if (st != nullptr && cache->length(l) > length &&
          !method->SurvivesTruncation(st, length))
        return false;
    }
  }
  for (int l = 0; l < num_layers; ++l) cache->Truncate(l, length);
  return true;
}

absl::Status RunAttentionLayer(const SparseAttention& method, int layer,
                               int pos_start, int n, const AttnInputs& in,
                               bool ends_prefill, SessionCache* cache,
                               AttentionSessionState* state, float* out,
                               KernelCost* cost, CorePool* pool) {
  const AttnShapes& s = method.shapes();
  if (pos_start < 0 || n <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad segment: pos_start ", pos_start, ", n ", n));
  }
  if (layer < 0 || layer >= int(state->layers.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " out of range"));
  }
  if (pos_start > cache->length(layer)) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, " holds ", cache->length(layer),
                     " positions; a segment cannot start at ", pos_start));
  }
  RETURN_IF_ERROR(cache->WriteKvRun(layer, pos_start, n, in.kv));
  cache->SetLength(layer, pos_start + n);
  const LayerView view = cache->View(layer);
  KernelCost local;
  KernelCost* c = cost != nullptr ? cost : &local;
  MethodLayerState* st = state->layers[layer].get();
  const bool sparse = method.SparseLayer(layer);
  if (sparse) method.OnAppend(view, pos_start, n, st, c);
  // The tokens dealt round-robin over the pool's cores (token i attends
  // i + 1 positions or so: contiguous ranges would leave the last core the
  // most work); each core's costs are summed after (whole numbers of bytes
  // and FLOPs: the same totals in any order).
  const int ranges = pool != nullptr && n > 1 ? std::min(n, pool->cores()) : 1;
  std::vector<KernelCost> range_cost(ranges);
  // A lone range (one token: a decode step) splits its Attend over the
  // cores by KV group instead, where the work repays waking them; heads
  // are independent, so the bits are the same.
  const int group = s.heads / s.kv_heads;
  std::vector<KernelCost> part_cost;
  auto attend = [&](const std::vector<HeadSelection>& heads, const float* q,
                    float* o, KernelCost* rc) {
    double work = 0;
    for (const HeadSelection& h : heads) {
      work += double(h.positions.size()) * s.head_dim * 2;
    }
    CorePool* split = ranges == 1 ? PoolFor(pool, work) : nullptr;
    if (split == nullptr) {
      method.Attend(view, q, heads, o, rc);
      return;
    }
    // Each range of KV groups adds its cost at its first group's slot.
    part_cost.assign(size_t(s.kv_heads), KernelCost());
    split->ParallelFor(s.kv_heads, 1, [&](int64_t b, int64_t e) {
      method.AttendHeads(view, q, heads, int(b) * group, int(e) * group, o,
                         &part_cost[size_t(b)]);
    });
    for (const KernelCost& pc : part_cost) *rc += pc;
  };
  auto tokens = [&](int64_t r0, int64_t r1) {
    // Reused per thread: a dense layer's selections at long context are
    // megabytes, which a fresh vector would map and page-fault every call.
    thread_local std::vector<HeadSelection> heads;
    for (int64_t r = r0; r < r1; ++r) {
      KernelCost& rc = range_cost[size_t(r)];
      for (int i = int(r); i < n; i += ranges) {
        const int pos = pos_start + i;
        const float* q = in.q + size_t(i) * s.heads * s.q_dim;
        if (sparse) {
          // A lone token (a decode step) lends the method the pool.
          method.Select(view, pos, q, st, &heads, &rc,
                        ranges == 1 ? pool : nullptr);
        } else {
          method.SelectDense(pos, &heads);
        }
        attend(heads, q, out + size_t(i) * s.heads * s.out_dim, &rc);
      }
    }
  };
  if (ranges > 1) {
    pool->ParallelFor(ranges, 1, tokens);
  } else {
    tokens(0, 1);
  }
  for (const KernelCost& rc : range_cost) *c += rc;
  if (sparse && ends_prefill) method.OnPrefillEnd(view, st, c, pool);
  return absl::OkStatus();
}

}  // namespace karat
