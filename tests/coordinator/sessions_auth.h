// Helpers of the tests of sessions' owners and quotas: client token files
// (security.client_tokens), the coordinator's TLS files (deploy/karat-certs)
// and a client API caller with a bearer token over TLS.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "coordinator/coordinator.h"
#include "karat.grpc.pb.h"
#include "tests/coordinator/coordinator_fixture.h"

namespace karat::coordinator {
namespace {

// A fresh directory under the system temp dir, removed at scope exit.
class TempDirectory {
 public:
  TempDirectory() {
    std::string tmpl =
        (std::filesystem::temp_directory_path() / "karat_sessions_XXXXXX")
            .string();
    REQUIRE(mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDirectory() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string path;
};

// The CA of the coordinator the latest TokenSecurity set up.
inline std::string& TestCaFile() {
  static std::string path;
  return path;
}

constexpr char kAliceToken[] = "alice-token-0123456789abcdef";
constexpr char kBobToken[] = "bob-token-0123456789abcdef";

// Writes token files into `dir` (alice and bob, `alice_limits` appended to
// alice's line, e.g. "max_sessions=1"; one admin) and returns the security
// block of Options naming them.
inline cluster::SecurityConfig TokenSecurity(
    const std::string& dir, const std::string& alice_limits = "") {
  const std::string clients = dir + "/client.tokens";
  const std::string admins = dir + "/admin.tokens";
  std::ofstream(clients) << kAliceToken << " alice " << alice_limits << "\n"
                         << kBobToken << " bob\n";
  std::ofstream(admins) << "admin-token-0123456789abcdef admin\n";
  // The coordinator's certificate and the CA the callers verify it with.
  REQUIRE(std::system((std::string(KARAT_CERTS_SCRIPT) + " " + dir + "/tls" +
                       " coordinator >/dev/null")
                          .c_str()) == 0);
  TestCaFile() = dir + "/tls/ca.crt";
  cluster::SecurityConfig s;
  s.set_plaintext(false);
  s.set_ca_cert(dir + "/tls/ca.crt");
  s.set_cert_dir(dir + "/tls");
  s.set_client_tokens(clients);
  s.set_admin_tokens(admins);
  return s;
}

// A caller of the client API with a bearer token ("" sends none).
class Principal {
 public:
  Principal(const Coordinator& coordinator, std::string token)
      : token_(std::move(token)),
        client_(v1::Karat::NewStub(Channel(coordinator.address()))) {}

  static std::shared_ptr<grpc::Channel> Channel(const std::string& address) {
    std::ifstream in(TestCaFile());
    std::stringstream ca;
    ca << in.rdbuf();
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = ca.str();
    return grpc::CreateChannel(address, grpc::SslCredentials(ssl));
  }

  grpc::Status Create(std::string* id, uint64_t seed = 7) {
    grpc::ClientContext ctx;
    Authorize(&ctx);
    v1::CreateSessionRequest req;
    req.set_seed(seed);
    v1::Session s;
    grpc::Status st = client_->CreateSession(&ctx, req, &s);
    if (id != nullptr) *id = s.session_id();
    return st;
  }
  std::string NewSession(uint64_t seed = 7) {
    std::string id;
    REQUIRE(Create(&id, seed).ok());
    return id;
  }
  grpc::Status Get(const std::string& id, v1::Session* out = nullptr) {
    grpc::ClientContext ctx;
    Authorize(&ctx);
    v1::GetSessionRequest req;
    req.set_session_id(id);
    req.set_include_tokens(true);
    v1::Session s;
    grpc::Status st = client_->GetSession(&ctx, req, &s);
    if (out != nullptr) *out = s;
    return st;
  }
  grpc::Status Close(const std::string& id) {
    grpc::ClientContext ctx;
    Authorize(&ctx);
    v1::CloseSessionRequest req;
    req.set_session_id(id);
    v1::CloseSessionResponse resp;
    return client_->CloseSession(&ctx, req, &resp);
  }
  grpc::Status Status(v1::ClusterStatus* out = nullptr) {
    grpc::ClientContext ctx;
    Authorize(&ctx);
    v1::ClusterStatus s;
    grpc::Status st = client_->GetClusterStatus(&ctx, {}, &s);
    if (out != nullptr) *out = s;
    return st;
  }
  Cluster::Result Generate(const std::string& id, const std::string& prompt,
                           int max_new) {
    grpc::ClientContext ctx;
    Authorize(&ctx);
    v1::GenerateRequest req;
    req.set_session_id(id);
    req.set_prompt(prompt);
    req.set_max_new_tokens(max_new);
    Cluster::Result r;
    auto reader = client_->Generate(&ctx, req);
    v1::GenerateResponse resp;
    while (reader->Read(&resp)) {
      if (resp.has_queued()) r.queued.push_back(resp.queued().position());
      if (resp.has_token()) r.tokens.push_back(resp.token());
      if (resp.has_done()) r.done = resp.done();
    }
    r.status = reader->Finish();
    return r;
  }

 private:
  void Authorize(grpc::ClientContext* ctx) const {
    if (!token_.empty()) ctx->AddMetadata("authorization", "Bearer " + token_);
  }

  const std::string token_;
  std::unique_ptr<v1::Karat::Stub> client_;
};

inline std::vector<int32_t> TokenIds(const v1::Session& s) {
  return std::vector<int32_t>(s.tokens().begin(), s.tokens().end());
}

inline std::vector<int32_t> StreamedIds(const Cluster::Result& r) {
  std::vector<int32_t> ids;
  for (const auto& t : r.tokens) ids.push_back(t.token_id());
  return ids;
}

}  // namespace
}  // namespace karat::coordinator
