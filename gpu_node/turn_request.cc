#include "gpu_node/turn_request.h"

#include <cmath>
#include <cstdint>
#include <limits>

#include "absl/strings/str_cat.h"

namespace karat {

absl::Status ValidateTurnRequest(const cluster::RunTurnRequest& r,
                                 int vocab_size, bool need_placement) {
  if (r.feed_tokens_size() == 0) {
    return absl::InvalidArgumentError("feed_tokens is empty");
  }
  for (int i = 0; i < r.feed_tokens_size(); ++i) {
    const int32_t t = r.feed_tokens(i);
    if (t < 0 || t >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "feed_tokens[", i, "] = ", t, " is outside [0, ", vocab_size, ")"));
    }
  }
  if (r.max_new_tokens() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens must be > 0, got ", r.max_new_tokens()));
  }
  if (r.pos_start() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("pos_start must be >= 0, got ", r.pos_start()));
  }
  // The decode loop counts positions in ints.
  const int64_t last_position =
      int64_t{r.pos_start()} + r.feed_tokens_size() + r.max_new_tokens();
  if (last_position > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("pos_start + feed size + max_new_tokens = ", last_position,
                     " is past the last position a turn can reach (",
                     std::numeric_limits<int>::max(), ")"));
  }
  if (!(r.temperature() >= 0) || !std::isfinite(r.temperature())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "temperature must be finite and >= 0, got ", r.temperature()));
  }
  if (r.micro_batch() < 0 || r.micro_batch() > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("micro_batch must be 0 or 1, got ", r.micro_batch()));
  }
  int previous = r.pos_start();
  for (int i = 0; i < r.prefill_ends_size(); ++i) {
    const int end = r.prefill_ends(i);
    if (end <= previous || end > r.pos_start() + r.feed_tokens_size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prefill_ends[", i, "] = ", end,
          " must be increasing and inside (pos_start, pos_start + feed size] = "
          "(",
          r.pos_start(), ", ", r.pos_start() + r.feed_tokens_size(), "]"));
    }
    previous = end;
  }
  if (!need_placement) return absl::OkStatus();
  if (!r.has_placement()) {
    return absl::InvalidArgumentError("placement is missing");
  }
  if (r.placement().fabric_address().empty()) {
    return absl::InvalidArgumentError(
        "placement.fabric_address is empty (the KARAT node's endpoint)");
  }
  if (r.placement().device() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "placement.device must be >= 0, got ", r.placement().device()));
  }
  return absl::OkStatus();
}

TurnRequest TurnRequestFromProto(const cluster::RunTurnRequest& r) {
  TurnRequest t;
  t.session = r.session();
  t.seed = r.seed();
  t.temperature = r.temperature();
  t.pos_start = r.pos_start();
  t.feed_tokens.assign(r.feed_tokens().begin(), r.feed_tokens().end());
  t.max_new_tokens = r.max_new_tokens();
  t.placement = r.placement();
  t.turn_epoch = r.turn_epoch();
  t.micro_batch = r.micro_batch();
  for (int end : r.prefill_ends())
    t.prefill_ends.push_back(end - r.pos_start());
  t.feed_ends_prefill = !r.resumed_decode();
  return t;
}

}  // namespace karat
