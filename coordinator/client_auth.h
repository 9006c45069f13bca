// Who calls the coordinator (docs/security.md): the client API's callers by
// their bearer tokens (security.client_tokens), the admin service's by
// theirs (security.admin_tokens), the nodes by their certificates. Built
// once at start; immutable afterwards, so thread-safe.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "cluster.pb.h"
#include "security/tokens.h"

namespace karat::coordinator {

// A client API caller.
struct Caller {
  // Owner of the sessions it creates; empty in plaintext mode (every caller
  // is the same anonymous one).
  std::string principal;
  // Its quota: the token file's limits over security.default_limits.
  cluster::ClientLimits limits;
};

class ClientAuth {
 public:
  // From the cluster file's security block, paths already resolved:
  // plaintext -> every caller trusted; else the token files are read
  // (NOT_FOUND / INVALID_ARGUMENT naming the file; each must hold a token).
  static absl::StatusOr<std::unique_ptr<ClientAuth>> Create(
      const cluster::SecurityConfig& security);

  bool plaintext() const { return plaintext_; }
  const security::TokenTable& client_tokens() const { return clients_; }
  const security::TokenTable& admin_tokens() const { return admins_; }

  // The caller of a client API call: UNAUTHENTICATED without a known
  // client token (an admin token is not a client token).
  absl::StatusOr<Caller> Client(const grpc::ServerContext& context) const;

  // OK for a caller with a known admin token (or in plaintext mode),
  // UNAUTHENTICATED otherwise.
  absl::Status Admin(const grpc::ServerContext& context) const;

  // OK when the caller presented the certificate of the daemon `name` (the
  // TLS layer verified it against the cluster's CA), or in plaintext mode;
  // UNAUTHENTICATED without a certificate, PERMISSION_DENIED for another
  // daemon's. `what` names the call in the message.
  absl::Status Daemon(const grpc::ServerContext& context,
                      const std::string& name, const std::string& what) const;

 private:
  bool plaintext_ = true;
  cluster::ClientLimits default_limits_;
  security::TokenTable clients_;
  security::TokenTable admins_;
};

}  // namespace karat::coordinator
