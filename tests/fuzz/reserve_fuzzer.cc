// libFuzzer target for KaratNode.Reserve: the input is parsed as a
// ReserveRequest, as gRPC parses it, and its fields go through the check
// DataPlaneHandler::Reserve runs before a device sees them
// (karat_node/reserve_request.h), on nodes of 0 to 4 devices. An accepted
// request names one of the node's devices and a positive token count.
#include <cstddef>
#include <cstdint>

#include "cluster.pb.h"
#include "karat_node/reserve_request.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/protobuf_quiet.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  karat::cluster::ReserveRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  for (int devices = 0; devices <= 4; ++devices) {
    const absl::Status st =
        karat::ValidateReserve(req.device(), devices, req.tokens());
    if (!st.ok()) {
      FUZZ_CHECK(st.code() == absl::StatusCode::kInvalidArgument);
      continue;
    }
    FUZZ_CHECK(req.device() >= 0 && req.device() < devices);
    FUZZ_CHECK(req.tokens() > 0);
  }
  return 0;
}
