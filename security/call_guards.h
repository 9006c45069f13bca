// Checks that run before any handler of a TLS server (gRPC's
// AuthMetadataProcessor): a call that fails them is answered
// UNAUTHENTICATED and never reaches a service. Thread-safe.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <set>
#include <string>

#include "security/tokens.h"

namespace karat::security {

// Admits only callers whose verified certificate names one of `names`
// (common name), e.g. the node daemons' ports: {"coordinator"}.
std::shared_ptr<grpc::AuthMetadataProcessor> PeerNameGuard(
    std::set<std::string> names);

// Admits callers that presented a verified certificate (daemons: what they
// may do is the handlers' business) and callers whose bearer token is in
// `tokens` (clients): the coordinator's port.
std::shared_ptr<grpc::AuthMetadataProcessor> CertificateOrTokenGuard(
    TokenTable tokens, std::string service);

// Admits only callers whose bearer token is in `tokens` (the admin port).
std::shared_ptr<grpc::AuthMetadataProcessor> TokenGuard(TokenTable tokens,
                                                        std::string service);

}  // namespace karat::security
