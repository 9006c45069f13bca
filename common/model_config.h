// The model's config.json (MODEL.md "Files"): Hugging Face field names plus an
// `attention` object. Parsing refuses unknown attention types or methods and
// inconsistent shapes with a message naming the file and the field.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace karat {

enum class AttentionType { kMlaDsa, kGqaBlock, kGqaDense };
enum class AttentionMethod { kDense, kQuest, kMagicPig, kClusterKv };

struct AttentionConfig {
  AttentionType type = AttentionType::kMlaDsa;
  AttentionMethod method = AttentionMethod::kDense;  // gqa_dense only
  // gqa_block
  int block_size = 16;
  int topk_blocks = 8;
  // quest
  int page_size = 16;
  int page_budget = 8;
  // magicpig
  int lsh_bits = 8;
  int lsh_tables = 32;
  // magicpig and clusterkv
  int sink = 4;
  int local = 64;
  // clusterkv
  int cluster_size = 16;
  int cluster_budget = 128;
  int kmeans_iters = 10;
};

struct ModelConfig {
  int hidden_size = 0;
  int num_hidden_layers = 0;
  int vocab_size = 258;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  int bos_token_id = 256;
  int eos_token_id = 257;
  // MLA
  int q_lora_rank = 0;
  int kv_lora_rank = 0;
  int qk_nope_head_dim = 0;
  int qk_rope_head_dim = 0;
  int v_head_dim = 0;
  int num_attention_heads = 0;
  // GQA
  int num_key_value_heads = 0;
  int head_dim = 0;
  // Indexer (DSA: heads x dim; gqa_block: Di = index_head_dim)
  int index_n_heads = 0;
  int index_head_dim = 0;
  int index_topk = 0;
  // FFN / MoE
  int n_routed_experts = 0;
  int num_experts_per_tok = 0;
  int n_shared_experts = 0;
  int moe_intermediate_size = 0;
  int intermediate_size = 0;
  int first_k_dense_replace = 0;
  int index_reuse_freq = 1;
  AttentionConfig attention;

  // Derived helpers.
  bool IsMoeLayer(int layer) const {
    return n_routed_experts > 0 && layer >= first_k_dense_replace;
  }
  // mla_dsa: does layer `l` run the indexer (l % index_reuse_freq == 0)?
  bool HasIndexer(int layer) const {
    return attention.type == AttentionType::kMlaDsa &&
           layer % index_reuse_freq == 0;
  }
};

// Bounds ValidateModelConfig puts on a config's sizes: far beyond the models
// this runs, and small enough that every tensor's shape, a rank's weight
// bytes (common/weights.h) and the tensor list stay well inside int64 and
// memory (at most 2^59 bytes of weights).
inline constexpr int kMaxModelDim = 1 << 16;  // widths, ranks, head dims,
                                              // intermediate sizes
inline constexpr int kMaxHeads = 1 << 12;     // attention, KV, indexer heads
inline constexpr int kMaxLayers = 1 << 8;
inline constexpr int kMaxRoutedExperts = 1 << 9;  // also shared experts

// Parses config.json text. `source` names the file in error messages, e.g.
// "model/config.json: field 'kv_lora_rank': must be > 0".
absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json,
                                             const std::string& source);
// Reads and parses DIR/config.json.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir);
// Checks shapes for consistency (every field the attention type needs is
// positive, heads divisible by kv heads, index_head_dim a power of two for
// mla_dsa, rope dims even, topk experts <= experts, ...) and the bounds
// above.
absl::Status ValidateModelConfig(const ModelConfig& config,
                                 const std::string& source);
// Serialises with the same field names (round-trips through ParseModelConfig).
std::string ModelConfigToJson(const ModelConfig& config);

// Built-in presets of MODEL.md: "dsa-tiny", "dsa-small", "glm-tiny",
// "glm-small", "minimax-tiny", "minimax-small", "llama-tiny" and
// "llama-small" (method dense; "llama-tiny-quest", "-magicpig",
// "-clusterkv" and their -small forms select the method).
absl::StatusOr<ModelConfig> PresetConfig(const std::string& name);
std::vector<std::string> PresetNames();

const char* AttentionTypeName(AttentionType t);
const char* AttentionMethodName(AttentionMethod m);

}  // namespace karat
