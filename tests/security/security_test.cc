// The security library: token files, HMAC-SHA256, and TLS with the
// certificates deploy/karat-certs makes (mutual TLS between daemons, server
// TLS for clients, a plaintext caller refused).
#include <catch2/catch.hpp>
#include <grpcpp/grpcpp.h>

#include <cstdlib>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "karat.grpc.pb.h"
#include "security/hmac.h"
#include "security/tls.h"
#include "security/tokens.h"

namespace karat::security {
namespace {

TEST_CASE("token files: credentials, limits and their errors", "[security]") {
  cluster::ClientLimits defaults;
  defaults.set_max_sessions(10);
  auto t = TokenTable::Parse(
      "# clients\n"
      "0123456789abcdef0123 alice max_concurrent_turns=2\n"
      "\n"
      "fedcba9876543210fedc bob sessions_per_second=0.5 session_burst=3 # x\n",
      "tokens", true, defaults);
  REQUIRE(t.ok());
  REQUIRE(t->size() == 2);
  const Credential* a = t->Find("0123456789abcdef0123");
  REQUIRE(a != nullptr);
  CHECK(a->principal == "alice");
  CHECK(a->limits.max_sessions() == 10);  // the default
  CHECK(a->limits.max_concurrent_turns() == 2);
  const Credential* b = t->Find("fedcba9876543210fedc");
  REQUIRE(b != nullptr);
  CHECK(b->limits.sessions_per_second() == 0.5);
  CHECK(b->limits.session_burst() == 3);
  CHECK(t->Find("0123456789abcdef012") == nullptr);
  CHECK(t->Find("") == nullptr);

  auto err = [&](const std::string& text, bool limits = true) {
    auto r = TokenTable::Parse(text, "f", limits, defaults);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
    return std::string(r.status().message());
  };
  CHECK(err("short alice\n") == "f:1: a token must have at least 16 characters");
  CHECK(err("\n0123456789abcdef0123\n") ==
        "f:2: expected TOKEN PRINCIPAL [key=value ...]");
  CHECK(err("0123456789abcdef0123 a\n0123456789abcdef0123 b\n") ==
        "f:2: token repeated");
  CHECK(err("0123456789abcdef0123 a\n0123456789abcdef0124 a\n") ==
        "f:2: principal a already named on line 1");
  CHECK(err("0123456789abcdef0123 a max_sessions=-1\n").find(
            "expected an integer") != std::string::npos);
  CHECK(err("0123456789abcdef0123 a colour=red\n").find("unknown key colour") !=
        std::string::npos);
  CHECK(err("0123456789abcdef0123 a max_sessions=1\n", false).find(
            "this file takes TOKEN PRINCIPAL") != std::string::npos);
  CHECK(TokenTable::Load("/nonexistent/tokens", true, defaults).status().code() ==
        absl::StatusCode::kNotFound);
}

TEST_CASE("HMAC-SHA256 matches RFC 4231 test case 2", "[security]") {
  const std::string mac = HmacSha256("Jefe", "what do ya want for nothing?");
  CHECK(absl::BytesToHexString(mac) ==
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  CHECK(ConstantTimeEqual(mac, mac));
  CHECK_FALSE(ConstantTimeEqual(mac, mac.substr(1)));
  CHECK(RandomBytes(32).size() == 32);
  CHECK(RandomBytes(32) != RandomBytes(32));
  CHECK(NewToken().size() == 64);
  CHECK(ShortId("s-0123456789abcdef") == "s-012345");
}

// Answers GetClusterStatus, remembering who called.
class Echo final : public ::karat::v1::Karat::Service {
 public:
  grpc::Status GetClusterStatus(grpc::ServerContext* ctx,
                                const v1::GetClusterStatusRequest*,
                                v1::ClusterStatus*) override {
    absl::MutexLock lock(&mu);
    peer = PeerCommonName(*ctx);
    token = BearerToken(*ctx);
    return grpc::Status::OK;
  }
  absl::Mutex mu;
  std::string peer, token;
};

struct Server {
  Echo echo;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  Server(std::shared_ptr<grpc::ServerCredentials> creds) {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", creds, &port);
    b.RegisterService(&echo);
    server = b.BuildAndStart();
    REQUIRE(server != nullptr);
  }
  ~Server() { server->Shutdown(); }
  grpc::Status Call(std::shared_ptr<grpc::ChannelCredentials> creds,
                    const std::string& token = "") {
    auto ch = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), creds);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
    v1::GetClusterStatusRequest req;
    v1::ClusterStatus resp;
    return ::karat::v1::Karat::NewStub(ch)->GetClusterStatus(&ctx, req, &resp);
  }
};

TEST_CASE("TLS: mutual between daemons, server-only for clients",
          "[security]") {
  char tmpl[] = "/tmp/karat-security-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  const std::string dir = tmpl;
  REQUIRE(std::system(absl::StrCat(KARAT_CERTS_SCRIPT, " ", dir,
                                   " coordinator gpu0 >/dev/null")
                          .c_str()) == 0);
  // Another cluster's CA: its certificates are refused.
  const std::string other = dir + "/other";
  REQUIRE(std::system(absl::StrCat(KARAT_CERTS_SCRIPT, " ", other,
                                   " gpu0 >/dev/null")
                          .c_str()) == 0);
  const TlsOptions coord =
      DaemonTlsOptions(false, dir + "/ca.crt", dir, "coordinator");
  const TlsOptions gpu0 = DaemonTlsOptions(false, dir + "/ca.crt", dir, "gpu0");
  TlsOptions client;
  client.ca_file = dir + "/ca.crt";
  const TlsOptions stranger =
      DaemonTlsOptions(false, dir + "/ca.crt", other, "gpu0");

  SECTION("a daemon-only port requires a certificate of the cluster") {
    auto creds = ServerCredentials(coord, ClientCertificates::kRequire);
    REQUIRE(creds.ok());
    Server s(*creds);
    REQUIRE(s.Call(*ChannelCredentials(gpu0)).ok());
    {
      absl::MutexLock lock(&s.echo.mu);
      CHECK(s.echo.peer == "gpu0");
    }
    CHECK_FALSE(s.Call(*ChannelCredentials(client)).ok());
    CHECK_FALSE(s.Call(*ChannelCredentials(stranger)).ok());
    CHECK_FALSE(s.Call(grpc::InsecureChannelCredentials()).ok());
  }
  SECTION("the client port takes a caller without a certificate") {
    auto creds =
        ServerCredentials(coord, ClientCertificates::kRequestAndVerify);
    REQUIRE(creds.ok());
    Server s(*creds);
    REQUIRE(s.Call(*ChannelCredentials(client), "tok").ok());
    {
      absl::MutexLock lock(&s.echo.mu);
      CHECK(s.echo.peer.empty());
      CHECK(s.echo.token == "tok");
    }
    REQUIRE(s.Call(*ChannelCredentials(gpu0)).ok());
    {
      absl::MutexLock lock(&s.echo.mu);
      CHECK(s.echo.peer == "gpu0");
    }
    CHECK_FALSE(s.Call(*ChannelCredentials(stranger)).ok());
    CHECK_FALSE(s.Call(grpc::InsecureChannelCredentials()).ok());
  }
  SECTION("missing and malformed files are named") {
    TlsOptions bad = coord;
    bad.key_file = dir + "/nope.key";
    auto r = ServerCredentials(bad, ClientCertificates::kRequire);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == absl::StatusCode::kNotFound);
    bad = coord;
    bad.ca_file = dir + "/client.tokens";
    r = ServerCredentials(bad, ClientCertificates::kRequire);
    REQUIRE_FALSE(r.ok());
    CHECK(std::string(r.status().message()).find("not a PEM file") !=
          std::string::npos);
    bad = TlsOptions();
    CHECK(ChannelCredentials(bad).status().code() ==
          absl::StatusCode::kInvalidArgument);
  }
  REQUIRE(std::system(("rm -rf " + dir).c_str()) == 0);
}

}  // namespace
}  // namespace karat::security
