// `karatctl bench --retry` (tools/karatctl/retry.h) against an in-process
// fake of karat.v1.Karat whose Generate follows a script per call: the
// idempotency key and tokens_received a retry sends, the tokens appended
// across attempts, the codes retried and not, the retry window, and the
// channel reconnecting to a server restarted on the same port.
#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "tools/karatctl/client.h"
#include "tools/karatctl/retry.h"

namespace karat::ctl {
namespace {

using Writer = grpc::ServerWriter<v1::GenerateResponse>;
// Call `n` (0-based) of Generate.
using Script = std::function<grpc::Status(int n, grpc::ServerContext*,
                                          const v1::GenerateRequest&, Writer*)>;

class FakeKarat final : public v1::Karat::Service {
 public:
  explicit FakeKarat(Script script) : script_(std::move(script)) {}

  grpc::Status CreateSession(grpc::ServerContext*,
                             const v1::CreateSessionRequest* req,
                             v1::Session* out) override {
    out->set_session_id("s-" + std::to_string(req->seed()));
    return grpc::Status::OK;
  }
  // The first close's answer is "lost" (UNAVAILABLE after closing).
  grpc::Status CloseSession(grpc::ServerContext*,
                            const v1::CloseSessionRequest*,
                            v1::CloseSessionResponse*) override {
    absl::MutexLock lock(&mu_);
    if (closes_++ == 0)
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "connection reset");
    return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown session");
  }
  grpc::Status Generate(grpc::ServerContext* ctx,
                        const v1::GenerateRequest* req,
                        Writer* writer) override {
    int n;
    {
      absl::MutexLock lock(&mu_);
      n = static_cast<int>(requests_.size());
      requests_.push_back(*req);
    }
    return script_(n, ctx, *req, writer);
  }
  std::vector<v1::GenerateRequest> requests() {
    absl::MutexLock lock(&mu_);
    return requests_;
  }

 private:
  Script script_;
  absl::Mutex mu_;
  std::vector<v1::GenerateRequest> requests_ ABSL_GUARDED_BY(mu_);
  int closes_ ABSL_GUARDED_BY(mu_) = 0;
};

struct Server {
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  Server(grpc::Service* service, int want_port = 0) {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:" + std::to_string(want_port),
                       grpc::InsecureServerCredentials(), &port);
    b.RegisterService(service);
    server = b.BuildAndStart();
  }
  ~Server() { server->Shutdown(std::chrono::system_clock::now()); }
  std::string address() const { return "127.0.0.1:" + std::to_string(port); }
};

// Token i of the turn is id 100 + i at position 10 + i.
void Send(Writer* w, int from, int to) {
  for (int i = from; i < to; ++i) {
    v1::GenerateResponse r;
    r.mutable_token()->set_token_id(100 + i);
    r.mutable_token()->set_position(10 + i);
    w->Write(r);
  }
}

void Done(Writer* w) {
  v1::GenerateResponse r;
  r.mutable_done()->set_finish_reason("length");
  w->Write(r);
}

grpc::Status Broken(grpc::ServerContext* ctx, int kept) {
  ctx->AddTrailingMetadata(kTurnTokensKey, std::to_string(kept));
  return grpc::Status(grpc::StatusCode::UNAVAILABLE, "GPU node gpu0 failed");
}

v1::GenerateRequest Request() {
  v1::GenerateRequest req;
  req.set_session_id("s-1");
  req.set_prompt("hi");
  req.set_max_new_tokens(10);
  req.set_idempotency_key("bench-x-0-0");
  return req;
}

RetryPolicy Retry(double timeout_s = 20) {
  RetryPolicy p;
  p.enabled = true;
  p.timeout_s = timeout_s;
  p.initial_backoff_s = 0.01;
  p.max_backoff_s = 0.05;
  return p;
}

std::vector<int32_t> Ids(int n) {
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) out.push_back(100 + i);
  return out;
}

TEST_CASE("retry: a broken turn resumes from the tokens received") {
  FakeKarat fake([](int n, grpc::ServerContext* ctx,
                    const v1::GenerateRequest& req, Writer* w) {
    if (n == 0) {
      Send(w, 0, 4);
      return Broken(ctx, 4);
    }
    if (n == 1)
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          "a generate is already running");
    Send(w, req.tokens_received(), 10);
    Done(w);
    return grpc::Status::OK;
  });
  Server server(&fake);
  Client client(server.address());
  int seen = 0;
  TurnRecord r = RunTurn(client, Request(), Retry(),
                         [&](const v1::GeneratedToken&) { ++seen; });
  CHECK(r.completed);
  CHECK(r.finish_reason == "length");
  CHECK(r.attempts == 3);
  CHECK(r.retried());
  CHECK(r.tokens == Ids(10));
  CHECK(seen == 10);
  CHECK(r.token_ms.size() == 10);
  CHECK(r.duplicate_tokens == 0);
  CHECK(r.position_gaps == 0);
  REQUIRE(r.attempt_errors.size() == 2);
  CHECK(r.attempt_errors[0].code() == absl::StatusCode::kUnavailable);
  CHECK(r.attempt_errors[1].code() == absl::StatusCode::kFailedPrecondition);
  CHECK(r.tokens_kept == 4);
  const auto reqs = fake.requests();
  REQUIRE(reqs.size() == 3);
  for (const auto& q : reqs) CHECK(q.idempotency_key() == "bench-x-0-0");
  CHECK(reqs[0].tokens_received() == 0);
  CHECK(reqs[1].tokens_received() == 4);
  CHECK(reqs[2].tokens_received() == 4);
  // The longest gap spans the retry: at least the two back-offs.
  CHECK(r.max_gap_ms() >= 10);
  CHECK(r.max_gap_ms() == r.token_ms[4] - r.token_ms[3]);
  CHECK(r.end_ms >= r.token_ms.back());

  const std::string line = TurnRecordJson(2, 1, 7, "s-1", "k", r);
  CHECK(line.find("\"session\": 2, \"turn\": 1, \"seed\": 7, \"session_id\": "
                  "\"s-1\", \"key\": \"k\", \"tokens\": [100, 101, 102, 103, "
                  "104, 105, 106, 107, 108, 109], \"token_ms\": [") == 1);
  CHECK(line.find("\"attempts\": 3, \"completed\": true, \"finish_reason\": "
                  "\"length\", \"attempt_errors\": [{\"code\": "
                  "\"UNAVAILABLE\", \"at_ms\": ") != std::string::npos);
  CHECK(line.find(", \"message\": \"GPU node gpu0 failed\"}, {\"code\": "
                  "\"FAILED_PRECONDITION\", \"at_ms\": ") != std::string::npos);
  REQUIRE(r.attempt_error_ms.size() == 2);
  CHECK(r.attempt_error_ms[0] >= r.token_ms[3]);
  CHECK(r.attempt_error_ms[1] <= r.token_ms[4]);
  CHECK(line.find("\"tokens_kept\": 4") != std::string::npos);
  CHECK(line.find("\"error\"") == std::string::npos);
  CHECK(line.back() == '\n');
}

TEST_CASE("retry: tokens replayed at positions already received") {
  // A server that ignores tokens_received streams the turn from its start
  // again: the repeats are counted and not appended.
  FakeKarat fake([](int n, grpc::ServerContext* ctx, const v1::GenerateRequest&,
                    Writer* w) {
    if (n == 0) {
      Send(w, 0, 6);
      return Broken(ctx, 0);
    }
    Send(w, 0, 10);
    Done(w);
    return grpc::Status::OK;
  });
  Server server(&fake);
  Client client(server.address());
  TurnRecord r = RunTurn(client, Request(), Retry(), nullptr);
  CHECK(r.completed);
  CHECK(r.tokens == Ids(10));
  CHECK(r.duplicate_tokens == 6);
  CHECK(r.position_gaps == 0);
}

TEST_CASE("retry: a gap in positions is counted and kept") {
  FakeKarat fake([](int n, grpc::ServerContext* ctx, const v1::GenerateRequest&,
                    Writer* w) {
    if (n == 0) {
      Send(w, 0, 3);
      return Broken(ctx, 3);
    }
    Send(w, 5, 10);
    Done(w);
    return grpc::Status::OK;
  });
  Server server(&fake);
  Client client(server.address());
  TurnRecord r = RunTurn(client, Request(), Retry(), nullptr);
  CHECK(r.completed);
  CHECK(r.tokens.size() == 8);
  CHECK(r.position_gaps == 1);
}

TEST_CASE("retry: codes that are not retried, and retries off") {
  const auto code =
      GENERATE(grpc::StatusCode::INVALID_ARGUMENT, grpc::StatusCode::NOT_FOUND,
               grpc::StatusCode::UNAVAILABLE);
  const bool enabled = GENERATE(true, false);
  FakeKarat fake([&](int, grpc::ServerContext*, const v1::GenerateRequest&,
                     Writer*) { return grpc::Status(code, "no"); });
  Server server(&fake);
  Client client(server.address());
  // Long enough for a second attempt on a loaded machine.
  RetryPolicy policy = Retry(1.5);
  policy.enabled = enabled;
  TurnRecord r = RunTurn(client, Request(), policy, nullptr);
  CHECK_FALSE(r.completed);
  const bool retried = enabled && code == grpc::StatusCode::UNAVAILABLE;
  CHECK(r.retried() == retried);
  if (!retried) CHECK(r.attempts == 1);
  CHECK(r.attempt_errors.back().code() == static_cast<absl::StatusCode>(code));
  const std::string line = TurnRecordJson(0, 0, 1, "s-1", "", r);
  CHECK(line.find("\"completed\": false") != std::string::npos);
  CHECK(line.find(std::string("\"error\": \"") +
                  StatusCodeName(static_cast<absl::StatusCode>(code)) +
                  ": no\"") != std::string::npos);
}

TEST_CASE(
    "retry: the window ends the turn, a stream without TurnDone is "
    "retried") {
  FakeKarat fake(
      [](int n, grpc::ServerContext*, const v1::GenerateRequest&, Writer* w) {
        Send(w, n, n + 1);  // one new token, then an end without TurnDone
        return grpc::Status::OK;
      });
  Server server(&fake);
  Client client(server.address());
  const auto start = std::chrono::steady_clock::now();
  TurnRecord r = RunTurn(client, Request(), Retry(1), nullptr);
  const double s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  CHECK_FALSE(r.completed);
  CHECK(r.attempts >= 3);
  CHECK(s >= 0.95);
  CHECK(s < 5);
  CHECK(static_cast<int>(r.tokens.size()) == r.attempts);
  CHECK(r.attempt_errors.back().code() == absl::StatusCode::kUnknown);
  CHECK(r.attempt_errors.back().message() ==
        "the stream ended without TurnDone");
}

TEST_CASE("retry: the client reconnects to a server restarted on its port") {
  FakeKarat fake(
      [](int, grpc::ServerContext*, const v1::GenerateRequest&, Writer* w) {
        Send(w, 0, 2);
        Done(w);
        return grpc::Status::OK;
      });
  auto first = std::make_unique<Server>(&fake);
  const int port = first->port;
  Client client(first->address());
  std::vector<absl::Status> errors;
  REQUIRE(CreateSessionRetrying(client, 1, Retry(), &errors).ok());
  first.reset();  // down: connections refused
  constexpr int kDownSeconds = 12;
  std::unique_ptr<Server> second;
  std::thread restart([&] {
    std::this_thread::sleep_for(std::chrono::seconds(kDownSeconds));
    second = std::make_unique<Server>(&fake, port);
  });
  const auto start = std::chrono::steady_clock::now();
  RetryPolicy policy = Retry();
  policy.initial_backoff_s = 0.1;
  policy.max_backoff_s = 0.5;
  auto session = CreateSessionRetrying(client, 2, policy, &errors);
  restart.join();
  const double s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  REQUIRE(session.ok());
  CHECK(session->session_id() == "s-2");
  CHECK_FALSE(errors.empty());
  CHECK(errors.front().code() == absl::StatusCode::kUnavailable);
  // Back within about a second of the restart (here 0.2-1.3 s): each
  // attempt on the failed channel connects afresh (the channel re-resolves
  // the address at most every 100 ms, and its back-off stays under 1 s).
  // With gRPC's defaults (a connection back-off of 1 s growing by 1.6x,
  // re-resolution slower still) the reconnect came 2-3 s late here.
  CHECK(s < kDownSeconds + 2);
  REQUIRE(second->port == port);
  TurnRecord r = RunTurn(client, Request(), Retry(), nullptr);
  CHECK(r.completed);
  CHECK(r.attempts == 1);
}

TEST_CASE("retry: a close whose answer was lost counts as closed") {
  FakeKarat fake(nullptr);
  Server server(&fake);
  Client client(server.address());
  std::vector<absl::Status> errors;
  CHECK(CloseSessionRetrying(client, "s-1", Retry(), &errors).ok());
  CHECK(errors.size() == 1);
  // Without retries the first answer stands, and NOT_FOUND on a first
  // attempt is an error.
  errors.clear();
  RetryPolicy off;
  CHECK(CloseSessionRetrying(client, "s-1", off, &errors).code() ==
        absl::StatusCode::kNotFound);
}

TEST_CASE("retry: keys are unique per run") {
  const std::string a = NewRunId(), b = NewRunId();
  CHECK(a.size() == 16);
  CHECK(a != b);
  CHECK(TurnKey(a, 3, 1) == "bench-" + a + "-3-1");
}

}  // namespace
}  // namespace karat::ctl
