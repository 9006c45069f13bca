// `karatctl plan --config FILE`: the daemons of a cluster config and their
// flags, one per line, as deploy/karat starts them.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace karat {

// The plan of the config at `path`: "model_dir DIR", "provider P", then
// "gpu NAME FLAGS..." per GPU node and "karat NAME FLAGS..." per KARAT node
// (see karatctl's usage). INVALID_ARGUMENT (NOT_FOUND for a file that
// cannot be read) prefixed with `path` when the config is malformed, does
// not fit its model, gives a KARAT node devices of different kinds, or
// leaves a tcp daemon no interface for its data plane.
absl::StatusOr<std::string> PlanText(const std::string& path);

}  // namespace karat
