#include "coordinator/client_auth.h"

#include "absl/strings/str_cat.h"
#include "security/tls.h"

namespace karat::coordinator {

absl::StatusOr<std::unique_ptr<ClientAuth>> ClientAuth::Create(
    const cluster::SecurityConfig& security) {
  auto auth = std::make_unique<ClientAuth>();
  auth->plaintext_ = security.plaintext();
  auth->default_limits_ = security.default_limits();
  if (auth->plaintext_) return auth;
  if (security.client_tokens().empty())
    return absl::InvalidArgumentError(
        "security.client_tokens: no client token file (TLS mode needs one; "
        "deploy/karat-certs makes one)");
  if (security.admin_tokens().empty())
    return absl::InvalidArgumentError(
        "security.admin_tokens: no admin token file (TLS mode needs one; "
        "deploy/karat-certs makes one)");
  absl::StatusOr<security::TokenTable> clients = security::TokenTable::Load(
      security.client_tokens(), true, security.default_limits());
  if (!clients.ok()) return clients.status();
  absl::StatusOr<security::TokenTable> admins = security::TokenTable::Load(
      security.admin_tokens(), false, cluster::ClientLimits());
  if (!admins.ok()) return admins.status();
  if (clients->size() == 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "security.client_tokens: ", security.client_tokens(), " holds no token"));
  if (admins->size() == 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "security.admin_tokens: ", security.admin_tokens(), " holds no token"));
  auth->clients_ = std::move(*clients);
  auth->admins_ = std::move(*admins);
  return auth;
}

absl::StatusOr<Caller> ClientAuth::Client(
    const grpc::ServerContext& context) const {
  if (plaintext_) return Caller{"", default_limits_};
  absl::StatusOr<const security::Credential*> cred =
      security::Authenticate(context, clients_, "the client API");
  if (!cred.ok()) return cred.status();
  return Caller{(*cred)->principal, (*cred)->limits};
}

absl::Status ClientAuth::Admin(const grpc::ServerContext& context) const {
  if (plaintext_) return absl::OkStatus();
  return security::Authenticate(context, admins_, "the admin API").status();
}

absl::Status ClientAuth::Daemon(const grpc::ServerContext& context,
                                const std::string& name,
                                const std::string& what) const {
  if (plaintext_) return absl::OkStatus();
  const std::string peer = security::PeerCommonName(context);
  if (peer.empty())
    return absl::UnauthenticatedError(absl::StrCat(
        what, " needs the certificate of the daemon ", name,
        " (mutual TLS with the cluster's CA)"));
  if (peer != name)
    return absl::PermissionDeniedError(absl::StrCat(
        what, ": the caller's certificate is ", peer, "'s, not ", name, "'s"));
  return absl::OkStatus();
}

}  // namespace karat::coordinator
