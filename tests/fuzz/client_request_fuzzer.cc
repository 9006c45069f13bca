// libFuzzer target for the client API's requests (karat.v1.Karat): the
// first byte picks the method (modulo 4: Generate, CreateSession,
// GetSession, CloseSession), the rest is parsed as its request message, as
// gRPC parses it, and goes through the checks its handler runs first
// (coordinator/client_requests.h; for Generate also PlanTurn against the
// session's latest turn, turn_plan.h). A request they accept has the shape
// the handlers rely on; one they refuse gets NOT_FOUND or INVALID_ARGUMENT
// with a short message.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/tokenizer.h"
#include "coordinator/client_requests.h"
#include "coordinator/turn_plan.h"
#include "karat.pb.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/protobuf_quiet.h"

namespace {

using karat::coordinator::PlanTurn;
using karat::coordinator::TurnPlan;
namespace v1 = karat::v1;

// No refusal quotes a hostile request whole.
constexpr size_t kMaxMessage = 1024;

void CheckRefusal(const absl::Status& st) {
  FUZZ_CHECK(st.code() == absl::StatusCode::kInvalidArgument ||
             st.code() == absl::StatusCode::kNotFound);
  FUZZ_CHECK(!st.message().empty());
  FUZZ_CHECK(st.message().size() <= kMaxMessage);
}

bool LooksLikeSessionId(const std::string& id) {
  return id.size() == 18 && id.compare(0, 2, "s-") == 0 &&
         id.find_first_not_of("0123456789abcdef", 2) == std::string::npos;
}

void CheckSessionId(const std::string& id, const absl::Status& st) {
  FUZZ_CHECK(st.ok() == LooksLikeSessionId(id));
  if (!st.ok()) FUZZ_CHECK(st.code() == absl::StatusCode::kNotFound);
}

void CheckPlan(const v1::GenerateRequest& req,
               const std::vector<int32_t>& prompt,
               const std::optional<karat::cluster::LastTurn>& last) {
  absl::StatusOr<TurnPlan> plan =
      PlanTurn(last, req.idempotency_key(), prompt, req.max_new_tokens(),
               req.temperature(), req.tokens_received());
  if (!plan.ok()) {
    CheckRefusal(plan.status());
    return;
  }
  FUZZ_CHECK(req.tokens_received() >= 0);
  FUZZ_CHECK(plan->kept >= 0);
  if (plan->kind == TurnPlan::kNew) FUZZ_CHECK(plan->kept == 0);
  if (plan->kind != TurnPlan::kNew) {
    FUZZ_CHECK(last.has_value());
    FUZZ_CHECK(last->idempotency_key() == req.idempotency_key());
    FUZZ_CHECK(plan->kept == last->generated());
  }
  if (plan->kind == TurnPlan::kReplay)
    FUZZ_CHECK(req.tokens_received() <= last->generated());
}

void FuzzGenerate(const v1::GenerateRequest& req) {
  for (int limit : {1, 16, 4096}) {
    const absl::Status st =
        karat::coordinator::ValidateGenerateRequest(req, limit);
    if (!LooksLikeSessionId(req.session_id())) {
      FUZZ_CHECK(st.code() == absl::StatusCode::kNotFound);
    }
    if (!st.ok()) {
      CheckRefusal(st);
      continue;
    }
    FUZZ_CHECK(req.max_new_tokens() >= 1 && req.max_new_tokens() <= limit);
    FUZZ_CHECK(req.prompt().empty() != req.prompt_tokens().empty());
    for (int32_t t : req.prompt_tokens())
      FUZZ_CHECK(t >= 0 && t < karat::kVocabSize);
    FUZZ_CHECK(std::isfinite(req.temperature()) && req.temperature() >= 0);
    FUZZ_CHECK(req.idempotency_key().size() <=
               karat::coordinator::kMaxIdempotencyKeyLength);
    // The prompt as the handler builds it (TurnCall).
    const std::vector<int32_t> prompt =
        req.prompt_tokens().empty()
            ? karat::EncodeText(req.prompt())
            : std::vector<int32_t>(req.prompt_tokens().begin(),
                                   req.prompt_tokens().end());
    FUZZ_CHECK(!prompt.empty());
    // Against no latest turn, and against a latest turn of the same key
    // and request, finished or broken off, with as many tokens generated
    // as the request says it received, and one fewer.
    CheckPlan(req, prompt, std::nullopt);
    for (int finished = 0; finished < 2; ++finished) {
      for (int fewer = 0; fewer < 2; ++fewer) {
        karat::cluster::LastTurn last;
        last.set_idempotency_key(req.idempotency_key());
        last.mutable_prompt()->Assign(prompt.begin(), prompt.end());
        last.set_max_new_tokens(req.max_new_tokens());
        last.set_temperature(req.temperature());
        const int64_t received = req.tokens_received();
        last.set_generated(static_cast<int32_t>(std::max<int64_t>(
            0, std::min<int64_t>(received, req.max_new_tokens()) - fewer)));
        last.set_prompt_in_history(true);
        if (finished) last.set_finish_reason("length");
        CheckPlan(req, prompt, last);
      }
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int method = data[0] % 4;
  const uint8_t* body = data + 1;
  const int body_size = static_cast<int>(size - 1);
  switch (method) {
    case 0: {
      v1::GenerateRequest req;
      if (!req.ParseFromArray(body, body_size)) return 0;
      FuzzGenerate(req);
      break;
    }
    case 1: {
      // CreateSession takes every seed: parsing is its only check.
      v1::CreateSessionRequest req;
      (void)req.ParseFromArray(body, body_size);
      break;
    }
    case 2: {
      v1::GetSessionRequest req;
      if (!req.ParseFromArray(body, body_size)) return 0;
      CheckSessionId(req.session_id(),
                     karat::coordinator::ValidateGetSessionRequest(req));
      break;
    }
    case 3: {
      v1::CloseSessionRequest req;
      if (!req.ParseFromArray(body, body_size)) return 0;
      const absl::Status st =
          karat::coordinator::ValidateCloseSessionRequest(req);
      CheckSessionId(req.session_id(), st);
      if (!st.ok()) CheckRefusal(st);
      break;
    }
  }
  return 0;
}
