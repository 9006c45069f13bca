// The request checks (client_requests.h, register_request.h) as the
// coordinator's handlers apply them, over gRPC.
#include <catch2/catch.hpp>
#include <string>

#include "coordinator/register_request.h"
#include "tests/coordinator/coordinator_fixture.h"

namespace karat::coordinator {
namespace {

TEST_CASE("a malformed session id is NOT_FOUND, quoted short, on every call",
          "[request_checks]") {
  Cluster c;
  c.AddNodes({1000}, {'A'});
  const std::string hostile = "s-" + std::string(1 << 20, '\n');
  auto check = [](const grpc::Status& st) {
    CHECK(st.error_code() == grpc::StatusCode::NOT_FOUND);
    CHECK(st.error_message().find("not a session id") != std::string::npos);
    CHECK(st.error_message().size() < 256);
  };
  check(c.Generate(hostile, "hi", 1).status);
  {
    v1::GetSessionRequest req;
    req.set_session_id(hostile);
    v1::Session s;
    grpc::ClientContext ctx;
    check(c.client->GetSession(&ctx, req, &s));
  }
  {
    v1::CloseSessionRequest req;
    req.set_session_id(hostile);
    v1::CloseSessionResponse resp;
    grpc::ClientContext ctx;
    check(c.client->CloseSession(&ctx, req, &resp));
  }
  // A well-formed id of no session is NOT_FOUND as before.
  const grpc::Status unknown = c.Generate("s-0000000000000000", "hi", 1).status;
  CHECK(unknown.error_code() == grpc::StatusCode::NOT_FOUND);
  CHECK(unknown.error_message().find("unknown or closed") != std::string::npos);
}

TEST_CASE("RegisterNode refuses what ValidateRegisterNodeRequest refuses",
          "[request_checks]") {
  Cluster c;
  cl::RegisterNodeRequest req;
  req.set_name("gpu9");
  req.set_role("gpu");
  req.set_grpc_address("127.0.0.1:1");
  req.set_ranks(kMaxGpuRanks + 1);
  cl::RegisterNodeResponse resp;
  {
    grpc::ClientContext ctx;
    const grpc::Status st = c.membership->RegisterNode(&ctx, req, &resp);
    CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(st.error_message().find("at most 1024 ranks") != std::string::npos);
  }
  req.set_ranks(2);
  req.add_devices()->set_used_bytes(-1);
  grpc::ClientContext ctx;
  const grpc::Status st = c.membership->RegisterNode(&ctx, req, &resp);
  CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(st.error_message().find("devices[0].") != std::string::npos);
  // Nothing refused was registered.
  CHECK(c.Status().nodes_size() == 0);
}

}  // namespace
}  // namespace karat::coordinator
