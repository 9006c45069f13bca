// What KaratNode.Reserve checks of a request (cluster.proto ReserveRequest)
// before a device sees it: a pure function, called by
// DataPlaneHandler::Reserve (which the handler calls with the request's
// fields) and exercised as it is by the fuzz target
// tests/fuzz/reserve_fuzzer.cc.
#pragma once

#include "absl/status/status.h"

namespace karat {

// INVALID_ARGUMENT unless `device` is one of the node's `num_devices` and
// `tokens` > 0.
absl::Status ValidateReserve(int device, int num_devices, int tokens);

}  // namespace karat
