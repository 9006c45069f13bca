// KARAT-side attention for one layer of one segment (DESIGN.md §2 step 3):
// append the segment's new entries, then Score -> Select -> Gather -> Attend
// for each of its tokens. The KARAT-node daemon and the reference engine call
// the same functions, so they agree bit for bit.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "common/kv_store.h"
#include "common/model_config.h"

namespace karat {

// Sizes of the per-token data-plane arrays for one layer (MODEL.md: indexer
// query as fp8 codes + scales, attention Q and outputs as fp32, KV in bf16).
struct AttnShapes {
  int heads = 0;          // attention heads H
  int kv_dim = 0;         // kv_lora + rope (mla_dsa)
  int kv_lora = 0;
  int rope = 0;
  int q_dim = 0;          // per head: kv_lora + rope (absorbed)
  int out_dim = 0;        // per head: kv_lora (o_lat)
  int index_heads = 0;    // Hi
  int index_dim = 0;      // Di
  int index_topk = 0;
  float softmax_scale = 0;
};
AttnShapes MakeAttnShapes(const ModelConfig& config);

// The GPU -> KARAT payload of one segment and layer, token-major. Spans
// point into a frame or into the GPU node's step buffers.
struct IndexInputs {      // frame kIndexQK; only on layers with an indexer
  const uint8_t* q_codes = nullptr;  // n x Hi x Di
  const float* q_scales = nullptr;   // n x Hi
  const float* weights = nullptr;    // n x Hi (already x Hi^-0.5)
  const uint8_t* k_codes = nullptr;  // n x Di
  const float* k_scales = nullptr;   // n
};
struct AttnInputs {       // frame kAttnQKV
  const float* q = nullptr;      // n x H x q_dim  ([q_abs | q_pe] per head)
  const uint16_t* kv = nullptr;  // n x kv_dim bf16
};

// What one kernel call read and computed, for the device timing model and
// the benchmarks (bytes of cache entries and metadata read, floating-point
// operations).
struct KernelCost {
  double bytes = 0;
  double flops = 0;
};

// Per-session state kept between layers of one step: the selection of the
// last layer that ran the indexer, per token of the segment (index reuse).
struct SelectionState {
  int pos_start = -1;
  std::vector<std::vector<int32_t>> per_token;
};

// Appends the indexer keys of tokens [pos_start, pos_start + n) to `layer`
// and computes each token's top-k (into `sel`). Positions >= pos_start
// already stored are dropped first (a resent position overwrites).
absl::Status RunIndexer(const AttnShapes& shapes, int layer, int pos_start,
                        int n, const IndexInputs& in, SessionCache* cache,
                        SelectionState* sel);

// Appends the KV entries and computes o_lat (n x H x out_dim) for each token,
// attending to the positions in `sel` (or to every position <= the token when
// `sel` is null: dense, for context <= index_topk or no indexer).
absl::Status RunAttention(const AttnShapes& shapes, int layer, int pos_start,
                          int n, const AttnInputs& in, SessionCache* cache,
                          const SelectionState* sel, float* out);

// --- Kernels (exposed for tests and benchmarks) ---

// I[s] = sum_h (w[h] * Di^-0.5) * ReLU((q_codes[h] . k_codes[s]) *
//        q_scale[h] * k_scale[s]) for s in [0, n).
void IndexerScore(const LayerView& view, int n, const uint8_t* q_codes,
                  const float* q_scales, const float* weights, int heads,
                  int dim, float* scores);
// Positions of the min(k, n) highest scores, ties to the lower position,
// -0.0 == +0.0; returned in increasing position order.
void SelectTopK(const float* scores, int n, int k, std::vector<int32_t>* out);
// Absorbed MLA over the positions `sel` (increasing): per head
// s = (q[h] . entry) * scale, softmax, o[h] = sum p * c.
void MlaAttend(const LayerView& view, const int32_t* sel, int nsel,
               const float* q, const AttnShapes& shapes, float* o_lat);

}  // namespace karat
