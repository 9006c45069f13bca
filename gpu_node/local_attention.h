// Attention on the GPU rank itself: the GPU-only baseline (issue's
// `gpu_only` mode, the paper's main comparison). The KV of the rank's
// sessions lives in the rank's emulated HBM — what is left of hbm_bytes
// after the weights — so the rank serves only as many sessions as that
// holds. Same kernels as the KARAT devices and the reference engine, so the
// tokens are the same.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/model_runner.h"
#include "common/sparse_attention.h"
#include "gpu_node/decode_loop.h"

namespace karat {

// Thread-safe: Reserve/Free come from gRPC threads, RunLayer from the
// micro-batches' threads (serialised: no transfer to wait for).
class GpuLocalAttention : public StepBackend {
 public:
  static absl::StatusOr<std::unique_ptr<GpuLocalAttention>> Create(
      const ModelConfig& config, const MethodWeights& weights,
      int tokens_per_page, size_t capacity_bytes);

  // Room for `tokens` positions of `session` (all or nothing):
  // RESOURCE_EXHAUSTED when the HBM left for KV cannot hold them now,
  // OUT_OF_RANGE when it could not even empty. `kv_tokens` >= 0 cuts what
  // the session stores beyond that many positions (a failed turn's
  // leftovers: KaratNode.Reserve); the result says whether the session's
  // KV had to be dropped whole instead (LocalAttentionBackend::Truncate).
  // `turn_epoch` fences the session's older turns off: a step of a turn
  // with an older epoch (SetPlacement) fails that session's segment from
  // now on, as a KARAT device refuses its frames.
  absl::StatusOr<bool> Reserve(uint64_t session, int tokens,
                               int kv_tokens = -1, uint64_t turn_epoch = 0);
  void Free(uint64_t session);
  // Frees every session; returns how many there were.
  int FreeAll();
  bool HasSession(uint64_t session) const;
  size_t capacity_bytes() const { return capacity_; }
  // Pages held by the sessions (page-granular, every layer).
  size_t used_bytes() const;
  // Those held by `session` (0 when it has none).
  size_t session_bytes(uint64_t session) const;
  int sessions() const;

  void SetPlacement(uint64_t session, const cluster::KaratPlacement& placement,
                    uint64_t turn_epoch) override;
  void ClearPlacement(uint64_t session) override;
  absl::Status RunLayer(int layer, const std::vector<Segment>& segs,
                        LayerTraffic* traffic) override;

 private:
  GpuLocalAttention(const ModelConfig& config, int tokens_per_page,
                    size_t capacity_bytes);
  size_t BytesFor(int tokens) const;

  const size_t capacity_;
  mutable absl::Mutex mu_;
  LocalAttentionBackend local_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, int> reserved_ ABSL_GUARDED_BY(mu_);
  // Per session: the newest turn epoch Reserve fenced in, and the epoch of
  // the turn in the decode loop now.
  absl::flat_hash_map<uint64_t, uint64_t> fence_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, uint64_t> running_ ABSL_GUARDED_BY(mu_);
};

}  // namespace karat
