// The GQA attention forms (common/sparse_attention.h): hand-worked checks of
// each method's formulas, selections against brute force on small random
// data, sparse == dense when the budget covers the context, and every GQA
// preset end to end through ModelRunner + LocalAttentionBackend.
#include "common/sparse_attention.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <random>
#include <set>

#include "common/core_pool.h"
#include "common/model_runner.h"
#include "common/numeric.h"
#include "common/reference_engine.h"
#include "common/simd_reduce.h"
#include "common/tokenizer.h"
#include "common/weights.h"

namespace karat {
namespace {

ModelFiles Model(const std::string& preset) {
  ModelFiles f;
  auto cfg = PresetConfig(preset);
  REQUIRE(cfg.ok());
  f.config = *cfg;
  f.tensors = GenerateWeights(f.config, 1);
  return f;
}

ModelFiles Model(const ModelConfig& c) {
  ModelFiles f;
  f.config = c;
  f.tensors = GenerateWeights(c, 1);
  return f;
}

std::vector<int32_t> Text(int seed, int len) {
  std::vector<int32_t> p;
  for (int j = 0; j < len; ++j) p.push_back(32 + (seed * 37 + j * 11) % 90);
  return p;
}

const char* kGqaPresets[] = {"minimax-small", "llama-small",
                             "llama-small-quest", "llama-small-magicpig",
                             "llama-small-clusterkv"};

// A layer cache filled with random entries through RunAttentionLayer.
struct RandomLayer {
  ModelConfig cfg;
  AttnShapes shapes;
  KvLayout layout;
  std::unique_ptr<PageArena> arena;
  std::unique_ptr<SessionCache> cache;
  std::unique_ptr<SparseAttention> method;
  std::unique_ptr<AttentionSessionState> state;
  std::mt19937 rng{7};
  static constexpr int kLayer = 2;

  RandomLayer(const ModelConfig& c, int tokens) : cfg(c) {
    shapes = MakeAttnShapes(c);
    layout = MakeKvLayout(c, 16);
    auto a = PageArena::Create(size_t(16) << 20, layout.page_bytes);
    REQUIRE(a.ok());
    arena = std::move(*a);
    cache = std::make_unique<SessionCache>(&layout, arena.get());
    REQUIRE(cache->Reserve(tokens + 64).ok());
    MethodWeights w;
    if (c.attention.method == AttentionMethod::kMagicPig) {
      w.lsh_hyperplanes = Gauss(size_t(c.attention.lsh_bits) *
                                c.attention.lsh_tables * c.head_dim);
    }
    auto m = NewSparseAttention(c, w);
    REQUIRE(m.ok());
    method = std::move(*m);
    state = NewAttentionSessionState(*method, c.num_hidden_layers);
    for (int l = 0; l <= kLayer; ++l) Append(l, 0, tokens, true);
  }
  std::vector<float> Gauss(size_t n) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> v(n);
    for (float& x : v) x = nd(rng);
    return v;
  }
  void Append(int layer, int pos, int n, bool ends_prefill) {
    std::vector<float> q = Gauss(size_t(n) * shapes.heads * shapes.q_dim);
    std::vector<float> kvf = Gauss(size_t(n) * shapes.kv_dim);
    std::vector<uint16_t> kv(kvf.size());
    FloatToBf16(kvf.data(), kvf.size(), kv.data());
    std::vector<float> out(size_t(n) * shapes.heads * shapes.out_dim);
    AttnInputs in{q.data(), kv.data()};
    REQUIRE(RunAttentionLayer(*method, layer, pos, n, in, ends_prefill,
                              cache.get(), state.get(), out.data())
                .ok());
  }
  LayerView View() const { return cache->View(kLayer); }
  std::vector<float> Key(int pos, int g) const {
    std::vector<float> k(shapes.head_dim);
    Bf16ToFloat(View().Part(pos, GqaEntry::KPart(shapes, g)), shapes.head_dim,
                k.data());
    return k;
  }
  std::vector<HeadSelection> Select(int pos, const std::vector<float>& q,
                                    CorePool* pool = nullptr) {
    std::vector<HeadSelection> heads;
    KernelCost cost;
    method->Select(View(), pos, q.data(), state->layers[kLayer].get(), &heads,
                   &cost, pool);
    return heads;
  }
};

float Dot(const float* a, const float* b, int d) {
  float s = 0.0f;
  for (int c = 0; c < d; ++c) s = std::fma(a[c], b[c], s);
  return s;
}

// Top `k` indices of `score` (ties to the lower index), as a set.
std::set<int> BruteTop(const std::vector<float>& score, int k) {
  std::vector<int> idx(score.size());
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = int(i);
  std::stable_sort(idx.begin(), idx.end(),
                   [&](int a, int b) { return score[a] > score[b]; });
  idx.resize(std::min<size_t>(k, idx.size()));
  return std::set<int>(idx.begin(), idx.end());
}

// ---------------------------------------------------------------------------
// Hand-worked formulas

TEST_CASE("magicpig: retrieval probability follows MODEL.md", "[attention]") {
  // K = 1, L = 2, orthogonal: p = 1 - (pi/2)/pi = 0.5, and both tables must
  // collide: w = 1 - 0.5 * (2 * 0.5 + 0.5) = 0.25 = p^2.
  CHECK(MagicPigRetrievalProbability(M_PI / 2, 1, 2) == Approx(0.25));
  CHECK(MagicPigRetrievalProbability(0.0, 8, 32) == Approx(1.0));
  CHECK(MagicPigRetrievalProbability(M_PI, 8, 32) == Approx(0.0));
  // Against the binomial tail P(at least 2 of L tables collide).
  for (int K : {1, 4, 8}) {
    for (int L : {2, 5, 32}) {
      for (double theta : {0.3, 1.0, 2.0}) {
        const double p = std::pow(1.0 - theta / M_PI, K);
        const double tail =
            1.0 - std::pow(1.0 - p, L) - L * p * std::pow(1.0 - p, L - 1);
        CHECK(MagicPigRetrievalProbability(theta, K, L) ==
              Approx(tail).margin(1e-12));
      }
    }
  }
  // And against simulated SimHash tables: random hyperplanes, a key at 60
  // degrees from the query (K = 2, L = 3).
  std::mt19937 rng(3);
  std::normal_distribution<double> nd;
  const int K = 2, L = 3, d = 16, trials = 20000;
  const double theta = M_PI / 3;
  std::vector<double> q(d, 0.0), k(d, 0.0);
  q[0] = 1;
  k[0] = std::cos(theta);
  k[1] = std::sin(theta);
  int retrieved = 0;
  for (int t = 0; t < trials; ++t) {
    int hits = 0;
    for (int j = 0; j < L; ++j) {
      bool same = true;
      for (int b = 0; b < K; ++b) {
        double dq = 0, dk = 0;
        for (int c = 0; c < d; ++c) {
          const double h = nd(rng);
          dq += h * q[c];
          dk += h * k[c];
        }
        same &= (dq > 0) == (dk > 0);
      }
      hits += same;
    }
    retrieved += hits >= 2;
  }
  CHECK(double(retrieved) / trials ==
        Approx(MagicPigRetrievalProbability(theta, K, L)).margin(0.015));
}

TEST_CASE("quest: the bound is at least the true max q.k of every page",
          "[attention]") {
  ModelConfig c = *PresetConfig("llama-small-quest");
  RandomLayer r(c, 77);
  const int d = c.head_dim, P = c.attention.page_size;
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<float> q = r.Gauss(d);
    for (int g = 0; g < c.num_key_value_heads; ++g) {
      for (int p = 0; p * P < 77; ++p) {
        std::vector<float> mn(d, INFINITY), mx(d, -INFINITY);
        float best = -INFINITY;
        for (int t = p * P; t < std::min(77, (p + 1) * P); ++t) {
          auto k = r.Key(t, g);
          for (int i = 0; i < d; ++i) {
            mn[i] = std::min(mn[i], k[i]);
            mx[i] = std::max(mx[i], k[i]);
          }
          best = std::max(best, Dot(q.data(), k.data(), d));
        }
        CHECK(QuestBound(q.data(), mn.data(), mx.data(), d) >=
              best - 1e-4f * std::abs(best));
      }
    }
  }
  // Hand-worked: q = (1, -2), page keys (1, 3) and (-1, 0): m = (-1, 0),
  // M = (1, 3); U = max(1, -1) + max(-6, 0) = 1; true max q.k = 1.
  const float q2[] = {1, -2}, m2[] = {-1, 0}, M2[] = {1, 3};
  CHECK(QuestBound(q2, m2, M2, 2) == 1.0f);
}

// ---------------------------------------------------------------------------
// Selections against brute force

TEST_CASE("quest: page selection equals brute force", "[attention]") {
  // The small preset takes the general kernel; the tiny one (d 64, 4 query
  // heads per KV head) the blocked one, with a page count that is not a
  // multiple of its 4-page step.
  for (const char* preset : {"llama-small-quest", "llama-tiny-quest"}) {
    ModelConfig c = *PresetConfig(preset);
    const bool tiny = std::string(preset) == "llama-tiny-quest";
    const int n = tiny ? 300 : 90, P = c.attention.page_size,
              B = c.attention.page_budget;
    RandomLayer r(c, n);
    const int d = c.head_dim,
              group = c.num_attention_heads / c.num_key_value_heads;
    for (int pos : tiny ? std::vector<int>{n - 1, 250, 213, 150}
                        : std::vector<int>{n - 1, 40, 17}) {
      std::vector<float> q = r.Gauss(size_t(c.num_attention_heads) * d);
      auto heads = r.Select(pos, q);
      const int cur = pos / P;
      for (int h = 0; h < c.num_attention_heads; ++h) {
        std::vector<float> u(cur);
        for (int p = 0; p < cur; ++p) {
          std::vector<float> mn(d, INFINITY), mx(d, -INFINITY);
          for (int t = p * P; t < (p + 1) * P; ++t) {
            auto k = r.Key(t, h / group);
            for (int i = 0; i < d; ++i) {
              mn[i] = std::min(mn[i], k[i]);
              mx[i] = std::max(mx[i], k[i]);
            }
          }
          u[p] = QuestBound(&q[size_t(h) * d], mn.data(), mx.data(), d);
        }
        std::set<int> pages = BruteTop(u, B - 1);
        pages.insert(cur);
        std::vector<int32_t> want;
        for (int p : pages) {
          for (int t = p * P; t <= std::min(pos, (p + 1) * P - 1); ++t) {
            want.push_back(t);
          }
        }
        CHECK(heads[h].positions == want);
      }
    }
  }
}

TEST_CASE("quest: selection equals brute force across page groups",
          "[attention]") {
  // The metadata is kept 64 pages a group: contexts of several groups,
  // appends that cross a group's end, query heads per KV head that take
  // every head-count variant of the kernel (1..4 at a time), and budgets
  // on either side of the running top-k's limit (64 pages besides the
  // current one).
  struct Variant {
    const char* preset;
    int heads, kv_heads, budget;
  };
  for (const Variant& v : {Variant{"llama-tiny-quest", 8, 2, 8},
                           Variant{"llama-small-quest", 4, 2, 70},
                           Variant{"llama-small-quest", 5, 1, 3},
                           Variant{"llama-small-quest", 3, 1, 66},
                           Variant{"llama-small-quest", 6, 1, 65}}) {
    ModelConfig c = *PresetConfig(v.preset);
    c.num_attention_heads = v.heads;
    c.num_key_value_heads = v.kv_heads;
    c.attention.page_budget = v.budget;
    const int P = c.attention.page_size, n0 = 130 * P + 5, more = 2 * P;
    RandomLayer r(c, n0);
    // Then a chunk and single tokens, through page 131 (group 2).
    for (int l = 0; l <= RandomLayer::kLayer; ++l) r.Append(l, n0, more, false);
    for (int t = n0 + more; t < n0 + more + 3; ++t) {
      for (int l = 0; l <= RandomLayer::kLayer; ++l) r.Append(l, t, 1, false);
    }
    const int n = n0 + more + 3, d = c.head_dim, H = v.heads,
              group = v.heads / v.kv_heads;
    for (int pos : {n - 1, n0 + 1, 64 * P, 64 * P - 1, 80 * P + 3}) {
      CAPTURE(v.preset, v.heads, v.kv_heads, v.budget, pos);
      std::vector<float> q = r.Gauss(size_t(H) * d);
      auto heads = r.Select(pos, q);
      REQUIRE(int(heads.size()) == H);
      const int cur = pos / P;
      for (int h = 0; h < H; ++h) {
        std::vector<float> u(cur);
        for (int p = 0; p < cur; ++p) {
          std::vector<float> mn(d, INFINITY), mx(d, -INFINITY);
          for (int t = p * P; t < (p + 1) * P; ++t) {
            auto k = r.Key(t, h / group);
            for (int i = 0; i < d; ++i) {
              mn[i] = std::min(mn[i], k[i]);
              mx[i] = std::max(mx[i], k[i]);
            }
          }
          u[p] = QuestBound(&q[size_t(h) * d], mn.data(), mx.data(), d);
        }
        std::set<int> pages = BruteTop(u, v.budget - 1);
        pages.insert(cur);
        std::vector<int32_t> want;
        for (int p : pages) {
          for (int t = p * P; t <= std::min(pos, (p + 1) * P - 1); ++t) {
            want.push_back(t);
          }
        }
        CHECK(heads[h].positions == want);
      }
      // Split over a pool's cores by KV head (threshold 0, so always where
      // there are two): the same selections.
      CorePool pool(3, 0);
      auto split = r.Select(pos, q, &pool);
      for (int h = 0; h < H; ++h) {
        CHECK(split[h].positions == heads[h].positions);
      }
    }
  }
}

TEST_CASE("RunningTopK keeps SelectTopK's positions", "[attention]") {
  // Scores from a handful of values (many ties, -0.0 and +0.0), some runs
  // with NaNs; every k up to the limit against lengths around multiples
  // of 16.
  std::mt19937 rng(11);
  const float kValues[] = {-1.5f, -0.0f, 0.0f, 0.25f, 1.0f, 2.0f, 3.5f};
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 2 + int(rng() % 300);
    std::vector<float> s(size_t(n + 15) / 16 * 16, 0.0f);
    for (int i = 0; i < n; ++i) {
      s[i] = trial % 3 == 0 ? std::normal_distribution<float>()(rng)
                            : kValues[rng() % 7];
    }
    if (trial % 5 == 4) s[rng() % n] = NAN;
    for (int k : {1, 2, 7, 15, 16, 17, 33, 64}) {
      if (k >= n) continue;
      CAPTURE(trial, n, k);
      std::vector<int32_t> want, got;
      SelectTopK(s.data(), n, k, &want);
      RunningTopK top;
      top.Reset(k, n);
      for (int first = 0; first < n; first += 16) {
        top.Offer16(_mm512_loadu_ps(&s[first]), first);
      }
      top.Take(&got);
      CHECK(got == want);
    }
  }
}

TEST_CASE("gqa_block: current block always taken; top-k equals brute force",
          "[attention]") {
  // minimax-tiny (Di 32, 2 KV heads) takes the 8-blocks-at-a-time kernel.
  for (const char* preset : {"minimax-small", "minimax-tiny"}) {
    ModelConfig c = *PresetConfig(preset);
    const bool tiny = std::string(preset) == "minimax-tiny";
    const int n = tiny ? 400 : 100, bs = c.attention.block_size,
              K = c.attention.topk_blocks;
    RandomLayer r(c, n);
    const AttnShapes& s = r.shapes;
    const int H = s.heads, d = s.head_dim, di = s.block_index_dim;
    const int group = H / s.kv_heads;
    for (int pos : tiny ? std::vector<int>{n - 1, 300, 217, 150}
                        : std::vector<int>{n - 1, 60, 43, 20}) {
      std::vector<float> q = r.Gauss(size_t(H) * s.q_dim);
      auto heads = r.Select(pos, q);
      const int cur = pos / bs;
      for (int h = 0; h < H; ++h) {
        // The current block, always.
        for (int t = cur * bs; t <= pos; ++t) {
          CHECK(std::count(heads[h].positions.begin(), heads[h].positions.end(),
                           t) == 1);
        }
        const int g = h / group;
        std::vector<float> score(cur);
        for (int b = 0; b < cur; ++b) {
          std::vector<float> mean(di, 0.0f), k(di);
          for (int t = b * bs; t < (b + 1) * bs; ++t) {
            Bf16ToFloat(r.View().Part(t, GqaEntry::IndexKeyPart(s, g)), di,
                        k.data());
            for (int i = 0; i < di; ++i) mean[i] += k[i];
          }
          for (float& m : mean) m /= float(bs);
          float acc = 0.0f;
          for (int hh = g * group; hh < (g + 1) * group; ++hh) {
            acc += Dot(&q[size_t(hh) * s.q_dim + d], mean.data(), di);
          }
          score[b] = acc;
        }
        std::set<int> blocks = BruteTop(score, K);
        blocks.insert(cur);
        std::vector<int32_t> want;
        for (int b : blocks) {
          for (int t = b * bs; t <= std::min(pos, (b + 1) * bs - 1); ++t) {
            want.push_back(t);
          }
        }
        CHECK(heads[h].positions == want);
      }
    }
  }
}

TEST_CASE("gqa_block: top-k equals brute force over long contexts",
          "[attention]") {
  // minimax-tiny's 16-blocks-a-step kernel: block counts that are and are
  // not multiples of 16, and top-k on either side of the running top-k's
  // limit (64).
  for (int topk : {8, 64, 70}) {
    ModelConfig c = *PresetConfig("minimax-tiny");
    c.attention.topk_blocks = topk;
    const int bs = c.attention.block_size, n = 100 * bs + 7;
    RandomLayer r(c, n);
    const AttnShapes& s = r.shapes;
    const int H = s.heads, d = s.head_dim, di = s.block_index_dim;
    const int group = H / s.kv_heads;
    for (int pos : {n - 1, 96 * bs, 90 * bs + 5, 71 * bs}) {
      CAPTURE(topk, pos);
      std::vector<float> q = r.Gauss(size_t(H) * s.q_dim);
      auto heads = r.Select(pos, q);
      const int cur = pos / bs;
      for (int g = 0; g < s.kv_heads; ++g) {
        std::vector<float> score(cur);
        for (int b = 0; b < cur; ++b) {
          std::vector<float> mean(di, 0.0f), k(di);
          for (int t = b * bs; t < (b + 1) * bs; ++t) {
            Bf16ToFloat(r.View().Part(t, GqaEntry::IndexKeyPart(s, g)), di,
                        k.data());
            for (int i = 0; i < di; ++i) mean[i] += k[i];
          }
          for (float& m : mean) m /= float(bs);
          float acc = 0.0f;
          for (int hh = g * group; hh < (g + 1) * group; ++hh) {
            acc += Dot(&q[size_t(hh) * s.q_dim + d], mean.data(), di);
          }
          score[b] = acc;
        }
        std::set<int> blocks = BruteTop(score, topk);
        blocks.insert(cur);
        std::vector<int32_t> want;
        for (int b : blocks) {
          for (int t = b * bs; t <= std::min(pos, (b + 1) * bs - 1); ++t) {
            want.push_back(t);
          }
        }
        for (int h = g * group; h < (g + 1) * group; ++h) {
          CHECK(heads[h].positions == want);
        }
      }
      // The 16-block steps split over a pool's cores (threshold 0, so
      // always): the same selections.
      for (int cores : {2, 3, 7}) {
        CAPTURE(cores);
        CorePool pool(cores, 0);
        auto split = r.Select(pos, q, &pool);
        for (int h = 0; h < H; ++h) {
          CHECK(split[h].positions == heads[h].positions);
        }
      }
    }
  }
}

// SparseAttention::Attend's definition (sparse_attention.cc), one head and
// one position at a time.
void ScalarAttend(const AttnShapes& s, const LayerView& view, const float* q,
                  const std::vector<HeadSelection>& heads, float* out) {
  const int d = s.head_dim, group = s.heads / s.kv_heads;
  std::vector<float> k(d), v(d);
  for (int h = 0; h < s.heads; ++h) {
    const int g = h / group;
    const HeadSelection& sel = heads[h];
    const size_t n = sel.positions.size();
    const float* qh = q + size_t(h) * s.q_dim;
    std::vector<float> p(n);
    float m = -INFINITY;
    for (size_t j = 0; j < n; ++j) {
      Bf16ToFloat(view.Part(sel.positions[j], GqaEntry::KPart(s, g)), d,
                  k.data());
      float dot = 0.0f;
      for (int c = 0; c < d; ++c) dot = std::fma(qh[c], k[c], dot);
      p[j] = dot * s.softmax_scale;
      if (!sel.bias.empty()) p[j] += sel.bias[j];
      m = std::max(m, p[j]);
    }
    // The denominator: p_j into lane j % 16 in order, then the lane tree.
    float lanes[16] = {};
    for (size_t j = 0; j < n; ++j) {
      p[j] = KernelExp(p[j] - m);
      lanes[j % 16] += p[j];
    }
    for (int w = 8; w >= 1; w /= 2) {
      for (int l = 0; l < w; ++l) lanes[l] = lanes[l] + lanes[l + w];
    }
    const float inv = 1.0f / lanes[0];
    float* oh = out + size_t(h) * s.out_dim;
    std::fill(oh, oh + d, 0.0f);
    for (size_t j = 0; j < n; ++j) {
      Bf16ToFloat(view.Part(sel.positions[j], GqaEntry::VPart(s, g)), d,
                  v.data());
      const float w = p[j] * inv;
      for (int c = 0; c < d; ++c) oh[c] = std::fma(w, v[c], oh[c]);
    }
  }
}

TEST_CASE("Attend equals its scalar definition bit for bit", "[attention]") {
  // Head dims on the kernel's fast paths (64, 128) and off them (40, 300:
  // masked tails, more channels than one pass holds); selections shared by
  // some of a group's heads, by all heads, or by none, with and without
  // logit offsets, and a NaN in one query.
  for (int hd : {64, 128, 40, 300}) {
    ModelConfig c = *PresetConfig("llama-tiny");
    c.head_dim = hd;
    const int n = 700;
    RandomLayer r(c, n);
    const AttnShapes& s = r.shapes;
    for (int trial = 0; trial < 12; ++trial) {
      CAPTURE(hd, trial);
      const int pos = 1 + int(r.rng() % (n - 1));
      std::vector<HeadSelection> heads(s.heads);
      for (int h = 0; h < s.heads; ++h) {
        const int every = 1 + (trial + h / 2) % 4;
        for (int t = 0; t <= pos; ++t) {
          if (t % every == 0 || t == pos) heads[h].positions.push_back(t);
        }
        if (trial % 3 == 0) {
          for (size_t j = 0; j < heads[h].positions.size(); ++j) {
            heads[h].bias.push_back(j % 5 == 0 ? -3.5f * float(j % 7) : 0.0f);
          }
        }
        if (trial % 4 == 1 && h % 2 == 1) heads[h] = heads[h - 1];
      }
      // Every head the same selection (as a dense layer's): whole groups
      // share it.
      if (trial % 4 == 2) {
        const int last = n - 1 - trial;
        heads[0].positions.clear();
        heads[0].bias.clear();
        for (int t = 0; t <= last; ++t) {
          heads[0].positions.push_back(t);
          if (trial == 6) heads[0].bias.push_back(t % 5 == 0 ? -2.0f : 0.0f);
        }
        for (int h = 1; h < s.heads; ++h) heads[h] = heads[0];
      }
      std::vector<float> q = r.Gauss(size_t(s.heads) * s.q_dim);
      if (trial == 5) q[3] = NAN;
      std::vector<float> want(size_t(s.heads) * s.out_dim, 7.0f);
      std::vector<float> got(want);
      ScalarAttend(s, r.View(), q.data(), heads, want.data());
      KernelCost cost;
      r.method->Attend(r.View(), q.data(), heads, got.data(), &cost);
      CHECK(std::memcmp(got.data(), want.data(), got.size() * 4) == 0);
    }
  }
}

TEST_CASE("a segment's tokens on a core pool give the same outputs and costs",
          "[attention]") {
  for (const char* preset :
       {"llama-tiny", "llama-tiny-quest", "llama-tiny-magicpig",
        "llama-tiny-clusterkv", "minimax-tiny"}) {
    INFO(preset);
    const ModelConfig c = *PresetConfig(preset);
    const AttnShapes s = MakeAttnShapes(c);
    MethodWeights w;
    std::mt19937 rng(9);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    if (c.attention.method == AttentionMethod::kMagicPig) {
      w.lsh_hyperplanes.resize(size_t(c.attention.lsh_bits) *
                               c.attention.lsh_tables * c.head_dim);
      for (float& x : w.lsh_hyperplanes) x = nd(rng);
    }
    auto method = NewSparseAttention(c, w);
    REQUIRE(method.ok());
    const KvLayout layout = MakeKvLayout(c, 16);
    CorePool pool(3, 0);
    // One cache and metadata per way; the same segments go through both.
    struct Way {
      std::unique_ptr<PageArena> arena;
      std::unique_ptr<SessionCache> cache;
      std::unique_ptr<AttentionSessionState> state;
    } way[2];
    for (Way& x : way) {
      x.arena =
          std::move(*PageArena::Create(size_t(32) << 20, layout.page_bytes));
      x.cache = std::make_unique<SessionCache>(&layout, x.arena.get());
      REQUIRE(x.cache->Reserve(1200).ok());
      x.state = NewAttentionSessionState(**method, c.num_hidden_layers);
    }
    const int layer = c.num_hidden_layers - 1;  // a sparse layer
    // A prefill in two segments, then three decode steps (one token: its
    // Attend is split over the pool by KV group).
    const std::pair<int, int> segments[] = {
        {0, 700}, {700, 301}, {1001, 1}, {1002, 1}, {1003, 1}};
    for (const auto& [start, n] : segments) {
      CAPTURE(start, n);
      std::vector<float> q(size_t(n) * s.heads * s.q_dim);
      for (float& x : q) x = nd(rng);
      std::vector<float> kvf(size_t(n) * s.kv_dim);
      for (float& x : kvf) x = nd(rng);
      std::vector<uint16_t> kv(kvf.size());
      FloatToBf16(kvf.data(), kvf.size(), kv.data());
      const AttnInputs in{q.data(), kv.data()};
      const bool ends_prefill = start + n == 1001;
      std::vector<float> out[2];
      KernelCost cost[2];
      for (int i = 0; i < 2; ++i) {
        out[i].assign(size_t(n) * s.heads * s.out_dim, 0.0f);
        REQUIRE(RunAttentionLayer(**method, layer, start, n, in, ends_prefill,
                                  way[i].cache.get(), way[i].state.get(),
                                  out[i].data(), &cost[i],
                                  i == 1 ? &pool : nullptr)
                    .ok());
      }
      CHECK(std::memcmp(out[0].data(), out[1].data(), out[0].size() * 4) == 0);
      CHECK(cost[0].bytes == cost[1].bytes);
      CHECK(cost[0].flops == cost[1].flops);
    }
  }
}

TEST_CASE("magicpig: retrieved set and weights equal brute force",
          "[attention]") {
  // Coarse buckets, so that random keys are retrieved; more tables than one
  // vector compare takes (byte buckets); and buckets wider than a byte,
  // stored in 32 bits. Half of the heads query with a centred key, which
  // shares its buckets in every table.
  const int bits_tables[][2] = {{2, 6}, {6, 70}, {10, 12}};
  for (const auto& bt : bits_tables) {
    DYNAMIC_SECTION("K " << bt[0] << ", L " << bt[1]) {
      ModelConfig c = *PresetConfig("llama-small-magicpig");
      c.attention.lsh_bits = bt[0];
      c.attention.lsh_tables = bt[1];
      const AttentionConfig& a = c.attention;
      const int n = 80;
      RandomLayer r(c, n);  // one prefill: the centring mean is fixed
      const int d = c.head_dim, hkv = c.num_key_value_heads;
      const int group = c.num_attention_heads / hkv;
      // The method's hyperplanes are the first Gauss() draws of the rng.
      std::mt19937 rng2(7);
      std::normal_distribution<float> nd(0.0f, 1.0f);
      std::vector<float> planes(size_t(a.lsh_bits) * a.lsh_tables * d);
      for (float& x : planes) x = nd(rng2);
      std::vector<std::vector<float>> mean(hkv, std::vector<float>(d, 0.0f));
      for (int t = a.sink; t < n - a.local; ++t) {
        for (int g = 0; g < hkv; ++g) {
          auto k = r.Key(t, g);
          for (int i = 0; i < d; ++i) mean[g][i] += k[i];
        }
      }
      for (auto& m : mean) {
        for (float& x : m) x /= float(n - a.local - a.sink);
      }
      auto bucket = [&](const float* x, int j) {
        uint32_t code = 0;
        for (int b = 0; b < a.lsh_bits; ++b) {
          if (Dot(&planes[size_t(j * a.lsh_bits + b) * d], x, d) > 0) {
            code |= 1u << b;
          }
        }
        return code;
      };
      int retrieved_total = 0;
      const int pos = n - 1;
      std::vector<float> q = r.Gauss(size_t(c.num_attention_heads) * d);
      for (int h = 0; h < c.num_attention_heads; h += 2) {
        auto k = r.Key(a.sink + 3 * h, h / group);
        for (int i = 0; i < d; ++i)
          q[size_t(h) * d + i] = k[i] - mean[h / group][i];
      }
      auto heads = r.Select(pos, q);
      for (int h = 0; h < c.num_attention_heads; ++h) {
        const float* qh = &q[size_t(h) * d];
        std::vector<int32_t> want;
        std::vector<float> bias;
        for (int t = 0; t <= pos; ++t) {
          if (t < a.sink || t > pos - a.local) {
            want.push_back(t);
            bias.push_back(0.0f);
            continue;
          }
          auto k = r.Key(t, h / group);
          for (int i = 0; i < d; ++i) k[i] -= mean[h / group][i];
          int hits = 0;
          for (int j = 0; j < a.lsh_tables; ++j) {
            hits += bucket(qh, j) == bucket(k.data(), j);
          }
          if (hits < 2) continue;
          // Clamped: a query equal to the key can round just past 1.
          const double cosv = std::clamp<double>(
              Dot(qh, k.data(), d) / (std::sqrt(Dot(qh, qh, d)) *
                                      std::sqrt(Dot(k.data(), k.data(), d))),
              -1.0, 1.0);
          const double p = std::pow(1 - std::acos(cosv) / M_PI, a.lsh_bits);
          const double w = 1 - std::pow(1 - p, a.lsh_tables - 1) *
                                   (a.lsh_tables * p + 1 - p);
          want.push_back(t);
          bias.push_back(float(-std::log(w + 1e-4)));
          ++retrieved_total;
        }
        REQUIRE(heads[h].positions == want);
        for (size_t j = 0; j < bias.size(); ++j) {
          CHECK(heads[h].bias[j] == Approx(bias[j]).epsilon(1e-4).margin(1e-4));
        }
      }
      CHECK(retrieved_total > 0);
      CHECK(retrieved_total < c.num_attention_heads *
                                  (n - a.sink - a.local));  // and it drops some
      // The scan split over a pool's cores by token range (threshold 0, so
      // always) selects the same positions with the same offsets.
      for (int cores : {2, 3, 7}) {
        CAPTURE(cores);
        CorePool pool(cores, 0);
        auto split = r.Select(pos, q, &pool);
        REQUIRE(split.size() == heads.size());
        for (size_t h = 0; h < heads.size(); ++h) {
          CHECK(split[h].positions == heads[h].positions);
          CHECK(split[h].bias == heads[h].bias);
        }
      }
    }
  }
}

// ClusterKV's clustering of tokens [from, to) of KV head g and its take for
// one query head, by the definition (attn_clusterkv.cc), one centroid at a
// time: k-means under cosine similarity from evenly spaced tokens, ties to
// the lower cluster; clusters in creation order, best q . centroid first.
std::vector<int> ScalarClusterTake(const RandomLayer& r, int g, int from,
                                   int to, const float* qh) {
  const AttentionConfig& a = r.cfg.attention;
  const int d = r.shapes.head_dim, n = to - from;
  const int k = (n + a.cluster_size - 1) / a.cluster_size;
  std::vector<std::vector<float>> x(n), cent(k);
  std::vector<float> xn(n), cn(k);
  for (int i = 0; i < n; ++i) {
    x[i] = r.Key(from + i, g);
    xn[i] = std::sqrt(Dot(x[i].data(), x[i].data(), d));
  }
  for (int j = 0; j < k; ++j) cent[j] = x[size_t(int64_t(j) * n / k)];
  std::vector<int> assign(n);
  for (int round = 0; round < std::max(1, a.kmeans_iters); ++round) {
    for (int j = 0; j < k; ++j) {
      cn[j] = std::sqrt(Dot(cent[j].data(), cent[j].data(), d));
    }
    for (int i = 0; i < n; ++i) {
      int best = 0;
      float best_cos = -INFINITY;
      for (int j = 0; j < k; ++j) {
        const float den = xn[i] * cn[j];
        const float cosv =
            den > 0.0f ? Dot(x[i].data(), cent[j].data(), d) / den : 0.0f;
        if (cosv > best_cos) {
          best_cos = cosv;
          best = j;
        }
      }
      assign[i] = best;
    }
    if (a.kmeans_iters == 0) break;
    std::vector<std::vector<float>> sum(k, std::vector<float>(d, 0.0f));
    std::vector<int> count(k, 0);
    for (int i = 0; i < n; ++i) {
      for (int c = 0; c < d; ++c) sum[assign[i]][c] += x[i][c];
      ++count[assign[i]];
    }
    for (int j = 0; j < k; ++j) {
      if (count[j] == 0) continue;
      for (int c = 0; c < d; ++c) cent[j][c] = sum[j][c] / float(count[j]);
    }
  }
  std::vector<std::vector<int>> members(k);
  for (int i = 0; i < n; ++i) members[assign[i]].push_back(from + i);
  std::vector<int> live, order;
  std::vector<float> score;
  for (int j = 0; j < k; ++j) {
    if (members[j].empty()) continue;
    live.push_back(j);
    score.push_back(Dot(qh, cent[j].data(), d));
  }
  order.resize(live.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = int(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int u, int v) { return score[u] > score[v]; });
  std::vector<int> take;
  int left = a.cluster_budget;
  for (int o : order) {
    if (left == 0) break;
    const std::vector<int>& m = members[live[o]];
    const int t = std::min(left, int(m.size()));
    take.insert(take.end(), m.begin(), m.begin() + t);
    left -= t;
  }
  return take;
}

TEST_CASE("clusterkv: clusters and take equal the scalar k-means",
          "[attention]") {
  // Enough tokens for several vectors of centroids (over 64 clusters: a
  // group of four vectors scored together, and one more), and a head dim
  // off the 16-lane grid.
  for (int hd : {64, 40}) {
    ModelConfig c = *PresetConfig("llama-tiny-clusterkv");
    c.head_dim = hd;
    const AttentionConfig& a = c.attention;
    const int n = 1200;
    RandomLayer r(c, n);
    const int H = r.shapes.heads, group = H / r.shapes.kv_heads;
    for (int l = 0; l <= RandomLayer::kLayer; ++l) r.Append(l, n, 1, false);
    for (int trial = 0; trial < 6; ++trial) {
      CAPTURE(hd, trial);
      std::vector<float> q = r.Gauss(size_t(H) * r.shapes.q_dim);
      auto heads = r.Select(n, q);
      for (int h = 0; h < H; ++h) {
        std::vector<int> want = ScalarClusterTake(
            r, h / group, a.sink, n, &q[size_t(h) * r.shapes.q_dim]);
        for (int t = 0; t < a.sink; ++t) want.push_back(t);
        want.push_back(n);
        std::sort(want.begin(), want.end());
        CHECK(heads[h].positions ==
              std::vector<int32_t>(want.begin(), want.end()));
      }
      // Split over a pool's cores by head (threshold 0, so always): the
      // same take.
      for (int cores : {2, 3}) {
        CorePool pool(cores, 0);
        auto split = r.Select(n, q, &pool);
        for (int h = 0; h < H; ++h) {
          CHECK(split[h].positions == heads[h].positions);
        }
      }
    }
  }
}

TEST_CASE("clusterkv: clusters partition the prefill; take equals brute force",
          "[attention]") {
  ModelConfig c = *PresetConfig("llama-small-clusterkv");
  const AttentionConfig& a = c.attention;
  const int n = 70;
  RandomLayer r(c, n);
  const int d = c.head_dim, H = c.num_attention_heads;
  // Decode tokens after the prefill are not clustered: attended exactly.
  r.Append(0, n, 3, false);
  r.Append(1, n, 3, false);
  r.Append(RandomLayer::kLayer, n, 3, false);
  const int pos = n + 2;
  std::vector<float> q = r.Gauss(size_t(H) * d);
  auto heads = r.Select(pos, q);
  for (int h = 0; h < H; ++h) {
    const auto& p = heads[h].positions;
    std::set<int> got(p.begin(), p.end());
    CHECK(got.size() == p.size());
    for (int t = 0; t < a.sink; ++t) CHECK(got.count(t) == 1);
    for (int t = n; t <= pos; ++t) CHECK(got.count(t) == 1);
    // Exactly the budget from the clusters.
    CHECK(int(p.size()) == a.sink + a.cluster_budget + 3);
  }
  // One more turn's prefill clusters the tokens since the last clustering.
  for (int l = 0; l <= RandomLayer::kLayer; ++l) {
    r.Append(l, n + 3, 20, true);
    r.Append(l, n + 23, 1, false);
  }
  auto after = r.Select(n + 23, r.Gauss(size_t(H) * d));
  CHECK(int(after[0].positions.size()) == a.sink + a.cluster_budget + 1);
}

// ---------------------------------------------------------------------------
// Model level

std::vector<float> LastLogits(const ModelFiles& f, int len) {
  auto runner = ModelRunner::Create(f);
  REQUIRE(runner.ok());
  LocalAttentionBackend be(f.config, 16, size_t(64) << 20);
  if (auto it = f.tensors.find("model.lsh_hyperplanes");
      it != f.tensors.end()) {
    be.SetMethodWeights(MethodWeights{it->second.data});
  }
  REQUIRE(be.Init().ok());
  REQUIRE(be.Reserve(1, len + 8).ok());
  std::vector<int32_t> p{kBosToken};
  auto t = Text(1, len - 1);
  p.insert(p.end(), t.begin(), t.end());
  Segment pre{1, 0, p, true};
  REQUIRE((*runner)->Step({pre}, &be).ok());
  Segment dec{1, len, {65}};
  auto l = (*runner)->Step({dec}, &be);
  REQUIRE(l.ok());
  return (*l)[0];
}

TEST_CASE("sparse == dense bit for bit when the budget covers the context",
          "[model]") {
  const int len = 100;
  const std::vector<float> dense = LastLogits(Model("llama-small"), len);
  ModelConfig quest = *PresetConfig("llama-small-quest");
  quest.attention.page_budget = 64;
  ModelConfig pig = *PresetConfig("llama-small-magicpig");
  pig.attention.local = 128;
  ModelConfig ckv = *PresetConfig("llama-small-clusterkv");
  ckv.attention.cluster_budget = 512;
  for (const ModelConfig& c : {quest, pig, ckv}) {
    INFO(AttentionMethodName(c.attention.method));
    const std::vector<float> l = LastLogits(Model(c), len);
    REQUIRE(l.size() == dense.size());
    CHECK(std::memcmp(l.data(), dense.data(), l.size() * 4) == 0);
  }
  // And with the presets' budgets the methods drop tokens: different logits.
  for (const char* p :
       {"llama-small-quest", "llama-small-magicpig", "llama-small-clusterkv"}) {
    INFO(p);
    const std::vector<float> l = LastLogits(Model(p), len);
    CHECK(std::memcmp(l.data(), dense.data(), l.size() * 4) != 0);
  }
  // gqa_block: top-k over every block == one block holding everything.
  ModelConfig all = *PresetConfig("minimax-small");
  all.attention.topk_blocks = 64;
  ModelConfig one = *PresetConfig("minimax-small");
  one.attention.block_size = 4096;
  const auto a = LastLogits(Model(all), len), b = LastLogits(Model(one), len);
  CHECK(std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
}

TEST_CASE("every GQA preset runs; chunked prefill gives the same tokens",
          "[model]") {
  for (const char* preset : kGqaPresets) {
    INFO(preset);
    ModelFiles f = Model(preset);
    ReferenceOptions whole, chunked;
    chunked.prefill_chunk = 7;
    chunked.tokens_per_page = 8;
    auto e1 = ReferenceEngine::Create(f, whole);
    auto e2 = ReferenceEngine::Create(f, chunked);
    REQUIRE(e1.ok());
    REQUIRE(e2.ok());
    ReferenceSession s1, s2;
    for (int turn = 0; turn < 2; ++turn) {
      auto p = Text(turn + 3, 70);
      auto a = (*e1)->RunTurn(&s1, p, 10, turn == 1 ? 0.8f : 0.0f);
      auto b = (*e2)->RunTurn(&s2, p, 10, turn == 1 ? 0.8f : 0.0f);
      REQUIRE(a.ok());
      REQUIRE(b.ok());
      CHECK(*a == *b);
      CHECK(a->size() >= 1);
    }
  }
}

TEST_CASE("GQA logits are bit-identical alone and inside a batch", "[model]") {
  for (const char* preset : {"llama-small-quest", "minimax-small"}) {
    INFO(preset);
    ModelFiles f = Model(preset);
    auto runner = ModelRunner::Create(f);
    REQUIRE(runner.ok());
    const int kBatch = 6;
    auto prompt = [](int i) {
      std::vector<int32_t> p{kBosToken};
      auto t = Text(i, 40 + 9 * i);
      p.insert(p.end(), t.begin(), t.end());
      return p;
    };
    std::vector<std::vector<float>> alone(kBatch);
    for (int i = 0; i < kBatch; ++i) {
      LocalAttentionBackend be(f.config, 16, size_t(64) << 20);
      REQUIRE(be.Init().ok());
      REQUIRE(be.Reserve(i + 1, 128).ok());
      Segment seg{uint64_t(i + 1), 0, prompt(i), true};
      REQUIRE((*runner)->Step({seg}, &be).ok());
      Segment dec{uint64_t(i + 1), int(seg.tokens.size()), {42}};
      auto l = (*runner)->Step({dec}, &be);
      REQUIRE(l.ok());
      alone[i] = (*l)[0];
    }
    LocalAttentionBackend be(f.config, 16, size_t(64) << 20);
    REQUIRE(be.Init().ok());
    std::vector<Segment> pre, dec;
    for (int i = 0; i < kBatch; ++i) {
      REQUIRE(be.Reserve(i + 1, 128).ok());
      pre.push_back({uint64_t(i + 1), 0, prompt(i), true});
      dec.push_back({uint64_t(i + 1), int(pre.back().tokens.size()), {42}});
    }
    REQUIRE((*runner)->Step(pre, &be).ok());
    auto b = (*runner)->Step(dec, &be);
    REQUIRE(b.ok());
    for (int i = 0; i < kBatch; ++i) {
      CHECK(std::memcmp((*b)[i].data(), alone[i].data(), alone[i].size() * 4) ==
            0);
    }
  }
}

TEST_CASE("RunAttentionLayer reports what the kernels read and computed",
          "[attention]") {
  for (const char* preset : kGqaPresets) {
    INFO(preset);
    ModelConfig c = *PresetConfig(preset);
    RandomLayer r(c, 60);
    const AttnShapes& s = r.shapes;
    std::vector<float> q(size_t(s.heads) * s.q_dim, 0.5f),
        out(s.heads * s.out_dim);
    std::vector<uint16_t> kv(s.kv_dim, FloatToBf16(0.25f));
    KernelCost cost;
    REQUIRE(RunAttentionLayer(*r.method, RandomLayer::kLayer, 60, 1,
                              AttnInputs{q.data(), kv.data()}, false,
                              r.cache.get(), r.state.get(), out.data(), &cost)
                .ok());
    // At least the selected keys and values of every KV head were read.
    CHECK(cost.bytes >= double(s.kv_heads) * s.head_dim * 2 * 2);
    CHECK(cost.flops > 0);
  }
}

TEST_CASE("magicpig without its hyperplanes is refused", "[model]") {
  ModelConfig c = *PresetConfig("llama-small-magicpig");
  LocalAttentionBackend be(c, 16, size_t(1) << 20);
  absl::Status st = be.Init();
  CHECK(absl::IsInvalidArgument(st));
  CHECK(std::string(st.message()).find("lsh_hyperplanes") != std::string::npos);
}

// ---------------------------------------------------------------------------
// Configs refused at load, naming the field

void ExpectRefused(const ModelConfig& c, const std::string& field) {
  absl::Status st = ValidateModelConfig(c, "cfg.json");
  INFO(field << ": " << st);
  CHECK(absl::IsInvalidArgument(st));
  CHECK(std::string(st.message()).find("'" + field + "'") != std::string::npos);
}

TEST_CASE("inconsistent GQA configs are refused naming the field", "[model]") {
  const ModelConfig llama = *PresetConfig("llama-small");
  const ModelConfig block = *PresetConfig("minimax-small");
  ModelConfig c = llama;
  c.num_key_value_heads = 3;  // does not divide 4 query heads
  ExpectRefused(c, "num_key_value_heads");
  c = llama;
  c.num_key_value_heads = 0;
  ExpectRefused(c, "num_key_value_heads");
  c = llama;
  c.head_dim = 31;  // RoPE pairs over the whole head
  ExpectRefused(c, "head_dim");
  c = block;
  c.index_head_dim = 0;
  ExpectRefused(c, "index_head_dim");
  c = block;
  c.attention.topk_blocks = 0;
  ExpectRefused(c, "attention.topk_blocks");
  c = block;
  c.attention.method = AttentionMethod::kQuest;  // methods are gqa_dense's
  ExpectRefused(c, "attention.method");
  c = *PresetConfig("llama-small-quest");
  c.attention.page_budget = 0;
  ExpectRefused(c, "attention.page_budget");
  c = *PresetConfig("llama-small-magicpig");
  c.attention.lsh_tables = 1;
  ExpectRefused(c, "attention.lsh_tables");
  c = *PresetConfig("llama-small-magicpig");
  c.attention.lsh_bits = 33;
  ExpectRefused(c, "attention.lsh_bits");
  c = *PresetConfig("llama-small-clusterkv");
  c.attention.cluster_size = 0;
  ExpectRefused(c, "attention.cluster_size");

  // An unknown method in config.json.
  std::string json = ModelConfigToJson(llama);
  const size_t at = json.find("\"dense\"");
  REQUIRE(at != std::string::npos);
  json.replace(at, 7, "\"sparse\"");
  auto parsed = ParseModelConfig(json, "cfg.json");
  REQUIRE(!parsed.ok());
  CHECK(std::string(parsed.status().message()).find("attention.method") !=
        std::string::npos);
  // Every GQA preset itself is accepted and runs through the registry.
  for (const char* p : kGqaPresets) {
    INFO(p);
    ModelFiles f = Model(p);
    CHECK(ValidateModelConfig(f.config, p).ok());
    auto runner = ModelRunner::Create(f);
    CHECK(runner.ok());
  }
}

}  // namespace
}  // namespace karat
