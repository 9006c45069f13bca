// Where karatctl finds a cluster and how it proves who it is
// (docs/client-api.md, docs/security.md): the admin API's address and the
// TLS credentials with the client and admin tokens, by default from the files
// `deploy/karat up` writes beside the coordinator's address file.
#pragma once

#include <grpcpp/security/credentials.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace karat::ctl {

struct ConnectionFlags {
  std::string addr_file;      // --addr-file ("" : run/coordinator.addr)
  std::string tls_dir;        // --tls-dir ("" : tls/ beside the address file)
  std::string admin_address;  // --admin-addr ("" : coordinator-admin.addr)
  bool plaintext = false;     // --plaintext
};

struct Connection {
  // The admin API's address; empty when it is not known.
  std::string admin_address;
  std::shared_ptr<grpc::ChannelCredentials> client;  // with the client token
  std::shared_ptr<grpc::ChannelCredentials> admin;   // with the admin token
  // The folder the defaults were taken from.
  std::string run_dir;
};

// Resolves `flags`: INVALID_ARGUMENT for --plaintext with --tls-dir,
// NOT_FOUND (saying what to pass) when the CA cannot be read.
absl::StatusOr<Connection> ResolveConnection(const ConnectionFlags& flags);

// The first line of a file without surrounding blanks; "" when unreadable.
std::string ReadFirstLine(const std::string& path);

}  // namespace karat::ctl
