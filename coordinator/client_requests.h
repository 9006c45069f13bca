// What the client API's handlers (karat.v1.Karat, proto/karat.proto) check
// of a request before they look at the cluster: pure functions, called by
// the handlers and exercised as they are by the fuzz target
// tests/fuzz/client_request_fuzzer.cc. CreateSessionRequest carries only a
// seed, of which every value is valid.
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "karat.pb.h"

namespace karat::coordinator {

// The session ids CreateSession hands out: "s-" and 16 lowercase hex digits.
inline constexpr size_t kSessionIdLength = 18;

// NOT_FOUND, as for an unknown session, unless `id` has the form of a
// session id; the message quotes at most the first 32 bytes of `id`,
// C-escaped, so that a hostile id reaches neither the logs nor the reply
// whole.
absl::Status ValidateSessionId(const std::string& id);

// GetSession and CloseSession: the session id's form (ValidateSessionId).
absl::Status ValidateGetSessionRequest(const v1::GetSessionRequest& req);
absl::Status ValidateCloseSessionRequest(const v1::CloseSessionRequest& req);

// Generate: the session id's form (NOT_FOUND), then INVALID_ARGUMENT unless
// max_new_tokens is in [1, max_new_tokens_limit], exactly one of prompt and
// prompt_tokens is set, every prompt token is in [0, kVocabSize), the
// idempotency key is valid (ValidateIdempotencyKey) and the temperature is
// finite and >= 0. What depends on the session (tokens_received, a repeated
// key) is PlanTurn's (turn_plan.h).
absl::Status ValidateGenerateRequest(const v1::GenerateRequest& req,
                                     int max_new_tokens_limit);

}  // namespace karat::coordinator
