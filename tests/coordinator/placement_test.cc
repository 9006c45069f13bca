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

}  // namespace
}  // namespace karat::coordinator
