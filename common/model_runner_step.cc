// ModelRunner::Step, the forward pass over a batch of segments: embedding,
// per layer attention (MLA with the DSA indexer, or the GQA forms) through
// an AttentionBackend, the dense FFN or the routed MoE (locally or through
// an ExpertBackend), then the final norm and LM head.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/linear.h"
#include "common/model_runner.h"
#include "common/model_runner_internal.h"
#include "common/numeric.h"
#include "common/status_macros.h"

namespace karat {

using runner_internal::Hadamard;
using runner_internal::Layer;
using runner_internal::LayerNorm;
using runner_internal::RmsNorm;
using runner_internal::RopeHalfSplit;
using runner_internal::RopeInterleaved;
using runner_internal::RopeTable;

namespace {

// GQA projections for one layer (MODEL.md "gqa_block", "gqa_dense"):
// q = W_q x [H, d], k, v = W_k x, W_v x [Hkv, d]; q and k roped with
// interleaved pairs over the whole head_dim at the absolute position (the
// step's per-row tables `rc`, `rs`, head_dim / 2 each per row). For
// gqa_block also q_i = W_iq x [H, Di] and k_i = W_ik x [Hkv, Di], not
// roped. Fills the traffic (q: [q | q_i] per head in fp32; kv: k | v | k_i
// in bf16), runs the backend and applies o_proj to the H x d outputs.
absl::Status GqaAttentionImpl(const ModelConfig& c, const AttnShapes& s,
                              const Layer& L, const std::vector<Segment>& segs,
                              const std::vector<float>& rc,
                              const std::vector<float>& rs,
                              const std::vector<float>& xn,
                              AttentionBackend* backend, int layer,
                              LayerTraffic* t, std::vector<float>* attn) {
  const int N = static_cast<int>(xn.size() / size_t(c.hidden_size));
  const int H = s.heads, hkv = s.kv_heads, d = s.head_dim;
  const int di = s.block_index_dim;
  std::vector<float> q(size_t(N) * H * d), k(size_t(N) * hkv * d),
      v(size_t(N) * hkv * d), qi, ki;
  L.q_proj.Apply(xn.data(), N, q.data());
  L.k_proj.Apply(xn.data(), N, k.data());
  L.v_proj.Apply(xn.data(), N, v.data());
  if (di > 0) {
    qi.resize(size_t(N) * H * di);
    ki.resize(size_t(N) * hkv * di);
    L.index_q.Apply(xn.data(), N, qi.data());
    L.index_k.Apply(xn.data(), N, ki.data());
  }
  t->has_indexer = false;
  t->q.resize(size_t(N) * H * s.q_dim);
  t->kv.resize(size_t(N) * s.kv_dim);
  t->out.resize(size_t(N) * H * s.out_dim);
  for (int r = 0; r < N; ++r) {
    const float* cs = &rc[size_t(r) * (d / 2)];
    const float* sn = &rs[size_t(r) * (d / 2)];
    for (int h = 0; h < H; ++h) {
      float* qh = &q[(size_t(r) * H + h) * d];
      RopeInterleaved(qh, d, cs, sn);
      float* dst = &t->q[(size_t(r) * H + h) * s.q_dim];
      std::memcpy(dst, qh, sizeof(float) * d);
      if (di > 0) {
        std::memcpy(dst + d, &qi[(size_t(r) * H + h) * di], sizeof(float) * di);
      }
    }
    uint16_t* kv = &t->kv[size_t(r) * s.kv_dim];
    for (int g = 0; g < hkv; ++g) {
      RopeInterleaved(&k[(size_t(r) * hkv + g) * d], d, cs, sn);
    }
    FloatToBf16(&k[size_t(r) * hkv * d], size_t(hkv) * d, kv);
    FloatToBf16(&v[size_t(r) * hkv * d], size_t(hkv) * d, kv + hkv * d);
    if (di > 0) {
      FloatToBf16(&ki[size_t(r) * hkv * di], size_t(hkv) * di,
                  kv + 2 * hkv * d);
    }
  }
  RETURN_IF_ERROR(backend->RunLayer(layer, segs, t));
  L.o_proj.Apply(t->out.data(), N, attn->data());
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<std::vector<float>>> ModelRunner::Step(
    const std::vector<Segment>& segs, AttentionBackend* backend,
    ExpertBackend* experts, std::vector<absl::Status>* failed) const {
  const Impl& m = *impl_;
  const ModelConfig& c = m.cfg;
  const AttnShapes& s = m.shapes;
  const int D = c.hidden_size, H = c.num_attention_heads;
  const int nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim;
  const int qh = nope + rope, lora = c.kv_lora_rank, vdim = c.v_head_dim;
  const int Hi = c.index_n_heads, Di = c.index_head_dim;
  const float eps = static_cast<float>(c.rms_norm_eps);

  LayerTraffic t;
  int N = 0;
  for (const Segment& seg : segs) {
    if (seg.tokens.empty()) {
      return absl::InvalidArgumentError("a segment has no tokens");
    }
    t.offsets.push_back(N);
    N += static_cast<int>(seg.tokens.size());
  }
  if (N == 0) return std::vector<std::vector<float>>();
  t.failed.assign(segs.size(), absl::OkStatus());

  std::vector<int64_t> pos(N);
  std::vector<float> x(size_t(N) * D);
  {
    int r = 0;
    for (const Segment& seg : segs) {
      for (size_t i = 0; i < seg.tokens.size(); ++i, ++r) {
        const int32_t id = seg.tokens[i];
        if (id < 0 || id >= c.vocab_size) {
          return absl::InvalidArgumentError(absl::StrCat(
              "token id ", id, " outside [0, ", c.vocab_size, ")"));
        }
        pos[r] = seg.pos_start + int64_t(i);
        std::memcpy(&x[size_t(r) * D], &m.embed[size_t(id) * D],
                    sizeof(float) * D);
      }
    }
  }

  // Rope tables per row, once per step: for mla_dsa both rope widths (MLA
  // rope and indexer rope are the same width here: qk_rope_head_dim); for
  // the GQA forms the whole head_dim.
  const bool gqa = c.attention.type != AttentionType::kMlaDsa;
  const int rope_w = gqa ? s.head_dim : rope;
  std::vector<float> rc(size_t(N) * (rope_w / 2)), rs(size_t(N) * (rope_w / 2));
  for (int r = 0; r < N; ++r) {
    RopeTable(c.rope_theta, rope_w, pos[r], &rc[size_t(r) * (rope_w / 2)],
              &rs[size_t(r) * (rope_w / 2)]);
  }

  std::vector<float> xn(size_t(N) * D), qa, qr, q, kva, qi, ki, iw, o, attn, g,
      u, ffn_out;
  t.q.resize(size_t(N) * H * s.q_dim);
  t.kv.resize(size_t(N) * s.kv_dim);
  t.out.resize(size_t(N) * H * s.out_dim);

  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const Layer& L = m.layers[l];
    for (int r = 0; r < N; ++r) {
      RmsNorm(&x[size_t(r) * D], D, L.in_norm.data(), eps, &xn[size_t(r) * D]);
    }
    if (gqa) {
      attn.resize(size_t(N) * D);
      RETURN_IF_ERROR(
          GqaAttentionImpl(c, s, L, segs, rc, rs, xn, backend, l, &t, &attn));
    } else {
      // Queries: q_a -> RMSNorm -> q_b, per head [nope | rope].
      const int ql = L.q_a.out();
      qa.resize(size_t(N) * ql);
      qr.resize(size_t(N) * ql);
      L.q_a.Apply(xn.data(), N, qa.data());
      for (int r = 0; r < N; ++r) {
        RmsNorm(&qa[size_t(r) * ql], ql, L.q_a_norm.data(), eps,
                &qr[size_t(r) * ql]);
      }
      q.resize(size_t(N) * H * qh);
      L.q_b.Apply(qr.data(), N, q.data());
      // Latent KV: [c | k_pe].
      kva.resize(size_t(N) * (lora + rope));
      std::vector<float> cn(lora);
      L.kv_a.Apply(xn.data(), N, kva.data());
      for (int r = 0; r < N; ++r) {
        float* row = &kva[size_t(r) * (lora + rope)];
        RmsNorm(row, lora, L.kv_a_norm.data(), eps, cn.data());
        std::memcpy(row, cn.data(), sizeof(float) * lora);
        const float* cs = &rc[size_t(r) * (rope / 2)];
        const float* sn = &rs[size_t(r) * (rope / 2)];
        RopeInterleaved(row + lora, rope, cs, sn);
        FloatToBf16(row, lora + rope, &t.kv[size_t(r) * s.kv_dim]);
        for (int h = 0; h < H; ++h) {
          float* qpe = &q[(size_t(r) * H + h) * qh + nope];
          RopeInterleaved(qpe, rope, cs, sn);
          std::memcpy(&t.q[(size_t(r) * H + h) * s.q_dim + lora], qpe,
                      sizeof(float) * rope);
        }
      }
      // Absorbed query: q_abs[h] = W_UK[h]^T q_nope[h].
      for (int h = 0; h < H; ++h) {
        L.uk_t[h].Apply(&q[size_t(h) * qh], H * qh, N,
                        &t.q[size_t(h) * s.q_dim], H * s.q_dim);
      }
      // DSA indexer (Index-Build).
      t.has_indexer = L.has_indexer;
      if (L.has_indexer) {
        t.index_q_codes.resize(size_t(N) * Hi * Di);
        t.index_q_scales.resize(size_t(N) * Hi);
        t.index_weights.resize(size_t(N) * Hi);
        t.index_k_codes.resize(size_t(N) * Di);
        t.index_k_scales.resize(N);
        qi.resize(size_t(N) * Hi * Di);
        ki.resize(size_t(N) * Di);
        iw.resize(size_t(N) * Hi);
        L.iq.Apply(qr.data(), N, qi.data());
        L.ik.Apply(xn.data(), N, ki.data());
        L.iw.Apply(xn.data(), N, iw.data());
        const float wscale = 1.0f / std::sqrt(float(Hi));
        for (int r = 0; r < N; ++r) {
          const float* cs = &rc[size_t(r) * (rope / 2)];
          const float* sn = &rs[size_t(r) * (rope / 2)];
          for (int h = 0; h < Hi; ++h) {
            float* v = &qi[(size_t(r) * Hi + h) * Di];
            RopeHalfSplit(v, rope, cs, sn);
            Hadamard(v, Di);
            t.index_q_scales[size_t(r) * Hi + h] =
                QuantizeFp8(v, Di, &t.index_q_codes[(size_t(r) * Hi + h) * Di]);
            t.index_weights[size_t(r) * Hi + h] =
                iw[size_t(r) * Hi + h] * wscale;
          }
          float* k = &ki[size_t(r) * Di];
          LayerNorm(k, Di, L.ik_norm_w.data(), L.ik_norm_b.data(), 1e-6f);
          RopeHalfSplit(k, rope, cs, sn);
          Hadamard(k, Di);
          t.index_k_scales[r] =
              QuantizeFp8(k, Di, &t.index_k_codes[size_t(r) * Di]);
        }
      }
      RETURN_IF_ERROR(backend->RunLayer(l, segs, &t));
      // o[h] = W_UV[h] o_lat[h]; then the output projection and residual.
      o.resize(size_t(N) * H * vdim);
      for (int h = 0; h < H; ++h) {
        L.uv[h].Apply(&t.out[size_t(h) * s.out_dim], H * s.out_dim, N,
                      &o[size_t(h) * vdim], H * vdim);
      }
      attn.resize(size_t(N) * D);
      L.o_proj.Apply(o.data(), N, attn.data());
    }  // mla_dsa
    for (size_t i = 0; i < x.size(); ++i) x[i] += attn[i];
    // FFN / MoE.
    for (int r = 0; r < N; ++r) {
      RmsNorm(&x[size_t(r) * D], D, L.post_norm.data(), eps,
              &xn[size_t(r) * D]);
    }
    ffn_out.assign(size_t(N) * D, 0.0f);
    if (!L.moe) {
      L.dense.Apply(xn.data(), N, ffn_out.data(), &g, &u);
    } else {
      const int E = c.n_routed_experts, K = c.num_experts_per_tok;
      std::vector<float> logits(size_t(N) * E);
      L.router.Apply(xn.data(), N, logits.data());
      // Per row: chosen experts in increasing id with renormalised weights.
      std::vector<std::vector<std::pair<int, float>>> chosen(N);
      std::vector<std::vector<int>> rows_of(E);
      for (int r = 0; r < N; ++r) {
        float* p = &logits[size_t(r) * E];
        float mx = -INFINITY;
        for (int e = 0; e < E; ++e) mx = std::max(mx, p[e]);
        float z = 0.0f;
        for (int e = 0; e < E; ++e) {
          p[e] = std::exp(p[e] - mx);
          z += p[e];
        }
        for (int e = 0; e < E; ++e) p[e] /= z;
        std::vector<int> ids(E);
        std::iota(ids.begin(), ids.end(), 0);
        std::partial_sort(ids.begin(), ids.begin() + K, ids.end(),
                          [p](int a, int b) {
                            if (p[a] != p[b]) return p[a] > p[b];
                            return a < b;
                          });
        ids.resize(K);
        std::sort(ids.begin(), ids.end());
        float sum = 0.0f;
        for (int e : ids) sum += p[e];
        for (int e : ids) {
          chosen[r].push_back({e, p[e] / sum});
          rows_of[e].push_back(r);
        }
      }
      // Expert outputs, batched per expert over its rows: here, or by the
      // expert backend (on the experts' owners).
      std::vector<std::vector<float>> eout(E);
      if (experts != nullptr) {
        ExpertWork work;
        work.layer = l;
        work.rows = N;
        work.xn = xn.data();
        work.rows_of = std::move(rows_of);
        RETURN_IF_ERROR(experts->RunExperts(work, &eout));
        rows_of = std::move(work.rows_of);
        if (eout.size() != size_t(E)) {
          return absl::InternalError(
              absl::StrCat("expert backend returned ", eout.size(),
                           " expert outputs for layer ", l, "; expected ", E));
        }
        for (int e = 0; e < E; ++e) {
          if (eout[e].size() != rows_of[e].size() * D) {
            return absl::InternalError(
                absl::StrCat("expert backend returned ", eout[e].size(),
                             " floats for expert ", e, " of layer ", l,
                             "; expected ", rows_of[e].size() * D));
          }
        }
      } else {
        for (int e = 0; e < E; ++e) {
          const auto& rows = rows_of[e];
          if (rows.empty()) continue;
          if (!OwnsExpert(e)) {
            return absl::FailedPreconditionError(
                absl::StrCat("layer ", l, " routes to expert ", e, " of rank ",
                             ExpertOwner(e), " but rank ", m.rank, " of ",
                             m.ranks, " has no expert backend"));
          }
          eout[e].resize(rows.size() * D);
          RETURN_IF_ERROR(ApplyExpert(l, e, xn.data(), rows.data(),
                                      int(rows.size()), eout[e].data()));
        }
      }
      // Combine: sum in increasing expert id, then the shared expert.
      std::vector<size_t> cursor(E, 0);
      for (int r = 0; r < N; ++r) {
        float* y = &ffn_out[size_t(r) * D];
        for (const auto& [e, w] : chosen[r]) {
          const float* src = &eout[e][cursor[e]++ * D];
          for (int d = 0; d < D; ++d) y[d] += w * src[d];
        }
      }
      if (L.has_shared) {
        std::vector<float> sh(size_t(N) * D);
        L.shared.Apply(xn.data(), N, sh.data(), &g, &u);
        for (size_t i = 0; i < ffn_out.size(); ++i) ffn_out[i] += sh[i];
      }
    }
    for (size_t i = 0; i < x.size(); ++i) x[i] += ffn_out[i];
  }

  // Final norm and LM head on the last token of each segment.
  const int S = static_cast<int>(segs.size());
  std::vector<float> last(size_t(S) * D);
  for (int i = 0; i < S; ++i) {
    const int r = t.offsets[i] + int(segs[i].tokens.size()) - 1;
    RmsNorm(&x[size_t(r) * D], D, m.final_norm.data(), eps,
            &last[size_t(i) * D]);
  }
  std::vector<float> logits(size_t(S) * c.vocab_size);
  m.lm_head.Apply(last.data(), S, logits.data());
  std::vector<std::vector<float>> result(S);
  for (int i = 0; i < S; ++i) {
    result[i].assign(logits.begin() + size_t(i) * c.vocab_size,
                     logits.begin() + size_t(i + 1) * c.vocab_size);
  }
  if (failed != nullptr) {
    *failed = std::move(t.failed);
  } else {
    for (const absl::Status& f : t.failed) RETURN_IF_ERROR(f);
  }
  return result;
}

}  // namespace karat
