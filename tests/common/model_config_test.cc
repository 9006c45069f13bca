#include "common/model_config.h"

#include <catch2/catch.hpp>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"

namespace karat {
namespace {

constexpr char kDsa[] = R"({
  "architectures": ["SomethingForCausalLM"],
  "torch_dtype": "bfloat16",
  "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 258,
  "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
  "bos_token_id": 256, "eos_token_id": 257,
  "num_attention_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 16,
  "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
  "index_n_heads": 2, "index_head_dim": 8, "index_topk": 4,
  "index_reuse_freq": 1, "first_k_dense_replace": 1,
  "intermediate_size": 96, "n_routed_experts": 4, "num_experts_per_tok": 2,
  "n_shared_experts": 1, "moe_intermediate_size": 32,
  "attention": {"type": "mla_dsa"}
})";

constexpr char kLlama[] = R"({
  "hidden_size": 64, "num_hidden_layers": 3,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
  "intermediate_size": 96,
  "attention": {"type": "gqa_dense", "method": "quest",
                "page_size": 8, "page_budget": 3}
})";

// Expects `json` to be refused with a message naming `field`.
void ExpectRefused(const std::string& json, const std::string& field,
                   const std::string& reason = "") {
  INFO(json);
  auto c = ParseModelConfig(json, "cfg.json");
  REQUIRE_FALSE(c.ok());
  INFO(c.status().ToString());
  CHECK(c.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StartsWith(c.status().message(),
                         "cfg.json: field '" + field + "': "));
  if (!reason.empty()) CHECK(absl::StrContains(c.status().message(), reason));
}

std::string Replace(const std::string& json, const std::string& from,
                    const std::string& to) {
  REQUIRE(absl::StrContains(json, from));
  return absl::StrReplaceAll(json, {{from, to}});
}

TEST_CASE("parses an mla_dsa config with extra HF fields", "[config]") {
  auto c = ParseModelConfig(kDsa, "cfg.json");
  REQUIRE(c.ok());
  CHECK(c->hidden_size == 64);
  CHECK(c->num_hidden_layers == 2);
  CHECK(c->attention.type == AttentionType::kMlaDsa);
  CHECK(c->q_lora_rank == 32);
  CHECK(c->qk_rope_head_dim == 4);
  CHECK(c->index_head_dim == 8);
  CHECK(c->n_routed_experts == 4);
  CHECK(c->rms_norm_eps == 1e-6);
  CHECK_FALSE(c->IsMoeLayer(0));
  CHECK(c->IsMoeLayer(1));
  CHECK(c->HasIndexer(1));
}

TEST_CASE("parses a gqa_dense config with method parameters", "[config]") {
  auto c = ParseModelConfig(kLlama, "cfg.json");
  REQUIRE(c.ok());
  CHECK(c->attention.type == AttentionType::kGqaDense);
  CHECK(c->attention.method == AttentionMethod::kQuest);
  CHECK(c->attention.page_size == 8);
  CHECK(c->attention.page_budget == 3);
  CHECK(c->vocab_size == 258);  // default
  CHECK_FALSE(c->IsMoeLayer(2));
}

TEST_CASE("refuses bad attention objects", "[config]") {
  ExpectRefused(Replace(kDsa, R"("type": "mla_dsa")", R"("type": "mha")"),
                "attention.type", "unknown attention type");
  ExpectRefused(Replace(kLlama, R"("method": "quest")", R"("method": "h2o")"),
                "attention.method", "unknown method");
  ExpectRefused(Replace(kDsa, R"("type": "mla_dsa")",
                        R"("type": "mla_dsa", "method": "quest")"),
                "attention.method", "only");
  ExpectRefused(Replace(kLlama, R"("page_budget": 3)",
                        R"("page_budget": 3, "page_budgte": 3)"),
                "attention.page_budgte", "unknown field");
  // A known parameter of another method is refused too.
  ExpectRefused(Replace(kLlama, R"("page_budget": 3)",
                        R"("page_budget": 3, "lsh_bits": 3)"),
                "attention.lsh_bits", "not a parameter");
  ExpectRefused(Replace(kLlama, R"("page_size": 8)", R"("page_size": 8.5)"),
                "attention.page_size", "integer");
  ExpectRefused(Replace(kLlama, R"("page_size": 8)", R"("page_size": 0)"),
                "attention.page_size", "> 0");
  ExpectRefused(Replace(kDsa, R"("attention": {"type": "mla_dsa"})",
                        R"("attention": {})"),
                "attention.type", "missing");
  ExpectRefused(Replace(kDsa, R"("attention": {"type": "mla_dsa"})",
                        R"("attention": "mla_dsa")"),
                "attention", "object");
  ExpectRefused(Replace(kDsa, R"("attention": {"type": "mla_dsa"})",
                        R"("attentionx": {"type": "mla_dsa"})"),
                "attention", "missing");
}

TEST_CASE("refuses missing and mistyped fields", "[config]") {
  ExpectRefused(Replace(kDsa, R"("kv_lora_rank": 16,)", ""), "kv_lora_rank",
                "missing");
  ExpectRefused(Replace(kLlama, R"("head_dim": 16,)", ""), "head_dim",
                "missing");
  ExpectRefused(Replace(kDsa, R"("moe_intermediate_size": 32,)", ""),
                "moe_intermediate_size", "missing");
  ExpectRefused(Replace(kLlama, R"("intermediate_size": 96,)", ""),
                "intermediate_size", "missing");
  ExpectRefused(Replace(kDsa, R"("hidden_size": 64)", R"("hidden_size": "64")"),
                "hidden_size", "integer");
  ExpectRefused(Replace(kDsa, R"("hidden_size": 64)", R"("hidden_size": 64.5)"),
                "hidden_size", "integer");
  ExpectRefused(
      Replace(kDsa, R"("hidden_size": 64)", R"("hidden_size": 99999999999)"),
      "hidden_size", "range");
  ExpectRefused(
      Replace(kDsa, R"("rope_theta": 10000.0)", R"("rope_theta": "big")"),
      "rope_theta", "number");
  // An integral value written as a float is still an integer.
  auto c = ParseModelConfig(
      Replace(kDsa, R"("hidden_size": 64)", R"("hidden_size": 64.0)"), "x");
  CHECK(c.ok());
}

TEST_CASE("refuses inconsistent shapes", "[config]") {
  ExpectRefused(
      Replace(kDsa, R"("index_head_dim": 8)", R"("index_head_dim": 12)"),
      "index_head_dim", "power of two");
  ExpectRefused(
      Replace(kDsa, R"("index_head_dim": 8)", R"("index_head_dim": 2)"),
      "index_head_dim", "qk_rope_head_dim");
  ExpectRefused(
      Replace(kDsa, R"("qk_rope_head_dim": 4)", R"("qk_rope_head_dim": 5)"),
      "qk_rope_head_dim", "even");
  ExpectRefused(Replace(kDsa, R"("index_topk": 4)", R"("index_topk": 0)"),
                "index_topk", "> 0");
  ExpectRefused(
      Replace(kDsa, R"("index_reuse_freq": 1)", R"("index_reuse_freq": 0)"),
      "index_reuse_freq", ">= 1");
  ExpectRefused(Replace(kDsa, R"("num_experts_per_tok": 2)",
                        R"("num_experts_per_tok": 5)"),
                "num_experts_per_tok");
  ExpectRefused(Replace(kDsa, R"("vocab_size": 258)", R"("vocab_size": 32000)"),
                "vocab_size", "258");
  ExpectRefused(Replace(kDsa, R"("bos_token_id": 256)", R"("bos_token_id": 1)"),
                "bos_token_id", "256");
  ExpectRefused(Replace(kDsa, R"("eos_token_id": 257)", R"("eos_token_id": 2)"),
                "eos_token_id", "257");
  ExpectRefused(Replace(kLlama, R"("num_key_value_heads": 2)",
                        R"("num_key_value_heads": 3)"),
                "num_key_value_heads", "divide");
  ExpectRefused(Replace(kLlama, R"("head_dim": 16)", R"("head_dim": 15)"),
                "head_dim", "even");
  ExpectRefused(Replace(kLlama, R"("intermediate_size": 96)",
                        R"("intermediate_size": 0)"),
                "intermediate_size", "> 0");
  ExpectRefused(Replace(kDsa, R"("first_k_dense_replace": 1)",
                        R"("first_k_dense_replace": 9)"),
                "first_k_dense_replace");
}

TEST_CASE("refuses malformed JSON naming the source", "[config]") {
  for (const char* bad : {"", "{", "[]", "{\"hidden_size\": 1,}",
                          "{\"a\": 1, \"a\": 2}", "{\"a\": tru}"}) {
    auto c = ParseModelConfig(bad, "cfg.json");
    REQUIRE_FALSE(c.ok());
    CHECK(c.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StartsWith(c.status().message(), "cfg.json: "));
  }
}

TEST_CASE("ModelConfigToJson round-trips", "[config]") {
  for (const std::string& name : PresetNames()) {
    INFO(name);
    auto c = PresetConfig(name);
    REQUIRE(c.ok());
    const std::string json = ModelConfigToJson(*c);
    auto back = ParseModelConfig(json, name);
    REQUIRE(back.ok());
    CHECK(ModelConfigToJson(*back) == json);
    CHECK(back->hidden_size == c->hidden_size);
    CHECK(back->rms_norm_eps == c->rms_norm_eps);
    CHECK(back->rope_theta == c->rope_theta);
    CHECK(back->attention.type == c->attention.type);
    CHECK(back->attention.method == c->attention.method);
    CHECK(back->attention.lsh_tables == c->attention.lsh_tables);
    CHECK(back->attention.cluster_budget == c->attention.cluster_budget);
    CHECK(back->index_reuse_freq == c->index_reuse_freq);
  }
}

TEST_CASE("presets match MODEL.md", "[config]") {
  const std::vector<std::string> names = PresetNames();
  for (const char* n :
       {"dsa-tiny", "dsa-small", "glm-tiny", "glm-small", "minimax-tiny",
        "minimax-small", "llama-tiny", "llama-small", "llama-tiny-quest",
        "llama-tiny-magicpig", "llama-tiny-clusterkv", "llama-small-quest",
        "llama-small-magicpig", "llama-small-clusterkv"}) {
    INFO(n);
    CHECK(std::find(names.begin(), names.end(), n) != names.end());
    CHECK(PresetConfig(n).ok());
  }
  CHECK(PresetConfig("gpt-5").status().code() == absl::StatusCode::kNotFound);

  auto dsa = PresetConfig("dsa-tiny");
  REQUIRE(dsa.ok());
  CHECK(dsa->attention.type == AttentionType::kMlaDsa);
  CHECK(dsa->hidden_size == 512);
  CHECK(dsa->num_hidden_layers == 6);
  CHECK(dsa->num_attention_heads == 8);
  CHECK(dsa->q_lora_rank == 192);
  CHECK(dsa->kv_lora_rank == 128);
  CHECK(dsa->qk_nope_head_dim == 32);
  CHECK(dsa->qk_rope_head_dim == 16);
  CHECK(dsa->v_head_dim == 32);
  CHECK(dsa->index_n_heads == 8);
  CHECK(dsa->index_head_dim == 32);
  CHECK(dsa->index_topk == 128);
  CHECK(dsa->first_k_dense_replace == 1);
  CHECK(dsa->intermediate_size == 1024);
  CHECK(dsa->n_routed_experts == 16);
  CHECK(dsa->num_experts_per_tok == 2);
  CHECK(dsa->n_shared_experts == 1);
  CHECK(dsa->moe_intermediate_size == 256);
  CHECK(dsa->index_reuse_freq == 1);

  auto glm = PresetConfig("glm-tiny");
  REQUIRE(glm.ok());
  CHECK(glm->num_hidden_layers == 8);
  CHECK(glm->index_reuse_freq == 4);
  CHECK(glm->HasIndexer(4));
  CHECK_FALSE(glm->HasIndexer(3));
  CHECK(PresetConfig("glm-small")->index_reuse_freq == 2);

  auto mm = PresetConfig("minimax-tiny");
  REQUIRE(mm.ok());
  CHECK(mm->attention.type == AttentionType::kGqaBlock);
  CHECK(mm->num_attention_heads == 8);
  CHECK(mm->num_key_value_heads == 2);
  CHECK(mm->head_dim == 64);
  CHECK(mm->index_head_dim == 32);
  CHECK(mm->attention.block_size == 16);
  CHECK(mm->attention.topk_blocks == 8);
  CHECK(mm->n_routed_experts == 16);

  auto ll = PresetConfig("llama-tiny");
  REQUIRE(ll.ok());
  CHECK(ll->attention.type == AttentionType::kGqaDense);
  CHECK(ll->attention.method == AttentionMethod::kDense);
  CHECK(ll->intermediate_size == 1536);
  CHECK(ll->n_routed_experts == 0);
  auto q = PresetConfig("llama-tiny-quest");
  CHECK(q->attention.method == AttentionMethod::kQuest);
  CHECK(q->attention.page_size == 16);
  CHECK(q->attention.page_budget == 8);
  auto mp = PresetConfig("llama-tiny-magicpig");
  CHECK(mp->attention.method == AttentionMethod::kMagicPig);
  CHECK(mp->attention.lsh_bits == 8);
  CHECK(mp->attention.lsh_tables == 32);
  CHECK(mp->attention.sink == 4);
  CHECK(mp->attention.local == 64);
  auto ck = PresetConfig("llama-tiny-clusterkv");
  CHECK(ck->attention.method == AttentionMethod::kClusterKv);
  CHECK(ck->attention.sink == 4);
  CHECK(ck->attention.cluster_size == 16);
  CHECK(ck->attention.cluster_budget == 128);
  CHECK(ck->attention.kmeans_iters == 10);
  CHECK(PresetConfig("llama-small-clusterkv")->attention.method ==
        AttentionMethod::kClusterKv);
}

TEST_CASE("refuses sizes beyond the bounds", "[config]") {
  // At the bounds: accepted.
  CHECK(ParseModelConfig(Replace(kDsa, "\"num_hidden_layers\": 2",
                                 "\"num_hidden_layers\": 256"),
                         "cfg.json")
            .ok());
  CHECK(ParseModelConfig(
            Replace(kDsa, "\"hidden_size\": 64", "\"hidden_size\": 65536"),
            "cfg.json")
            .ok());
  // Past them: refused, naming the field and the bound.
  ExpectRefused(
      Replace(kDsa, "\"num_hidden_layers\": 2", "\"num_hidden_layers\": 257"),
      "num_hidden_layers", "at most 256, got 257");
  ExpectRefused(Replace(kDsa, "\"hidden_size\": 64", "\"hidden_size\": 65537"),
                "hidden_size", "at most 65536");
  ExpectRefused(Replace(kDsa, "\"num_attention_heads\": 2",
                        "\"num_attention_heads\": 4097"),
                "num_attention_heads", "at most 4096");
  ExpectRefused(
      Replace(kDsa, "\"n_routed_experts\": 4", "\"n_routed_experts\": 513"),
      "n_routed_experts", "at most 512");
  ExpectRefused(
      Replace(kDsa, "\"n_shared_experts\": 1", "\"n_shared_experts\": 513"),
      "n_shared_experts", "at most 512");
  ExpectRefused(Replace(kLlama, "\"intermediate_size\": 96",
                        "\"intermediate_size\": 2147483647"),
                "intermediate_size", "at most 65536");
  // The model_config fuzz target's inputs: sizes whose weights' byte count
  // overflowed int64, and 2^31 - 1 layers that took the tensor list
  // beyond any memory (tests/fuzz/model_config_corpus/regression_*).
  ExpectRefused(Replace(Replace(kDsa, "\"hidden_size\": 64",
                                "\"hidden_size\": 2147483647"),
                        "\"q_lora_rank\": 32", "\"q_lora_rank\": 2147483647"),
                "hidden_size", "at most 65536");
  ExpectRefused(Replace(kLlama, "\"num_hidden_layers\": 3",
                        "\"num_hidden_layers\": 2147483647"),
                "num_hidden_layers", "at most 256");
}

TEST_CASE("ValidateModelConfig checks a hand-built struct", "[config]") {
  ModelConfig c = *PresetConfig("dsa-small");
  CHECK(ValidateModelConfig(c, "x").ok());
  c.index_n_heads = 0;
  auto s = ValidateModelConfig(c, "x");
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(s.message(), "field 'index_n_heads'"));
}

}  // namespace
}  // namespace karat
