// Sessions belong to the principal that created them (docs/security.md
// "Sessions"): the client API's callers by their bearer tokens, the owner in
// the write-ahead log across a restart, the state dir's modes, and the
// request size limit of the client port.
#include <sys/stat.h>

#include <catch2/catch.hpp>
#include <string>

#include "tests/coordinator/sessions_auth.h"

namespace karat::coordinator {
namespace {

// `status` is NOT_FOUND with the message an id that does not exist gets
// (`ghost`, answered `ghost_status`), the id aside.
void CheckLikeUnknown(const grpc::Status& status, const std::string& id,
                      const grpc::Status& ghost_status,
                      const std::string& ghost) {
  CHECK(status.error_code() == grpc::StatusCode::NOT_FOUND);
  CHECK(ghost_status.error_code() == grpc::StatusCode::NOT_FOUND);
  std::string message = status.error_message();
  const size_t at = message.find(id);
  REQUIRE(at != std::string::npos);
  message.replace(at, id.size(), ghost);
  CHECK(message == ghost_status.error_message());
}

int Mode(const std::string& path) {
  struct stat st;
  REQUIRE(::stat(path.c_str(), &st) == 0);
  return int(st.st_mode & 0777);
}

TEST_CASE("ownership: another principal's session is answered as unknown") {
  TempDirectory dir;
  Cluster c(64, [&](Options& o) { o.security = TokenSecurity(dir.path); });
  Principal alice(*c.coordinator, kAliceToken);
  Principal bob(*c.coordinator, kBobToken);
  const std::string id = alice.NewSession(3);
  const std::string ghost = "s-00000000deadbeef";

  CheckLikeUnknown(bob.Get(id), id, bob.Get(ghost), ghost);
  CheckLikeUnknown(bob.Generate(id, "hi", 1).status, id,
                   bob.Generate(ghost, "hi", 1).status, ghost);
  CheckLikeUnknown(bob.Close(id), id, bob.Close(ghost), ghost);

  // The owner still has it, unchanged; its turn gets past the owner check
  // (no GPU node is registered in this test).
  v1::Session s;
  REQUIRE(alice.Get(id, &s).ok());
  CHECK(s.seed() == 3);
  CHECK(s.num_tokens() == 0);
  Cluster::Result turn = alice.Generate(id, "hi", 1);
  CHECK(turn.status.error_code() == grpc::StatusCode::UNAVAILABLE);
  CHECK(turn.status.error_message().find("no alive GPU node") !=
        std::string::npos);
  // Anyone with a client token sees the cluster's status.
  v1::ClusterStatus status;
  REQUIRE(bob.Status(&status).ok());
  CHECK(status.sessions() == 1);
  REQUIRE(alice.Close(id).ok());
  CHECK(alice.Get(id).error_code() == grpc::StatusCode::NOT_FOUND);
}

TEST_CASE("ownership: every client call needs a known client token") {
  TempDirectory dir;
  Cluster c(64, [&](Options& o) { o.security = TokenSecurity(dir.path); });
  Principal alice(*c.coordinator, kAliceToken);
  const std::string id = alice.NewSession();
  for (const std::string& token :
       {std::string(), std::string("not-a-known-token-0123456789"),
        std::string("admin-token-0123456789abcdef")}) {
    INFO("token \"" << token << "\"");
    Principal p(*c.coordinator, token);
    const std::string why =
        token.empty() ? "needs a bearer token" : "unknown bearer token";
    std::string created;
    for (const grpc::Status& st :
         {p.Create(&created), p.Get(id), p.Generate(id, "hi", 1).status,
          p.Close(id), p.Status()}) {
      CHECK(st.error_code() == grpc::StatusCode::UNAUTHENTICATED);
      CHECK(st.error_message().find(why) != std::string::npos);
    }
  }
  // Nothing was created or closed.
  v1::ClusterStatus status;
  REQUIRE(alice.Status(&status).ok());
  CHECK(status.sessions() == 1);
  CHECK(alice.Get(id).ok());
}

TEST_CASE("ownership: owners are logged and restored with their sessions") {
  TempDirectory dir;
  const std::string state = dir.path + "/state";
  auto configure = [&](Options& o) {
    o.security = TokenSecurity(dir.path, "max_sessions=2");
    o.state_dir = state;
  };
  std::string a, bobs;
  {
    Cluster c(64, configure);
    Principal alice(*c.coordinator, kAliceToken);
    Principal bob(*c.coordinator, kBobToken);
    a = alice.NewSession(5);
    const std::string closed = alice.NewSession(6);
    bobs = bob.NewSession(8);
    REQUIRE(alice.Close(closed).ok());
  }
  // The state dir the coordinator created, and its log, are its user's only.
  CHECK(Mode(state) == 0700);
  CHECK(Mode(state + "/sessions.wal") == 0600);

  Cluster c(64, configure);
  Principal alice(*c.coordinator, kAliceToken);
  Principal bob(*c.coordinator, kBobToken);
  v1::Session s;
  REQUIRE(alice.Get(a, &s).ok());
  CHECK(s.seed() == 5);
  REQUIRE(bob.Get(bobs, &s).ok());
  CHECK(s.seed() == 8);
  CheckLikeUnknown(bob.Get(a), a, bob.Get("s-00000000deadbeef"),
                   "s-00000000deadbeef");
  CHECK(alice.Get(bobs).error_code() == grpc::StatusCode::NOT_FOUND);
  CHECK(bob.Close(a).error_code() == grpc::StatusCode::NOT_FOUND);
  // The restored session counts against alice's max_sessions=2.
  REQUIRE(alice.Create(nullptr).ok());
  grpc::Status third = alice.Create(nullptr);
  CHECK(third.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(third.error_message().find("max_sessions limit (2)") !=
        std::string::npos);
  REQUIRE(alice.Close(a).ok());
  CHECK(alice.Create(nullptr).ok());
}

TEST_CASE("client API: a request over max_message_bytes is refused") {
  const std::string prompt(5 * 1000 * 1000, 'x');  // a 5 MB prompt
  {
    Cluster c;
    const std::string id = c.NewSession();
    Cluster::Result r = c.Generate(id, prompt, 1);
    CHECK(r.status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
    INFO(r.status.error_message());
    CHECK(r.status.error_message().find("4194304") != std::string::npos);
    CHECK(r.tokens.empty());
    CHECK(c.Get(id).num_tokens() == 0);
  }
  // A larger limit lets it through to the handler (which has no GPU node
  // to run it on here).
  Cluster c(64, [](Options& o) { o.max_message_bytes = 8 << 20; });
  const std::string id = c.NewSession();
  Cluster::Result r = c.Generate(id, prompt, 1);
  CHECK(r.status.error_code() == grpc::StatusCode::UNAVAILABLE);
  CHECK(r.status.error_message().find("no alive GPU node") !=
        std::string::npos);
  CHECK_FALSE(Coordinator::Start([] {
                Options o;
                o.max_message_bytes = 0;
                return o;
              }())
                  .ok());
}

}  // namespace
}  // namespace karat::coordinator
