#include "karat_node/reserve_request.h"

#include "absl/strings/str_cat.h"

namespace karat {

absl::Status ValidateReserve(int device, int num_devices, int tokens) {
  if (device < 0 || device >= num_devices) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device ", device, " does not exist (the node has ", num_devices, ")"));
  }
  if (tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("reserve of ", tokens, " tokens; must be > 0"));
  }
  return absl::OkStatus();
}

}  // namespace karat
