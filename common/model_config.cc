#include "common/model_config.h"

#include <cmath>
#include <fstream>
#include <iterator>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/json.h"
#include "common/status_macros.h"

namespace karat {

namespace internal {
// Generated at build time from presets/*.json (common/numerics.cmake).
struct PresetText {
  const char* name;
  const char* json;
};
extern const PresetText kPresetTexts[];
extern const size_t kNumPresetTexts;
}  // namespace internal

namespace {

struct IntField {
  const char* name;
  int ModelConfig::*member;
};
constexpr IntField kIntFields[] = {
    {"hidden_size", &ModelConfig::hidden_size},
    {"num_hidden_layers", &ModelConfig::num_hidden_layers},
    {"vocab_size", &ModelConfig::vocab_size},
    {"bos_token_id", &ModelConfig::bos_token_id},
    {"eos_token_id", &ModelConfig::eos_token_id},
    {"q_lora_rank", &ModelConfig::q_lora_rank},
    {"kv_lora_rank", &ModelConfig::kv_lora_rank},
    {"qk_nope_head_dim", &ModelConfig::qk_nope_head_dim},
    {"qk_rope_head_dim", &ModelConfig::qk_rope_head_dim},
    {"v_head_dim", &ModelConfig::v_head_dim},
    {"num_attention_heads", &ModelConfig::num_attention_heads},
    {"num_key_value_heads", &ModelConfig::num_key_value_heads},
    {"head_dim", &ModelConfig::head_dim},
    {"index_n_heads", &ModelConfig::index_n_heads},
    {"index_head_dim", &ModelConfig::index_head_dim},
    {"index_topk", &ModelConfig::index_topk},
    {"n_routed_experts", &ModelConfig::n_routed_experts},
    {"num_experts_per_tok", &ModelConfig::num_experts_per_tok},
    {"n_shared_experts", &ModelConfig::n_shared_experts},
    {"moe_intermediate_size", &ModelConfig::moe_intermediate_size},
    {"intermediate_size", &ModelConfig::intermediate_size},
    {"first_k_dense_replace", &ModelConfig::first_k_dense_replace},
    {"index_reuse_freq", &ModelConfig::index_reuse_freq},
};

struct DoubleField {
  const char* name;
  double ModelConfig::*member;
};
constexpr DoubleField kDoubleFields[] = {
    {"rms_norm_eps", &ModelConfig::rms_norm_eps},
    {"rope_theta", &ModelConfig::rope_theta},
};

struct AttnField {
  const char* name;
  int AttentionConfig::*member;
};
constexpr AttnField kAttnFields[] = {
    {"block_size", &AttentionConfig::block_size},
    {"topk_blocks", &AttentionConfig::topk_blocks},
    {"page_size", &AttentionConfig::page_size},
    {"page_budget", &AttentionConfig::page_budget},
    {"lsh_bits", &AttentionConfig::lsh_bits},
    {"lsh_tables", &AttentionConfig::lsh_tables},
    {"sink", &AttentionConfig::sink},
    {"local", &AttentionConfig::local},
    {"cluster_size", &AttentionConfig::cluster_size},
    {"cluster_budget", &AttentionConfig::cluster_budget},
    {"kmeans_iters", &AttentionConfig::kmeans_iters},
};

// The attention parameters that belong to a type and method; any other
// parameter in the `attention` object is a mistake worth refusing.
std::vector<std::string> AttentionParams(const AttentionConfig& a) {
  if (a.type == AttentionType::kGqaBlock) return {"block_size", "topk_blocks"};
  if (a.type != AttentionType::kGqaDense) return {};
  switch (a.method) {
    case AttentionMethod::kDense:
      return {};
    case AttentionMethod::kQuest:
      return {"page_size", "page_budget"};
    case AttentionMethod::kMagicPig:
      return {"lsh_bits", "lsh_tables", "sink", "local"};
    case AttentionMethod::kClusterKv:
      return {"sink", "cluster_size", "cluster_budget", "kmeans_iters"};
  }
  return {};
}

bool ParseAttentionType(const std::string& s, AttentionType* t) {
  for (AttentionType c : {AttentionType::kMlaDsa, AttentionType::kGqaBlock,
                          AttentionType::kGqaDense}) {
    if (s == AttentionTypeName(c)) {
      *t = c;
      return true;
    }
  }
  return false;
}

bool ParseAttentionMethod(const std::string& s, AttentionMethod* m) {
  for (AttentionMethod c :
       {AttentionMethod::kDense, AttentionMethod::kQuest,
        AttentionMethod::kMagicPig, AttentionMethod::kClusterKv}) {
    if (s == AttentionMethodName(c)) {
      *m = c;
      return true;
    }
  }
  return false;
}

absl::Status FieldError(const std::string& source, const std::string& field,
                        const std::string& reason) {
  return absl::InvalidArgumentError(
      absl::StrCat(source, ": field '", field, "': ", reason));
}

absl::Status ReadInt(const JsonValue& v, const std::string& source,
                     const std::string& field, int* out) {
  int64_t x;
  if (!v.AsInt64(&x)) {
    return FieldError(source, field,
                      v.kind == JsonValue::Kind::kNumber
                          ? absl::StrCat("must be an integer, got ", v.text)
                          : "must be an integer");
  }
  if (x < INT32_MIN || x > INT32_MAX) {
    return FieldError(source, field, absl::StrCat("out of range: ", x));
  }
  *out = static_cast<int>(x);
  return absl::OkStatus();
}

bool IsPowerOfTwo(int x) { return x > 0 && (x & (x - 1)) == 0; }

absl::Status ParseAttention(const JsonValue& obj, const std::string& source,
                            AttentionConfig* a) {
  if (!obj.is_object()) {
    return FieldError(source, "attention", "must be an object");
  }
  const JsonValue* type = obj.Find("type");
  if (type == nullptr) return FieldError(source, "attention.type", "missing");
  if (type->kind != JsonValue::Kind::kString ||
      !ParseAttentionType(type->text, &a->type)) {
    return FieldError(
        source, "attention.type",
        absl::StrCat("unknown attention type ",
                     type->kind == JsonValue::Kind::kString
                         ? JsonQuote(type->text)
                         : std::string("(not a string)"),
                     "; expected mla_dsa, gqa_block or gqa_dense"));
  }
  a->method = AttentionMethod::kDense;
  if (const JsonValue* method = obj.Find("method"); method != nullptr) {
    if (method->kind != JsonValue::Kind::kString ||
        !ParseAttentionMethod(method->text, &a->method)) {
      return FieldError(
          source, "attention.method",
          absl::StrCat("unknown method ",
                       method->kind == JsonValue::Kind::kString
                           ? JsonQuote(method->text)
                           : std::string("(not a string)"),
                       "; expected dense, quest, magicpig or clusterkv"));
    }
    if (a->method != AttentionMethod::kDense &&
        a->type != AttentionType::kGqaDense) {
      return FieldError(source, "attention.method",
                        absl::StrCat("method ", method->text,
                                     " applies only to attention type "
                                     "gqa_dense, not ",
                                     type->text));
    }
  }
  const std::vector<std::string> allowed = AttentionParams(*a);
  for (const auto& [key, value] : obj.object) {
    if (key == "type" || key == "method") continue;
    const std::string field = "attention." + key;
    const AttnField* f = nullptr;
    for (const AttnField& c : kAttnFields) {
      if (key == c.name) f = &c;
    }
    if (f == nullptr) return FieldError(source, field, "unknown field");
    bool ok = false;
    for (const std::string& p : allowed) ok = ok || p == key;
    if (!ok) {
      return FieldError(
          source, field,
          absl::StrCat(
              "not a parameter of ", AttentionTypeName(a->type),
              a->type == AttentionType::kGqaDense
                  ? absl::StrCat(" method ", AttentionMethodName(a->method))
                  : std::string()));
    }
    RETURN_IF_ERROR(ReadInt(value, source, field, &(a->*(f->member))));
  }
  return absl::OkStatus();
}

// Fields a config must state for its attention type and FFN; the struct's
// zero defaults for them would only produce a less helpful message later.
std::vector<std::string> RequiredFields(const ModelConfig& c) {
  std::vector<std::string> r = {"hidden_size", "num_hidden_layers",
                                "num_attention_heads"};
  if (c.attention.type == AttentionType::kMlaDsa) {
    for (const char* f :
         {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
          "v_head_dim", "index_n_heads", "index_head_dim", "index_topk"}) {
      r.push_back(f);
    }
  } else {
    r.push_back("num_key_value_heads");
    r.push_back("head_dim");
    if (c.attention.type == AttentionType::kGqaBlock) {
      r.push_back("index_head_dim");
    }
  }
  if (c.n_routed_experts > 0) {
    r.push_back("num_experts_per_tok");
    r.push_back("moe_intermediate_size");
  }
  if (c.n_routed_experts == 0 || c.first_k_dense_replace > 0) {
    r.push_back("intermediate_size");
  }
  return r;
}

std::string ReadFileOr(const std::string& path, absl::Status* status) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    *status = absl::NotFoundError(absl::StrCat(path, ": cannot open"));
    return {};
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) {
    *status = absl::DataLossError(absl::StrCat(path, ": read failed"));
  }
  return ss.str();
}

// The bounds of model_config.h (kMaxModelDim, ...), so that the weights'
// shapes and sizes, which multiply these, cannot overflow.
absl::Status CheckBounds(const ModelConfig& c, const std::string& source) {
  const struct {
    const char* name;
    int value;
    int max;
  } bounds[] = {
      {"hidden_size", c.hidden_size, kMaxModelDim},
      {"num_hidden_layers", c.num_hidden_layers, kMaxLayers},
      {"q_lora_rank", c.q_lora_rank, kMaxModelDim},
      {"kv_lora_rank", c.kv_lora_rank, kMaxModelDim},
      {"qk_nope_head_dim", c.qk_nope_head_dim, kMaxModelDim},
      {"qk_rope_head_dim", c.qk_rope_head_dim, kMaxModelDim},
      {"v_head_dim", c.v_head_dim, kMaxModelDim},
      {"num_attention_heads", c.num_attention_heads, kMaxHeads},
      {"num_key_value_heads", c.num_key_value_heads, kMaxHeads},
      {"head_dim", c.head_dim, kMaxModelDim},
      {"index_n_heads", c.index_n_heads, kMaxHeads},
      {"index_head_dim", c.index_head_dim, kMaxModelDim},
      {"n_routed_experts", c.n_routed_experts, kMaxRoutedExperts},
      {"n_shared_experts", c.n_shared_experts, kMaxRoutedExperts},
      {"moe_intermediate_size", c.moe_intermediate_size, kMaxModelDim},
      {"intermediate_size", c.intermediate_size, kMaxModelDim},
      {"attention.lsh_tables", c.attention.lsh_tables, kMaxModelDim},
  };
  for (const auto& b : bounds) {
    if (b.value > b.max) {
      return FieldError(
          source, b.name,
          absl::StrCat("must be at most ", b.max, ", got ", b.value));
    }
  }
  return absl::OkStatus();
}

}  // namespace

const char* AttentionTypeName(AttentionType t) {
  switch (t) {
    case AttentionType::kMlaDsa:
      return "mla_dsa";
    case AttentionType::kGqaBlock:
      return "gqa_block";
    case AttentionType::kGqaDense:
      return "gqa_dense";
  }
  return "unknown";
}

const char* AttentionMethodName(AttentionMethod m) {
  switch (m) {
    case AttentionMethod::kDense:
      return "dense";
    case AttentionMethod::kQuest:
      return "quest";
    case AttentionMethod::kMagicPig:
      return "magicpig";
    case AttentionMethod::kClusterKv:
      return "clusterkv";
  }
  return "unknown";
}

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json,
                                             const std::string& source) {
  absl::StatusOr<JsonValue> doc = ParseJson(json);
  if (!doc.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": invalid JSON: ", doc.status().message()));
  }
  if (!doc->is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": top level must be a JSON object"));
  }
  ModelConfig c;
  // HF writes `null` for an unused field; that reads as absent.
  auto present = [&](const char* name) -> const JsonValue* {
    const JsonValue* v = doc->Find(name);
    return v == nullptr || v->kind == JsonValue::Kind::kNull ? nullptr : v;
  };
  for (const IntField& f : kIntFields) {
    if (const JsonValue* v = present(f.name)) {
      RETURN_IF_ERROR(ReadInt(*v, source, f.name, &(c.*(f.member))));
    }
  }
  for (const DoubleField& f : kDoubleFields) {
    if (const JsonValue* v = present(f.name)) {
      if (v->kind != JsonValue::Kind::kNumber) {
        return FieldError(source, f.name, "must be a number");
      }
      c.*(f.member) = v->number;
    }
  }
  const JsonValue* attention = present("attention");
  if (attention == nullptr) return FieldError(source, "attention", "missing");
  RETURN_IF_ERROR(ParseAttention(*attention, source, &c.attention));
  for (const std::string& f : RequiredFields(c)) {
    if (present(f.c_str()) == nullptr) {
      return FieldError(
          source, f,
          absl::StrCat("missing (required for attention type ",
                       AttentionTypeName(c.attention.type),
                       c.n_routed_experts > 0 ? " with MoE" : "", ")"));
    }
  }
  RETURN_IF_ERROR(ValidateModelConfig(c, source));
  return c;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir) {
  const std::string path = model_dir + "/config.json";
  absl::Status status;
  std::string text = ReadFileOr(path, &status);
  RETURN_IF_ERROR(status);
  return ParseModelConfig(text, path);
}

absl::Status ValidateModelConfig(const ModelConfig& c,
                                 const std::string& source) {
  auto positive = [&](const char* name, int v) -> absl::Status {
    if (v <= 0) {
      return FieldError(source, name, absl::StrCat("must be > 0, got ", v));
    }
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(positive("hidden_size", c.hidden_size));
  RETURN_IF_ERROR(positive("num_hidden_layers", c.num_hidden_layers));
  if (c.vocab_size != 258) {
    return FieldError(
        source, "vocab_size",
        absl::StrCat("must be 258 (byte-level tokens), got ", c.vocab_size));
  }
  if (c.bos_token_id != 256) {
    return FieldError(source, "bos_token_id",
                      absl::StrCat("must be 256, got ", c.bos_token_id));
  }
  if (c.eos_token_id != 257) {
    return FieldError(source, "eos_token_id",
                      absl::StrCat("must be 257, got ", c.eos_token_id));
  }
  if (!(c.rms_norm_eps > 0) || !std::isfinite(c.rms_norm_eps)) {
    return FieldError(source, "rms_norm_eps", "must be a finite number > 0");
  }
  if (!(c.rope_theta > 0) || !std::isfinite(c.rope_theta)) {
    return FieldError(source, "rope_theta", "must be a finite number > 0");
  }
  RETURN_IF_ERROR(positive("num_attention_heads", c.num_attention_heads));

  const AttentionConfig& a = c.attention;
  if (a.method != AttentionMethod::kDense &&
      a.type != AttentionType::kGqaDense) {
    return FieldError(source, "attention.method",
                      absl::StrCat("method ", AttentionMethodName(a.method),
                                   " applies only to gqa_dense"));
  }
  if (a.type == AttentionType::kMlaDsa) {
    RETURN_IF_ERROR(positive("q_lora_rank", c.q_lora_rank));
    RETURN_IF_ERROR(positive("kv_lora_rank", c.kv_lora_rank));
    RETURN_IF_ERROR(positive("qk_nope_head_dim", c.qk_nope_head_dim));
    RETURN_IF_ERROR(positive("qk_rope_head_dim", c.qk_rope_head_dim));
    if (c.qk_rope_head_dim % 2 != 0) {
      return FieldError(source, "qk_rope_head_dim",
                        absl::StrCat("must be even, got ", c.qk_rope_head_dim));
    }
    RETURN_IF_ERROR(positive("v_head_dim", c.v_head_dim));
    RETURN_IF_ERROR(positive("index_n_heads", c.index_n_heads));
    if (!IsPowerOfTwo(c.index_head_dim)) {
      return FieldError(
          source, "index_head_dim",
          absl::StrCat("must be a power of two, got ", c.index_head_dim));
    }
    if (c.index_head_dim < c.qk_rope_head_dim) {
      return FieldError(
          source, "index_head_dim",
          absl::StrCat("must be >= qk_rope_head_dim (", c.qk_rope_head_dim,
                       "), got ", c.index_head_dim));
    }
    RETURN_IF_ERROR(positive("index_topk", c.index_topk));
    if (c.index_reuse_freq < 1) {
      return FieldError(source, "index_reuse_freq",
                        absl::StrCat("must be >= 1, got ", c.index_reuse_freq));
    }
  } else {
    RETURN_IF_ERROR(positive("num_key_value_heads", c.num_key_value_heads));
    if (c.num_attention_heads % c.num_key_value_heads != 0) {
      return FieldError(source, "num_key_value_heads",
                        absl::StrCat("must divide num_attention_heads (",
                                     c.num_attention_heads, "), got ",
                                     c.num_key_value_heads));
    }
    RETURN_IF_ERROR(positive("head_dim", c.head_dim));
    if (c.head_dim % 2 != 0) {
      return FieldError(source, "head_dim",
                        absl::StrCat("must be even, got ", c.head_dim));
    }
    if (c.index_reuse_freq != 1) {
      return FieldError(source, "index_reuse_freq",
                        absl::StrCat("applies only to mla_dsa; must be 1 for ",
                                     AttentionTypeName(a.type), ", got ",
                                     c.index_reuse_freq));
    }
    if (a.type == AttentionType::kGqaBlock) {
      RETURN_IF_ERROR(positive("index_head_dim", c.index_head_dim));
      RETURN_IF_ERROR(positive("attention.block_size", a.block_size));
      RETURN_IF_ERROR(positive("attention.topk_blocks", a.topk_blocks));
    }
    auto non_negative = [&](const char* name, int v) -> absl::Status {
      if (v < 0) {
        return FieldError(source, name, absl::StrCat("must be >= 0, got ", v));
      }
      return absl::OkStatus();
    };
    if (a.type == AttentionType::kGqaDense) {
      switch (a.method) {
        case AttentionMethod::kDense:
          break;
        case AttentionMethod::kQuest:
          RETURN_IF_ERROR(positive("attention.page_size", a.page_size));
          RETURN_IF_ERROR(positive("attention.page_budget", a.page_budget));
          break;
        case AttentionMethod::kMagicPig:
          if (a.lsh_bits < 1 || a.lsh_bits > 32) {
            return FieldError(
                source, "attention.lsh_bits",
                absl::StrCat("must be in [1, 32], got ", a.lsh_bits));
          }
          // A key is retrieved when two tables agree, so one table never
          // retrieves anything.
          if (a.lsh_tables < 2) {
            return FieldError(source, "attention.lsh_tables",
                              absl::StrCat("must be >= 2, got ", a.lsh_tables));
          }
          RETURN_IF_ERROR(non_negative("attention.sink", a.sink));
          RETURN_IF_ERROR(non_negative("attention.local", a.local));
          break;
        case AttentionMethod::kClusterKv:
          RETURN_IF_ERROR(non_negative("attention.sink", a.sink));
          RETURN_IF_ERROR(positive("attention.cluster_size", a.cluster_size));
          RETURN_IF_ERROR(
              positive("attention.cluster_budget", a.cluster_budget));
          RETURN_IF_ERROR(
              non_negative("attention.kmeans_iters", a.kmeans_iters));
          break;
      }
    }
  }

  if (c.n_routed_experts < 0) {
    return FieldError(source, "n_routed_experts",
                      absl::StrCat("must be >= 0, got ", c.n_routed_experts));
  }
  if (c.first_k_dense_replace < 0 ||
      c.first_k_dense_replace > c.num_hidden_layers) {
    return FieldError(source, "first_k_dense_replace",
                      absl::StrCat("must be in [0, num_hidden_layers], got ",
                                   c.first_k_dense_replace));
  }
  if (c.n_routed_experts > 0) {
    if (c.num_experts_per_tok < 1 ||
        c.num_experts_per_tok > c.n_routed_experts) {
      return FieldError(
          source, "num_experts_per_tok",
          absl::StrCat("must be in [1, n_routed_experts (", c.n_routed_experts,
                       ")], got ", c.num_experts_per_tok));
    }
    RETURN_IF_ERROR(positive("moe_intermediate_size", c.moe_intermediate_size));
    if (c.n_shared_experts < 0) {
      return FieldError(source, "n_shared_experts",
                        absl::StrCat("must be >= 0, got ", c.n_shared_experts));
    }
  }
  const bool has_dense_layer =
      c.n_routed_experts == 0 || c.first_k_dense_replace > 0;
  if (has_dense_layer) {
    RETURN_IF_ERROR(positive("intermediate_size", c.intermediate_size));
  }
  return CheckBounds(c, source);
}

std::string ModelConfigToJson(const ModelConfig& c) {
  std::string out = "{\n";
  // The three leading size fields first, then the floating-point ones, then
  // the rest in table order: the usual reading order of an HF config.
  for (int i = 0; i < 3; ++i) {
    absl::StrAppend(&out, "  \"", kIntFields[i].name,
                    "\": ", c.*(kIntFields[i].member), ",\n");
  }
  for (const DoubleField& f : kDoubleFields) {
    absl::StrAppend(&out, "  \"", f.name, "\": ", JsonNumber(c.*(f.member)),
                    ",\n");
  }
  for (size_t i = 3; i < std::size(kIntFields); ++i) {
    absl::StrAppend(&out, "  \"", kIntFields[i].name,
                    "\": ", c.*(kIntFields[i].member), ",\n");
  }
  absl::StrAppend(&out, "  \"attention\": {\"type\": \"",
                  AttentionTypeName(c.attention.type), "\", \"method\": \"",
                  AttentionMethodName(c.attention.method), "\"");
  for (const std::string& p : AttentionParams(c.attention)) {
    for (const AttnField& f : kAttnFields) {
      if (p == f.name) {
        absl::StrAppend(&out, ", \"", f.name, "\": ", c.attention.*(f.member));
      }
    }
  }
  out += "}\n}\n";
  return out;
}

std::vector<std::string> PresetNames() {
  std::vector<std::string> names;
  for (size_t i = 0; i < internal::kNumPresetTexts; ++i) {
    names.push_back(internal::kPresetTexts[i].name);
  }
  return names;
}

absl::StatusOr<ModelConfig> PresetConfig(const std::string& name) {
  for (size_t i = 0; i < internal::kNumPresetTexts; ++i) {
    if (name == internal::kPresetTexts[i].name) {
      return ParseModelConfig(internal::kPresetTexts[i].json,
                              absl::StrCat("preset ", name));
    }
  }
  return absl::NotFoundError(
      absl::StrCat("unknown preset \"", name,
                   "\"; known: ", absl::StrJoin(PresetNames(), ", ")));
}

}  // namespace karat
