// Loading and validating the cluster configuration (proto/cluster.proto's
// ClusterConfig, protobuf text format). Pure functions, thread-safe.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "cluster.pb.h"
#include "common/model_config.h"

namespace karat::coordinator {

// Parses `text` as a ClusterConfig. `name` (usually the file path) prefixes
// every error: "NAME:LINE:COLUMN: problem" for syntax errors (1-based),
// "NAME: field: problem" for values that parse but are invalid. Returns
// INVALID_ARGUMENT on either.
absl::StatusOr<cluster::ClusterConfig> ParseClusterConfig(
    const std::string& text, const std::string& name);

// A path named in the cluster file at `config_path`: a relative one is
// taken from the file's folder (security's TLS and token files).
std::string PathFromConfig(const std::string& config_path,
                           const std::string& path);

// Reads and parses the file at `path` (NOT_FOUND when it cannot be read).
absl::StatusOr<cluster::ClusterConfig> LoadClusterConfig(
    const std::string& path);

// Checks values that parse but make no sense: empty or duplicate node names,
// negative limits, a KARAT node without devices or with a device of zero
// capacity, an unknown `mode`, `scheduling.schedule` or `scheduling.balance`,
// `scheduling.micro_batches` outside {0, 1, 2}, a negative or non-finite
// `scheduling.tbt_slo_ms`, a negative `hbm_bytes`, `gpu_only` mode without
// `hbm_bytes` on every GPU node, and in `karat` mode a GPU node whose links
// (`links`) to every KARAT node are down. The message names the field
// ("karat_nodes[0].devices[1].capacity_bytes: must be > 0").
absl::Status ValidateClusterConfig(const cluster::ClusterConfig& config);

// The checks of `scheduling` alone (part of ValidateClusterConfig; also what
// Coordinator::Start checks of its Options): `micro_batches` outside
// {0, 1, 2}, an unknown `schedule`, `balance` or `step_cost_mode`, a
// negative or non-finite `tbt_slo_ms` or `step_cost` cost, a negative
// `queue_timeout_ms`. INVALID_ARGUMENT naming the field
// ("scheduling.micro_batches: must be 1 or 2 (0: 2), got 3").
absl::Status ValidateSchedulingConfig(const cluster::SchedulingConfig& sc);

// The checks that need the model (`model`, usually read from
// model_dir/config.json): the routed experts must divide evenly among the
// GPU ranks ("gpu_nodes: 16 routed experts cannot be split evenly among 3
// GPU ranks"), and a GPU node's `hbm_bytes`, when set, must hold the weights
// of its rank (RankWeightBytes; "gpu_nodes[1].hbm_bytes: 1000000 bytes
// cannot hold the rank's 3456789 bytes of weights"). INVALID_ARGUMENT.
absl::Status ValidateClusterConfigForModel(const cluster::ClusterConfig& config,
                                           const ModelConfig& model);

// Reads `model_dir`/config.json (LoadModelConfig) and runs
// ValidateClusterConfigForModel. NOT_FOUND when the model config cannot be
// read, INVALID_ARGUMENT when it is malformed or the checks fail.
absl::Status CheckClusterConfigAgainstModel(
    const cluster::ClusterConfig& config, const std::string& model_dir);

}  // namespace karat::coordinator
