// GpuNode.RunTurn's request (cluster.proto RunTurnRequest): what the
// handler checks of it (ValidateTurnRequest, a pure function, exercised as
// it is by the fuzz target tests/fuzz/run_turn_fuzzer.cc) and the turn the
// decode loop takes from it.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "cluster.pb.h"

namespace karat {

// One turn as the decode loop takes it (cluster.proto RunTurnRequest).
struct TurnRequest {
  uint64_t session = 0;
  uint64_t seed = 0;
  float temperature = 0;
  int pos_start = 0;
  std::vector<int32_t> feed_tokens;
  int max_new_tokens = 0;
  cluster::KaratPlacement placement;
  uint64_t turn_epoch = 0;
  // Micro-batch of the session (0 or 1) until SetMicroBatches moves it.
  int micro_batch = 0;
  // Feed offsets (1 .. feed size) where a turn's prefill ended: prefill
  // chunks never cross one, and each marks Segment::ends_prefill.
  std::vector<int> prefill_ends;
  // Whether the feed's end is one of them (RunTurnRequest.resumed_decode
  // clears it).
  bool feed_ends_prefill = true;
};

// INVALID_ARGUMENT unless: feed_tokens non-empty with ids in [0, vocab),
// max_new_tokens > 0, pos_start >= 0, the turn's positions (pos_start +
// feed size + max_new_tokens) within an int, temperature >= 0 and finite,
// micro_batch 0 or 1, prefill_ends increasing inside the feed, and (when
// `need_placement`, i.e. attention on KARAT nodes) a placement with a
// fabric address and a device >= 0.
absl::Status ValidateTurnRequest(const cluster::RunTurnRequest& request,
                                 int vocab_size, bool need_placement = true);
// The turn of a request that passed ValidateTurnRequest.
TurnRequest TurnRequestFromProto(const cluster::RunTurnRequest& request);

}  // namespace karat
