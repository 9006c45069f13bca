// Turns and session calls of `karatctl bench`, with retries under --retry.
//
// A turn retried here keeps its idempotency key and sends how many of its
// tokens it already has (GenerateRequest.tokens_received), so a coordinator
// that honours the key continues the same turn and streams only the tokens
// after those; the record appends them. A token at a position already
// received is a protocol error: it is counted and not appended.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tools/karatctl/client.h"

namespace karat::ctl {

struct RetryPolicy {
  bool enabled = false;
  // A turn (or session call) is given up this long after it began.
  double timeout_s = 120;
  // Between attempts: from `initial_backoff_s`, doubling up to
  // `max_backoff_s`; back to the start after an attempt that streamed
  // tokens.
  double initial_backoff_s = 0.1;
  double max_backoff_s = 2.0;
};

// Whether a failed attempt is tried again under --retry: UNAVAILABLE (also
// a refused connection or a broken stream), DEADLINE_EXCEEDED, ABORTED,
// INTERNAL, UNKNOWN, CANCELLED (the client never cancels, so it came from
// the server or the transport), RESOURCE_EXHAUSTED (a full queue) and
// FAILED_PRECONDITION (the session still busy with the broken call). Not:
// INVALID_ARGUMENT, NOT_FOUND and the rest.
bool IsRetryable(absl::StatusCode code);

// A unique idempotency key per run, session and turn:
// "bench-<run id>-<session>-<turn>".
std::string NewRunId();
std::string TurnKey(const std::string& run_id, int session, int turn);

// One turn as the client saw it, over all its attempts.
struct TurnRecord {
  std::vector<int32_t> tokens;
  // When each token arrived, in ms since the turn began.
  std::vector<double> token_ms;
  // Wall-clock time at which the turn began (ms since the Unix epoch), and
  // when it completed or was given up, in ms since it began.
  double start_unix_ms = 0;
  double end_ms = 0;
  int attempts = 0;
  bool completed = false;
  std::string finish_reason;  // from TurnDone
  // The status of each failed attempt, in order; the last one is why a turn
  // that did not complete was given up.
  std::vector<absl::Status> attempt_errors;
  // When each of them ended, in ms since the turn began.
  std::vector<double> attempt_error_ms;
  // What the last failed attempt's trailing metadata said the session kept
  // of the turn (kTurnTokensKey), when it said so.
  std::optional<int64_t> tokens_kept;
  // Tokens at a position already received (dropped), or after a gap
  // (kept; the turn's tokens then differ from an uninterrupted run's).
  int duplicate_tokens = 0;
  int position_gaps = 0;
  // Why no attempt was made (the session could not be created); OK
  // otherwise.
  absl::Status not_started;

  bool retried() const { return attempts > 1; }
  // Turn start to the first token; 0 without tokens.
  double ttft_ms() const { return token_ms.empty() ? 0 : token_ms.front(); }
  // Between consecutive tokens (a wait across a retry included).
  std::vector<double> tbt_ms() const;
  // The longest of tbt_ms(); 0 with fewer than two tokens.
  double max_gap_ms() const;
};

// Runs `request` (its idempotency key set by the caller when `policy` is
// enabled) until it completes, fails with a status that is not retried, or
// the policy's time runs out; one attempt when the policy is off.
// `on_token` sees every token appended to the record.
TurnRecord RunTurn(
    Client& client, v1::GenerateRequest request, const RetryPolicy& policy,
    const std::function<void(const v1::GeneratedToken&)>& on_token);

// CreateSession, retried under the policy (an answer lost on the way may
// leave a session behind on the coordinator; another one is created).
// `errors` receives the status of every failed attempt.
absl::StatusOr<v1::Session> CreateSessionRetrying(
    Client& client, uint64_t seed, const RetryPolicy& policy,
    std::vector<absl::Status>* errors);

// CloseSession, retried under the policy; NOT_FOUND after a failed attempt
// counts as closed (the lost answer's close went through).
absl::Status CloseSessionRetrying(Client& client, const std::string& id,
                                  const RetryPolicy& policy,
                                  std::vector<absl::Status>* errors);

// One line of --tokens-out (a JSON object and a newline): session, turn,
// seed, session_id, key, tokens, token_ms, start_unix_ms, end_ms, attempts,
// completed, finish_reason, attempt_errors ({code, at_ms, message} of
// each failed attempt), max_gap_ms,
// duplicate_tokens, position_gaps, tokens_kept (when known) and, for a turn
// that did not complete, error ("CODE: message").
std::string TurnRecordJson(int session, int turn, uint64_t seed,
                           const std::string& session_id,
                           const std::string& key, const TurnRecord& record);

}  // namespace karat::ctl
