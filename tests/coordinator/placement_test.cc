#include "coordinator/placement.h"

#include <catch2/catch.hpp>

namespace karat::coordinator {
namespace {

NodeState Karat(uint32_t id, bool alive, std::vector<DeviceState> devices) {
  NodeState n;
  n.id = id;
  n.name = "karat" + std::to_string(id);
  n.role = NodeRole::kKarat;
  n.alive = alive;
  n.devices = std::move(devices);
  return n;
}

NodeState Gpu(uint32_t id, bool alive, int active) {
  NodeState n;
  n.id = id;
  n.name = "gpu" + std::to_string(id);
  n.role = NodeRole::kGpu;
  n.alive = alive;
  n.active_turns = active;
  return n;
}

TEST_CASE("home devices: least occupied first across nodes") {
  ClusterState s;
  s.nodes.push_back(Karat(1, true, {{0, 1000, 500}, {1, 1000, 100}}));
  s.nodes.push_back(Karat(2, true, {{0, 1000, 300}, {1, 1000, 0}}));
  std::vector<HomeDevice> want = {{2, 1}, {1, 1}, {2, 0}, {1, 0}};
  CHECK(ChooseHomeDevices(s) == want);
}

TEST_CASE("home devices: dead and GPU nodes are skipped") {
  ClusterState s;
  s.nodes.push_back(Karat(1, false, {{0, 1000, 0}}));
  s.nodes.push_back(Gpu(2, true, 0));
  s.nodes.push_back(Karat(3, true, {{0, 1000, 700}}));
  std::vector<HomeDevice> want = {{3, 0}};
  CHECK(ChooseHomeDevices(s) == want);
}

TEST_CASE("home devices: ties go to more free bytes, then lower ids") {
  ClusterState s;
  s.nodes.push_back(Karat(4, true, {{1, 1000, 200}, {0, 1000, 200}}));
  s.nodes.push_back(Karat(2, true, {{0, 1000, 200}, {1, 4000, 200}}));
  std::vector<HomeDevice> want = {{2, 1}, {2, 0}, {4, 0}, {4, 1}};
  CHECK(ChooseHomeDevices(s) == want);
}

TEST_CASE("home devices: empty cluster gives no candidate") {
  CHECK(ChooseHomeDevices(ClusterState{}).empty());
}

TEST_CASE("gpu node: fewest active turns, ties to lower id, alive only") {
  ClusterState s;
  s.nodes.push_back(Gpu(3, true, 2));
  s.nodes.push_back(Gpu(5, true, 1));
  s.nodes.push_back(Gpu(4, true, 1));
  s.nodes.push_back(Gpu(1, false, 0));
  s.nodes.push_back(Karat(2, true, {{0, 1, 0}}));
  REQUIRE(ChooseGpuNode(s).has_value());
  CHECK(*ChooseGpuNode(s) == 4);
  ClusterState none;
  none.nodes.push_back(Gpu(1, false, 0));
  CHECK_FALSE(ChooseGpuNode(none).has_value());
}

TEST_CASE("expert ownership: own blocks, a lost rank's experts spread") {
  using V = std::vector<int>;
  // Every rank alive: the block sharding.
  CHECK(ExpertOwners(8, 2, {0, 1}) == V{0, 0, 0, 0, 1, 1, 1, 1});
  CHECK(ExpertOwners(8, 4, {3, 1, 0, 2}) == V{0, 0, 1, 1, 2, 2, 3, 3});
  // One of two lost: the survivor takes everything.
  CHECK(ExpertOwners(8, 2, {0}) == V{0, 0, 0, 0, 0, 0, 0, 0});
  CHECK(ExpertOwners(8, 2, {1}) == V{1, 1, 1, 1, 1, 1, 1, 1});
  // Alive ranks keep their blocks; the lost ranks' experts go round-robin
  // over the alive ranks, in increasing expert id and rank.
  CHECK(ExpertOwners(8, 4, {0, 2, 3}) == V{0, 0, 0, 2, 2, 2, 3, 3});
  CHECK(ExpertOwners(8, 4, {1, 3}) == V{1, 3, 1, 1, 1, 3, 3, 3});
  CHECK(ExpertOwners(12, 4, {0, 1, 2}) ==
        V{0, 0, 0, 1, 1, 1, 2, 2, 2, 0, 1, 2});
  // Duplicates and ranks out of range are ignored; nothing alive, a bad
  // rank count or an uneven split give no table.
  CHECK(ExpertOwners(8, 2, {0, 0, 7, -1}) == ExpertOwners(8, 2, {0}));
  CHECK(ExpertOwners(8, 2, {}).empty());
  CHECK(ExpertOwners(8, 3, {0}).empty());
  CHECK(ExpertOwners(8, 0, {0}).empty());
}

}  // namespace
}  // namespace karat::coordinator
