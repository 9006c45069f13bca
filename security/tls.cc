#include "security/tls.h"

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace karat::security {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path,
                                    const std::string& what) {
  if (path.empty())
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": no file named (TLS needs it; or the cluster "
                           "file's security.plaintext for tests)"));
  absl::StatusOr<std::string> text = ReadSecretFile(path, what);
  if (!text.ok()) return text.status();
  if (!absl::StrContains(*text, "-----BEGIN "))
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", path, ": not a PEM file"));
  return text;
}

}  // namespace

absl::StatusOr<std::string> ReadSecretFile(const std::string& path,
                                           const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return absl::NotFoundError(
        absl::StrCat(what, ": cannot read ", path));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

TlsOptions DaemonTlsOptions(bool plaintext, const std::string& ca_cert,
                            const std::string& cert_dir,
                            const std::string& name) {
  TlsOptions o;
  o.plaintext = plaintext;
  o.ca_file = ca_cert;
  if (!cert_dir.empty()) {
    o.cert_file = absl::StrCat(cert_dir, "/", name, ".crt");
    o.key_file = absl::StrCat(cert_dir, "/", name, ".key");
  }
  return o;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const TlsOptions& o, ClientCertificates clients,
    std::shared_ptr<grpc::AuthMetadataProcessor> guard) {
  if (o.plaintext) return grpc::InsecureServerCredentials();
  absl::StatusOr<std::string> ca = ReadPem(o.ca_file, "TLS CA certificate");
  if (!ca.ok()) return ca.status();
  absl::StatusOr<std::string> cert = ReadPem(o.cert_file, "TLS certificate");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem(o.key_file, "TLS private key");
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions ssl(
      clients == ClientCertificates::kRequire
          ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
          : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  ssl.pem_root_certs = *ca;
  ssl.pem_key_cert_pairs.push_back({*key, *cert});
  std::shared_ptr<grpc::ServerCredentials> creds =
      grpc::SslServerCredentials(ssl);
  if (guard != nullptr) creds->SetAuthMetadataProcessor(std::move(guard));
  return creds;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ClientCredentials(
    const TlsOptions& o, const std::string& token) {
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> channel =
      ChannelCredentials(o);
  if (!channel.ok() || o.plaintext || token.empty()) return channel;
  return grpc::CompositeChannelCredentials(
      *channel, grpc::AccessTokenCredentials(token));
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const TlsOptions& o) {
  if (o.plaintext) return grpc::InsecureChannelCredentials();
  absl::StatusOr<std::string> ca = ReadPem(o.ca_file, "TLS CA certificate");
  if (!ca.ok()) return ca.status();
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = *ca;
  if (!o.cert_file.empty() || !o.key_file.empty()) {
    absl::StatusOr<std::string> cert =
        ReadPem(o.cert_file, "TLS certificate");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadPem(o.key_file, "TLS private key");
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *cert;
    ssl.pem_private_key = *key;
  }
  return grpc::SslCredentials(ssl);
}

std::string PeerCommonName(const grpc::ServerContext& context) {
  std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return "";
  for (const grpc::string_ref& v :
       auth->FindPropertyValues("x509_common_name"))
    return std::string(v.data(), v.size());
  return "";
}

}  // namespace karat::security
