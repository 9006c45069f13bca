// libFuzzer target for Coordinator.RegisterNode: the input is parsed as a
// RegisterNodeRequest, as gRPC parses it, and goes through the checks the
// handler runs first (coordinator/register_request.h), in karat and in
// gpu_only mode. What they accept then goes where the coordinator puts it:
// its devices into the home-device choice and a GPU node's rank and routed
// experts into the expert ownership (coordinator/placement.h), which must
// stay small and consistent.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cluster.pb.h"
#include "coordinator/placement.h"
#include "coordinator/register_request.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/protobuf_quiet.h"

namespace {

namespace co = karat::coordinator;

void CheckAccepted(const karat::cluster::RegisterNodeRequest& req,
                   co::NodeRole role) {
  FUZZ_CHECK(role ==
             (req.role() == "gpu" ? co::NodeRole::kGpu : co::NodeRole::kKarat));
  FUZZ_CHECK(req.role() == "gpu" || req.role() == "karat");
  FUZZ_CHECK(!req.name().empty() && !req.grpc_address().empty());
  FUZZ_CHECK(req.devices_size() <= co::kMaxNodeDevices);
  // The node as the coordinator's placement sees it, beside another KARAT
  // node with one device.
  co::ClusterState state;
  co::NodeState node;
  node.id = 1;
  node.name = req.name();
  node.role = role;
  node.alive = true;
  for (const auto& d : req.devices()) {
    FUZZ_CHECK(d.device() >= 0 && d.capacity_bytes() >= 0 &&
               d.used_bytes() >= 0);
    node.devices.push_back({d.device(), d.capacity_bytes(), d.used_bytes()});
  }
  co::NodeState other;
  other.id = 2;
  other.role = co::NodeRole::kKarat;
  other.alive = true;
  other.devices.push_back({0, 1 << 30, 1 << 20});
  state.nodes = {node, other};
  const std::vector<co::HomeDevice> homes = co::ChooseHomeDevices(state);
  const size_t karat_devices =
      1 + (role == co::NodeRole::kKarat ? node.devices.size() : 0);
  FUZZ_CHECK(homes.size() == karat_devices);
  FUZZ_CHECK(co::ChooseGpuNode(state).has_value() ==
             (role == co::NodeRole::kGpu));
  if (role != co::NodeRole::kGpu) return;
  const int ranks = req.ranks() > 0 ? req.ranks() : 1;
  FUZZ_CHECK(ranks <= co::kMaxGpuRanks);
  FUZZ_CHECK(req.rank() >= 0 && req.rank() < ranks);
  FUZZ_CHECK(req.routed_experts() >= 0 &&
             req.routed_experts() <= karat::kMaxRoutedExperts);
  // Only this rank alive: it owns every expert.
  const std::vector<int> owners =
      co::ExpertOwners(req.routed_experts(), ranks, {req.rank()});
  if (req.routed_experts() > 0 && req.routed_experts() % ranks == 0) {
    FUZZ_CHECK(owners.size() == size_t(req.routed_experts()));
    for (int owner : owners) FUZZ_CHECK(owner == req.rank());
  } else {
    FUZZ_CHECK(owners.empty());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  karat::cluster::RegisterNodeRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  for (bool gpu_only : {false, true}) {
    absl::StatusOr<co::NodeRole> role =
        co::ValidateRegisterNodeRequest(req, gpu_only);
    if (!role.ok()) {
      FUZZ_CHECK(role.status().code() == absl::StatusCode::kInvalidArgument);
      // No refusal quotes a hostile request whole.
      FUZZ_CHECK(role.status().message().size() <= 1024);
      continue;
    }
    if (gpu_only && *role == co::NodeRole::kGpu)
      FUZZ_CHECK(req.kv_capacity_bytes() >= 0);
    CheckAccepted(req, *role);
  }
  return 0;
}
