#include "coordinator/turn_plan.h"

#include "absl/strings/str_cat.h"

namespace karat::coordinator {

absl::Status ValidateIdempotencyKey(const std::string& key) {
  if (key.size() > kMaxIdempotencyKeyLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("idempotency_key holds ", key.size(),
                     " characters; at most ", kMaxIdempotencyKeyLength));
  }
  for (size_t i = 0; i < key.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(key[i]);
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError(absl::StrCat(
          "idempotency_key: character ", i,
          " is not printable ASCII (use letters, digits and punctuation)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<TurnPlan> PlanTurn(const std::optional<cluster::LastTurn>& last,
                                  const std::string& key,
                                  const std::vector<int32_t>& prompt,
                                  int max_new_tokens, float temperature,
                                  int tokens_received) {
  if (tokens_received < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokens_received must be >= 0, got ", tokens_received));
  }
  if (key.empty() || !last.has_value() || last->idempotency_key() != key) {
    if (tokens_received > 0 && key.empty()) {
      return absl::InvalidArgumentError(
          "tokens_received needs the idempotency_key of the turn it counts");
    }
    return TurnPlan{TurnPlan::kNew, 0};
  }
  const bool same_prompt =
      prompt.size() == size_t(last->prompt_size()) &&
      std::equal(prompt.begin(), prompt.end(), last->prompt().begin());
  if (!same_prompt || last->max_new_tokens() != max_new_tokens ||
      last->temperature() != temperature) {
    return absl::InvalidArgumentError(absl::StrCat(
        "idempotency_key \"", key,
        "\" was used for another request on this session (prompt, "
        "max_new_tokens and temperature must be the same as the first "
        "call's); use a new key for a new turn"));
  }
  if (!last->finish_reason().empty()) {
    if (tokens_received > last->generated()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tokens_received ", tokens_received, " is past the end of the turn (",
          last->generated(), " tokens)"));
    }
    return TurnPlan{TurnPlan::kReplay, last->generated()};
  }
  if (last->prompt_in_history()) {
    return TurnPlan{TurnPlan::kContinue, last->generated()};
  }
  return TurnPlan{TurnPlan::kNew, 0};
}

int TurnStart(const cluster::LastTurn& turn) {
  return turn.base_tokens() + (turn.base_tokens() == 0 ? 1 : 0) +
         turn.prompt_size();
}

}  // namespace karat::coordinator
