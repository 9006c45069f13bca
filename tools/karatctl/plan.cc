#include "tools/karatctl/plan.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "coordinator/cluster_config.h"
#include "coordinator/data_plane_bind.h"

namespace karat {
namespace {

// Appends the daemon's --fabric-node (coordinator/data_plane_bind.h) to
// `flags`, or says why the config gives it none to bind.
absl::Status AppendFabricNode(const cluster::ClusterConfig& config,
                              const std::string& listen,
                              const std::string& fabric_node,
                              const std::string& what, std::string* flags) {
  absl::StatusOr<std::string> bind =
      coordinator::DataPlaneBindAddress(config, listen, fabric_node, what);
  if (!bind.ok()) return bind.status();
  if (!bind->empty()) absl::StrAppend(flags, " --fabric-node ", *bind);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> PlanText(const std::string& path) {
  auto config = coordinator::LoadClusterConfig(path);
  if (!config.ok()) return config.status();
  auto refuse = [&](const absl::Status& why) {
    return absl::Status(why.code(), absl::StrCat(path, ": ", why.message()));
  };
  std::string out;
  if (!config->model_dir().empty()) {
    // Checked here when the model is already there (relative to the current
    // directory); the coordinator checks again at start.
    absl::Status fits = coordinator::CheckClusterConfigAgainstModel(
        *config, config->model_dir());
    if (!fits.ok() && fits.code() != absl::StatusCode::kNotFound)
      return refuse(fits);
  }
  absl::StrAppend(&out, "model_dir ", config->model_dir(), "\n");
  absl::StrAppend(&out, "provider ",
                  config->provider().empty() ? "shm" : config->provider(),
                  "\n");
  // TLS (docs/security.md): "plaintext", "default" (the launcher makes the
  // files in the run directory) or "files CA CERT_DIR CLIENT_TOKENS
  // ADMIN_TOKENS" (the config's, relative paths from the config's folder).
  const auto& sec = config->security();
  if (sec.plaintext()) {
    absl::StrAppend(&out, "security plaintext\n");
  } else if (sec.ca_cert().empty() && sec.cert_dir().empty() &&
             sec.client_tokens().empty() && sec.admin_tokens().empty()) {
    absl::StrAppend(&out, "security default\n");
  } else {
    std::string files;
    for (const auto& [p, field] :
         {std::pair{sec.ca_cert(), "ca_cert"}, {sec.cert_dir(), "cert_dir"},
          {sec.client_tokens(), "client_tokens"},
          {sec.admin_tokens(), "admin_tokens"}}) {
      if (p.empty())
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": security.", field,
                         ": required when the security block names TLS "
                         "files"));
      absl::StrAppend(&files, " ", coordinator::PathFromConfig(path, p));
    }
    absl::StrAppend(&out, "security files", files, "\n");
  }
  const auto& sched = config->scheduling();
  const std::string mode = config->mode().empty() ? "karat" : config->mode();
  const int micro_batches =
      sched.micro_batches() == 0 ? 2 : sched.micro_batches();
  const std::string schedule =
      sched.schedule().empty() ? "ofms" : sched.schedule();
  for (int rank = 0; rank < config->gpu_nodes_size(); ++rank) {
    const auto& g = config->gpu_nodes(rank);
    std::string flags =
        absl::StrCat(" --rank ", rank, " --ranks ", config->gpu_nodes_size(),
                     " --mode ", mode, " --micro-batches ", micro_batches,
                     " --schedule ", schedule, " --hbm-bytes ", g.hbm_bytes());
    if (g.max_step_tokens() > 0)
      flags += " --max-step-tokens " + std::to_string(g.max_step_tokens());
    if (g.max_batch() > 0)
      flags += " --max-batch " + std::to_string(g.max_batch());
    if (g.threads() > 0) flags += " --threads " + std::to_string(g.threads());
    if (g.hbm_bandwidth_gbps() > 0)
      absl::StrAppend(&flags, " --hbm-bandwidth-gbps ", g.hbm_bandwidth_gbps());
    if (g.tflops() > 0) absl::StrAppend(&flags, " --tflops ", g.tflops());
    flags += " --listen " +
             (g.listen().empty() ? std::string("127.0.0.1:0") : g.listen());
    if (absl::Status bind = AppendFabricNode(
            *config, g.listen(), g.fabric_node(),
            absl::StrCat("gpu_nodes[", rank, "] (", g.name(), ")"), &flags);
        !bind.ok())
      return refuse(bind);
    absl::StrAppend(&out, "gpu ", g.name(), flags, "\n");
  }
  for (int i = 0; i < config->karat_nodes_size(); ++i) {
    const auto& k = config->karat_nodes(i);
    const auto& d0 = k.devices(0);
    for (const auto& d : k.devices()) {
      if (d.capacity_bytes() != d0.capacity_bytes() ||
          d.cores() != d0.cores() ||
          d.bandwidth_gbps() != d0.bandwidth_gbps() ||
          d.tflops() != d0.tflops()) {
        return refuse(absl::InvalidArgumentError(absl::StrCat(
            "karat_nodes[", i,
            "]: karat-node takes one capacity, core count and timing model "
            "for all its devices")));
      }
    }
    std::string flags = " --devices " + std::to_string(k.devices_size()) +
                        " --device-capacity " +
                        std::to_string(d0.capacity_bytes());
    if (d0.cores() > 0) flags += " --cores " + std::to_string(d0.cores());
    if (d0.bandwidth_gbps() > 0)
      absl::StrAppend(&flags, " --device-bandwidth-gbps ", d0.bandwidth_gbps());
    if (d0.tflops() > 0)
      absl::StrAppend(&flags, " --device-tflops ", d0.tflops());
    if (k.tokens_per_page() > 0)
      flags += " --tokens-per-page " + std::to_string(k.tokens_per_page());
    flags += " --listen " +
             (k.listen().empty() ? std::string("127.0.0.1:0") : k.listen());
    if (absl::Status bind = AppendFabricNode(
            *config, k.listen(), k.fabric_node(),
            absl::StrCat("karat_nodes[", i, "] (", k.name(), ")"), &flags);
        !bind.ok())
      return refuse(bind);
    absl::StrAppend(&out, "karat ", k.name(), flags, "\n");
  }
  return out;
}

}  // namespace karat
