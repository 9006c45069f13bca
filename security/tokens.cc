#include "security/tokens.h"

#include <openssl/rand.h>
#include <openssl/sha.h>

#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "security/tls.h"

namespace karat::security {
namespace {

std::string Sha256(const std::string& data) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(data.data()), data.size(),
         digest);
  return std::string(reinterpret_cast<const char*>(digest), sizeof(digest));
}

absl::Status LineError(const std::string& name, int line,
                       const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(name, ":", line, ": ", why));
}

// Applies one `key=value` to `l`; false with `why` set on a bad one.
bool ApplyLimit(const std::string& key, const std::string& value,
                cluster::ClientLimits* l, std::string* why) {
  int64_t n = 0;
  double r = 0;
  auto integer = [&](int64_t max) {
    if (!absl::SimpleAtoi(value, &n) || n < 0 || n > max) {
      *why = absl::StrCat(key, "=", value, ": expected an integer in [0, ",
                          max, "]");
      return false;
    }
    return true;
  };
  if (key == "max_sessions") {
    if (!integer(1 << 30)) return false;
    l->set_max_sessions(static_cast<int32_t>(n));
  } else if (key == "max_kv_bytes") {
    if (!integer(int64_t{1} << 60)) return false;
    l->set_max_kv_bytes(n);
  } else if (key == "max_concurrent_turns") {
    if (!integer(1 << 30)) return false;
    l->set_max_concurrent_turns(static_cast<int32_t>(n));
  } else if (key == "session_burst") {
    if (!integer(1 << 30)) return false;
    l->set_session_burst(static_cast<int32_t>(n));
  } else if (key == "sessions_per_second") {
    if (!absl::SimpleAtod(value, &r) || !std::isfinite(r) || r < 0) {
      *why = absl::StrCat(key, "=", value, ": expected a number >= 0");
      return false;
    }
    l->set_sessions_per_second(r);
  } else {
    *why = absl::StrCat("unknown key ", key,
                        " (max_sessions, max_kv_bytes, max_concurrent_turns, "
                        "sessions_per_second, session_burst)");
    return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<TokenTable> TokenTable::Parse(
    const std::string& text, const std::string& name, bool limits,
    const cluster::ClientLimits& defaults) {
  TokenTable table;
  absl::flat_hash_map<std::string, int> principals;
  int line_no = 0;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++line_no;
    absl::string_view line = raw;
    const size_t hash = line.find('#');
    if (hash != absl::string_view::npos) line = line.substr(0, hash);
    std::vector<std::string> words =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (words.empty()) continue;
    if (words.size() < 2)
      return LineError(name, line_no, "expected TOKEN PRINCIPAL [key=value ...]");
    const std::string& token = words[0];
    if (token.size() < 16)
      return LineError(name, line_no,
                       "a token must have at least 16 characters");
    Credential cred;
    cred.principal = words[1];
    cred.limits = defaults;
    for (size_t i = 2; i < words.size(); ++i) {
      if (!limits)
        return LineError(name, line_no,
                         absl::StrCat("unexpected ", words[i],
                                      " (this file takes TOKEN PRINCIPAL)"));
      const size_t eq = words[i].find('=');
      if (eq == std::string::npos)
        return LineError(name, line_no,
                         absl::StrCat(words[i], ": expected key=value"));
      std::string why;
      if (!ApplyLimit(words[i].substr(0, eq), words[i].substr(eq + 1),
                      &cred.limits, &why))
        return LineError(name, line_no, why);
    }
    auto [p, fresh] = principals.emplace(cred.principal, line_no);
    if (!fresh)
      return LineError(name, line_no,
                       absl::StrCat("principal ", cred.principal,
                                    " already named on line ", p->second));
    if (!table.by_hash_.emplace(Sha256(token), std::move(cred)).second)
      return LineError(name, line_no, "token repeated");
  }
  return table;
}

absl::StatusOr<TokenTable> TokenTable::Load(
    const std::string& path, bool limits,
    const cluster::ClientLimits& defaults) {
  absl::StatusOr<std::string> text = ReadSecretFile(path, "token file");
  if (!text.ok()) return text.status();
  return Parse(*text, path, limits, defaults);
}

const Credential* TokenTable::Find(const std::string& token) const {
  auto it = by_hash_.find(Sha256(token));
  return it == by_hash_.end() ? nullptr : &it->second;
}

std::string TokenOfAuthorization(absl::string_view v) {
  if (!absl::ConsumePrefix(&v, "Bearer ") && !absl::ConsumePrefix(&v, "bearer "))
    return "";
  return std::string(absl::StripAsciiWhitespace(v));
}

std::string BearerToken(const grpc::ServerContext& context) {
  const auto& md = context.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return "";
  return TokenOfAuthorization(
      absl::string_view(it->second.data(), it->second.size()));
}

absl::StatusOr<const Credential*> Authenticate(
    const grpc::ServerContext& context, const TokenTable& table,
    const std::string& service) {
  const std::string token = BearerToken(context);
  if (token.empty())
    return absl::UnauthenticatedError(absl::StrCat(
        service, " needs a bearer token (metadata `authorization: Bearer "
                 "TOKEN`; karatctl --token-file)"));
  const Credential* cred = table.Find(token);
  if (cred == nullptr)
    return absl::UnauthenticatedError(
        absl::StrCat(service, ": unknown bearer token"));
  return cred;
}

std::string NewToken() {
  unsigned char bytes[32];
  if (RAND_bytes(bytes, sizeof(bytes)) != 1) abort();
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (unsigned char b : bytes) {
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  return out;
}

std::string ShortId(const std::string& id) {
  return id.size() <= 8 ? id : id.substr(0, 8);
}

}  // namespace karat::security
