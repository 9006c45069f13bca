#include "gpu_node/local_attention.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace karat {

GpuLocalAttention::GpuLocalAttention(const ModelConfig& config,
                                     int tokens_per_page, size_t capacity_bytes)
    : capacity_(capacity_bytes),
      local_(config, tokens_per_page, capacity_bytes) {}

absl::StatusOr<std::unique_ptr<GpuLocalAttention>> GpuLocalAttention::Create(
    const ModelConfig& config, const MethodWeights& weights,
    int tokens_per_page, size_t capacity_bytes) {
  std::unique_ptr<GpuLocalAttention> a(
      new GpuLocalAttention(config, tokens_per_page, capacity_bytes));
  absl::MutexLock lock(&a->mu_);
  a->local_.SetMethodWeights(weights);
  RETURN_IF_ERROR(a->local_.Init());
  return a;
}

size_t GpuLocalAttention::BytesFor(int tokens) const {
  const KvLayout& l = local_.layout();
  const size_t pages =
      (size_t(tokens) + l.tokens_per_page - 1) / size_t(l.tokens_per_page);
  return pages * l.page_bytes * size_t(l.num_layers);
}

absl::StatusOr<bool> GpuLocalAttention::Reserve(uint64_t session, int tokens,
                                                int kv_tokens,
                                                uint64_t turn_epoch) {
  absl::MutexLock lock(&mu_);
  const bool known = reserved_.contains(session);
  absl::Status s = local_.Reserve(session, tokens);
  if (!s.ok()) {
    if (!known) local_.Drop(session);
    if (BytesFor(tokens) > capacity_) {
      return absl::OutOfRangeError(absl::StrCat(
          "the GPU rank's memory left for KV (", capacity_,
          " bytes) cannot hold ", tokens, " positions (", BytesFor(tokens),
          " bytes) even with no other session"));
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        "the GPU rank's memory left for KV (", capacity_,
        " bytes) cannot hold ", tokens, " more positions: ", s.message()));
  }
  int& r = reserved_[session];
  r = std::max(r, tokens);
  uint64_t& fence = fence_[session];
  fence = std::max(fence, turn_epoch);
  if (kv_tokens < 0) return false;
  return !local_.Truncate(session, kv_tokens);
}

void GpuLocalAttention::Free(uint64_t session) {
  absl::MutexLock lock(&mu_);
  local_.Drop(session);
  reserved_.erase(session);
  fence_.erase(session);
}

void GpuLocalAttention::SetPlacement(uint64_t session,
                                     const cluster::KaratPlacement&,
                                     uint64_t turn_epoch) {
  absl::MutexLock lock(&mu_);
  running_[session] = turn_epoch;
}

void GpuLocalAttention::ClearPlacement(uint64_t session) {
  absl::MutexLock lock(&mu_);
  running_.erase(session);
}

int GpuLocalAttention::FreeAll() {
  absl::MutexLock lock(&mu_);
  const int n = static_cast<int>(reserved_.size());
  for (const auto& [session, tokens] : reserved_) local_.Drop(session);
  reserved_.clear();
  fence_.clear();
  return n;
}

bool GpuLocalAttention::HasSession(uint64_t session) const {
  absl::MutexLock lock(&mu_);
  return reserved_.contains(session);
}

size_t GpuLocalAttention::used_bytes() const {
  absl::MutexLock lock(&mu_);
  size_t total = 0;
  for (const auto& [session, tokens] : reserved_) total += BytesFor(tokens);
  return total;
}

size_t GpuLocalAttention::session_bytes(uint64_t session) const {
  absl::MutexLock lock(&mu_);
  auto it = reserved_.find(session);
  return it == reserved_.end() ? 0 : BytesFor(it->second);
}

int GpuLocalAttention::sessions() const {
  absl::MutexLock lock(&mu_);
  return int(reserved_.size());
}

absl::Status GpuLocalAttention::RunLayer(int layer,
                                         const std::vector<Segment>& segs,
                                         LayerTraffic* traffic) {
  absl::MutexLock lock(&mu_);
  // A turn superseded by a later Reserve (cancelled or moved while its step
  // ran) fails alone; it must not write the session's KV any more.
  if (traffic->failed.size() == segs.size()) {
    for (size_t i = 0; i < segs.size(); ++i) {
      auto f = fence_.find(segs[i].session);
      auto r = running_.find(segs[i].session);
      if (f == fence_.end() || r == running_.end() || r->second >= f->second)
        continue;
      if (traffic->failed[i].ok()) {
        traffic->failed[i] = absl::FailedPreconditionError(absl::StrCat(
            "turn ", r->second, " of session ", segs[i].session,
            " was superseded by turn ", f->second));
      }
    }
  }
  return local_.RunLayer(layer, segs, traffic);
}

}  // namespace karat
