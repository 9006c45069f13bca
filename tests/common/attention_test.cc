// Hand-worked and brute-force checks of the KARAT-side kernels.
#include "common/attention.h"

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <random>

#include "common/core_pool.h"
#include "common/kv_store.h"
#include "common/model_config.h"
#include "common/numeric.h"
#include "common/sparse_attention.h"

namespace karat {
namespace {

// A session cache with `n` tokens of index keys (dim d) and KV (dim kv).
struct Store {
  KvLayout layout;
  std::unique_ptr<PageArena> arena;
  std::unique_ptr<SessionCache> cache;
  Store(int kv_dim, int index_dim, int tokens_per_page, int layers = 1) {
    ModelConfig c;
    c.num_hidden_layers = layers;
    c.attention.type = AttentionType::kMlaDsa;
    c.kv_lora_rank = kv_dim;
    c.qk_rope_head_dim = 0;
    c.index_head_dim = index_dim;
    layout = MakeKvLayout(c, tokens_per_page);
    arena = *PageArena::Create(size_t(64) << 20, layout.page_bytes);
    cache = std::make_unique<SessionCache>(&layout, arena.get());
  }
};

// MlaAttend's defined arithmetic (attention.h), scalar: fixed chunks,
// per-chunk max / lane-tree denominator / unnormalised fma chains, merged
// in chunk order.
std::vector<float> ScalarMlaAttend(const LayerView& v,
                                   const std::vector<int32_t>& sel,
                                   const float* q, const AttnShapes& sh) {
  const int lora = sh.kv_lora, n = int(sel.size());
  std::vector<float> out(size_t(sh.heads) * lora);
  for (int h = 0; h < sh.heads; ++h) {
    std::vector<float> ms, zs;
    std::vector<std::vector<float>> os;
    for (int c0 = 0; c0 < n; c0 += kMlaAttendChunk) {
      const int c1 = std::min(n, c0 + kMlaAttendChunk);
      std::vector<float> sc;
      float m = -INFINITY;
      for (int j = c0; j < c1; ++j) {
        std::vector<float> e(sh.kv_dim);
        Bf16ToFloat(v.Kv(sel[j]), sh.kv_dim, e.data());
        float dot = 0.0f;
        for (int d = 0; d < sh.kv_dim; ++d) {
          dot = std::fma(q[h * sh.q_dim + d], e[d], dot);
        }
        sc.push_back(dot * sh.softmax_scale);
        m = std::max(m, sc.back());
      }
      float lanes[16] = {};
      for (size_t j = 0; j < sc.size(); ++j) {
        sc[j] = KernelExp(sc[j] - m);
        lanes[j % 16] = lanes[j % 16] + sc[j];
      }
      for (int w = 8; w >= 1; w /= 2) {
        for (int l = 0; l < w; ++l) lanes[l] = lanes[l] + lanes[l + w];
      }
      std::vector<float> o(lora, 0.0f);
      for (int j = c0; j < c1; ++j) {
        std::vector<float> e(sh.kv_dim);
        Bf16ToFloat(v.Kv(sel[j]), sh.kv_dim, e.data());
        for (int d = 0; d < lora; ++d) o[d] = std::fma(sc[j - c0], e[d], o[d]);
      }
      ms.push_back(m);
      zs.push_back(lanes[0]);
      os.push_back(o);
    }
    float mx = -INFINITY;
    for (float m : ms) mx = std::max(mx, m);
    float z = 0.0f;
    std::vector<float> a(lora, 0.0f);
    for (size_t c = 0; c < ms.size(); ++c) {
      const float w = KernelExp(ms[c] - mx);
      z = std::fma(w, zs[c], z);
      for (int d = 0; d < lora; ++d) a[d] = std::fma(w, os[c][d], a[d]);
    }
    for (int d = 0; d < lora; ++d)
      out[size_t(h) * lora + d] = a[d] * (1.0f / z);
  }
  return out;
}

// MlaAttend in double: the softmax-weighted latents of every head, and
// per output element the bound sum_j p[j] |e_j[d]| / z of its rounding.
void DoubleMlaAttend(const LayerView& v, const std::vector<int32_t>& sel,
                     const float* q, const AttnShapes& sh,
                     std::vector<double>* out, std::vector<double>* mag) {
  const int lora = sh.kv_lora, n = int(sel.size());
  out->assign(size_t(sh.heads) * lora, 0.0);
  mag->assign(size_t(sh.heads) * lora, 0.0);
  std::vector<float> e(size_t(n) * sh.kv_dim);
  for (int j = 0; j < n; ++j) {
    Bf16ToFloat(v.Kv(sel[j]), sh.kv_dim, &e[size_t(j) * sh.kv_dim]);
  }
  for (int h = 0; h < sh.heads; ++h) {
    std::vector<double> s(n);
    double mx = -1e300;
    for (int j = 0; j < n; ++j) {
      double dot = 0;
      for (int d = 0; d < sh.kv_dim; ++d) {
        dot += double(q[h * sh.q_dim + d]) * e[size_t(j) * sh.kv_dim + d];
      }
      s[j] = dot * sh.softmax_scale;
      mx = std::max(mx, s[j]);
    }
    double z = 0;
    for (int j = 0; j < n; ++j) z += (s[j] = std::exp(s[j] - mx));
    for (int j = 0; j < n; ++j) {
      for (int d = 0; d < lora; ++d) {
        const double x = s[j] / z * e[size_t(j) * sh.kv_dim + d];
        (*out)[size_t(h) * lora + d] += x;
        (*mag)[size_t(h) * lora + d] += std::fabs(x);
      }
    }
  }
}

// Error allowed against the double reference, relative to sum_j p_j |e_j|:
// a few times what the fp32 vector path shows (~1.5e-6 at most here). A
// two-part split of q or p (16 significant bits) misses it.
constexpr double kAttendTolerance = 4e-6;

// Checks MlaAttend's output `got` with AttendUnit::kTileUnit for a
// selection: without a tile unit (the vector path) it must equal the
// scalar model `want` bit for bit; on the tile unit (whose accumulation
// has no scalar model) it must be as close to a double reference as the
// vector path is, up to a small factor.
void CheckAttendPath(const LayerView& v, const std::vector<int32_t>& sel,
                     const float* q, const AttnShapes& sh,
                     const std::vector<float>& want,
                     const std::vector<float>& got) {
  REQUIRE(got.size() == want.size());
  if (!MlaAttendUsesTileUnit()) {
    CHECK(std::memcmp(want.data(), got.data(), want.size() * 4) == 0);
    return;
  }
  std::vector<double> ref, mag;
  DoubleMlaAttend(v, sel, q, sh, &ref, &mag);
  double worst_vec = 0, worst_tile = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double bound = mag[i] * kAttendTolerance + 1e-30;
    worst_vec = std::max(worst_vec, std::fabs(want[i] - ref[i]) / bound);
    worst_tile = std::max(worst_tile, std::fabs(got[i] - ref[i]) / bound);
  }
  INFO("vector error " << worst_vec << ", tile error " << worst_tile
                       << " (units of " << kAttendTolerance
                       << " x sum_j p_j |e_j|)");
  CHECK(worst_vec <= 1.0);
  CHECK(worst_tile <= 1.0);
}

// The indexer's defined arithmetic (attention.h), one key at a time:
// pairwise bf16 products (exact for fp8 values) added odd then even into an
// fp32 chain, then the ReLU'd head terms fused in head order, then the key
// scale. `key` holds decoded values.
float ScalarIndexScore(const uint8_t* q_codes, const float* q_scales,
                       const float* w, int heads, int dim, const float* key,
                       float k_scale) {
  const int padded = (dim + 31) / 32 * 32;
  const float dim_scale = 1.0f / std::sqrt(float(dim));
  float acc = 0.0f;
  for (int h = 0; h < heads; ++h) {
    auto qv = [&](int d) {
      return d < dim ? Fp8E4M3ToFloat(q_codes[h * dim + d]) : 0.0f;
    };
    auto kv = [&](int d) { return d < dim ? key[d] : 0.0f; };
    float dot = 0.0f;
    for (int p = 0; p < padded / 2; ++p) {
      dot = dot + qv(2 * p + 1) * kv(2 * p + 1);
      dot = dot + qv(2 * p) * kv(2 * p);
    }
    const float c = (w[h] * dim_scale) * q_scales[h];
    acc = std::fma(c, dot > 0.0f ? dot : 0.0f, acc);
  }
  return acc * k_scale;
}

// Checks IndexerScore's output for keys [0, n) of `keys` (decoded values,
// n x dim; the codes and scales as stored). Without the tile unit the
// result must equal ScalarIndexScore bit for bit. With it (its internal
// accumulation has no scalar model) each key must score exactly as it does
// alone, in lane 0 of a fresh block, and within fp32 noise of a double
// reference.
void CheckIndexScores(const float* got, int n, const uint8_t* q_codes,
                      const float* q_scales, const float* w, int heads, int dim,
                      const std::vector<uint8_t>& key_codes,
                      const std::vector<float>& keys,
                      const std::vector<float>& scales) {
  if (!IndexerUsesTileUnit()) {
    for (int s = 0; s < n; ++s) {
      const float want = ScalarIndexScore(q_codes, q_scales, w, heads, dim,
                                          &keys[size_t(s) * dim], scales[s]);
      CHECK(std::memcmp(&want, &got[s], 4) == 0);
    }
    return;
  }
  Store alone(8, dim, 4);
  REQUIRE(alone.cache->Reserve(1).ok());
  const float dim_scale = 1.0f / std::sqrt(float(dim));
  for (int s = 0; s < n; ++s) {
    REQUIRE(
        alone.cache->WriteIndexKey(0, 0, &key_codes[size_t(s) * dim], scales[s])
            .ok());
    float one;
    IndexerScore(alone.cache->View(0), 1, q_codes, q_scales, w, heads, dim,
                 &one);
    CHECK(std::memcmp(&one, &got[s], 4) == 0);
    double ref = 0, mag = 0;
    for (int h = 0; h < heads; ++h) {
      double dot = 0, amag = 0;
      for (int d = 0; d < dim; ++d) {
        const double t = double(Fp8E4M3ToFloat(q_codes[h * dim + d])) *
                         keys[size_t(s) * dim + d];
        dot += t;
        amag += std::fabs(t);
      }
      const double c = double(w[h]) * dim_scale * q_scales[h] * scales[s];
      ref += c * std::max(dot, 0.0);
      mag += std::fabs(c) * amag;
    }
    CHECK(std::fabs(double(got[s]) - ref) <= 1e-5 * mag + 1e-30);
  }
}

// The indexer's paths a test runs in: the process's own (the tile unit where
// granted, else the measured vector form) and each vector form, forced; and
// the process's own code widening (-1) or a forced one (a CodeWidening).
// Restores the process's choices when it goes out of scope.
class IndexerPathScope {
 public:
  explicit IndexerPathScope(int path, int widening = -1) {
    if (path == 1) ForceIndexerVectorPath(IndexerDots::kBf16Pairs);
    if (path == 2) ForceIndexerVectorPath(IndexerDots::kFp32Fma);
    if (widening >= 0) ForceCodeWidening(CodeWidening(widening));
  }
  ~IndexerPathScope() {
    ResetIndexerPath();
    ResetCodeWidening();
  }
  IndexerPathScope(const IndexerPathScope&) = delete;
  IndexerPathScope& operator=(const IndexerPathScope&) = delete;
};

TEST_CASE("DSA indexer: the ReLU changes the top-k", "[attention]") {
  // Two heads with signed weights +1 and -1. Without the ReLU key A would
  // score 1 - (-4) = 5 and win; with it, A scores 1 and B 2 - 0.5 = 1.5.
  Store st(/*kv_dim=*/2, /*index_dim=*/2, /*tokens_per_page=*/4);
  REQUIRE(st.cache->Reserve(2).ok());
  const float ka[2] = {1.0f, -4.0f}, kb[2] = {2.0f, 0.5f};
  uint8_t codes[2];
  for (int i = 0; i < 2; ++i) codes[i] = FloatToFp8E4M3(ka[i]);
  REQUIRE(st.cache->WriteIndexKey(0, 0, codes, 1.0f).ok());
  for (int i = 0; i < 2; ++i) codes[i] = FloatToFp8E4M3(kb[i]);
  REQUIRE(st.cache->WriteIndexKey(0, 1, codes, 1.0f).ok());
  const uint8_t q[4] = {FloatToFp8E4M3(1.0f), FloatToFp8E4M3(0.0f),
                        FloatToFp8E4M3(0.0f), FloatToFp8E4M3(1.0f)};
  const float qs[2] = {1.0f, 1.0f};
  const float w[2] = {1.0f, -1.0f};
  float scores[2];
  IndexerScore(st.cache->View(0), 2, q, qs, w, 2, 2, scores);
  const float r = 1.0f / std::sqrt(2.0f);
  CHECK(scores[0] == Approx(1.0f * r));
  CHECK(scores[1] == Approx(1.5f * r));
  std::vector<int32_t> top;
  SelectTopK(scores, 2, 1, &top);
  REQUIRE(top.size() == 1);
  CHECK(top[0] == 1);  // B; without the ReLU it would be A.
}

TEST_CASE("top-k: ties go to the lower position, -0.0 == +0.0", "[attention]") {
  const float s[8] = {1.0f, 3.0f, -0.0f, 3.0f, 0.0f, 2.0f, 3.0f, -1.0f};
  std::vector<int32_t> top;
  SelectTopK(s, 8, 2, &top);
  CHECK(top == std::vector<int32_t>{1, 3});
  SelectTopK(s, 8, 5, &top);
  CHECK(top == std::vector<int32_t>{0, 1, 3, 5, 6});
  // Zeros of both signs tie: the lower position wins.
  const float z[4] = {-1.0f, 0.0f, -0.0f, -2.0f};
  SelectTopK(z, 4, 1, &top);
  CHECK(top == std::vector<int32_t>{1});
  const float z2[4] = {-1.0f, -0.0f, 0.0f, -2.0f};
  SelectTopK(z2, 4, 1, &top);
  CHECK(top == std::vector<int32_t>{1});
  // k >= n: every position (exactly dense).
  SelectTopK(s, 8, 100, &top);
  CHECK(top.size() == 8);
}

// The positions of the min(k, n) highest scores by brute force (ties to
// the lower position, -0.0 == +0.0), in increasing order: what SelectTopK
// must return.
std::vector<int32_t> BruteTopK(const std::vector<float>& s, int k) {
  const int n = int(s.size());
  std::vector<int32_t> idx(n);
  for (int i = 0; i < n; ++i) idx[i] = i;
  std::stable_sort(idx.begin(), idx.end(),
                   [&](int a, int b) { return s[a] > s[b]; });
  idx.resize(std::min(k, n));
  std::sort(idx.begin(), idx.end());
  return idx;
}

TEST_CASE("top-k equals brute force on tie-free random data", "[attention]") {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> d(-1, 1);
  for (int trial = 0; trial < 20; ++trial) {
    const int n = 50 + trial * 37, k = 1 + trial * 5;
    std::vector<float> s(n);
    for (auto& v : s) v = d(rng);
    std::vector<int32_t> top;
    SelectTopK(s.data(), n, k, &top);
    CHECK(top == BruteTopK(s, k));
  }
}

TEST_CASE("MLA absorbed equals the naive expansion", "[attention]") {
  const int H = 3, nope = 4, rope = 2, v = 5, lora = 6, T = 7;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  auto rnd = [&](size_t n) {
    std::vector<float> x(n);
    for (auto& e : x) e = nd(rng);
    return x;
  };
  auto uk = rnd(size_t(H) * nope * lora), uv = rnd(size_t(H) * v * lora);
  auto c = rnd(size_t(T) * lora), kpe = rnd(size_t(T) * rope);
  auto qn = rnd(size_t(H) * nope), qpe = rnd(size_t(H) * rope);
  // Entries go through bf16 as stored; use the rounded values on both sides.
  RoundThroughBf16(c.data(), c.size());
  RoundThroughBf16(kpe.data(), kpe.size());
  const float scale = 1.0f / std::sqrt(float(nope + rope));

  // Naive: k_nope = W_UK c, v = W_UV c per head.
  std::vector<double> naive(size_t(H) * v);
  for (int h = 0; h < H; ++h) {
    std::vector<double> s(T);
    double mx = -1e30;
    for (int t = 0; t < T; ++t) {
      double dot = 0;
      for (int i = 0; i < nope; ++i) {
        double k = 0;
        for (int j = 0; j < lora; ++j)
          k += double(uk[(size_t(h) * nope + i) * lora + j]) * c[t * lora + j];
        dot += qn[h * nope + i] * k;
      }
      for (int i = 0; i < rope; ++i)
        dot += double(qpe[h * rope + i]) * kpe[t * rope + i];
      s[t] = dot * scale;
      mx = std::max(mx, s[t]);
    }
    double z = 0;
    for (int t = 0; t < T; ++t) z += (s[t] = std::exp(s[t] - mx));
    for (int o = 0; o < v; ++o) {
      double acc = 0;
      for (int t = 0; t < T; ++t) {
        double val = 0;
        for (int j = 0; j < lora; ++j)
          val += double(uv[(size_t(h) * v + o) * lora + j]) * c[t * lora + j];
        acc += s[t] / z * val;
      }
      naive[h * v + o] = acc;
    }
  }

  // Absorbed, through the store and MlaAttend.
  Store st(lora + rope, 0, 4);
  REQUIRE(st.cache->Reserve(T).ok());
  for (int t = 0; t < T; ++t) {
    std::vector<float> e(lora + rope);
    std::copy(&c[t * lora], &c[t * lora] + lora, e.begin());
    std::copy(&kpe[t * rope], &kpe[t * rope] + rope, e.begin() + lora);
    std::vector<uint16_t> b(lora + rope);
    FloatToBf16(e.data(), e.size(), b.data());
    REQUIRE(st.cache->WriteKv(0, t, b.data()).ok());
  }
  st.cache->SetLength(0, T);
  AttnShapes sh;
  sh.heads = H;
  sh.kv_lora = lora;
  sh.rope = rope;
  sh.kv_dim = sh.q_dim = lora + rope;
  sh.out_dim = lora;
  sh.softmax_scale = scale;
  std::vector<float> q(size_t(H) * sh.q_dim);
  for (int h = 0; h < H; ++h) {
    for (int j = 0; j < lora; ++j) {
      float a = 0;
      for (int i = 0; i < nope; ++i)
        a += uk[(size_t(h) * nope + i) * lora + j] * qn[h * nope + i];
      q[h * sh.q_dim + j] = a;
    }
    for (int i = 0; i < rope; ++i)
      q[h * sh.q_dim + lora + i] = qpe[h * rope + i];
  }
  std::vector<int32_t> sel(T);
  for (int t = 0; t < T; ++t) sel[t] = t;
  std::vector<float> olat(size_t(H) * lora);
  MlaAttend(st.cache->View(0), sel.data(), T, q.data(), sh, olat.data());
  for (int h = 0; h < H; ++h) {
    for (int o = 0; o < v; ++o) {
      double acc = 0;
      for (int j = 0; j < lora; ++j)
        acc += double(uv[(size_t(h) * v + o) * lora + j]) * olat[h * lora + j];
      CHECK(acc == Approx(naive[h * v + o]).margin(1e-4));
    }
  }
}

TEST_CASE("blocked kernels equal the one-position-at-a-time arithmetic",
          "[attention]") {
  // The kernels vectorise across positions; each position must still get
  // exactly the arithmetic defined in attention.h, so chunking and batching
  // cannot matter.
  const int kDim = 32, kHeads = 8, kN = 150, kLora = 24, kRope = 8;
  Store st(kLora + kRope, kDim, 16);
  REQUIRE(st.cache->Reserve(kN).ok());
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  std::vector<float> keys(size_t(kN) * kDim), scales(kN);
  std::vector<uint8_t> key_codes(size_t(kN) * kDim);
  for (int s = 0; s < kN; ++s) {
    std::vector<float> k(kDim);
    for (auto& v : k) v = nd(rng);
    uint8_t* codes = &key_codes[size_t(s) * kDim];
    scales[s] = QuantizeFp8(k.data(), kDim, codes);
    for (int d = 0; d < kDim; ++d)
      keys[size_t(s) * kDim + d] = Fp8E4M3ToFloat(codes[d]);
    REQUIRE(st.cache->WriteIndexKey(0, s, codes, scales[s]).ok());
    std::vector<float> e(kLora + kRope);
    for (auto& v : e) v = nd(rng);
    std::vector<uint16_t> b(e.size());
    FloatToBf16(e.data(), e.size(), b.data());
    REQUIRE(st.cache->WriteKv(0, s, b.data()).ok());
  }
  st.cache->SetLength(0, kN);
  std::vector<uint8_t> qc(kHeads * kDim);
  std::vector<float> qs(kHeads), w(kHeads);
  for (int h = 0; h < kHeads; ++h) {
    std::vector<float> q(kDim);
    for (auto& v : q) v = nd(rng);
    qs[h] = QuantizeFp8(q.data(), kDim, &qc[h * kDim]);
    w[h] = nd(rng);
  }
  std::vector<float> got(kN);
  IndexerScore(st.cache->View(0), kN, qc.data(), qs.data(), w.data(), kHeads,
               kDim, got.data());
  CheckIndexScores(got.data(), kN, qc.data(), qs.data(), w.data(), kHeads, kDim,
                   key_codes, keys, scales);
  // Scoring a prefix gives the same values as scoring everything.
  std::vector<float> prefix(77);
  IndexerScore(st.cache->View(0), 77, qc.data(), qs.data(), w.data(), kHeads,
               kDim, prefix.data());
  CHECK(std::memcmp(prefix.data(), got.data(), 77 * 4) == 0);

  // MlaAttend against the scalar chain, position by position.
  AttnShapes sh;
  sh.heads = 2;
  sh.kv_lora = kLora;
  sh.rope = kRope;
  sh.kv_dim = sh.q_dim = kLora + kRope;
  sh.out_dim = kLora;
  sh.softmax_scale = 0.25f;
  std::vector<float> q(size_t(sh.heads) * sh.q_dim);
  for (auto& v : q) v = nd(rng);
  std::vector<int32_t> sel;
  for (int s = 0; s < kN; s += 3) sel.push_back(s);
  std::vector<float> o(size_t(sh.heads) * kLora);
  MlaAttend(st.cache->View(0), sel.data(), int(sel.size()), q.data(), sh,
            o.data(), nullptr, AttendUnit::kVector);
  const std::vector<float> want =
      ScalarMlaAttend(st.cache->View(0), sel, q.data(), sh);
  CHECK(std::memcmp(want.data(), o.data(), want.size() * 4) == 0);
  // The tile unit's path, where there is one: within fp32 rounding of a
  // double reference.
  MlaAttend(st.cache->View(0), sel.data(), int(sel.size()), q.data(), sh,
            o.data(), nullptr, AttendUnit::kTileUnit);
  CheckAttendPath(st.cache->View(0), sel, q.data(), sh, want, o);
}

TEST_CASE("attend: several chunks, odd heads and widths, any core count",
          "[attention][core_pool]") {
  // 9 heads (a group of 8 and one more) or 19 (two groups, whose entry
  // slices are widened once for both, and three more), lora 40 (a 32-wide
  // slice and a tail), 1100 selected entries (four whole chunks and a short
  // one), on pages of 7 entries.
  const int heads = GENERATE(9, 19);
  CAPTURE(heads);
  const int kLora = 40, kRope = 8, kN = 1200;
  Store st(kLora + kRope, 32, 7);
  REQUIRE(st.cache->Reserve(kN).ok());
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  for (int s = 0; s < kN; ++s) {
    std::vector<float> e(kLora + kRope);
    for (auto& v : e) v = nd(rng);
    std::vector<uint16_t> b(e.size());
    FloatToBf16(e.data(), e.size(), b.data());
    REQUIRE(st.cache->WriteKv(0, s, b.data()).ok());
  }
  st.cache->SetLength(0, kN);
  AttnShapes sh;
  sh.heads = heads;
  sh.kv_lora = kLora;
  sh.rope = kRope;
  sh.kv_dim = sh.q_dim = kLora + kRope;
  sh.out_dim = kLora;
  sh.softmax_scale = 0.3f;
  std::vector<float> q(size_t(sh.heads) * sh.q_dim);
  for (auto& v : q) v = 2.0f * nd(rng);
  std::vector<int32_t> sel;
  for (int s = 0; s < kN && sel.size() < 1100; ++s) {
    if (s % 12 != 5) sel.push_back(s);
  }
  REQUIRE(sel.size() > size_t(4 * kMlaAttendChunk));
  const std::vector<float> want =
      ScalarMlaAttend(st.cache->View(0), sel, q.data(), sh);
  std::vector<float> o(want.size()), vec(want.size());
  MlaAttend(st.cache->View(0), sel.data(), int(sel.size()), q.data(), sh,
            vec.data(), nullptr, AttendUnit::kVector);
  CHECK(std::memcmp(want.data(), vec.data(), want.size() * 4) == 0);
  MlaAttend(st.cache->View(0), sel.data(), int(sel.size()), q.data(), sh,
            o.data(), nullptr, AttendUnit::kTileUnit);
  CheckAttendPath(st.cache->View(0), sel, q.data(), sh, want, o);
  for (const int cores : {2, 3}) {
    CorePool pool(cores, /*min_parallel_work=*/0);
    std::vector<float> split(want.size(), -1.0f);
    MlaAttend(st.cache->View(0), sel.data(), int(sel.size()), q.data(), sh,
              split.data(), &pool, AttendUnit::kVector);
    CHECK(std::memcmp(want.data(), split.data(), want.size() * 4) == 0);
    // Either path: the same bits for any core count.
    std::fill(split.begin(), split.end(), -1.0f);
    MlaAttend(st.cache->View(0), sel.data(), int(sel.size()), q.data(), sh,
              split.data(), &pool, AttendUnit::kTileUnit);
    CHECK(std::memcmp(o.data(), split.data(), o.size() * 4) == 0);
  }
  // The outputs are convex combinations of the latents: a loose sanity
  // check that the merge weighs the chunks.
  for (float v : o) CHECK(std::fabs(v) < 5.0f);
}

TEST_CASE("indexer: odd shapes and page sizes keep the defined arithmetic",
          "[attention]") {
  const int path = GENERATE(0, 1, 2);
  const int widening = GENERATE(0, 1);
  CAPTURE(path, widening);
  IndexerPathScope scope(path, widening);
  struct Shape {
    int heads, dim, tpp, n, kv = 8;
  };
  // The last: dsa-tiny's pages (KV entries of 144, index pages of 512
  // keys), a scan over three index pages.
  for (const Shape sh : {Shape{13, 20, 7, 100}, Shape{64, 128, 64, 70},
                         Shape{3, 64, 5, 33}, Shape{8, 32, 64, 1100, 144}}) {
    Store st(sh.kv, sh.dim, sh.tpp);
    CAPTURE(sh.n, st.layout.index_tokens_per_page);
    REQUIRE(st.cache->Reserve(sh.n).ok());
    std::mt19937 rng(sh.heads * 100 + sh.dim);
    std::normal_distribution<float> nd;
    std::vector<float> keys(size_t(sh.n) * sh.dim), scales(sh.n);
    std::vector<uint8_t> key_codes(size_t(sh.n) * sh.dim);
    for (int s = 0; s < sh.n; ++s) {
      std::vector<float> k(sh.dim);
      for (auto& v : k) v = nd(rng) * (s % 5 == 0 ? 1e-3f : 1.0f);
      uint8_t* codes = &key_codes[size_t(s) * sh.dim];
      scales[s] = QuantizeFp8(k.data(), sh.dim, codes);
      for (int d = 0; d < sh.dim; ++d) {
        keys[size_t(s) * sh.dim + d] = Fp8E4M3ToFloat(codes[d]);
      }
      REQUIRE(st.cache->WriteIndexKey(0, s, codes, scales[s]).ok());
    }
    std::vector<uint8_t> qc(size_t(sh.heads) * sh.dim);
    std::vector<float> qs(sh.heads), w(sh.heads);
    for (int h = 0; h < sh.heads; ++h) {
      std::vector<float> q(sh.dim);
      for (auto& v : q) v = nd(rng);
      qs[h] = QuantizeFp8(q.data(), sh.dim, &qc[size_t(h) * sh.dim]);
      w[h] = nd(rng);
    }
    std::vector<float> got(sh.n);
    IndexerScore(st.cache->View(0), sh.n, qc.data(), qs.data(), w.data(),
                 sh.heads, sh.dim, got.data());
    CheckIndexScores(got.data(), sh.n, qc.data(), qs.data(), w.data(), sh.heads,
                     sh.dim, key_codes, keys, scales);
    CorePool pool(3, /*min_parallel_work=*/0);
    std::vector<float> split(sh.n);
    IndexerScore(st.cache->View(0), sh.n, qc.data(), qs.data(), w.data(),
                 sh.heads, sh.dim, split.data(), &pool);
    CHECK(std::memcmp(split.data(), got.data(), got.size() * 4) == 0);
  }
}

TEST_CASE(
    "indexer: every fp8 code scores the same in whole and partial "
    "blocks",
    "[attention]") {
  const int path = GENERATE(0, 1, 2);
  const int widening = GENERATE(0, 1);
  CAPTURE(path, widening);
  IndexerPathScope scope(path, widening);
  // Whole 32-key blocks widen normal codes by bit moves and fall back to
  // the byte tables for zero, subnormal and NaN codes (kBitMoves), or take
  // the tables for all (kByteTables); a key scored alone (a partial block)
  // always goes through the tables. Keys here hold every
  // code 0..255, blocks of normal codes only, and normal blocks with a
  // single zero or subnormal code, on contiguous and on split pages.
  const int kDim = 32, kHeads = 8, kN = 32 * 12;
  std::mt19937 rng(23);
  std::vector<uint8_t> codes(size_t(kN) * kDim);
  for (int s = 0; s < kN; ++s) {
    for (int d = 0; d < kDim; ++d) {
      uint8_t c;
      if (s < 8 * 32) {
        c = uint8_t((s * kDim + d) % 256);  // every code, NaNs included
      } else {
        c = uint8_t(8 + rng() % 119);  // normal: exponent 1-15, not NaN
        if (rng() % 2) c |= 0x80;
      }
      codes[size_t(s) * kDim + d] = c;
    }
  }
  codes[size_t(8 * 32 + 40) * kDim + 7] = 0x00;   // a zero in block 9
  codes[size_t(8 * 32 + 70) * kDim + 30] = 0x85;  // a subnormal in block 10
  std::vector<uint8_t> qc(size_t(kHeads) * kDim);
  std::vector<float> qs(kHeads), w(kHeads);
  for (int h = 0; h < kHeads; ++h) {
    std::vector<float> q(kDim);
    for (auto& v : q) v = std::normal_distribution<float>()(rng);
    qs[h] = QuantizeFp8(q.data(), kDim, &qc[size_t(h) * kDim]);
    w[h] = std::normal_distribution<float>()(rng);
  }
  for (const int tpp : {64, 5}) {
    Store st(8, kDim, tpp);
    REQUIRE(st.cache->Reserve(kN).ok());
    for (int s = 0; s < kN; ++s) {
      REQUIRE(st.cache
                  ->WriteIndexKey(0, s, &codes[size_t(s) * kDim],
                                  0.01f * float(1 + s % 7))
                  .ok());
    }
    std::vector<float> got(kN);
    IndexerScore(st.cache->View(0), kN, qc.data(), qs.data(), w.data(), kHeads,
                 kDim, got.data());
    Store alone(8, kDim, 4);
    REQUIRE(alone.cache->Reserve(1).ok());
    int differ = 0;
    for (int s = 0; s < kN; ++s) {
      REQUIRE(alone.cache
                  ->WriteIndexKey(0, 0, &codes[size_t(s) * kDim],
                                  0.01f * float(1 + s % 7))
                  .ok());
      float one;
      IndexerScore(alone.cache->View(0), 1, qc.data(), qs.data(), w.data(),
                   kHeads, kDim, &one);
      differ += std::memcmp(&one, &got[s], 4) != 0;
    }
    CHECK(differ == 0);
  }
}

TEST_CASE(
    "indexer: several queries at once score as each alone, any shape, "
    "limits and core count",
    "[attention][core_pool]") {
  const int path = GENERATE(0, 1, 2);
  CAPTURE(path);
  IndexerPathScope scope(path);
  // The row path's paired queries (8 and 5 heads, 32 and 64 dims; an odd
  // count leaves a query unpaired; from 8 queries on the keys are the B
  // operand, below they are the A operand), the general paths (16 heads, 128
  // dims), limits of a prefill segment (consecutive) and arbitrary ones,
  // pages of 64 and 5 keys, keys with every code (NaN, zero, subnormal).
  struct Case {
    int heads, dim, nq;
    bool causal;
  };
  const int kN = 32 * 9 + 7;
  for (const Case& c :
       {Case{8, 32, 64, true}, Case{8, 32, 7, false}, Case{5, 64, 9, true},
        Case{8, 64, 2, false}, Case{16, 32, 6, true}, Case{8, 128, 3, false},
        Case{8, 32, 1, false}, Case{5, 32, 17, false}, Case{8, 64, 8, false}}) {
    CAPTURE(c.heads, c.dim, c.nq, c.causal);
    std::mt19937 rng(c.heads * 100 + c.dim + c.nq);
    std::vector<uint8_t> codes(size_t(kN) * c.dim);
    for (size_t i = 0; i < codes.size(); ++i) {
      codes[i] = i < size_t(c.dim) * 40 ? uint8_t(i % 256) : uint8_t(rng());
    }
    std::vector<uint8_t> qc(size_t(c.nq) * c.heads * c.dim);
    std::vector<float> qs(size_t(c.nq) * c.heads), w(qs.size());
    for (size_t i = 0; i < qs.size(); ++i) {
      std::vector<float> q(c.dim);
      for (auto& v : q) v = std::normal_distribution<float>()(rng);
      qs[i] = QuantizeFp8(q.data(), c.dim, &qc[i * c.dim]);
      w[i] = std::normal_distribution<float>()(rng);
    }
    std::vector<int> limit(c.nq);
    for (int i = 0; i < c.nq; ++i) {
      limit[i] = c.causal ? kN - c.nq + i + 1 : 1 + int(rng() % kN);
    }
    for (const int tpp : {64, 48, 5}) {
      Store st(8, c.dim, tpp);
      REQUIRE(st.cache->Reserve(kN).ok());
      for (int s = 0; s < kN; ++s) {
        REQUIRE(st.cache
                    ->WriteIndexKey(0, s, &codes[size_t(s) * c.dim],
                                    0.01f * float(1 + s % 7))
                    .ok());
      }
      const LayerView view = st.cache->View(0);
      // Each query alone.
      std::vector<std::vector<float>> want(c.nq);
      for (int i = 0; i < c.nq; ++i) {
        want[i].resize(limit[i]);
        IndexerScore(view, limit[i], &qc[size_t(i) * c.heads * c.dim],
                     &qs[size_t(i) * c.heads], &w[size_t(i) * c.heads], c.heads,
                     c.dim, want[i].data());
      }
      for (const int cores : {0, 2}) {
        CAPTURE(tpp, cores);
        std::unique_ptr<CorePool> pool;
        if (cores > 0) pool = std::make_unique<CorePool>(cores, 0);
        std::vector<std::vector<float>> got(c.nq);
        std::vector<float*> out(c.nq);
        for (int i = 0; i < c.nq; ++i) {
          got[i].assign(size_t(limit[i]) + 32, -7.0f);
          out[i] = got[i].data();
        }
        IndexerScoreQueries(view, c.nq, qc.data(), qs.data(), w.data(), c.heads,
                            c.dim, limit.data(), out.data(), pool.get());
        int differ = 0, beyond = 0;
        for (int i = 0; i < c.nq; ++i) {
          differ += std::memcmp(got[i].data(), want[i].data(),
                                size_t(limit[i]) * 4) != 0;
          for (size_t s = limit[i]; s < got[i].size(); ++s) {
            beyond += got[i][s] != -7.0f;
          }
        }
        CHECK(differ == 0);
        CHECK(beyond == 0);  // nothing written past a query's limit
      }
    }
  }
}

TEST_CASE("indexer: the vdpbf16ps and FMA forms give the same bits",
          "[attention]") {
  // Every code (NaN, zero and subnormal ones included) in keys and
  // queries, whole and partial blocks, the real shape and odd ones; one
  // query and a prefill segment. The process's own choice must be one of
  // the two.
  const IndexerDotsChoice& m = IndexerDotsMeasured();
  INFO("vdpbf16ps " << m.bf16_per_s << "/s, FMA " << m.fma_per_s << "/s");
  CHECK(m.bf16_per_s > 0);
  CHECK(m.fma_per_s > 0);
  CHECK(IndexerVectorDots() == m.dots);
  const CodeWideningChoice& cw = CodeWideningMeasured();
  INFO("bit moves " << cw.bit_moves_ns << " ns, byte tables "
                    << cw.byte_tables_ns << " ns");
  CHECK(cw.bit_moves_ns > 0);
  CHECK(cw.byte_tables_ns > 0);
  struct Shape {
    int heads, dim, tpp, n;
  };
  for (const Shape sh : {Shape{64, 128, 64, 32 * 5 + 9}, Shape{8, 32, 16, 300},
                         Shape{13, 20, 7, 100}, Shape{4, 64, 5, 70}}) {
    CAPTURE(sh.heads, sh.dim, sh.tpp);
    std::mt19937 rng(sh.heads + sh.dim);
    Store st(8, sh.dim, sh.tpp);
    REQUIRE(st.cache->Reserve(sh.n).ok());
    for (int s = 0; s < sh.n; ++s) {
      std::vector<uint8_t> codes(sh.dim);
      for (int d = 0; d < sh.dim; ++d) {
        codes[d] = s < 32 ? uint8_t((s * sh.dim + d) % 256) : uint8_t(rng());
      }
      REQUIRE(st.cache->WriteIndexKey(0, s, codes.data(), 0.02f * (1 + s % 3))
                  .ok());
    }
    const int nq = 3;
    std::vector<uint8_t> qc(size_t(nq) * sh.heads * sh.dim);
    for (size_t i = 0; i < qc.size(); ++i) {
      qc[i] = i < 256 ? uint8_t(255 - i) : uint8_t(rng());
    }
    std::vector<float> qs(size_t(nq) * sh.heads), w(qs.size());
    for (size_t i = 0; i < qs.size(); ++i) {
      qs[i] = 0.01f * float(1 + i % 5);
      w[i] = std::normal_distribution<float>()(rng);
    }
    const int limit[nq] = {sh.n - 2, sh.n - 1, sh.n};
    std::vector<float> got[2][nq];
    for (int form = 0; form < 2; ++form) {
      IndexerPathScope scope(1 + form);
      std::vector<float*> out(nq);
      for (int i = 0; i < nq; ++i) {
        got[form][i].assign(limit[i], -7.0f);
        out[i] = got[form][i].data();
      }
      IndexerScoreQueries(st.cache->View(0), nq, qc.data(), qs.data(), w.data(),
                          sh.heads, sh.dim, limit, out.data());
      std::vector<float> one(sh.n);
      IndexerScore(st.cache->View(0), sh.n, qc.data() + 2 * sh.heads * sh.dim,
                   qs.data() + 2 * sh.heads, w.data() + 2 * sh.heads, sh.heads,
                   sh.dim, one.data());
      CHECK(std::memcmp(one.data(), got[form][2].data(), 4 * size_t(sh.n)) ==
            0);
    }
    for (int i = 0; i < nq; ++i) {
      CHECK(std::memcmp(got[0][i].data(), got[1][i].data(),
                        4 * size_t(limit[i])) == 0);
    }
  }
}

TEST_CASE("top-k: sampled threshold and exact cut equal brute force",
          "[attention]") {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> d(-1, 1);
  // k > 64 takes the exact cut (a bitwise search for the k-th score) over
  // every position or, from 512 scores on with k <= n / 4, over those at or
  // above a sampled threshold (the sample size depends on n and k). From
  // 32768 scores on, a pool's cores compress ranges of them (pools of 2
  // and 3, and sizes off the 32-key grid).
  CorePool pool2(2, 0), pool3(3, 0);
  for (const int n :
       {100, 300, 512, 1000, 2048, 4095, 5000, 20000, 32768, 40007, 131072}) {
    for (const int k : {1, 65, 100, 128, 2048}) {
      for (int pattern = 0; pattern < 6; ++pattern) {
        std::vector<float> s(n);
        for (auto& v : s) v = d(rng);
        switch (pattern) {
          case 1:  // few distinct values, so the cut falls inside a tie
            for (auto& v : s) v = std::round(v * 8.0f) / 8.0f;
            break;
          case 2:  // rising: the best are all at the end of the range
            for (int i = 0; i < n; ++i) s[i] = float(i) / float(n);
            break;
          case 3:  // signed zeros, equal to each other, and a few above
            for (int i = 0; i < n; ++i) {
              s[i] = i % 7 == 0 ? float(i) : (i % 2 == 0 ? -0.0f : 0.0f);
            }
            break;
          case 4:  // infinities of both signs among the scores
            for (int i = 0; i < n; i += 5) s[i] = i % 2 ? INFINITY : -INFINITY;
            break;
          case 5:  // every score negative
            for (auto& v : s) v = -1.0f - std::abs(v);
            break;
          default:
            break;
        }
        std::vector<int32_t> top;
        SelectTopK(s.data(), n, k, &top);
        INFO("n " << n << ", k " << k << ", pattern " << pattern);
        const std::vector<int32_t> want = BruteTopK(s, k);
        CHECK(top == want);
        for (CorePool* pool : {&pool2, &pool3}) {
          std::vector<int32_t> split;
          SelectTopK(s.data(), n, k, &split, pool);
          CHECK(split == want);
        }
      }
    }
  }
}

TEST_CASE("top-k: NaN scores neither crash nor overflow the result",
          "[attention]") {
  // NaN scores (from NaN codes) have no place in the order; the result is
  // still at most k distinct positions in increasing order.
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> d(-1, 1);
  for (const int n : {100, 2048, 20000}) {
    for (const int k : {1, 65, 128}) {
      std::vector<float> s(n);
      for (auto& v : s) v = d(rng);
      for (int i = 3; i < n; i += 97) s[i] = NAN;
      std::vector<int32_t> top;
      SelectTopK(s.data(), n, k, &top);
      CHECK(top.size() <= size_t(k));
      for (size_t j = 0; j < top.size(); ++j) {
        CHECK(top[j] >= 0);
        CHECK(top[j] < n);
        if (j > 0) CHECK(top[j - 1] < top[j]);
      }
    }
  }
}

TEST_CASE("top-k: small-k heap path equals brute force", "[attention]") {
  // k <= 64 takes a one-pass heap; rising, falling, tied and random scores
  // (rising scores make every position enter the heap).
  std::mt19937 rng(17);
  std::uniform_real_distribution<float> d(-1, 1);
  for (const int n : {2, 17, 100, 1000, 8192}) {
    for (const int k : {1, 7, 8, 33, 64, 65}) {
      for (int pattern = 0; pattern < 5; ++pattern) {
        std::vector<float> s(n);
        for (int i = 0; i < n; ++i) {
          switch (pattern) {
            case 0:
              s[i] = d(rng);
              break;
            case 1:
              s[i] = float(i);
              break;  // rising
            case 2:
              s[i] = float(n - i);
              break;  // falling
            case 3:
              s[i] = std::round(d(rng) * 2.0f);
              break;  // few values
            default:
              s[i] = (i % 3 == 0) ? -0.0f : 0.0f;  // signed zeros
          }
        }
        std::vector<int32_t> top;
        SelectTopK(s.data(), n, k, &top);
        CHECK(top == BruteTopK(s, k));
      }
    }
  }
}

TEST_CASE("core pool: every item once, in contiguous ranges", "[core_pool]") {
  for (const int cores : {1, 2, 3, 5}) {
    CorePool pool(cores);
    CHECK(pool.cores() == cores);
    for (const int64_t n : {0, 1, 7, 64, 1000}) {
      for (const int64_t grain : {1, 32}) {
        std::vector<std::atomic<int>> hits(size_t(n) + 1);
        std::atomic<int> calls{0};
        pool.ParallelFor(n, grain, [&](int64_t b, int64_t e) {
          CHECK(b < e);
          CHECK((b % grain) == 0);
          ++calls;
          for (int64_t i = b; i < e; ++i) ++hits[i];
        });
        for (int64_t i = 0; i < n; ++i) CHECK(hits[i].load() == 1);
        CHECK(calls.load() <= cores);
      }
    }
  }
}

// Runs a 3-layer-free session through RunIndexer + RunAttention, the
// positions split into the given segments, on `pool`; returns each token's
// selection and output.
struct SessionRun {
  std::vector<std::vector<int32_t>> selections;
  std::vector<float> outputs;
};
SessionRun RunSession(const std::vector<int>& segments, CorePool* pool) {
  const int kHi = 8, kDi = 32, kLora = 32, kRope = 16, kHeads = 4, kTopk = 24;
  int total = 0;
  for (int n : segments) total += n;
  ModelConfig c;
  c.num_hidden_layers = 1;
  c.attention.type = AttentionType::kMlaDsa;
  c.kv_lora_rank = kLora;
  c.qk_rope_head_dim = kRope;
  c.index_head_dim = kDi;
  KvLayout layout = MakeKvLayout(c, 16);
  auto arena = *PageArena::Create(size_t(16) << 20, layout.page_bytes);
  SessionCache cache(&layout, arena.get());
  REQUIRE(cache.Reserve(total).ok());
  AttnShapes sh;
  sh.heads = kHeads;
  sh.kv_lora = kLora;
  sh.rope = kRope;
  sh.kv_dim = sh.q_dim = kLora + kRope;
  sh.out_dim = kLora;
  sh.index_heads = kHi;
  sh.index_dim = kDi;
  sh.index_topk = kTopk;
  sh.softmax_scale = 0.2f;
  // Per-token inputs, a pure function of the position.
  std::mt19937 rng(21);
  std::normal_distribution<float> nd;
  std::vector<uint8_t> qc(size_t(total) * kHi * kDi), kc(size_t(total) * kDi);
  std::vector<float> qs(size_t(total) * kHi), w(size_t(total) * kHi), ks(total);
  std::vector<float> q(size_t(total) * kHeads * sh.q_dim);
  std::vector<uint16_t> kv(size_t(total) * sh.kv_dim);
  for (int t = 0; t < total; ++t) {
    std::vector<float> x(kDi);
    for (int h = 0; h < kHi; ++h) {
      for (auto& v : x) v = nd(rng);
      qs[size_t(t) * kHi + h] =
          QuantizeFp8(x.data(), kDi, &qc[(size_t(t) * kHi + h) * kDi]);
      w[size_t(t) * kHi + h] = nd(rng);
    }
    for (auto& v : x) v = nd(rng);
    ks[t] = QuantizeFp8(x.data(), kDi, &kc[size_t(t) * kDi]);
    for (int i = 0; i < kHeads * sh.q_dim; ++i) {
      q[size_t(t) * kHeads * sh.q_dim + i] = nd(rng);
    }
    std::vector<float> e(sh.kv_dim);
    for (auto& v : e) v = nd(rng);
    FloatToBf16(e.data(), e.size(), &kv[size_t(t) * sh.kv_dim]);
  }
  SessionRun run;
  run.outputs.resize(size_t(total) * kHeads * kLora);
  int pos = 0;
  for (int n : segments) {
    IndexInputs ii;
    ii.q_codes = &qc[size_t(pos) * kHi * kDi];
    ii.q_scales = &qs[size_t(pos) * kHi];
    ii.weights = &w[size_t(pos) * kHi];
    ii.k_codes = &kc[size_t(pos) * kDi];
    ii.k_scales = &ks[pos];
    SelectionState sel;
    KernelCost cost;
    REQUIRE(RunIndexer(sh, 0, pos, n, ii, &cache, &sel, pool, &cost).ok());
    CHECK(cost.bytes > 0);
    CHECK(cost.flops > 0);
    for (auto& t : sel.per_token) run.selections.push_back(t);
    AttnInputs ai;
    ai.q = &q[size_t(pos) * kHeads * sh.q_dim];
    ai.kv = &kv[size_t(pos) * sh.kv_dim];
    REQUIRE(RunAttention(sh, 0, pos, n, ai, &cache, &sel,
                         &run.outputs[size_t(pos) * kHeads * kLora], pool,
                         &cost)
                .ok());
    pos += n;
  }
  return run;
}

TEST_CASE(
    "indexer and attention: same bits for any core count and any "
    "segmentation",
    "[attention][core_pool]") {
  const SessionRun ref = RunSession(
      {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,   1, 1, 1, 1, 1,
       1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,   1, 1, 1, 1, 1,
       1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 150, 1, 1, 1},
      nullptr);
  REQUIRE(ref.selections.size() == 213);
  CHECK(ref.selections.back().size() == 24);
  for (const int cores : {1, 2, 3}) {
    CorePool pool(cores, /*min_parallel_work=*/0);
    for (const auto& segs : {std::vector<int>{213}, std::vector<int>{70, 143},
                             std::vector<int>{5, 100, 1, 1, 106}}) {
      const SessionRun got = RunSession(segs, &pool);
      CHECK(got.selections == ref.selections);
      REQUIRE(got.outputs.size() == ref.outputs.size());
      CHECK(std::memcmp(got.outputs.data(), ref.outputs.data(),
                        ref.outputs.size() * 4) == 0);
    }
  }
}

TEST_CASE(
    "attend: the tile unit agrees with the vector path to fp32 "
    "rounding, any shape and core count",
    "[attention][core_pool]") {
  // dsa-tiny's shape, an odd one (27 part rows: a 16-row and an 11-row
  // block; lora 40: a padded 32-dim pair), a wide one (48 heads: the
  // whole-chunk weighted sums), two heads and one entry, odd entry widths
  // (37 and 31 dims: a last bf16 pair with one dim), over several chunks,
  // with scores large enough that the softmax is peaked (an inexact split
  // of q or p would show).
  struct Case {
    int heads, lora, rope, n;
    float q_scale;
  };
  for (const Case& c : {Case{8, 128, 16, 2100, 3.0f}, Case{9, 40, 8, 700, 2.0f},
                        Case{48, 64, 16, 400, 1.0f}, Case{2, 16, 0, 40, 4.0f},
                        Case{8, 128, 16, 1, 3.0f}, Case{8, 32, 5, 300, 2.0f},
                        Case{3, 24, 7, 45, 2.0f}}) {
    CAPTURE(c.heads, c.lora, c.rope, c.n);
    Store st(c.lora + c.rope, 32, 64);
    const int tokens = c.n + c.n / 16 + 2;
    REQUIRE(st.cache->Reserve(tokens).ok());
    std::mt19937 rng(c.heads * 1000 + c.lora);
    std::normal_distribution<float> nd;
    for (int s = 0; s < tokens; ++s) {
      std::vector<float> e(c.lora + c.rope);
      for (auto& v : e) v = nd(rng);
      std::vector<uint16_t> b(e.size());
      FloatToBf16(e.data(), e.size(), b.data());
      REQUIRE(st.cache->WriteKv(0, s, b.data()).ok());
    }
    st.cache->SetLength(0, tokens);
    AttnShapes sh;
    sh.heads = c.heads;
    sh.kv_lora = c.lora;
    sh.rope = c.rope;
    sh.kv_dim = sh.q_dim = c.lora + c.rope;
    sh.out_dim = c.lora;
    sh.softmax_scale = 1.0f / std::sqrt(float(sh.kv_dim));
    std::vector<float> q(size_t(sh.heads) * sh.q_dim);
    for (auto& v : q) v = c.q_scale * nd(rng);
    // Every position but a scattered few, in increasing order.
    std::vector<int32_t> sel;
    for (int s = 0; s < tokens && int(sel.size()) < c.n; ++s) {
      if (s % 17 != 3) sel.push_back(s);
    }
    REQUIRE(int(sel.size()) == c.n);
    const LayerView view = st.cache->View(0);
    const std::vector<float> want = ScalarMlaAttend(view, sel, q.data(), sh);
    std::vector<float> vec(want.size()), got(want.size());
    MlaAttend(view, sel.data(), c.n, q.data(), sh, vec.data(), nullptr,
              AttendUnit::kVector);
    CHECK(std::memcmp(want.data(), vec.data(), want.size() * 4) == 0);
    MlaAttend(view, sel.data(), c.n, q.data(), sh, got.data(), nullptr,
              AttendUnit::kTileUnit);
    CheckAttendPath(view, sel, q.data(), sh, want, got);
    // kAuto takes the tile unit only for large enough calls.
    std::vector<float> deflt(want.size());
    MlaAttend(view, sel.data(), c.n, q.data(), sh, deflt.data());
    const bool large = MlaAttendTileWorthIt(c.heads, c.n);
    CHECK(std::memcmp(deflt.data(), large ? got.data() : vec.data(),
                      deflt.size() * 4) == 0);
    if (c.n == 1) {
      // A one-entry selection is that entry's latent, exactly, either way.
      std::vector<float> e(sh.kv_dim);
      Bf16ToFloat(view.Kv(sel[0]), sh.kv_dim, e.data());
      for (int h = 0; h < sh.heads; ++h) {
        CHECK(std::memcmp(&got[size_t(h) * c.lora], e.data(), c.lora * 4) == 0);
        CHECK(std::memcmp(&vec[size_t(h) * c.lora], e.data(), c.lora * 4) == 0);
      }
    }
    for (const int cores : {2, 3}) {
      CorePool pool(cores, /*min_parallel_work=*/0);
      std::vector<float> split(want.size(), -1.0f);
      MlaAttend(view, sel.data(), c.n, q.data(), sh, split.data(), &pool,
                AttendUnit::kTileUnit);
      CHECK(std::memcmp(got.data(), split.data(), got.size() * 4) == 0);
    }
  }
}

TEST_CASE("KernelExp: vector lanes equal the scalar function, near exp",
          "[attention]") {
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> d(-120.0f, 90.0f);
  std::vector<float> xs = {0.0f,    -0.0f, 1.0f,  -1.0f,     -103.9f,  -104.0f,
                           -104.1f, 88.0f, 89.0f, -INFINITY, INFINITY, NAN};
  for (int i = 0; i < 20000; ++i) xs.push_back(d(rng));
  for (const float x : xs) {
    const float e = KernelExp(x);
    if (std::isnan(x)) {
      CHECK(std::isnan(e));
      continue;
    }
    if (x < -104.0f) {
      CHECK(e == 0.0f);
    } else if (x <= 88.0f && x > -87.0f) {
      CHECK(e == Approx(std::exp(double(x))).epsilon(3e-7));
    }
  }
  // The vector path is exercised through MlaAttend in the test above; here
  // softmax weights of a one-entry selection must be exactly 1.
  CHECK(KernelExp(0.0f) == 1.0f);
}

TEST_CASE("page arena: all-or-nothing reservations", "[kv_store]") {
  Store st(8, 4, 4, /*layers=*/2);
  // Per layer, 8 tokens take 2 KV pages and 1 index page (32 keys).
  CHECK(st.layout.index_tokens_per_page == 32);
  CHECK(st.layout.PagesFor(8) == 3);
  CHECK(st.layout.PagesFor(4) == 2);
  CHECK(st.layout.PagesFor(9) == 4);
  auto arena =
      *PageArena::Create(st.layout.page_bytes * 10, st.layout.page_bytes);
  SessionCache a(&st.layout, arena.get());
  REQUIRE(a.Reserve(8).ok());  // 3 pages x 2 layers
  CHECK(arena->free_pages() == 4);
  CHECK(a.bytes() == 6 * st.layout.page_bytes);
  SessionCache b(&st.layout, arena.get());
  CHECK(b.Reserve(9).code() == absl::StatusCode::kResourceExhausted);
  CHECK(arena->free_pages() == 4);  // nothing taken
  REQUIRE(b.Reserve(4).ok());
  CHECK(arena->free_pages() == 0);
  CHECK(b.reserved_tokens() == 4);
  uint16_t kv[8] = {};
  CHECK(b.WriteKv(0, 4, kv).code() == absl::StatusCode::kResourceExhausted);
}

TEST_CASE("KvEntries gives Kv's addresses, page sizes of every kind",
          "[kv_store]") {
  // Powers of two take the shift and the mask, the others the division.
  for (const int tpp : {64, 16, 1, 48, 5}) {
    CAPTURE(tpp);
    Store st(24, 8, tpp);
    const int n = 300;
    REQUIRE(st.cache->Reserve(n).ok());
    st.cache->SetLength(0, n);
    const LayerView v = st.cache->View(0);
    std::vector<int32_t> positions;
    for (int t = n - 1; t >= 0; t -= 7) positions.push_back(t);
    positions.push_back(0);
    positions.push_back(tpp);
    std::vector<const uint16_t*> got(positions.size());
    v.KvEntries(positions.data(), int(positions.size()), got.data());
    int wrong = 0;
    for (size_t j = 0; j < positions.size(); ++j) {
      wrong += got[j] != v.Kv(positions[j]);
    }
    CHECK(wrong == 0);
  }
}

TEST_CASE("GQA pages: each head's k, v and index key rows stored together",
          "[kv_store]") {
  // llama-tiny (k, v) and minimax-tiny (k, v, block index keys), pages of a
  // power of two and of an odd token count; entries written one at a
  // time, in runs that cross pages, and appended.
  for (const char* preset : {"llama-tiny", "minimax-tiny"}) {
    for (const int tpp : {16, 5}) {
      CAPTURE(preset, tpp);
      ModelConfig c = *PresetConfig(preset);
      c.num_hidden_layers = 1;
      const AttnShapes s = MakeAttnShapes(c);
      const KvLayout layout = MakeKvLayout(c, tpp);
      REQUIRE(layout.kv_parts == (s.block_index_dim > 0 ? 3 : 2) * s.kv_heads);
      auto arena = *PageArena::Create(size_t(64) << 20, layout.page_bytes);
      SessionCache one(&layout, arena.get()), run(&layout, arena.get()),
          appended(&layout, arena.get());
      const int n = 47;
      std::vector<uint16_t> kv(size_t(n) * layout.kv_dim);
      std::mt19937 rng(tpp);
      for (auto& x : kv) x = uint16_t(rng());
      for (SessionCache* cache : {&one, &run, &appended}) {
        REQUIRE(cache->Reserve(n).ok());
      }
      for (int t = 0; t < n; ++t) {
        REQUIRE(one.WriteKv(0, t, &kv[size_t(t) * layout.kv_dim]).ok());
        REQUIRE(appended.Append(0, &kv[size_t(t) * layout.kv_dim], nullptr, 0)
                    .ok());
      }
      REQUIRE(run.WriteKvRun(0, 0, 3, kv.data()).ok());
      REQUIRE(run.WriteKvRun(0, 3, n - 3, &kv[size_t(3) * layout.kv_dim]).ok());
      one.SetLength(0, n);
      run.SetLength(0, n);
      int wrong = 0, apart = 0;
      for (SessionCache* cache : {&one, &run, &appended}) {
        const LayerView v = cache->View(0);
        std::vector<uint16_t> got(layout.kv_dim);
        for (int t = 0; t < n; ++t) {
          const uint16_t* want = &kv[size_t(t) * layout.kv_dim];
          v.ReadKv(t, got.data());
          wrong += std::memcmp(got.data(), want, got.size() * 2) != 0;
          for (int g = 0; g < s.kv_heads; ++g) {
            wrong += std::memcmp(v.Part(t, GqaEntry::KPart(s, g)),
                                 want + GqaEntry::K(s, g), s.head_dim * 2) != 0;
            wrong += std::memcmp(v.Part(t, GqaEntry::VPart(s, g)),
                                 want + GqaEntry::V(s, g), s.head_dim * 2) != 0;
            if (s.block_index_dim > 0) {
              wrong += std::memcmp(v.Part(t, GqaEntry::IndexKeyPart(s, g)),
                                   want + GqaEntry::IndexKey(s, g),
                                   s.block_index_dim * 2) != 0;
            }
            // The next position of the page follows right after.
            if ((t + 1) % tpp != 0 && t + 1 < n) {
              const int k = GqaEntry::KPart(s, g);
              apart += v.Part(t + 1, k) != v.Part(t, k) + s.head_dim;
            }
          }
        }
      }
      CHECK(wrong == 0);
      CHECK(apart == 0);
    }
  }
}

TEST_CASE("index keys: every write path stores the codes read back",
          "[kv_store]") {
  // KV pages of 64, 48, 16 and 5 tokens (index pages of their size);
  // dimensions that take the whole-block transpose (32, 128, 16) and that
  // do not (20, 7 with its zero pad code, 1).
  for (const int tpp : {64, 48, 16, 5}) {
    for (const int dim : {32, 128, 16, 20, 7, 1}) {
      CAPTURE(tpp, dim);
      const int n = 200;
      std::mt19937 rng(tpp * 1000 + dim);
      std::vector<uint8_t> codes(size_t(n) * dim);
      for (auto& c : codes) c = uint8_t(rng());
      std::vector<float> scales(n);
      for (int s = 0; s < n; ++s) scales[s] = 0.5f + float(s);
      // Runs of every length from every start, key by key, and appended.
      Store runs(8, dim, tpp), single(8, dim, tpp), appended(8, dim, tpp);
      REQUIRE(runs.cache->Reserve(n).ok());
      REQUIRE(single.cache->Reserve(n).ok());
      REQUIRE(appended.cache->Reserve(n).ok());
      const int lengths[] = {1, 31, 32, 33, 64, 7, 32};
      for (int s = 0, i = 0; s < n; ++i) {
        const int len = std::min(lengths[i % 7], n - s);
        REQUIRE(runs.cache
                    ->WriteIndexKeyRun(0, s, len, &codes[size_t(s) * dim],
                                       &scales[s])
                    .ok());
        s += len;
      }
      std::vector<uint16_t> kv(8);
      for (int s = 0; s < n; ++s) {
        REQUIRE(single.cache
                    ->WriteIndexKey(0, s, &codes[size_t(s) * dim], scales[s])
                    .ok());
        REQUIRE(appended.cache
                    ->Append(0, kv.data(), &codes[size_t(s) * dim], scales[s])
                    .ok());
      }
      runs.cache->SetLength(0, n);
      single.cache->SetLength(0, n);
      int wrong = 0;
      for (Store* st : {&runs, &single, &appended}) {
        const LayerView v = st->cache->View(0);
        std::vector<uint8_t> got(dim);
        for (int s = 0; s < n; ++s) {
          v.IndexKeyCodes(s, got.data());
          wrong += std::memcmp(got.data(), &codes[size_t(s) * dim], dim) != 0;
          wrong += v.IndexScale(s) != scales[s];
        }
      }
      CHECK(wrong == 0);
      // The whole-block transpose leaves the index pages as the per-key
      // path does, unused slots and pad codes included.
      const int itpp = runs.layout.index_tokens_per_page;
      int pages_differ = 0;
      for (int pg = 0; pg * itpp < n; ++pg) {
        pages_differ += std::memcmp(runs.cache->View(0).IndexPageData(pg),
                                    single.cache->View(0).IndexPageData(pg),
                                    runs.layout.page_bytes) != 0;
      }
      CHECK(pages_differ == 0);
      // Pair p of the key in slot j of a block is at 64 p + 2 IndexKeySlot(j).
      const LayerView v = single.cache->View(0);
      const int s = std::min(n - 1, itpp + itpp / 2);
      const uint8_t* at = v.IndexKeyBlock(s / itpp, s % itpp / kIndexKeyBlock) +
                          2 * IndexKeySlot(s % itpp % kIndexKeyBlock);
      CHECK(at[0] == codes[size_t(s) * dim]);
      CHECK(at[size_t(single.layout.IndexPairs() - 1) * 64 + 1] ==
            (dim % 2 == 1 ? 0 : codes[size_t(s) * dim + dim - 1]));
    }
  }
  // The slots are a permutation of the 32 keys.
  std::vector<int> seen(kIndexKeyBlock, 0);
  for (int j = 0; j < kIndexKeyBlock; ++j) ++seen[IndexKeySlot(j)];
  CHECK(std::count(seen.begin(), seen.end(), 1) == kIndexKeyBlock);
}

}  // namespace
}  // namespace karat
