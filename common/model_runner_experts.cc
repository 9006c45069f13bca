// ModelRunner's routed-expert ownership (ExpertOwner, SetExpertOwners,
// SnapshotExperts, ...) and ApplyExpert, which runs one expert's FFN over
// the rows routed to it.
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/model_runner.h"
#include "common/model_runner_internal.h"
#include "common/status_macros.h"

namespace karat {

using runner_internal::Ffn;
using runner_internal::Layer;
using runner_internal::MakeFfn;

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
}  // namespace karat
