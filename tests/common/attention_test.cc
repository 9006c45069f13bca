// Hand-worked and brute-force checks of the KARAT-side kernels.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <random>

#include "common/attention.h"
#include "common/kv_store.h"
#include "common/numeric.h"

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

TEST_CASE("top-k equals brute force on tie-free random data", "[attention]") {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> d(-1, 1);
  for (int trial = 0; trial < 20; ++trial) {
    const int n = 50 + trial * 37, k = 1 + trial * 5;
    std::vector<float> s(n);
    for (auto& v : s) v = d(rng);
    std::vector<int32_t> top;
    SelectTopK(s.data(), n, k, &top);
    std::vector<int32_t> idx(n);
    for (int i = 0; i < n; ++i) idx[i] = i;
    std::sort(idx.begin(), idx.end(), [&](int a, int b) { return s[a] > s[b]; });
    idx.resize(std::min(k, n));
    std::sort(idx.begin(), idx.end());
    CHECK(top == idx);
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
      for (int i = 0; i < rope; ++i) dot += double(qpe[h * rope + i]) * kpe[t * rope + i];
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
    for (int i = 0; i < rope; ++i) q[h * sh.q_dim + lora + i] = qpe[h * rope + i];
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
  // exactly the scalar fma chain, so chunking and batching cannot matter.
  const int kDim = 32, kHeads = 8, kN = 150, kLora = 24, kRope = 8;
  Store st(kLora + kRope, kDim, 16);
  REQUIRE(st.cache->Reserve(kN).ok());
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  std::vector<float> keys(size_t(kN) * kDim), scales(kN);
  for (int s = 0; s < kN; ++s) {
    std::vector<float> k(kDim);
    for (auto& v : k) v = nd(rng);
    uint8_t codes[kDim];
    scales[s] = QuantizeFp8(k.data(), kDim, codes);
    for (int d = 0; d < kDim; ++d) keys[size_t(s) * kDim + d] = Fp8E4M3ToFloat(codes[d]);
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
  const float dim_scale = 1.0f / std::sqrt(float(kDim));
  for (int s = 0; s < kN; ++s) {
    float acc = 0.0f;
    for (int h = 0; h < kHeads; ++h) {
      float dot = 0.0f;
      for (int d = 0; d < kDim; ++d)
        dot = std::fma(Fp8E4M3ToFloat(qc[h * kDim + d]), keys[size_t(s) * kDim + d], dot);
      const float v = dot * qs[h] * scales[s];
      acc = std::fma(w[h] * dim_scale, v > 0.0f ? v : 0.0f, acc);
    }
    CHECK(std::memcmp(&acc, &got[s], 4) == 0);
  }
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
  MlaAttend(st.cache->View(0), sel.data(), int(sel.size()), q.data(), sh, o.data());
  const LayerView v = st.cache->View(0);
  for (int h = 0; h < sh.heads; ++h) {
    std::vector<float> sc(sel.size());
    float m = -INFINITY;
    for (size_t j = 0; j < sel.size(); ++j) {
      std::vector<float> e(sh.kv_dim);
      Bf16ToFloat(v.Kv(sel[j]), sh.kv_dim, e.data());
      float dot = 0.0f;
      for (int d = 0; d < sh.kv_dim; ++d) dot = std::fma(q[h * sh.q_dim + d], e[d], dot);
      sc[j] = dot * sh.softmax_scale;
      m = std::max(m, sc[j]);
    }
    float z = 0.0f;
    for (auto& x : sc) z += (x = std::exp(x - m));
    std::vector<float> want(kLora, 0.0f);
    for (size_t j = 0; j < sel.size(); ++j) {
      std::vector<float> e(sh.kv_dim);
      Bf16ToFloat(v.Kv(sel[j]), sh.kv_dim, e.data());
      const float p = sc[j] * (1.0f / z);
      for (int d = 0; d < kLora; ++d) want[d] = std::fma(p, e[d], want[d]);
    }
    CHECK(std::memcmp(want.data(), &o[h * kLora], kLora * 4) == 0);
  }
}

TEST_CASE("page arena: all-or-nothing reservations", "[kv_store]") {
  Store st(8, 4, 4, /*layers=*/2);
  auto arena = *PageArena::Create(st.layout.page_bytes * 6, st.layout.page_bytes);
  SessionCache a(&st.layout, arena.get());
  REQUIRE(a.Reserve(8).ok());  // 2 pages x 2 layers
  CHECK(arena->free_pages() == 2);
  SessionCache b(&st.layout, arena.get());
  CHECK(b.Reserve(9).code() == absl::StatusCode::kResourceExhausted);
  CHECK(arena->free_pages() == 2);  // nothing taken
  REQUIRE(b.Reserve(4).ok());
  CHECK(arena->free_pages() == 0);
  uint16_t kv[8] = {};
  CHECK(b.WriteKv(0, 4, kv).code() == absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace karat
