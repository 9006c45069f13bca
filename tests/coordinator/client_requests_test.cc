// The client API's request checks (coordinator/client_requests.h).
#include "coordinator/client_requests.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace karat::coordinator {
namespace {

constexpr const char* kId = "s-0123456789abcdef";

TEST_CASE("session ids: s- and 16 lowercase hex digits", "[client_requests]") {
  CHECK(ValidateSessionId(kId).ok());
  CHECK(ValidateSessionId("s-ffffffffffffffff").ok());
  for (const std::string& bad : std::vector<std::string>{
           "", "s-", "s-0123456789abcde", "s-0123456789abcdef0",
           "s-0123456789ABCDEF", "x-0123456789abcdef", "s-0123456789abcdeg",
           "s-does-not-exist", std::string("s-0123456789abcde\0", 18)}) {
    INFO("id " << bad);
    const absl::Status st = ValidateSessionId(bad);
    // As for an unknown session.
    CHECK(st.code() == absl::StatusCode::kNotFound);
    CHECK(std::string(st.message()).find("not a session id") !=
          std::string::npos);
  }
}

TEST_CASE("a malformed session id is quoted short and escaped",
          "[client_requests]") {
  const std::string huge = "s-" + std::string(1 << 20, 'x');
  const absl::Status st = ValidateSessionId(huge);
  CHECK(st.code() == absl::StatusCode::kNotFound);
  CHECK(st.message().size() < 200);
  CHECK(std::string(st.message()).find("xxx...\"") != std::string::npos);
  const absl::Status ctl = ValidateSessionId("s-\n\x01\xff");
  CHECK(std::string(ctl.message()).find("s-\\n\\x01\\xff") !=
        std::string::npos);
}

TEST_CASE("GetSession and CloseSession check the id", "[client_requests]") {
  v1::GetSessionRequest get;
  get.set_session_id(kId);
  CHECK(ValidateGetSessionRequest(get).ok());
  get.set_session_id("nope");
  CHECK(ValidateGetSessionRequest(get).code() == absl::StatusCode::kNotFound);
  v1::CloseSessionRequest close;
  close.set_session_id(kId);
  CHECK(ValidateCloseSessionRequest(close).ok());
  close.set_session_id("S-0123456789ABCDEF");
  CHECK(ValidateCloseSessionRequest(close).code() ==
        absl::StatusCode::kNotFound);
}

TEST_CASE("Generate requests", "[client_requests]") {
  v1::GenerateRequest r;
  r.set_session_id(kId);
  r.set_prompt("hi");
  r.set_max_new_tokens(16);
  CHECK(ValidateGenerateRequest(r, 16).ok());
  auto code = [&](auto mutate, int limit = 16) {
    v1::GenerateRequest b = r;
    mutate(&b);
    return ValidateGenerateRequest(b, limit).code();
  };
  using v1::GenerateRequest;
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  CHECK(code([](GenerateRequest* b) { b->set_session_id("s-1"); }) ==
        absl::StatusCode::kNotFound);
  // The id comes first: a malformed one is NOT_FOUND whatever else is wrong.
  CHECK(code([](GenerateRequest* b) {
          b->set_session_id("s-1");
          b->set_max_new_tokens(0);
        }) == absl::StatusCode::kNotFound);
  CHECK(code([](GenerateRequest* b) { b->set_max_new_tokens(0); }) == kInvalid);
  CHECK(code([](GenerateRequest* b) { b->set_max_new_tokens(17); }) ==
        kInvalid);
  CHECK(code([](GenerateRequest* b) { b->set_max_new_tokens(17); }, 17) ==
        absl::StatusCode::kOk);
  CHECK(code([](GenerateRequest* b) { b->clear_prompt(); }) == kInvalid);
  CHECK(code([](GenerateRequest* b) { b->add_prompt_tokens(1); }) == kInvalid);
  CHECK(code([](GenerateRequest* b) {
          b->clear_prompt();
          b->add_prompt_tokens(257);
        }) == absl::StatusCode::kOk);
  CHECK(code([](GenerateRequest* b) {
          b->clear_prompt();
          b->add_prompt_tokens(258);
        }) == kInvalid);
  CHECK(code([](GenerateRequest* b) {
          b->clear_prompt();
          b->add_prompt_tokens(-1);
        }) == kInvalid);
  CHECK(code([](GenerateRequest* b) { b->set_idempotency_key("a\tb"); }) ==
        kInvalid);
  CHECK(code([](GenerateRequest* b) { b->set_temperature(-0.5f); }) ==
        kInvalid);
  CHECK(code([](GenerateRequest* b) {
          b->set_temperature(std::numeric_limits<float>::quiet_NaN());
        }) == kInvalid);
  CHECK(code([](GenerateRequest* b) { b->set_temperature(INFINITY); }) ==
        kInvalid);
}

}  // namespace
}  // namespace karat::coordinator
