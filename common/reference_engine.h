// The single-process reference engine: the whole model in one process, KV
// and index keys stored in the same formats and read by the same kernels as
// the cluster. It is the oracle of every end-to-end test (DESIGN.md §6).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_runner.h"
#include "common/weights.h"

namespace karat {

// A conversation as the engine sees it: the token history (BOS, prompts,
// generated tokens) and how many of its positions have KV stored.
struct ReferenceSession {
  uint64_t key = 1;
  uint64_t seed = 0;
  std::vector<int32_t> tokens;
  int kv_len = 0;
};

struct ReferenceOptions {
  // Most tokens per prefill step (0: the whole turn at once). Chunking does
  // not change the result.
  int prefill_chunk = 0;
  int tokens_per_page = 64;
  size_t capacity_bytes = size_t(8) << 30;
};

// Not thread-safe.
class ReferenceEngine {
 public:
  static absl::StatusOr<std::unique_ptr<ReferenceEngine>> Create(
      const ModelFiles& files, const ReferenceOptions& options = {});
  ~ReferenceEngine();

  // One turn (MODEL.md "Tokens, positions, turns"): feeds the history not
  // yet stored plus `prompt` (BOS first on a new session), then samples up to
  // `max_new_tokens`, stopping after EOS. Returns the generated ids.
  absl::StatusOr<std::vector<int32_t>> RunTurn(
      ReferenceSession* session, const std::vector<int32_t>& prompt,
      int max_new_tokens, float temperature);

  // The logits of the last token of `tokens` fed after the session's stored
  // history (for tests of batch invariance).
  const ModelRunner& runner() const;

 private:
  ReferenceEngine();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace karat
