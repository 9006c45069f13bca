// Loading and validating the cluster configuration (proto/cluster.proto's
// ClusterConfig, protobuf text format). Pure functions, thread-safe.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "cluster.pb.h"

namespace karat::coordinator {

// Parses `text` as a ClusterConfig. `name` (usually the file path) prefixes
// every error: "NAME:LINE:COLUMN: problem" for syntax errors (1-based),
// "NAME: field: problem" for values that parse but are invalid. Returns
// INVALID_ARGUMENT on either.
absl::StatusOr<cluster::ClusterConfig> ParseClusterConfig(
    const std::string& text, const std::string& name);

// Reads and parses the file at `path` (NOT_FOUND when it cannot be read).
absl::StatusOr<cluster::ClusterConfig> LoadClusterConfig(
    const std::string& path);

// Checks values that parse but make no sense: empty or duplicate node names,
// negative limits, a KARAT node without devices or with a device of zero
// capacity. The message names the field ("karat_nodes[0].devices[1].
// capacity_bytes: must be > 0").
absl::Status ValidateClusterConfig(const cluster::ClusterConfig& config);

// Checks one link-emulation rule (names not empty, latency, jitter and
// bandwidth >= 0, loss within [0, 1]); `field` prefixes the message
// ("links[2].loss: must be within [0, 1]").
absl::Status ValidateLinkConfig(const cluster::LinkConfig& link,
                                const std::string& field);

}  // namespace karat::coordinator
