// gRPC channel protection for every daemon and client (docs/security.md):
// TLS credentials from PEM files, mutual TLS between daemons, and the
// verified identity of a caller. Pure set-up helpers, thread-safe.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace karat::security {

// Where a program finds its TLS files. `plaintext` turns TLS off (every
// other field is then ignored).
struct TlsOptions {
  bool plaintext = false;
  // The cluster's certificate authority (PEM): the peer's certificate must
  // be signed by it.
  std::string ca_file;
  // This program's certificate and private key (PEM). A daemon needs both;
  // a client has neither.
  std::string cert_file;
  std::string key_file;
};

// The TLS options of the daemon `name` from a cluster file's security
// block: CA_CERT, CERT_DIR/NAME.crt and CERT_DIR/NAME.key.
TlsOptions DaemonTlsOptions(bool plaintext, const std::string& ca_cert,
                            const std::string& cert_dir,
                            const std::string& name);

// Whether a server asks its callers for a certificate.
enum class ClientCertificates {
  // Every caller must present one signed by the CA (daemon-only ports: the
  // nodes' services).
  kRequire,
  // A caller may present one (then it is verified) or none (clients with a
  // bearer token; the coordinator's port serves both).
  kRequestAndVerify,
};

// Server credentials: insecure when `o.plaintext`, else TLS with o's
// certificate and key, verifying client certificates against o.ca_file as
// `clients` says. NOT_FOUND names a file that cannot be read,
// INVALID_ARGUMENT one that is not PEM or a missing field.
// `guard` (optional; security/call_guards.h) checks every call before its
// handler runs.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const TlsOptions& o, ClientCertificates clients,
    std::shared_ptr<grpc::AuthMetadataProcessor> guard = nullptr);

// Channel credentials: insecure when `o.plaintext`, else TLS verifying the
// server against o.ca_file, presenting o's certificate when it has one.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const TlsOptions& o);

// A client's credentials: ChannelCredentials(o) and, when `token` is not
// empty, the bearer token on every call (metadata `authorization: Bearer
// TOKEN`). In plaintext the token is not sent (gRPC sends no call
// credentials over an insecure channel; a plaintext cluster asks for none).
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ClientCredentials(
    const TlsOptions& o, const std::string& token);

// The common name of the certificate the caller of `context` presented and
// the server verified; empty when it presented none (or in plaintext).
std::string PeerCommonName(const grpc::ServerContext& context);

// Reads a whole file (NOT_FOUND naming `what` and the path when it cannot).
absl::StatusOr<std::string> ReadSecretFile(const std::string& path,
                                           const std::string& what);

}  // namespace karat::security
