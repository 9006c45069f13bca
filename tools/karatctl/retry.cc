#include "tools/karatctl/retry.h"

#include <unistd.h>

#include <algorithm>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/json.h"

namespace karat::ctl {
namespace {

using Clock = std::chrono::steady_clock;

double MsSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start)
      .count();
}

std::chrono::nanoseconds Seconds(double s) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::duration<double>(s));
}

// Back-off and give-up time of one retried call.
class Attempts {
 public:
  explicit Attempts(const RetryPolicy& policy)
      : policy_(policy),
        give_up_(Clock::now() + Seconds(policy.timeout_s)),
        deadline_(
            std::chrono::system_clock::now() +
            std::chrono::duration_cast<std::chrono::system_clock::duration>(
                Seconds(policy.timeout_s))),
        backoff_s_(policy.initial_backoff_s) {}

  // The deadline of every attempt: the end of the retry window (none when
  // retries are off, as without --retry).
  Deadline deadline() const {
    return policy_.enabled ? Deadline(deadline_) : Deadline();
  }

  void Progress() { backoff_s_ = policy_.initial_backoff_s; }

  // Whether to try again after a failure with `status`; sleeps the back-off
  // first. False when retries are off, the code is not retried or the
  // window has passed.
  bool Again(const absl::Status& status) {
    if (!policy_.enabled || !IsRetryable(status.code())) return false;
    const auto now = Clock::now();
    if (now >= give_up_) return false;
    std::this_thread::sleep_for(
        std::min<Clock::duration>(Seconds(backoff_s_), give_up_ - now));
    backoff_s_ = std::min(backoff_s_ * 2, policy_.max_backoff_s);
    return Clock::now() < give_up_;
  }

 private:
  const RetryPolicy& policy_;
  const Clock::time_point give_up_;
  const std::chrono::system_clock::time_point deadline_;
  double backoff_s_;
};

}  // namespace

bool IsRetryable(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kFailedPrecondition:
      return true;
    default:
      return false;
  }
}

std::string NewRunId() {
  std::random_device rd;
  const uint64_t bits =
      (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
      static_cast<uint64_t>(
          std::chrono::system_clock::now().time_since_epoch().count()) ^
      (static_cast<uint64_t>(getpid()) << 16);
  return absl::StrFormat("%016x", bits);
}

std::string TurnKey(const std::string& run_id, int session, int turn) {
  return absl::StrCat("bench-", run_id, "-", session, "-", turn);
}

std::vector<double> TurnRecord::tbt_ms() const {
  std::vector<double> out;
  for (size_t i = 1; i < token_ms.size(); ++i)
    out.push_back(token_ms[i] - token_ms[i - 1]);
  return out;
}

double TurnRecord::max_gap_ms() const {
  double gap = 0;
  for (double t : tbt_ms()) gap = std::max(gap, t);
  return gap;
}

TurnRecord RunTurn(
    Client& client, v1::GenerateRequest request, const RetryPolicy& policy,
    const std::function<void(const v1::GeneratedToken&)>& on_token) {
  TurnRecord rec;
  const auto start = Clock::now();
  rec.start_unix_ms = std::chrono::duration<double, std::milli>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
  Attempts attempts(policy);
  int64_t last_position = 0;
  for (;;) {
    rec.attempts++;
    if (policy.enabled)
      request.set_tokens_received(static_cast<int32_t>(rec.tokens.size()));
    const size_t had = rec.tokens.size();
    auto result = client.Generate(
        request,
        [&](const v1::GeneratedToken& t) {
          const double ms = MsSince(start);
          if (!rec.tokens.empty()) {
            if (t.position() <= last_position) {
              rec.duplicate_tokens++;
              return;
            }
            if (t.position() != last_position + 1) rec.position_gaps++;
          }
          last_position = t.position();
          rec.tokens.push_back(t.token_id());
          rec.token_ms.push_back(ms);
          if (on_token) on_token(t);
        },
        nullptr, attempts.deadline());
    absl::Status status = result.status();
    if (result.ok()) {
      if (!result->finish_reason.empty()) {
        rec.completed = true;
        rec.finish_reason = result->finish_reason;
        rec.end_ms = MsSince(start);
        return rec;
      }
      status = absl::UnknownError("the stream ended without TurnDone");
    }
    rec.attempt_errors.push_back(status);
    rec.attempt_error_ms.push_back(MsSince(start));
    if (auto kept = TurnTokensKept(status)) rec.tokens_kept = kept;
    if (rec.tokens.size() > had) attempts.Progress();
    if (!attempts.Again(status)) {
      rec.end_ms = MsSince(start);
      return rec;
    }
  }
}

absl::StatusOr<v1::Session> CreateSessionRetrying(
    Client& client, uint64_t seed, const RetryPolicy& policy,
    std::vector<absl::Status>* errors) {
  Attempts attempts(policy);
  for (;;) {
    auto session = client.CreateSession(seed, attempts.deadline());
    if (session.ok()) return session;
    errors->push_back(session.status());
    if (!attempts.Again(session.status())) return session.status();
  }
}

absl::Status CloseSessionRetrying(Client& client, const std::string& id,
                                  const RetryPolicy& policy,
                                  std::vector<absl::Status>* errors) {
  Attempts attempts(policy);
  for (;;) {
    absl::Status st = client.CloseSession(id, attempts.deadline());
    if (st.ok()) return st;
    // An earlier attempt whose answer was lost may have closed it.
    if (st.code() == absl::StatusCode::kNotFound && !errors->empty())
      return absl::OkStatus();
    errors->push_back(st);
    if (!attempts.Again(st)) return st;
  }
}

std::string TurnRecordJson(int session, int turn, uint64_t seed,
                           const std::string& session_id,
                           const std::string& key, const TurnRecord& r) {
  std::string out = absl::StrCat(
      "{\"session\": ", session, ", \"turn\": ", turn, ", \"seed\": ", seed,
      ", \"session_id\": ", JsonQuote(session_id, /*ascii=*/true),
      ", \"key\": ", JsonQuote(key, /*ascii=*/true), ", \"tokens\": [");
  for (size_t i = 0; i < r.tokens.size(); ++i)
    absl::StrAppend(&out, i ? ", " : "", r.tokens[i]);
  absl::StrAppend(&out, "], \"token_ms\": [");
  for (size_t i = 0; i < r.token_ms.size(); ++i)
    absl::StrAppend(&out, i ? ", " : "",
                    absl::StrFormat("%.2f", r.token_ms[i]));
  absl::StrAppend(
      &out, "], \"start_unix_ms\": ", absl::StrFormat("%.1f", r.start_unix_ms),
      ", \"end_ms\": ", absl::StrFormat("%.2f", r.end_ms),
      ", \"attempts\": ", r.attempts,
      ", \"completed\": ", r.completed ? "true" : "false",
      ", \"finish_reason\": ", JsonQuote(r.finish_reason, /*ascii=*/true),
      ", \"attempt_errors\": [");
  for (size_t i = 0; i < r.attempt_errors.size(); ++i) {
    const absl::Status& st = r.attempt_errors[i];
    absl::StrAppend(&out, i ? ", " : "", "{\"code\": \"",
                    StatusCodeName(st.code()), "\", \"at_ms\": ",
                    absl::StrFormat("%.2f", i < r.attempt_error_ms.size()
                                                ? r.attempt_error_ms[i]
                                                : 0.0),
                    ", \"message\": ", JsonQuote(std::string(st.message()), /*ascii=*/true),
                    "}");
  }
  absl::StrAppend(
      &out, "], \"max_gap_ms\": ", absl::StrFormat("%.2f", r.max_gap_ms()),
      ", \"duplicate_tokens\": ", r.duplicate_tokens,
      ", \"position_gaps\": ", r.position_gaps);
  if (r.tokens_kept)
    absl::StrAppend(&out, ", \"tokens_kept\": ", *r.tokens_kept);
  if (!r.completed) {
    const absl::Status last =
        !r.attempt_errors.empty() ? r.attempt_errors.back()
        : !r.not_started.ok()     ? r.not_started
                                  : absl::UnknownError("no attempt was made");
    absl::StrAppend(&out, ", \"error\": ",
                    JsonQuote(absl::StrCat(StatusCodeName(last.code()), ": ",
                                           last.message()),
                              /*ascii=*/true));
  }
  absl::StrAppend(&out, "}\n");
  return out;
}

}  // namespace karat::ctl
