// What a Generate call does with a session's latest turn (docs/client-api.md,
// retries): a request whose idempotency key is the latest turn's
// continues or replays that turn instead of starting another. Pure
// functions over cluster::LastTurn (proto/cluster.proto), which the
// coordinator keeps per session and logs in its write-ahead log.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cluster.pb.h"

namespace karat::coordinator {

// At most this many characters, each printable ASCII.
inline constexpr size_t kMaxIdempotencyKeyLength = 128;
// INVALID_ARGUMENT naming what is wrong with `key` ("" is valid: none).
absl::Status ValidateIdempotencyKey(const std::string& key);

struct TurnPlan {
  enum Kind {
    kNew,       // a turn of its own (the prompt joins the history)
    kContinue,  // the latest turn broke off: it goes on where it stopped
    kReplay,    // the latest turn finished: its end is streamed again
  } kind = kNew;
  // Tokens of the turn the session's history already holds.
  int kept = 0;
};

// The plan for a request with `key`, `prompt`, `max_new_tokens` and
// `temperature` on a session whose latest turn is `last`. A key that
// matches `last` with another request is INVALID_ARGUMENT, and so is a
// replay asked to start past the turn's end (`tokens_received`).
absl::StatusOr<TurnPlan> PlanTurn(const std::optional<cluster::LastTurn>& last,
                                  const std::string& key,
                                  const std::vector<int32_t>& prompt,
                                  int max_new_tokens, float temperature,
                                  int tokens_received);

// The history index of the turn's first generated token: after its base,
// the BOS of a session's first turn and its prompt.
int TurnStart(const cluster::LastTurn& turn);

}  // namespace karat::coordinator
