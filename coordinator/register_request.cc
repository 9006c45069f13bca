#include "coordinator/register_request.h"

#include <set>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace karat::coordinator {
namespace {

// How much of a string field a message quotes.
constexpr size_t kQuotedBytes = 32;

// `s` C-escaped in quotes, cut after kQuotedBytes bytes ("...").
std::string Quoted(const std::string& s) {
  return absl::StrCat(
      "\"", absl::CHexEscape(absl::string_view(s).substr(0, kQuotedBytes)),
      s.size() > kQuotedBytes ? "...\"" : "\"");
}

absl::Status Invalid(const cluster::RegisterNodeRequest& req,
                     const std::string& problem) {
  return absl::InvalidArgumentError(
      absl::StrCat("node ", Quoted(req.name()), ": ", problem));
}

absl::Status ValidateDevices(const cluster::RegisterNodeRequest& req) {
  if (req.devices_size() > kMaxNodeDevices)
    return Invalid(req, absl::StrCat(req.devices_size(), " devices; at most ",
                                     kMaxNodeDevices));
  std::set<int32_t> ids;
  for (int i = 0; i < req.devices_size(); ++i) {
    const cluster::DeviceInfo& d = req.devices(i);
    const std::string f = absl::StrCat("devices[", i, "].");
    if (d.device() < 0)
      return Invalid(req,
                     absl::StrCat(f, "device must be >= 0, got ", d.device()));
    if (!ids.insert(d.device()).second)
      return Invalid(
          req, absl::StrCat(f, "device ", d.device(), " is listed twice"));
    if (d.capacity_bytes() < 0 || d.used_bytes() < 0 || d.sessions() < 0 ||
        d.cores() < 0)
      return Invalid(
          req, absl::StrCat(f,
                            "capacity_bytes, used_bytes, sessions and "
                            "cores must be >= 0, got ",
                            d.capacity_bytes(), ", ", d.used_bytes(), ", ",
                            d.sessions(), ", ", d.cores()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<NodeRole> ValidateRegisterNodeRequest(
    const cluster::RegisterNodeRequest& req, bool gpu_only) {
  NodeRole role;
  if (req.role() == "gpu") {
    role = NodeRole::kGpu;
  } else if (req.role() == "karat") {
    role = NodeRole::kKarat;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "role must be \"gpu\" or \"karat\", got ", Quoted(req.role())));
  }
  if (req.name().empty())
    return absl::InvalidArgumentError("node name must not be empty");
  if (req.grpc_address().empty())
    return Invalid(req, "grpc_address must not be empty");
  if (role == NodeRole::kGpu) {
    const int ranks = req.ranks() > 0 ? req.ranks() : 1;
    if (req.ranks() < 0 || req.ranks() > kMaxGpuRanks || req.rank() < 0 ||
        req.rank() >= ranks)
      return Invalid(
          req, absl::StrCat("rank ", req.rank(),
                            " is outside [0, ranks) with ranks ", req.ranks(),
                            " (at most ", kMaxGpuRanks, " ranks)"));
    if (req.routed_experts() < 0 || req.routed_experts() > kMaxRoutedExperts)
      return Invalid(
          req, absl::StrCat("routed_experts must be in [0, ", kMaxRoutedExperts,
                            "], got ", req.routed_experts()));
    if (gpu_only && req.kv_capacity_bytes() < 0)
      return Invalid(req, "kv_capacity_bytes must be >= 0");
  }
  if (absl::Status devices = ValidateDevices(req); !devices.ok())
    return devices;
  return role;
}

}  // namespace karat::coordinator
