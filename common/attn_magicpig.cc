// gqa_dense, method `magicpig` (MODEL.md; Chen et al., "MagicPIG: LSH
// Sampling for Efficient LLM Generation", §4): SimHash tables over centred
// keys; a key is retrieved when it shares the query's bucket in at least two
// of L tables, and its logit is corrected by its retrieval probability
// (importance sampling); sink and local tokens are attended exactly.
#include <algorithm>
#include <cmath>

#include "common/numeric.h"
#include "common/sparse_attention.h"

namespace karat {

double MagicPigRetrievalProbability(double theta, int bits, int tables) {
  const double p = std::pow(1.0 - theta / M_PI, bits);
  return 1.0 - std::pow(1.0 - p, tables - 1) * (tables * p + 1.0 - p);
}

namespace {

class PigState final : public MethodLayerState {
 public:
  // The centring mean is fixed at the end of the session's first prefill;
  // until then the layer attends densely and no key is hashed.
  bool fixed = false;
  std::vector<float> mean;      // Hkv x d
  std::vector<uint32_t> codes;  // positions x Hkv x L
  std::vector<float> norms;     // positions x Hkv: |centred key|
  size_t bytes() const override {
    return mean.size() * sizeof(float) + codes.size() * sizeof(uint32_t) +
           norms.size() * sizeof(float);
  }
};

class MagicPigAttention final : public SparseAttention {
 public:
  MagicPigAttention(const AttnShapes& s, const AttentionConfig& a,
                    std::vector<float> planes)
      : SparseAttention(s),
        bits_(a.lsh_bits),
        tables_(a.lsh_tables),
        sink_(a.sink),
        local_(a.local),
        planes_(std::move(planes)) {}
  const char* name() const override { return "gqa_dense/magicpig"; }
  std::unique_ptr<MethodLayerState> NewLayerState() const override {
    return std::make_unique<PigState>();
  }

  void OnAppend(const LayerView& view, int pos_start, int n,
                MethodLayerState* state, KernelCost* cost) const override {
    auto* st = static_cast<PigState*>(state);
    if (!st->fixed) return;
    HashKeys(view, pos_start, pos_start + n, st, cost);
  }

  void OnPrefillEnd(const LayerView& view, MethodLayerState* state,
                    KernelCost* cost) const override {
    auto* st = static_cast<PigState*>(state);
    if (st->fixed) return;
    const int hkv = shapes_.kv_heads, d = shapes_.head_dim;
    // Mean of the first prefill's keys without the sink and local tokens
    // (fp32 sum in position order); an empty range leaves the keys as is.
    const int lo = std::min(sink_, view.length);
    const int hi = std::max(lo, view.length - local_);
    st->mean.assign(size_t(hkv) * d, 0.0f);
    std::vector<float> k(d);
    for (int t = lo; t < hi; ++t) {
      for (int g = 0; g < hkv; ++g) {
        Bf16ToFloat(view.Kv(t) + GqaEntry::K(shapes_, g), d, k.data());
        for (int c = 0; c < d; ++c) st->mean[size_t(g) * d + c] += k[c];
      }
    }
    if (hi > lo) {
      for (float& m : st->mean) m /= float(hi - lo);
    }
    st->fixed = true;
    HashKeys(view, 0, view.length, st, cost);
  }

  void Select(const LayerView& view, int pos, const float* q,
              const MethodLayerState* state, std::vector<HeadSelection>* heads,
              KernelCost* cost) const override {
    const auto* st = static_cast<const PigState*>(state);
    const int mid_end = pos - local_ + 1;  // middle: [sink, mid_end)
    if (!st->fixed || mid_end <= sink_) {
      SelectDense(pos, heads);
      return;
    }
    const int H = shapes_.heads, hkv = shapes_.kv_heads, d = shapes_.head_dim;
    const int group = H / hkv;
    heads->resize(H);
    std::vector<uint32_t> qcodes(tables_);
    std::vector<float> k(d);
    for (int h = 0; h < H; ++h) {
      const int g = h / group;
      const float* qh = q + size_t(h) * shapes_.q_dim;
      Hash(qh, qcodes.data());
      float qn = 0.0f;
      for (int c = 0; c < d; ++c) qn = std::fma(qh[c], qh[c], qn);
      qn = std::sqrt(qn);
      HeadSelection& sel = (*heads)[h];
      sel.positions.clear();
      sel.bias.clear();
      for (int t = 0; t < sink_; ++t) {
        sel.positions.push_back(t);
        sel.bias.push_back(0.0f);
      }
      for (int t = sink_; t < mid_end; ++t) {
        const uint32_t* kc = &st->codes[(size_t(t) * hkv + g) * tables_];
        int hits = 0;
        for (int j = 0; j < tables_ && hits < 2; ++j)
          hits += kc[j] == qcodes[j];
        if (hits < 2) continue;
        // Angle between the query and the centred key.
        Bf16ToFloat(view.Kv(t) + GqaEntry::K(shapes_, g), d, k.data());
        const float* mean = &st->mean[size_t(g) * d];
        float dot = 0.0f;
        for (int c = 0; c < d; ++c) dot = std::fma(qh[c], k[c] - mean[c], dot);
        const float kn = st->norms[size_t(t) * hkv + g];
        double cosv =
            qn > 0.0f && kn > 0.0f ? double(dot) / (double(qn) * kn) : 0.0;
        cosv = std::clamp(cosv, -1.0, 1.0);
        const double w =
            MagicPigRetrievalProbability(std::acos(cosv), bits_, tables_);
        sel.positions.push_back(t);
        sel.bias.push_back(static_cast<float>(-std::log(w + 1e-4)));
      }
      for (int t = mid_end; t <= pos; ++t) {
        sel.positions.push_back(t);
        sel.bias.push_back(0.0f);
      }
    }
    cost->bytes += double(mid_end - sink_) * hkv * tables_ * 4;
    cost->flops += double(H) * tables_ * bits_ * d * 2;
  }

 private:
  // Bucket of `x` in every table: bit b of table j is
  // (hyperplane j*K + b) . x > 0.
  void Hash(const float* x, uint32_t* codes) const {
    const int d = shapes_.head_dim;
    for (int j = 0; j < tables_; ++j) {
      uint32_t code = 0;
      for (int b = 0; b < bits_; ++b) {
        const float* plane = &planes_[size_t(j * bits_ + b) * d];
        float dot = 0.0f;
        for (int c = 0; c < d; ++c) dot = std::fma(plane[c], x[c], dot);
        if (dot > 0.0f) code |= uint32_t(1) << b;
      }
      codes[j] = code;
    }
  }

  void HashKeys(const LayerView& view, int from, int to, PigState* st,
                KernelCost* cost) const {
    const int hkv = shapes_.kv_heads, d = shapes_.head_dim;
    st->codes.resize(size_t(to) * hkv * tables_);
    st->norms.resize(size_t(to) * hkv);
    std::vector<float> k(d);
    for (int t = from; t < to; ++t) {
      for (int g = 0; g < hkv; ++g) {
        Bf16ToFloat(view.Kv(t) + GqaEntry::K(shapes_, g), d, k.data());
        const float* mean = &st->mean[size_t(g) * d];
        float nn = 0.0f;
        for (int c = 0; c < d; ++c) {
          k[c] -= mean[c];
          nn = std::fma(k[c], k[c], nn);
        }
        st->norms[size_t(t) * hkv + g] = std::sqrt(nn);
        Hash(k.data(), &st->codes[(size_t(t) * hkv + g) * tables_]);
      }
    }
    cost->bytes += double(to - from) * hkv * d * 2;
    cost->flops += double(to - from) * hkv * tables_ * bits_ * d * 2;
  }

  const int bits_, tables_, sink_, local_;
  const std::vector<float> planes_;  // K*L x d
};

}  // namespace

std::unique_ptr<SparseAttention> NewMagicPigAttention(
    const AttnShapes& s, const AttentionConfig& a,
    std::vector<float> hyperplanes) {
  return std::make_unique<MagicPigAttention>(s, a, std::move(hyperplanes));
}

}  // namespace karat
