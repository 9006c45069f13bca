#include "tools/karatctl/connection.h"

#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "security/tls.h"

namespace karat::ctl {

std::string ReadFirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return "";
  return std::string(absl::StripAsciiWhitespace(line));
}

absl::StatusOr<Connection> ResolveConnection(const ConnectionFlags& flags) {
  Connection c;
  c.run_dir = ".";
  const std::string f =
      flags.addr_file.empty() ? "run/coordinator.addr" : flags.addr_file;
  if (const size_t slash = f.rfind('/'); slash != std::string::npos)
    c.run_dir = f.substr(0, slash);
  c.admin_address = flags.admin_address.empty()
                        ? ReadFirstLine(c.run_dir + "/coordinator-admin.addr")
                        : flags.admin_address;
  security::TlsOptions tls;
  std::string client_token, admin_token;
  if (flags.plaintext) {
    if (!flags.tls_dir.empty())
      return absl::InvalidArgumentError("--plaintext contradicts --tls-dir");
    tls.plaintext = true;
  } else {
    const std::string dir =
        flags.tls_dir.empty() ? c.run_dir + "/tls" : flags.tls_dir;
    tls.ca_file = dir + "/ca.crt";
    if (ReadFirstLine(tls.ca_file).empty())
      return absl::NotFoundError(absl::StrCat(
          "no TLS files: cannot read ", tls.ca_file,
          " (pass --tls-dir DIR, or --plaintext for a cluster without TLS)"));
    client_token = ReadFirstLine(dir + "/client.token");
    admin_token = ReadFirstLine(dir + "/admin.token");
  }
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> client =
      security::ClientCredentials(tls, client_token);
  if (!client.ok()) return client.status();
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> admin =
      security::ClientCredentials(tls, admin_token);
  if (!admin.ok()) return admin.status();
  c.client = *client;
  c.admin = *admin;
  return c;
}

}  // namespace karat::ctl
