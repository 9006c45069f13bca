#include "coordinator/placement.h"

#include <algorithm>
#include <tuple>

namespace karat::coordinator {

std::vector<HomeDevice> ChooseHomeDevices(const ClusterState& state) {
  struct Candidate {
    HomeDevice home;
    int64_t used;
    int64_t free;
  };
  std::vector<Candidate> candidates;
  for (const NodeState& node : state.nodes) {
    if (node.role != NodeRole::kKarat || !node.alive) continue;
    for (const DeviceState& d : node.devices) {
      candidates.push_back({{node.id, d.device},
                            d.used_bytes,
                            d.capacity_bytes - d.used_bytes});
    }
  }
  std::sort(candidates.begin(), candidates.end(),
            [](const Candidate& a, const Candidate& b) {
              return std::make_tuple(a.used, -a.free, a.home.node_id,
                                     a.home.device) <
                     std::make_tuple(b.used, -b.free, b.home.node_id,
                                     b.home.device);
            });
  std::vector<HomeDevice> out;
  out.reserve(candidates.size());
  for (const Candidate& c : candidates) out.push_back(c.home);
  return out;
}

std::optional<uint32_t> ChooseGpuNode(const ClusterState& state) {
  const NodeState* best = nullptr;
  for (const NodeState& node : state.nodes) {
    if (node.role != NodeRole::kGpu || !node.alive) continue;
    if (best == nullptr || node.active_turns < best->active_turns ||
        (node.active_turns == best->active_turns && node.id < best->id)) {
      best = &node;
    }
  }
  if (best == nullptr) return std::nullopt;
  return best->id;
}

std::vector<int> ExpertOwners(int experts, int ranks,
                              const std::vector<int>& alive) {
  if (ranks < 1 || experts < 1 || experts % ranks != 0) return {};
  std::vector<bool> up(size_t(ranks), false);
  std::vector<int> order;
  for (int r : alive) {
    if (r < 0 || r >= ranks || up[size_t(r)]) continue;
    up[size_t(r)] = true;
  }
  for (int r = 0; r < ranks; ++r)
    if (up[size_t(r)]) order.push_back(r);
  if (order.empty()) return {};
  const int per_rank = experts / ranks;
  std::vector<int> owner(static_cast<size_t>(experts));
  size_t next = 0;
  for (int e = 0; e < experts; ++e) {
    const int home = e / per_rank;
    if (up[size_t(home)]) {
      owner[size_t(e)] = home;
    } else {
      owner[size_t(e)] = order[next++ % order.size()];
    }
  }
  return owner;
}

}  // namespace karat::coordinator
