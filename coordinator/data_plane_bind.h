// Where a daemon's data plane binds (docs/security.md "Data plane",
// `karatctl plan`'s --fabric-node). Pure functions, thread-safe.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "cluster.pb.h"

namespace karat::coordinator {

// The --fabric-node of a daemon of `config` whose gRPC address is `listen`
// and whose config names `fabric_node`; `what` names it in errors
// ("gpu_nodes[1] (gpu1)"). Empty: the flag is not given (the daemon binds
// its provider's default, common/transport.h DataPlaneBindNode).
//   - shm (also an empty `provider`): empty; shm binds no interface.
//   - `fabric_node` set: it.
//   - tcp: the host of `listen` when it names one ("localhost" as
//     127.0.0.1); 127.0.0.1 without `listen` (the daemons' default
//     127.0.0.1:0), so a cluster whose daemons are all on this host keeps
//     its data plane on loopback. INVALID_ARGUMENT, naming the daemon, when
//     `listen` is a wildcard (0.0.0.0, [::]): no interface to bind to.
//   - any other provider (verbs): empty (the provider's default).
absl::StatusOr<std::string> DataPlaneBindAddress(
    const cluster::ClusterConfig& config, const std::string& listen,
    const std::string& fabric_node, const std::string& what);

}  // namespace karat::coordinator
