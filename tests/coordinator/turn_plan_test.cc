#include "coordinator/turn_plan.h"

#include <catch2/catch.hpp>

namespace karat::coordinator {
namespace {

cluster::LastTurn Last(const std::string& key, std::vector<int32_t> prompt,
                       int generated, const std::string& finish,
                       bool in_history) {
  cluster::LastTurn t;
  t.set_idempotency_key(key);
  t.mutable_prompt()->Assign(prompt.begin(), prompt.end());
  t.set_max_new_tokens(16);
  t.set_temperature(0.5f);
  t.set_base_tokens(10);
  t.set_generated(generated);
  t.set_finish_reason(finish);
  t.set_prompt_in_history(in_history);
  return t;
}

TEST_CASE("idempotency keys are short printable ASCII", "[turn_plan]") {
  CHECK(ValidateIdempotencyKey("").ok());
  CHECK(ValidateIdempotencyKey("turn-7/retry:a").ok());
  CHECK(absl::IsInvalidArgument(ValidateIdempotencyKey(std::string(129, 'a'))));
  CHECK(absl::IsInvalidArgument(ValidateIdempotencyKey("a\nb")));
  CHECK(absl::IsInvalidArgument(ValidateIdempotencyKey("caf\xc3\xa9")));
}

TEST_CASE("the latest turn's key continues or replays it", "[turn_plan]") {
  const std::vector<int32_t> p = {1, 2, 3};
  // No key, another key, no latest turn: a new turn.
  CHECK(PlanTurn(Last("k", p, 4, "", true), "", p, 16, 0.5f, 0)->kind ==
        TurnPlan::kNew);
  CHECK(PlanTurn(Last("k", p, 4, "", true), "other", p, 16, 0.5f, 0)->kind ==
        TurnPlan::kNew);
  CHECK(PlanTurn(std::nullopt, "k", p, 16, 0.5f, 3)->kind == TurnPlan::kNew);
  // Broke off after 4 tokens: continue.
  auto plan = PlanTurn(Last("k", p, 4, "", true), "k", p, 16, 0.5f, 2);
  REQUIRE(plan.ok());
  CHECK(plan->kind == TurnPlan::kContinue);
  CHECK(plan->kept == 4);
  // Broke off before its first token (or a restart lost it): run again.
  CHECK(PlanTurn(Last("k", p, 0, "", false), "k", p, 16, 0.5f, 5)->kind ==
        TurnPlan::kNew);
  // Finished: replay, from no further than its end.
  plan = PlanTurn(Last("k", p, 9, "eos", true), "k", p, 16, 0.5f, 9);
  REQUIRE(plan.ok());
  CHECK(plan->kind == TurnPlan::kReplay);
  CHECK(plan->kept == 9);
  CHECK(absl::IsInvalidArgument(
      PlanTurn(Last("k", p, 9, "eos", true), "k", p, 16, 0.5f, 10).status()));
}

TEST_CASE("a key reused with another request is refused", "[turn_plan]") {
  const std::vector<int32_t> p = {1, 2, 3};
  const auto last = Last("k", p, 4, "", true);
  CHECK(absl::IsInvalidArgument(
      PlanTurn(last, "k", {1, 2}, 16, 0.5f, 0).status()));
  CHECK(absl::IsInvalidArgument(PlanTurn(last, "k", p, 15, 0.5f, 0).status()));
  CHECK(absl::IsInvalidArgument(PlanTurn(last, "k", p, 16, 0.0f, 0).status()));
  // tokens_received means nothing without the key it counts for.
  CHECK(absl::IsInvalidArgument(
      PlanTurn(std::nullopt, "", p, 16, 0.5f, 2).status()));
  CHECK(absl::IsInvalidArgument(PlanTurn(last, "k", p, 16, 0.5f, -1).status()));
}

TEST_CASE("a turn's first generated token follows its prompt", "[turn_plan]") {
  cluster::LastTurn t = Last("k", {5, 6, 7}, 0, "", false);
  CHECK(TurnStart(t) == 13);
  t.set_base_tokens(0);  // the session's first turn: BOS, then the prompt
  CHECK(TurnStart(t) == 4);
}

}  // namespace
}  // namespace karat::coordinator
