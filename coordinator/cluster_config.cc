#include "coordinator/cluster_config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/link_rules.h"
#include "common/status_macros.h"
#include "common/weights.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"

namespace karat::coordinator {
namespace {

// Keeps the first error; protobuf reports 0-based lines and columns.
class FirstErrorCollector : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, google::protobuf::io::ColumnNumber column,
                const std::string& message) override {
    if (!has_error_) {
      has_error_ = true;
      error_ = absl::StrCat(line + 1, ":", column + 1, ": ", message);
    }
  }
  void AddWarning(int, google::protobuf::io::ColumnNumber,
                  const std::string&) override {}
  bool has_error() const { return has_error_; }
  const std::string& error() const { return error_; }

 private:
  bool has_error_ = false;
  std::string error_;
};

absl::Status Invalid(const std::string& field, const std::string& problem) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", problem));
}

}  // namespace

absl::Status ValidateSchedulingConfig(const cluster::SchedulingConfig& sc) {
  if (sc.micro_batches() < 0 || sc.micro_batches() > 2)
    return Invalid(
        "scheduling.micro_batches",
        absl::StrCat("must be 1 or 2 (0: 2), got ", sc.micro_batches()));
  if (!sc.schedule().empty() && sc.schedule() != "ofms" &&
      sc.schedule() != "scms")
    return Invalid("scheduling.schedule",
                   absl::StrCat("must be \"ofms\" or \"scms\", got \"",
                                sc.schedule(), "\""));
  if (!sc.balance().empty() && sc.balance() != "cmr" && sc.balance() != "count")
    return Invalid("scheduling.balance",
                   absl::StrCat("must be \"cmr\" or \"count\", got \"",
                                sc.balance(), "\""));
  if (!(sc.tbt_slo_ms() >= 0) || std::isinf(sc.tbt_slo_ms()))
    return Invalid("scheduling.tbt_slo_ms", "must be >= 0 and finite");
  if (sc.queue_timeout_ms() < 0)
    return Invalid("scheduling.queue_timeout_ms", "must be >= 0");
  for (const auto& [field, value] :
       {std::pair<const char*, double>{"fixed_ms", sc.step_cost().fixed_ms()},
        {"per_request_ms", sc.step_cost().per_request_ms()},
        {"per_context_token_ms", sc.step_cost().per_context_token_ms()}}) {
    if (!(value >= 0) || std::isinf(value))
      return Invalid(absl::StrCat("scheduling.step_cost.", field),
                     "must be >= 0 and finite");
  }
  if (!sc.step_cost_mode().empty() && sc.step_cost_mode() != "learned" &&
      sc.step_cost_mode() != "fixed")
    return Invalid("scheduling.step_cost_mode",
                   absl::StrCat("must be \"learned\" or \"fixed\", got \"",
                                sc.step_cost_mode(), "\""));
  return absl::OkStatus();
}

absl::Status ValidateClusterConfig(const cluster::ClusterConfig& config) {
  const auto& c = config.coordinator();
  if (c.max_new_tokens_limit() < 0)
    return Invalid("coordinator.max_new_tokens_limit", "must be >= 0");
  if (c.heartbeat_interval_ms() < 0)
    return Invalid("coordinator.heartbeat_interval_ms", "must be >= 0");
  if (c.node_timeout_ms() < 0)
    return Invalid("coordinator.node_timeout_ms", "must be >= 0");
  if (c.max_message_bytes() < 0)
    return Invalid("coordinator.max_message_bytes", "must be >= 0 (0: 4 MiB)");
  // "coordinator" is the coordinator's certificate name (docs/security.md):
  // a node under it could pass for the coordinator with the nodes.
  std::set<std::string> names = {"coordinator"};
  for (int i = 0; i < config.gpu_nodes_size(); ++i) {
    const auto& g = config.gpu_nodes(i);
    std::string f = absl::StrCat("gpu_nodes[", i, "]");
    if (g.name().empty()) return Invalid(f + ".name", "must not be empty");
    if (!names.insert(g.name()).second)
      return Invalid(f + ".name",
                     g.name() == "coordinator"
                         ? std::string("\"coordinator\" is the coordinator's "
                                       "name")
                         : absl::StrCat("duplicate node name \"", g.name(),
                                        "\""));
    if (g.max_step_tokens() < 0)
      return Invalid(f + ".max_step_tokens", "must be >= 0");
    if (g.max_batch() < 0) return Invalid(f + ".max_batch", "must be >= 0");
    if (g.threads() < 0) return Invalid(f + ".threads", "must be >= 0");
    if (!(g.hbm_bandwidth_gbps() >= 0) || std::isinf(g.hbm_bandwidth_gbps()))
      return Invalid(f + ".hbm_bandwidth_gbps", "must be >= 0 and finite");
    if (!(g.tflops() >= 0) || std::isinf(g.tflops()))
      return Invalid(f + ".tflops", "must be >= 0 and finite");
  }
  for (int i = 0; i < config.karat_nodes_size(); ++i) {
    const auto& k = config.karat_nodes(i);
    std::string f = absl::StrCat("karat_nodes[", i, "]");
    if (k.name().empty()) return Invalid(f + ".name", "must not be empty");
    if (!names.insert(k.name()).second)
      return Invalid(f + ".name",
                     k.name() == "coordinator"
                         ? std::string("\"coordinator\" is the coordinator's "
                                       "name")
                         : absl::StrCat("duplicate node name \"", k.name(),
                                        "\""));
    if (k.tokens_per_page() < 0)
      return Invalid(f + ".tokens_per_page", "must be >= 0");
    if (k.devices_size() == 0)
      return Invalid(f + ".devices", "a KARAT node needs at least one device");
    for (int d = 0; d < k.devices_size(); ++d) {
      std::string df = absl::StrCat(f, ".devices[", d, "]");
      if (k.devices(d).capacity_bytes() <= 0)
        return Invalid(df + ".capacity_bytes", "must be > 0");
      if (k.devices(d).cores() < 0)
        return Invalid(df + ".cores", "must be >= 0");
      if (!(k.devices(d).bandwidth_gbps() >= 0) ||
          std::isinf(k.devices(d).bandwidth_gbps()))
        return Invalid(df + ".bandwidth_gbps", "must be >= 0 and finite");
      if (!(k.devices(d).tflops() >= 0) || std::isinf(k.devices(d).tflops()))
        return Invalid(df + ".tflops", "must be >= 0 and finite");
    }
  }
  for (int i = 0; i < config.links_size(); ++i) {
    absl::Status link = ValidateLinkRule(LinkRuleFromProto(config.links(i)),
                                         absl::StrCat("links[", i, "]"));
    if (!link.ok()) return link;
  }
  const std::string& mode = config.mode();
  const cluster::SecurityConfig& sec = config.security();
  if (sec.plaintext() && (!sec.ca_cert().empty() || !sec.cert_dir().empty() ||
                          !sec.client_tokens().empty() ||
                          !sec.admin_tokens().empty()))
    return Invalid("security.plaintext",
                   "contradicts the TLS and token files the block names");
  if (!sec.admin_listen().empty() &&
      sec.admin_listen().find(':') == std::string::npos)
    return Invalid("security.admin_listen", "expected HOST:PORT");
  if (sec.idle_kv_evict_s() < 0)
    return Invalid("security.idle_kv_evict_s", "must be >= 0 (0: never)");
  const cluster::ClientLimits& lim = sec.default_limits();
  if (lim.max_sessions() < 0 || lim.max_kv_bytes() < 0 ||
      lim.max_concurrent_turns() < 0 || lim.session_burst() < 0 ||
      !(lim.sessions_per_second() >= 0) ||
      std::isinf(lim.sessions_per_second()))
    return Invalid("security.default_limits", "every limit must be >= 0");
  if (!mode.empty() && mode != "karat" && mode != "gpu_only")
    return Invalid(
        "mode",
        absl::StrCat("must be \"karat\" or \"gpu_only\", got \"", mode, "\""));
  const bool gpu_only = mode == "gpu_only";
  RETURN_IF_ERROR(ValidateSchedulingConfig(config.scheduling()));
  for (int i = 0; i < config.gpu_nodes_size(); ++i) {
    const auto& g = config.gpu_nodes(i);
    std::string f = absl::StrCat("gpu_nodes[", i, "].hbm_bytes");
    if (g.hbm_bytes() < 0) return Invalid(f, "must be >= 0");
    if (gpu_only && g.hbm_bytes() == 0)
      return Invalid(
          f, "must be > 0 in gpu_only mode (the rank's KV lives in it)");
  }
  if (!gpu_only && config.karat_nodes_size() > 0) {
    // The rules resolve as on the nodes (the links were checked above).
    std::vector<LinkRule> rules;
    for (const auto& l : config.links()) rules.push_back(LinkRuleFromProto(l));
    for (int i = 0; i < config.gpu_nodes_size(); ++i) {
      const std::string& g = config.gpu_nodes(i).name();
      bool reachable = false;
      for (const auto& k : config.karat_nodes()) {
        if (!ResolveLink(rules, g, k.name()).down &&
            !ResolveLink(rules, k.name(), g).down)
          reachable = true;
      }
      if (!reachable)
        return Invalid(absl::StrCat("gpu_nodes[", i, "]"),
                       absl::StrCat("GPU node \"", g,
                                    "\" has no link to any KARAT node that is "
                                    "not down (see links)"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateClusterConfigForModel(const cluster::ClusterConfig& config,
                                           const ModelConfig& model) {
  const int ranks = std::max(1, config.gpu_nodes_size());
  if (model.n_routed_experts % ranks != 0)
    return Invalid("gpu_nodes",
                   absl::StrCat(model.n_routed_experts,
                                " routed experts cannot be split evenly among ",
                                ranks, " GPU ranks"));
  for (int i = 0; i < config.gpu_nodes_size(); ++i) {
    const int64_t hbm = config.gpu_nodes(i).hbm_bytes();
    if (hbm <= 0) continue;
    const int64_t weights = RankWeightBytes(model, i, ranks);
    if (hbm < weights)
      return Invalid(absl::StrCat("gpu_nodes[", i, "].hbm_bytes"),
                     absl::StrCat(hbm, " bytes cannot hold the rank's ",
                                  weights, " bytes of weights"));
  }
  return absl::OkStatus();
}

absl::Status CheckClusterConfigAgainstModel(
    const cluster::ClusterConfig& config, const std::string& model_dir) {
  absl::StatusOr<ModelConfig> model = LoadModelConfig(model_dir);
  if (model.status().code() == absl::StatusCode::kNotFound)
    return absl::NotFoundError(
        absl::StrCat(model_dir, "/config.json: cannot read the model config"));
  if (!model.ok())
    return absl::InvalidArgumentError(std::string(model.status().message()));
  return ValidateClusterConfigForModel(config, *model);
}

absl::StatusOr<cluster::ClusterConfig> ParseClusterConfig(
    const std::string& text, const std::string& name) {
  cluster::ClusterConfig config;
  FirstErrorCollector errors;
  google::protobuf::TextFormat::Parser parser;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(text, &config)) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ":", errors.has_error() ? errors.error() : "malformed config"));
  }
  absl::Status valid = ValidateClusterConfig(config);
  if (!valid.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": ", valid.message()));
  }
  return config;
}

std::string PathFromConfig(const std::string& config_path,
                           const std::string& path) {
  if (path.empty() || path[0] == '/') return path;
  const size_t slash = config_path.rfind('/');
  return slash == std::string::npos ? path
                                    : config_path.substr(0, slash + 1) + path;
}

absl::StatusOr<cluster::ClusterConfig> LoadClusterConfig(
    const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat(path, ": cannot read the cluster config"));
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  return ParseClusterConfig(buffer.str(), path);
}

}  // namespace karat::coordinator
