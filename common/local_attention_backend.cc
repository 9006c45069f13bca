// LocalAttentionBackend: the single-process AttentionBackend of the
// reference engine, with its own page arena and per-session KV caches.
#include <algorithm>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/model_runner.h"
#include "common/status_macros.h"

namespace karat {

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

}  // namespace karat
