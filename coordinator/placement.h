// Placement policies (DESIGN.md §3 "Placement", §4): pure functions over a
// snapshot of the cluster, so they can be tested on hand-made states.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace karat::coordinator {

// One KARAT device as the coordinator last saw it.
struct DeviceState {
  int32_t device = 0;
  int64_t capacity_bytes = 0;
  int64_t used_bytes = 0;
};

enum class NodeRole { kGpu, kKarat };

// One registered node. `active_turns` counts the turns the coordinator is
// currently running through it (GPU nodes).
struct NodeState {
  uint32_t id = 0;
  std::string name;
  NodeRole role = NodeRole::kKarat;
  bool alive = false;
  std::vector<DeviceState> devices;
  int active_turns = 0;
};

struct ClusterState {
  std::vector<NodeState> nodes;
};

// A place for a session's KV.
struct HomeDevice {
  uint32_t node_id = 0;
  int32_t device = 0;
  bool operator==(const HomeDevice& o) const {
    return node_id == o.node_id && device == o.device;
  }
};

// Every device of every alive KARAT node, least occupied first: increasing
// used_bytes, then more free bytes, then lower node id, then lower device.
// The caller tries them in order until one accepts the reservation.
std::vector<HomeDevice> ChooseHomeDevices(const ClusterState& state);

// The alive GPU node with the fewest active turns (ties: lower id), or
// nullopt when no GPU node is alive.
std::optional<uint32_t> ChooseGpuNode(const ClusterState& state);

// Expert ownership over the alive GPU ranks (DESIGN.md §7): owner[e] for
// each of the `experts` routed experts. An alive rank keeps its own block
// [r * E / ranks, (r + 1) * E / ranks); the experts of the ranks not in
// `alive` go, in increasing id, round-robin to the alive ranks in
// increasing rank order, so every coordinator computes the same table.
// With every rank alive it is the block sharding. Empty when `alive` is
// empty, `ranks` < 1 or `experts` is not a positive multiple of `ranks`;
// ranks outside [0, ranks) in `alive` are ignored.
std::vector<int> ExpertOwners(int experts, int ranks,
                              const std::vector<int>& alive);

}  // namespace karat::coordinator
