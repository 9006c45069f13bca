#include "common/model_runner.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/linear.h"
#include "common/numeric.h"
#include "common/stable_hash.h"
#include "common/status_macros.h"

namespace karat {
namespace {

// --- Elementwise blocks (MODEL.md "Common blocks"); fixed order per row. ---

void RmsNorm(const float* x, int n, const float* g, float eps, float* y) {
  float ss = 0.0f;
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / float(n) + eps);
  for (int i = 0; i < n; ++i) y[i] = x[i] * inv * g[i];
}

void LayerNorm(float* x, int n, const float* w, const float* b, float eps) {
  float mean = 0.0f;
  for (int i = 0; i < n; ++i) mean += x[i];
  mean /= float(n);
  float var = 0.0f;
  for (int i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
  var /= float(n);
  const float inv = 1.0f / std::sqrt(var + eps);
  for (int i = 0; i < n; ++i) x[i] = (x[i] - mean) * inv * w[i] + b[i];
}

// cos/sin of position * theta^(-2i/r), angle in double, rounded to fp32.
void RopeTable(double theta, int r, int64_t pos, float* cs, float* sn) {
  for (int i = 0; i < r / 2; ++i) {
    const double f = std::pow(theta, -2.0 * i / r);
    const double a = double(pos) * f;
    cs[i] = static_cast<float>(std::cos(a));
    sn[i] = static_cast<float>(std::sin(a));
  }
}

void RopeInterleaved(float* x, int r, const float* cs, const float* sn) {
  for (int i = 0; i < r / 2; ++i) {
    const float a = x[2 * i], b = x[2 * i + 1];
    x[2 * i] = a * cs[i] - b * sn[i];
    x[2 * i + 1] = a * sn[i] + b * cs[i];
  }
}

void RopeHalfSplit(float* x, int r, const float* cs, const float* sn) {
  const int h = r / 2;
  for (int i = 0; i < h; ++i) {
    const float a = x[i], b = x[i + h];
    x[i] = a * cs[i] - b * sn[i];
    x[i + h] = a * sn[i] + b * cs[i];
  }
}

// Walsh-Hadamard transform in Sylvester order, scaled by n^-0.5.
void Hadamard(float* x, int n) {
  for (int h = 1; h < n; h *= 2) {
    for (int i = 0; i < n; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
  const float s = 1.0f / std::sqrt(float(n));
  for (int i = 0; i < n; ++i) x[i] *= s;
}

float Silu(float x) { return x / (1.0f + std::exp(-x)); }

// A SwiGLU FFN: down(silu(gate x) * up x).
struct Ffn {
  LinearWeight gate, up, down;
  void Apply(const float* x, int rows, float* y, std::vector<float>* g,
             std::vector<float>* u) const {
    const int inter = gate.out();
    g->resize(size_t(rows) * inter);
    u->resize(size_t(rows) * inter);
    gate.Apply(x, rows, g->data());
    up.Apply(x, rows, u->data());
    for (size_t i = 0; i < g->size(); ++i) (*g)[i] = Silu((*g)[i]) * (*u)[i];
    down.Apply(g->data(), rows, y);
  }
};

struct Layer {
  std::vector<float> in_norm, post_norm;
  // MLA
  LinearWeight q_a, q_b, kv_a, o_proj;
  std::vector<float> q_a_norm, kv_a_norm;
  std::vector<LinearWeight> uk_t;  // per head [kv_lora, nope] = W_UK[h]^T
  std::vector<LinearWeight> uv;    // per head [v, kv_lora]
  // DSA indexer
  bool has_indexer = false;
  LinearWeight iq, ik, iw;
  std::vector<float> ik_norm_w, ik_norm_b;
  // GQA (gqa_block, gqa_dense); o_proj as above. Block indexer projections.
  LinearWeight q_proj, k_proj, v_proj, index_q, index_k;
  // FFN
  bool moe = false;
  Ffn dense;
  LinearWeight router;
  // By expert id: the routed experts whose weights this rank holds (its
  // own block, and those it took over), null for the others. Guarded by
  // ModelRunner::Impl::experts_mu.
  std::vector<std::shared_ptr<const Ffn>> experts;
  bool has_shared = false;
  Ffn shared;
};

std::vector<float> Vec(const ModelFiles& f, const std::string& name) {
  return f.at(name).data;
}
LinearWeight Lin(const ModelFiles& f, const std::string& name) {
  const Tensor& t = f.at(name);
  return LinearWeight(t.data.data(), int(t.rows()), int(t.cols()));
}
Ffn MakeFfn(const ModelFiles& f, const std::string& prefix) {
  Ffn ffn;
  ffn.gate = Lin(f, prefix + "gate_proj.weight");
  ffn.up = Lin(f, prefix + "up_proj.weight");
  ffn.down = Lin(f, prefix + "down_proj.weight");
  return ffn;
}

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

// --- LayerTraffic -------------------------------------------------------

IndexInputs LayerTraffic::IndexFor(int seg, const AttnShapes& s) const {
  const size_t r = offsets[seg];
  IndexInputs in;
  in.q_codes = index_q_codes.data() + r * s.index_heads * s.index_dim;
  in.q_scales = index_q_scales.data() + r * s.index_heads;
  in.weights = index_weights.data() + r * s.index_heads;
  in.k_codes = index_k_codes.data() + r * s.index_dim;
  in.k_scales = index_k_scales.data() + r;
  return in;
}

AttnInputs LayerTraffic::AttnFor(int seg, const AttnShapes& s) const {
  const size_t r = offsets[seg];
  AttnInputs in;
  in.q = q.data() + r * s.heads * s.q_dim;
  in.kv = kv.data() + r * s.kv_dim;
  return in;
}

float* LayerTraffic::OutFor(int seg, const AttnShapes& s) {
  return out.data() + size_t(offsets[seg]) * s.heads * s.out_dim;
}

// --- ModelRunner ----------------------------------------------------------

struct ModelRunner::Impl {
  ModelConfig cfg;
  AttnShapes shapes;
  std::vector<float> embed;  // [vocab, hidden]
  std::vector<Layer> layers;
  std::vector<float> final_norm;
  LinearWeight lm_head;
  int rank = 0;
  int ranks = 1;
  int experts_per_rank = 0;  // n_routed_experts / ranks
  int first_expert = 0;      // rank * experts_per_rank
  // Routed-expert ownership (SetExpertOwners); which experts' weights are
  // held is layers[l].experts (the same experts in every MoE layer).
  mutable absl::Mutex experts_mu;
  std::vector<int> owner ABSL_GUARDED_BY(experts_mu);  // by expert id
  absl::Mutex set_owners_mu;  // one SetExpertOwners at a time
  int first_moe_layer = -1;   // -1: no MoE layer

  bool OwnBlock(int e) const {
    return e >= first_expert && e < first_expert + experts_per_rank;
  }
  bool HeldLocked(int e) const ABSL_SHARED_LOCKS_REQUIRED(experts_mu) {
    return first_moe_layer >= 0 &&
           layers[size_t(first_moe_layer)].experts[size_t(e)] != nullptr;
  }
};

ModelRunner::ModelRunner() : impl_(new Impl) {}
ModelRunner::~ModelRunner() = default;
const ModelConfig& ModelRunner::config() const { return impl_->cfg; }
const AttnShapes& ModelRunner::shapes() const { return impl_->shapes; }
int ModelRunner::rank() const { return impl_->rank; }
int ModelRunner::ranks() const { return impl_->ranks; }

int ModelRunner::ExpertOwner(int expert) const {
  if (expert < 0 || expert >= impl_->cfg.n_routed_experts) return -1;
  absl::ReaderMutexLock lock(&impl_->experts_mu);
  return impl_->owner[size_t(expert)];
}

bool ModelRunner::OwnsExpert(int expert) const {
  return ExpertOwner(expert) == impl_->rank;
}

bool ModelRunner::HoldsExpert(int expert) const {
  if (expert < 0 || expert >= impl_->cfg.n_routed_experts) return false;
  absl::ReaderMutexLock lock(&impl_->experts_mu);
  return impl_->HeldLocked(expert);
}

std::vector<int> ModelRunner::ExpertOwners() const {
  absl::ReaderMutexLock lock(&impl_->experts_mu);
  return impl_->owner;
}

std::vector<int> ModelRunner::HeldExperts() const {
  absl::ReaderMutexLock lock(&impl_->experts_mu);
  std::vector<int> out;
  for (int e = 0; e < impl_->cfg.n_routed_experts; ++e)
    if (impl_->HeldLocked(e)) out.push_back(e);
  return out;
}

absl::StatusOr<std::vector<int>> ModelRunner::MissingExperts(
    const std::vector<int>& owners) const {
  const Impl& m = *impl_;
  const int E = m.cfg.n_routed_experts;
  if (owners.size() != size_t(E)) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert ownership lists ", owners.size(),
                     " experts; the model has ", E, " routed experts"));
  }
  for (int e = 0; e < E; ++e) {
    if (owners[size_t(e)] < 0 || owners[size_t(e)] >= m.ranks) {
      return absl::InvalidArgumentError(
          absl::StrCat("expert ", e, " is given to rank ", owners[size_t(e)],
                       ", outside [0, ", m.ranks, ")"));
    }
  }
  absl::ReaderMutexLock lock(&m.experts_mu);
  std::vector<int> missing;
  for (int e = 0; e < E; ++e)
    if (owners[size_t(e)] == m.rank && !m.HeldLocked(e)) missing.push_back(e);
  return missing;
}

absl::Status ModelRunner::SetExpertOwners(const std::vector<int>& owners,
                                          const ModelFiles& files) {
  Impl& m = *impl_;
  absl::MutexLock serial(&m.set_owners_mu);
  ASSIGN_OR_RETURN(std::vector<int> missing, MissingExperts(owners));
  // Packed outside the lock: steps go on meanwhile.
  std::map<std::pair<int, int>, std::shared_ptr<const Ffn>> loaded;
  for (int e : missing) {
    for (int l = 0; l < m.cfg.num_hidden_layers; ++l) {
      if (!m.cfg.IsMoeLayer(l)) continue;
      const std::string prefix =
          absl::StrCat("model.layers.", l, ".mlp.experts.", e, ".");
      for (const char* part : {"gate_proj", "up_proj", "down_proj"}) {
        const std::string name = absl::StrCat(prefix, part, ".weight");
        if (files.tensors.find(name) == files.tensors.end()) {
          return absl::InvalidArgumentError(
              absl::StrCat("rank ", m.rank, " takes over expert ", e,
                           " but its weights lack tensor '", name, "'"));
        }
      }
      loaded[{l, e}] = std::make_shared<const Ffn>(MakeFfn(files, prefix));
    }
  }
  absl::MutexLock lock(&m.experts_mu);
  for (auto& [le, ffn] : loaded) {
    m.layers[size_t(le.first)].experts[size_t(le.second)] = std::move(ffn);
  }
  // Experts handed back are released; a step still computing one keeps its
  // weights alive until it is done (shared_ptr).
  for (int e = 0; e < m.cfg.n_routed_experts; ++e) {
    if (owners[size_t(e)] == m.rank || m.OwnBlock(e)) continue;
    for (Layer& L : m.layers) {
      if (L.moe) L.experts[size_t(e)].reset();
    }
  }
  m.owner = owners;
  return absl::OkStatus();
}

ExpertSnapshot ModelRunner::SnapshotExperts(int layer) const {
  const Impl& m = *impl_;
  ExpertSnapshot snapshot;
  snapshot.layer_ = layer;
  snapshot.weights_.resize(size_t(m.cfg.n_routed_experts));
  const bool moe = layer >= 0 && layer < m.cfg.num_hidden_layers &&
                   m.layers[size_t(layer)].moe;
  absl::ReaderMutexLock lock(&m.experts_mu);
  snapshot.owners_ = m.owner;
  if (moe) {
    const auto& held = m.layers[size_t(layer)].experts;
    for (size_t e = 0; e < held.size(); ++e) snapshot.weights_[e] = held[e];
  }
  return snapshot;
}

namespace {

absl::Status CheckExpertCall(const ModelConfig& c,
                             const std::vector<Layer>& layers, int layer,
                             int expert, int n) {
  if (layer < 0 || layer >= c.num_hidden_layers || !layers[layer].moe) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " is not an MoE layer"));
  }
  if (expert < 0 || expert >= c.n_routed_experts) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expert ", expert, " outside [0, ", c.n_routed_experts, ")"));
  }
  if (n < 0) {
    return absl::InvalidArgumentError(absl::StrCat("negative row count ", n));
  }
  return absl::OkStatus();
}

void RunExpert(const Ffn& ffn, int hidden, const float* x, const int32_t* rows,
               int n, float* out) {
  if (n == 0) return;
  const size_t D = size_t(hidden);
  thread_local std::vector<float> in, g, u;
  in.resize(size_t(n) * D);
  for (int i = 0; i < n; ++i) {
    std::memcpy(&in[i * D], x + size_t(rows[i]) * D, sizeof(float) * D);
  }
  ffn.Apply(in.data(), n, out, &g, &u);
}

}  // namespace

absl::Status ModelRunner::ApplyExpert(int layer, int expert, const float* x,
                                      const int32_t* rows, int n,
                                      float* out) const {
  const Impl& m = *impl_;
  RETURN_IF_ERROR(CheckExpertCall(m.cfg, m.layers, layer, expert, n));
  std::shared_ptr<const Ffn> ffn;
  {
    absl::ReaderMutexLock lock(&m.experts_mu);
    ffn = m.layers[layer].experts[size_t(expert)];
  }
  if (ffn == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "expert ", expert, " belongs to rank ", ExpertOwner(expert),
        ", not to rank ", m.rank, " of ", m.ranks));
  }
  RunExpert(*ffn, m.cfg.hidden_size, x, rows, n, out);
  return absl::OkStatus();
}

absl::Status ModelRunner::ApplyExpert(const ExpertSnapshot& snapshot, int layer,
                                      int expert, const float* x,
                                      const int32_t* rows, int n,
                                      float* out) const {
  const Impl& m = *impl_;
  RETURN_IF_ERROR(CheckExpertCall(m.cfg, m.layers, layer, expert, n));
  if (snapshot.layer_ != layer) {
    return absl::InvalidArgumentError(
        absl::StrCat("an expert snapshot of layer ", snapshot.layer_,
                     " used for layer ", layer));
  }
  if (!snapshot.holds(expert)) {
    return absl::FailedPreconditionError(
        absl::StrCat("expert ", expert, " belonged to rank ",
                     snapshot.owners_[size_t(expert)], ", not to rank ", m.rank,
                     " of ", m.ranks));
  }
  RunExpert(*static_cast<const Ffn*>(snapshot.weights_[size_t(expert)].get()),
            m.cfg.hidden_size, x, rows, n, out);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ModelRunner>> ModelRunner::Create(
    const ModelFiles& f, const RunnerOptions& options) {
  const ModelConfig& c = f.config;
  const bool gqa = c.attention.type != AttentionType::kMlaDsa;
  if (options.ranks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank count ", options.ranks, " must be at least 1"));
  }
  if (options.rank < 0 || options.rank >= options.ranks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", options.rank, " outside [0, ", options.ranks, ")"));
  }
  if (c.n_routed_experts % options.ranks != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "n_routed_experts (", c.n_routed_experts,
        ") is not a multiple of the GPU rank count (", options.ranks,
        "): experts are sharded across ranks in equal blocks"));
  }
  for (const TensorSpec& spec : ExpectedTensors(c)) {
    if (f.tensors.find(spec.name) == f.tensors.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("missing tensor '", spec.name, "'"));
    }
  }
  std::unique_ptr<ModelRunner> r(new ModelRunner());
  Impl& m = *r->impl_;
  m.cfg = c;
  m.shapes = MakeAttnShapes(c);
  m.rank = options.rank;
  m.ranks = options.ranks;
  m.experts_per_rank = c.n_routed_experts / options.ranks;
  m.first_expert = options.rank * m.experts_per_rank;
  {
    absl::MutexLock lock(&m.experts_mu);
    m.owner.resize(size_t(c.n_routed_experts));
    for (int e = 0; e < c.n_routed_experts; ++e)
      m.owner[size_t(e)] = e / m.experts_per_rank;
  }
  m.embed = Vec(f, "model.embed_tokens.weight");
  m.final_norm = Vec(f, "model.norm.weight");
  m.lm_head = Lin(f, "lm_head.weight");
  const int H = c.num_attention_heads, nope = c.qk_nope_head_dim,
            v = c.v_head_dim, lora = c.kv_lora_rank;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    const std::string a = p + "self_attn.";
    Layer L;
    L.in_norm = Vec(f, p + "input_layernorm.weight");
    L.post_norm = Vec(f, p + "post_attention_layernorm.weight");
    if (gqa) {
      L.q_proj = Lin(f, a + "q_proj.weight");
      L.k_proj = Lin(f, a + "k_proj.weight");
      L.v_proj = Lin(f, a + "v_proj.weight");
      L.o_proj = Lin(f, a + "o_proj.weight");
      if (c.attention.type == AttentionType::kGqaBlock) {
        L.index_q = Lin(f, a + "index_q_proj.weight");
        L.index_k = Lin(f, a + "index_k_proj.weight");
      }
    } else {
      L.q_a = Lin(f, a + "q_a_proj.weight");
      L.q_a_norm = Vec(f, a + "q_a_layernorm.weight");
      L.q_b = Lin(f, a + "q_b_proj.weight");
      L.kv_a = Lin(f, a + "kv_a_proj_with_mqa.weight");
      L.kv_a_norm = Vec(f, a + "kv_a_layernorm.weight");
      L.o_proj = Lin(f, a + "o_proj.weight");
      const Tensor& kvb = f.at(a + "kv_b_proj.weight");  // [H*(nope+v), lora]
      for (int h = 0; h < H; ++h) {
        const float* base = kvb.data.data() + size_t(h) * (nope + v) * lora;
        std::vector<float> ukt(size_t(lora) * nope);
        for (int i = 0; i < nope; ++i)
          for (int j = 0; j < lora; ++j)
            ukt[size_t(j) * nope + i] = base[size_t(i) * lora + j];
        L.uk_t.emplace_back(ukt.data(), lora, nope);
        L.uv.emplace_back(base + size_t(nope) * lora, v, lora);
      }
      L.has_indexer = c.HasIndexer(l);
      if (L.has_indexer) {
        L.iq = Lin(f, a + "indexer.wq_b.weight");
        L.ik = Lin(f, a + "indexer.wk.weight");
        L.iw = Lin(f, a + "indexer.weights_proj.weight");
        L.ik_norm_w = Vec(f, a + "indexer.k_norm.weight");
        L.ik_norm_b = Vec(f, a + "indexer.k_norm.bias");
      }
    }  // mla_dsa
    L.moe = c.IsMoeLayer(l);
    const std::string mlp = p + "mlp.";
    if (L.moe) {
      if (m.first_moe_layer < 0) m.first_moe_layer = l;
      L.router = Lin(f, mlp + "gate.weight");
      L.experts.resize(size_t(c.n_routed_experts));
      for (int e = m.first_expert; e < m.first_expert + m.experts_per_rank;
           ++e) {
        L.experts[size_t(e)] = std::make_shared<const Ffn>(
            MakeFfn(f, absl::StrCat(mlp, "experts.", e, ".")));
      }
      L.has_shared = c.n_shared_experts > 0;
      if (L.has_shared) L.shared = MakeFfn(f, mlp + "shared_experts.");
    } else {
      L.dense = MakeFfn(f, mlp);
    }
    m.layers.push_back(std::move(L));
  }
  return r;
}

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

// --- LocalAttentionBackend ------------------------------------------------

struct LocalAttentionBackend::Impl {
  ModelConfig cfg;
  AttnShapes shapes;
  KvLayout layout;
  size_t capacity = 0;
  std::unique_ptr<PageArena> arena;
  MethodWeights method_weights;
  std::unique_ptr<SparseAttention> method;  // GQA forms only
  struct Sess {
    std::unique_ptr<SessionCache> cache;
    SelectionState sel;
    std::unique_ptr<AttentionSessionState> method_state;
  };
  std::map<uint64_t, Sess> sessions;
};

LocalAttentionBackend::LocalAttentionBackend(const ModelConfig& config,
                                             int tokens_per_page,
                                             size_t capacity_bytes)
    : impl_(new Impl) {
  impl_->cfg = config;
  impl_->shapes = MakeAttnShapes(config);
  impl_->layout = MakeKvLayout(config, tokens_per_page);
  impl_->capacity = capacity_bytes;
}

LocalAttentionBackend::~LocalAttentionBackend() {
  impl_->sessions.clear();  // frees pages before the arena goes
}

const KvLayout& LocalAttentionBackend::layout() const { return impl_->layout; }

void LocalAttentionBackend::SetMethodWeights(MethodWeights weights) {
  impl_->method_weights = std::move(weights);
}

absl::Status LocalAttentionBackend::Init() {
  ASSIGN_OR_RETURN(impl_->arena, PageArena::Create(impl_->capacity,
                                                   impl_->layout.page_bytes));
  if (impl_->cfg.attention.type != AttentionType::kMlaDsa) {
    ASSIGN_OR_RETURN(impl_->method,
                     NewSparseAttention(impl_->cfg, impl_->method_weights));
  }
  return absl::OkStatus();
}

absl::Status LocalAttentionBackend::Reserve(uint64_t session, int tokens) {
  auto& s = impl_->sessions[session];
  if (!s.cache) {
    s.cache =
        std::make_unique<SessionCache>(&impl_->layout, impl_->arena.get());
    if (impl_->method != nullptr) {
      s.method_state = NewAttentionSessionState(*impl_->method,
                                                impl_->cfg.num_hidden_layers);
    }
  }
  return s.cache->Reserve(tokens);
}

void LocalAttentionBackend::Drop(uint64_t session) {
  impl_->sessions.erase(session);
}

bool LocalAttentionBackend::Truncate(uint64_t session, int length) {
  auto it = impl_->sessions.find(session);
  if (it == impl_->sessions.end() || !it->second.cache) return true;
  Impl::Sess& s = it->second;
  const int layers = impl_->cfg.num_hidden_layers;
  if (TruncateSessionKv(impl_->method.get(), s.method_state.get(),
                        s.cache.get(), layers, length))
    return true;
  for (int l = 0; l < layers; ++l) s.cache->Truncate(l, 0);
  s.method_state = NewAttentionSessionState(*impl_->method, layers);
  return false;
}

absl::Status LocalAttentionBackend::RunLayer(int layer,
                                             const std::vector<Segment>& segs,
                                             LayerTraffic* t) {
  const bool dsa = impl_->cfg.attention.type == AttentionType::kMlaDsa;
  // The kernels' cost goes to the calling thread's meter (a GPU rank's
  // timing model in gpu_only mode; kernel_cost.h), also when a segment fails.
  KernelCost cost;
  struct Charge {
    const KernelCost& cost;
    ~Charge() { ChargeKernelCost(cost); }
  } charge{cost};
  // One segment's failure is its own (LayerTraffic::failed) when the
  // caller sized `failed`; otherwise it fails the layer.
  const bool isolate = t->failed.size() == segs.size();
  for (size_t i = 0; i < segs.size(); ++i) {
    if (isolate && !t->failed[i].ok()) continue;  // failed in an earlier layer
    const Segment& seg = segs[i];
    const int n = static_cast<int>(seg.tokens.size());
    float* out = t->OutFor(int(i), impl_->shapes);
    absl::Status st = [&]() -> absl::Status {
      auto it = impl_->sessions.find(seg.session);
      if (it == impl_->sessions.end()) {
        return absl::NotFoundError(
            absl::StrCat("session ", seg.session, " has no cache"));
      }
      auto& s = it->second;
      if (impl_->method != nullptr) {
        return RunAttentionLayer(*impl_->method, layer, seg.pos_start, n,
                                 t->AttnFor(int(i), impl_->shapes),
                                 seg.ends_prefill, s.cache.get(),
                                 s.method_state.get(), out, &cost);
      }
      if (t->has_indexer) {
        RETURN_IF_ERROR(RunIndexer(impl_->shapes, layer, seg.pos_start, n,
                                   t->IndexFor(int(i), impl_->shapes),
                                   s.cache.get(), &s.sel, nullptr, &cost));
      }
      return RunAttention(impl_->shapes, layer, seg.pos_start, n,
                          t->AttnFor(int(i), impl_->shapes), s.cache.get(),
                          dsa ? &s.sel : nullptr, out, nullptr, &cost);
    }();
    if (st.ok()) continue;
    if (!isolate) return st;
    t->failed[i] = st;
    std::fill(out, out + size_t(n) * impl_->shapes.heads * impl_->shapes.out_dim,
              0.0f);
  }
  return absl::OkStatus();
}

// --- Sampling -------------------------------------------------------------

int32_t SampleToken(const std::vector<float>& logits, float temperature,
                    uint64_t seed, int64_t position) {
  const int V = static_cast<int>(logits.size());
  if (!(temperature > 0.0f)) {
    int best = 0;
    for (int i = 1; i < V; ++i) {
      if (logits[i] > logits[best]) best = i;
    }
    return best;
  }
  const uint64_t key = seed ^ (0x9E3779B97F4A7C15ull * uint64_t(position + 1));
  const double u = double(SplitMix64(key) >> 11) * 0x1.0p-53;
  float mx = -INFINITY;
  for (float l : logits) mx = std::max(mx, l / temperature);
  std::vector<double> p(V);
  double z = 0.0;
  for (int i = 0; i < V; ++i) {
    p[i] = std::exp(double(logits[i] / temperature - mx));
    z += p[i];
  }
  double cum = 0.0;
  for (int i = 0; i < V; ++i) {
    cum += p[i] / z;
    if (cum > u) return i;
  }
  // Rounding left the total just under u: the last id with mass.
  for (int i = V - 1; i >= 0; --i) {
    if (p[i] > 0.0) return i;
  }
  return V - 1;
}

}  // namespace karat
