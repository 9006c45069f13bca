// libFuzzer target for GpuNode.RunTurn: the input is parsed as a
// RunTurnRequest, as gRPC parses it, and goes through the handler's check
// (gpu_node/turn_request.h ValidateTurnRequest), with and without a
// placement needed. A request it accepts becomes a turn
// (TurnRequestFromProto) of the shape the decode loop relies on: tokens in
// the vocabulary, prefill ends increasing inside the feed, every position
// of the turn within an int.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "cluster.pb.h"
#include "gpu_node/turn_request.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/protobuf_quiet.h"

namespace {

constexpr int kVocab = 258;

void CheckTurn(const karat::cluster::RunTurnRequest& req, bool placement) {
  const karat::TurnRequest t = karat::TurnRequestFromProto(req);
  FUZZ_CHECK(!t.feed_tokens.empty());
  for (int32_t token : t.feed_tokens) FUZZ_CHECK(token >= 0 && token < kVocab);
  FUZZ_CHECK(t.max_new_tokens > 0 && t.pos_start >= 0);
  FUZZ_CHECK(std::isfinite(t.temperature) && t.temperature >= 0);
  FUZZ_CHECK(t.micro_batch == 0 || t.micro_batch == 1);
  const int64_t last =
      int64_t{t.pos_start} + int64_t(t.feed_tokens.size()) + t.max_new_tokens;
  FUZZ_CHECK(last <= std::numeric_limits<int>::max());
  int previous = 0;
  for (int end : t.prefill_ends) {
    FUZZ_CHECK(end > previous && end <= int(t.feed_tokens.size()));
    previous = end;
  }
  if (placement) {
    FUZZ_CHECK(!t.placement.fabric_address().empty());
    FUZZ_CHECK(t.placement.device() >= 0);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  karat::cluster::RunTurnRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  for (bool placement : {true, false}) {
    const absl::Status st = karat::ValidateTurnRequest(req, kVocab, placement);
    if (!st.ok()) {
      FUZZ_CHECK(st.code() == absl::StatusCode::kInvalidArgument);
      continue;
    }
    CheckTurn(req, placement);
  }
  return 0;
}
