// What Coordinator.RegisterNode checks of a request before it looks at the
// cluster (the role, name and address, a GPU node's rank and routed
// experts, the devices): a pure function, called by the handler
// (membership_service.cc) and exercised as it is by the fuzz target
// tests/fuzz/register_node_fuzzer.cc.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "cluster.pb.h"
#include "common/model_config.h"
#include "coordinator/placement.h"

namespace karat::coordinator {

// Bounds on what a node may claim; far beyond any cluster this runs, small
// enough that the tables sized by them (per rank, per expert, per device)
// stay small. A GPU node's routed experts are its model's, at most
// kMaxRoutedExperts (common/model_config.h).
inline constexpr int kMaxGpuRanks = 1024;
inline constexpr int kMaxNodeDevices = 1024;

// The node's role, or INVALID_ARGUMENT naming the field: a role other than
// "gpu" or "karat", an empty name or grpc_address; for a GPU node ranks
// outside [0, kMaxGpuRanks] (0: 1), a rank outside [0, ranks), routed
// experts outside [0, kMaxRoutedExperts], and in gpu_only mode a negative
// kv_capacity_bytes; more than kMaxNodeDevices devices, a device id that is
// negative or repeated, or a negative capacity, used bytes, session or core
// count. Messages quote at most 32 bytes of a string field.
absl::StatusOr<NodeRole> ValidateRegisterNodeRequest(
    const cluster::RegisterNodeRequest& req, bool gpu_only);

}  // namespace karat::coordinator
