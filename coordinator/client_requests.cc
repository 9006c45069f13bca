#include "coordinator/client_requests.h"

#include <cmath>
#include <cstdint>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "common/tokenizer.h"
#include "coordinator/turn_plan.h"

namespace karat::coordinator {
namespace {

// How much of a malformed session id a message quotes.
constexpr size_t kQuotedIdBytes = 32;

bool IsLowerHex(char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
}

}  // namespace

absl::Status ValidateSessionId(const std::string& id) {
  bool ok = id.size() == kSessionIdLength && id[0] == 's' && id[1] == '-';
  for (size_t i = 2; ok && i < id.size(); ++i) ok = IsLowerHex(id[i]);
  if (ok) return absl::OkStatus();
  const absl::string_view shown =
      absl::string_view(id).substr(0, kQuotedIdBytes);
  return absl::NotFoundError(absl::StrCat(
      "no session \"", absl::CHexEscape(shown),
      id.size() > kQuotedIdBytes ? "...\"" : "\"",
      " (not a session id: CreateSession returns \"s-\" and 16 hex digits)"));
}

absl::Status ValidateGetSessionRequest(const v1::GetSessionRequest& req) {
  return ValidateSessionId(req.session_id());
}

absl::Status ValidateCloseSessionRequest(const v1::CloseSessionRequest& req) {
  return ValidateSessionId(req.session_id());
}

absl::Status ValidateGenerateRequest(const v1::GenerateRequest& req,
                                     int max_new_tokens_limit) {
  RETURN_IF_ERROR(ValidateSessionId(req.session_id()));
  if (req.max_new_tokens() < 1 || req.max_new_tokens() > max_new_tokens_limit) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens must be in [1, ", max_new_tokens_limit,
                     "], got ", req.max_new_tokens()));
  }
  if (req.prompt().empty() && req.prompt_tokens().empty())
    return absl::InvalidArgumentError(
        "the prompt is empty (set prompt or prompt_tokens)");
  if (!req.prompt().empty() && !req.prompt_tokens().empty())
    return absl::InvalidArgumentError("set prompt or prompt_tokens, not both");
  for (int i = 0; i < req.prompt_tokens_size(); ++i) {
    const int32_t t = req.prompt_tokens(i);
    if (t < 0 || t >= kVocabSize)
      return absl::InvalidArgumentError(
          absl::StrCat("prompt_tokens[", i, "] = ", t, " is outside [0, ",
                       kVocabSize - 1, "]"));
  }
  RETURN_IF_ERROR(ValidateIdempotencyKey(req.idempotency_key()));
  if (!std::isfinite(req.temperature()) || req.temperature() < 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "temperature must be finite and >= 0, got ", req.temperature()));
  return absl::OkStatus();
}

}  // namespace karat::coordinator
