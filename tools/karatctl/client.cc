#include "tools/karatctl/client.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/string_view.h"

namespace karat::ctl {
namespace {

// The channel's reconnect back-off while the coordinator is unreachable,
// and how often it may resolve the address again: after a connection
// failure a new connection is tried when the address has been resolved
// again, which gRPC's default (30 s between resolutions, with a back-off)
// delayed by up to 5 s after a coordinator restart.
// GRPC_ARG_MIN_RECONNECT_BACKOFF_MS is left alone: gRPC's core reads it as
// the shortest time a connection attempt is given (default 20 s), and at
// 100 ms a handshake with a busy coordinator on a loaded box was cut off
// ("tcp handshaker shutdown").
constexpr int kReconnectInitialMs = 100;
constexpr int kReconnectMaxMs = 1000;

absl::Status FromGrpc(const grpc::Status& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      s.error_message());
}

std::shared_ptr<grpc::Channel> MakeChannel(
    const std::string& address,
    std::shared_ptr<grpc::ChannelCredentials> credentials) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, kReconnectInitialMs);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, kReconnectMaxMs);
  args.SetInt(GRPC_ARG_DNS_MIN_TIME_BETWEEN_RESOLUTIONS_MS,
              kReconnectInitialMs);
  return grpc::CreateCustomChannel(address, std::move(credentials), args);
}

void SetDeadline(grpc::ClientContext* ctx, const Deadline& deadline) {
  if (deadline) ctx->set_deadline(*deadline);
}

}  // namespace

std::optional<int64_t> TurnTokensKept(const absl::Status& status) {
  auto payload = status.GetPayload(kTurnTokensKey);
  int64_t n = 0;
  if (!payload || !absl::SimpleAtoi(std::string(*payload), &n)) return {};
  return n;
}

const char* StatusCodeName(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
      return "OK";
    case absl::StatusCode::kCancelled:
      return "CANCELLED";
    case absl::StatusCode::kUnknown:
      return "UNKNOWN";
    case absl::StatusCode::kInvalidArgument:
      return "INVALID_ARGUMENT";
    case absl::StatusCode::kDeadlineExceeded:
      return "DEADLINE_EXCEEDED";
    case absl::StatusCode::kNotFound:
      return "NOT_FOUND";
    case absl::StatusCode::kAlreadyExists:
      return "ALREADY_EXISTS";
    case absl::StatusCode::kPermissionDenied:
      return "PERMISSION_DENIED";
    case absl::StatusCode::kResourceExhausted:
      return "RESOURCE_EXHAUSTED";
    case absl::StatusCode::kFailedPrecondition:
      return "FAILED_PRECONDITION";
    case absl::StatusCode::kAborted:
      return "ABORTED";
    case absl::StatusCode::kOutOfRange:
      return "OUT_OF_RANGE";
    case absl::StatusCode::kUnimplemented:
      return "UNIMPLEMENTED";
    case absl::StatusCode::kInternal:
      return "INTERNAL";
    case absl::StatusCode::kUnavailable:
      return "UNAVAILABLE";
    case absl::StatusCode::kDataLoss:
      return "DATA_LOSS";
    case absl::StatusCode::kUnauthenticated:
      return "UNAUTHENTICATED";
    default:
      return "UNKNOWN";
  }
}

Client::Client(const std::string& address)
    : Client(address, grpc::InsecureChannelCredentials()) {}

Client::Client(const std::string& address,
               std::shared_ptr<grpc::ChannelCredentials> credentials)
    : stub_(v1::Karat::NewStub(MakeChannel(address, std::move(credentials)))) {}

absl::StatusOr<v1::Session> Client::CreateSession(uint64_t seed,
                                                  Deadline deadline) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx, deadline);
  v1::CreateSessionRequest req;
  req.set_seed(seed);
  v1::Session out;
  grpc::Status st = stub_->CreateSession(&ctx, req, &out);
  if (!st.ok()) return FromGrpc(st);
  return out;
}

absl::StatusOr<v1::Session> Client::GetSession(const std::string& id) {
  grpc::ClientContext ctx;
  v1::GetSessionRequest req;
  req.set_session_id(id);
  v1::Session out;
  grpc::Status st = stub_->GetSession(&ctx, req, &out);
  if (!st.ok()) return FromGrpc(st);
  return out;
}

absl::Status Client::CloseSession(const std::string& id, Deadline deadline) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx, deadline);
  v1::CloseSessionRequest req;
  req.set_session_id(id);
  v1::CloseSessionResponse out;
  return FromGrpc(stub_->CloseSession(&ctx, req, &out));
}

absl::StatusOr<v1::ClusterStatus> Client::GetClusterStatus() {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::ClusterStatus out;
  grpc::Status st = stub_->GetClusterStatus(&ctx, {}, &out);
  if (!st.ok()) return FromGrpc(st);
  return out;
}

absl::StatusOr<TurnResult> Client::Generate(
    const v1::GenerateRequest& request,
    const std::function<void(const v1::GeneratedToken&)>& on_token,
    const std::function<void(const v1::PrefillProgress&)>& on_progress,
    Deadline deadline) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx, deadline);
  TurnResult result;
  auto start = std::chrono::steady_clock::now();
  auto previous = start;
  auto reader = stub_->Generate(&ctx, request);
  v1::GenerateResponse resp;
  while (reader->Read(&resp)) {
    if (resp.has_token()) {
      auto now = std::chrono::steady_clock::now();
      double ms =
          std::chrono::duration<double, std::milli>(now - previous).count();
      if (result.tokens == 0) {
        result.ttft_ms = ms;
      } else {
        result.tbt_ms.push_back(ms);
      }
      previous = now;
      result.tokens++;
      if (on_token) on_token(resp.token());
    } else if (resp.has_done()) {
      result.finish_reason = resp.done().finish_reason();
    } else if (resp.has_prefill() && on_progress) {
      on_progress(resp.prefill());
    }
  }
  grpc::Status st = reader->Finish();
  if (!st.ok()) {
    absl::Status out = FromGrpc(st);
    const auto& trailers = ctx.GetServerTrailingMetadata();
    if (auto it = trailers.find(kTurnTokensKey); it != trailers.end())
      out.SetPayload(
          kTurnTokensKey,
          absl::Cord(absl::string_view(it->second.data(), it->second.size())));
    return out;
  }
  return result;
}

}  // namespace karat::ctl
