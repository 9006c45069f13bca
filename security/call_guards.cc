#include "security/call_guards.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace karat::security {
namespace {

class PeerNames final : public grpc::AuthMetadataProcessor {
 public:
  explicit PeerNames(std::set<std::string> names) : names_(std::move(names)) {}
  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata&, grpc::AuthContext* context,
                       OutputMetadata*, OutputMetadata*) override {
    std::string peer;
    if (context != nullptr && context->IsPeerAuthenticated())
      for (const grpc::string_ref& v :
           context->FindPropertyValues("x509_common_name"))
        peer.assign(v.data(), v.size());
    if (names_.count(peer)) return grpc::Status::OK;
    return grpc::Status(
        grpc::StatusCode::UNAUTHENTICATED,
        peer.empty()
            ? absl::StrCat("this daemon takes calls from ",
                           absl::StrJoin(names_, ", "),
                           " only (a certificate of the cluster's CA)")
            : absl::StrCat("this daemon takes calls from ",
                           absl::StrJoin(names_, ", "), " only, not from ",
                           peer));
  }

 private:
  const std::set<std::string> names_;
};

class Tokens final : public grpc::AuthMetadataProcessor {
 public:
  Tokens(TokenTable tokens, std::string service, bool certificates)
      : tokens_(std::move(tokens)),
        service_(std::move(service)),
        certificates_(certificates) {}
  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata& md, grpc::AuthContext* context,
                       OutputMetadata* consumed, OutputMetadata*) override {
    if (certificates_ && context != nullptr && context->IsPeerAuthenticated())
      return grpc::Status::OK;
    auto it = md.find("authorization");
    if (it == md.end())
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          absl::StrCat(service_,
                                       " needs a bearer token (metadata "
                                       "`authorization: Bearer TOKEN`)"));
    const std::string token = TokenOfAuthorization(
        absl::string_view(it->second.data(), it->second.size()));
    if (token.empty() || tokens_.Find(token) == nullptr)
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          absl::StrCat(service_, ": unknown bearer token"));
    return grpc::Status::OK;
  }

 private:
  const TokenTable tokens_;
  const std::string service_;
  const bool certificates_;
};

}  // namespace

std::shared_ptr<grpc::AuthMetadataProcessor> PeerNameGuard(
    std::set<std::string> names) {
  return std::make_shared<PeerNames>(std::move(names));
}

std::shared_ptr<grpc::AuthMetadataProcessor> TokenGuard(TokenTable tokens,
                                                        std::string service) {
  return std::make_shared<Tokens>(std::move(tokens), std::move(service),
                                  false);
}

std::shared_ptr<grpc::AuthMetadataProcessor> CertificateOrTokenGuard(
    TokenTable tokens, std::string service) {
  return std::make_shared<Tokens>(std::move(tokens), std::move(service), true);
}

}  // namespace karat::security
