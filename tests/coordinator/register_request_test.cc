// Coordinator.RegisterNode's request check (coordinator/register_request.h).
#include "coordinator/register_request.h"

#include <catch2/catch.hpp>
#include <string>

namespace karat::coordinator {
namespace {

cluster::RegisterNodeRequest Karat() {
  cluster::RegisterNodeRequest r;
  r.set_name("karat0");
  r.set_role("karat");
  r.set_grpc_address("127.0.0.1:5000");
  for (int d = 0; d < 2; ++d) {
    cluster::DeviceInfo* info = r.add_devices();
    info->set_device(d);
    info->set_capacity_bytes(1 << 30);
    info->set_cores(1);
  }
  return r;
}

cluster::RegisterNodeRequest Gpu() {
  cluster::RegisterNodeRequest r;
  r.set_name("gpu1");
  r.set_role("gpu");
  r.set_grpc_address("127.0.0.1:5001");
  r.set_rank(1);
  r.set_ranks(2);
  r.set_routed_experts(16);
  return r;
}

// The message of a refused request, "" when it is accepted.
std::string Refusal(const cluster::RegisterNodeRequest& r,
                    bool gpu_only = false) {
  absl::StatusOr<NodeRole> role = ValidateRegisterNodeRequest(r, gpu_only);
  if (role.ok()) return "";
  CHECK(role.status().code() == absl::StatusCode::kInvalidArgument);
  return std::string(role.status().message());
}

TEST_CASE("RegisterNode: roles, names, addresses", "[register_request]") {
  CHECK(*ValidateRegisterNodeRequest(Karat(), false) == NodeRole::kKarat);
  CHECK(*ValidateRegisterNodeRequest(Gpu(), false) == NodeRole::kGpu);
  cluster::RegisterNodeRequest r = Karat();
  r.set_role("cpu");
  CHECK(Refusal(r).find("role must be") != std::string::npos);
  r.set_role(std::string(100000, 'r'));
  CHECK(Refusal(r).size() < 200);  // the role quoted short
  r = Karat();
  r.clear_name();
  CHECK(Refusal(r).find("name must not be empty") != std::string::npos);
  r = Karat();
  r.clear_grpc_address();
  CHECK(Refusal(r).find("karat0") != std::string::npos);
}

TEST_CASE("RegisterNode: a GPU node's rank and routed experts",
          "[register_request]") {
  cluster::RegisterNodeRequest r = Gpu();
  r.set_rank(2);
  CHECK(Refusal(r).find("rank 2 is outside") != std::string::npos);
  r = Gpu();
  r.set_ranks(-1);
  CHECK_FALSE(Refusal(r).empty());
  r = Gpu();
  r.set_ranks(0);  // one rank
  r.set_rank(0);
  CHECK(Refusal(r).empty());
  r.set_ranks(kMaxGpuRanks);
  r.set_rank(kMaxGpuRanks - 1);
  CHECK(Refusal(r).empty());
  r.set_ranks(kMaxGpuRanks + 1);
  CHECK(Refusal(r).find("at most 1024 ranks") != std::string::npos);
  r = Gpu();
  r.set_routed_experts(kMaxRoutedExperts);
  CHECK(Refusal(r).empty());
  r.set_routed_experts(kMaxRoutedExperts + 1);
  CHECK(Refusal(r).find("routed_experts") != std::string::npos);
  r.set_routed_experts(-1);
  CHECK(Refusal(r).find("routed_experts") != std::string::npos);
  // A KARAT node's rank fields are not read.
  r = Karat();
  r.set_rank(-5);
  r.set_routed_experts(-1);
  CHECK(Refusal(r).empty());
}

TEST_CASE("RegisterNode: kv_capacity_bytes in gpu_only mode",
          "[register_request]") {
  cluster::RegisterNodeRequest r = Gpu();
  r.set_kv_capacity_bytes(-1);
  CHECK(Refusal(r, /*gpu_only=*/false).empty());
  CHECK(Refusal(r, /*gpu_only=*/true).find("kv_capacity_bytes") !=
        std::string::npos);
}

TEST_CASE("RegisterNode: devices", "[register_request]") {
  cluster::RegisterNodeRequest r = Karat();
  r.mutable_devices(1)->set_device(0);
  CHECK(Refusal(r).find("devices[1].device 0 is listed twice") !=
        std::string::npos);
  r = Karat();
  r.mutable_devices(0)->set_device(-1);
  CHECK(Refusal(r).find("devices[0].device must be >= 0") != std::string::npos);
  for (int field = 0; field < 4; ++field) {
    r = Karat();
    cluster::DeviceInfo* d = r.mutable_devices(1);
    if (field == 0) d->set_capacity_bytes(-1);
    if (field == 1) d->set_used_bytes(-1);
    if (field == 2) d->set_sessions(-1);
    if (field == 3) d->set_cores(-1);
    CHECK(Refusal(r).find("devices[1].") != std::string::npos);
  }
  r = Karat();
  r.clear_devices();
  for (int d = 0; d < kMaxNodeDevices; ++d) r.add_devices()->set_device(d);
  CHECK(Refusal(r).empty());
  r.add_devices()->set_device(kMaxNodeDevices);
  CHECK(Refusal(r).find("at most 1024") != std::string::npos);
}

}  // namespace
}  // namespace karat::coordinator
