// Clear errors for requests a server cannot even parse. gRPC answers a
// request whose bytes do not parse as the method's message (a string field
// that is not UTF-8, which proto3 refuses, or garbage) with INTERNAL and an
// empty message, and protobuf logs an error line per such request. Every
// KARAT server installs these interceptors, which turn that answer into
// INVALID_ARGUMENT saying what to check; KARAT's own handlers never answer
// INTERNAL without a message. InstallProtobufLogLimiter routes protobuf's
// log lines through the project's log, at most one a minute per kind.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <vector>

namespace karat {

// Interceptor creators for grpc::ServerBuilder::experimental().
// SetInterceptorCreators.
std::vector<
    std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
RequestErrorInterceptors();

// The status a server sends instead of `status` for a request of `method`
// (pure; what the interceptor applies): unchanged unless it is INTERNAL
// with an empty message.
grpc::Status ExplainStatus(const grpc::Status& status, const char* method);

// Once per process; idempotent.
void InstallProtobufLogLimiter();

}  // namespace karat
