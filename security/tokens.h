// Bearer-token credentials of the client API and the admin service
// (docs/security.md): the token files, and who a call's token names.
// Parsing is pure; TokenTable is immutable once built, so thread-safe.
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/status/statusor.h"
#include "cluster.pb.h"

namespace karat::security {

// One credential of a token file.
struct Credential {
  // Who the token stands for: the owner of the sessions it creates, the
  // name quotas are counted under, what logs print.
  std::string principal;
  // Its limits: the file's settings over the configured defaults.
  cluster::ClientLimits limits;
};

// The tokens of one file, looked up by a hash of the token (a lookup takes
// the same time whatever prefix of a token a caller guessed).
class TokenTable {
 public:
  // Parses a token file: one credential a line, `TOKEN PRINCIPAL
  // [key=value ...]`, blank lines and `#` comments skipped. `limits` says
  // whether the ClientLimits keys (max_sessions, max_kv_bytes,
  // max_concurrent_turns, sessions_per_second, session_burst) are allowed;
  // keys not given take `defaults`. INVALID_ARGUMENT "NAME:LINE: problem"
  // for a malformed line, a token shorter than 16 characters, a repeated
  // token or principal, an unknown key or a bad value.
  static absl::StatusOr<TokenTable> Parse(const std::string& text,
                                          const std::string& name,
                                          bool limits,
                                          const cluster::ClientLimits& defaults);

  // Reads and parses the file at `path` (NOT_FOUND when unreadable).
  static absl::StatusOr<TokenTable> Load(const std::string& path, bool limits,
                                         const cluster::ClientLimits& defaults);

  // The credential of `token`, or nullptr.
  const Credential* Find(const std::string& token) const;

  size_t size() const { return by_hash_.size(); }

 private:
  absl::flat_hash_map<std::string, Credential> by_hash_;  // SHA-256 -> cred
};

// The token of an `authorization` metadata value "Bearer TOKEN" (or
// "bearer TOKEN"); empty when it is not one.
std::string TokenOfAuthorization(absl::string_view value);

// The bearer token of a call: the `authorization` metadata "Bearer TOKEN".
// Empty when there is none.
std::string BearerToken(const grpc::ServerContext& context);

// The credential of the call's bearer token in `table`: UNAUTHENTICATED
// ("missing bearer token" / "unknown bearer token") otherwise. `service`
// names what was refused in the message.
absl::StatusOr<const Credential*> Authenticate(const grpc::ServerContext& context,
                                               const TokenTable& table,
                                               const std::string& service);

// Creates a token: 32 random bytes, hex (64 characters).
std::string NewToken();

// The first 8 characters of a session id or key for logs: enough to follow
// one session, too little to act on it.
std::string ShortId(const std::string& id);

}  // namespace karat::security
