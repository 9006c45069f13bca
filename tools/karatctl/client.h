// A thin synchronous client of karat.v1.Karat used by every karatctl
// command. Thread-safe (one stub, one channel).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <grpcpp/security/credentials.h>

#include "absl/status/statusor.h"
#include "karat.grpc.pb.h"

namespace karat::ctl {

// "NOT_FOUND", "UNAVAILABLE", ...
const char* StatusCodeName(absl::StatusCode code);

// The trailing-metadata key of a failed Generate that had streamed tokens:
// how many of the turn's tokens the session kept. Client::Generate copies it
// into the returned status as a payload of the same name.
inline constexpr char kTurnTokensKey[] = "karat-turn-tokens";

// The value of that payload, when the server sent one.
std::optional<int64_t> TurnTokensKept(const absl::Status& status);

// A deadline for one call; none when unset.
using Deadline = std::optional<std::chrono::system_clock::time_point>;

// The outcome of one streamed turn, timed on the client.
struct TurnResult {
  int tokens = 0;
  double ttft_ms = 0;          // request sent -> first token
  std::vector<double> tbt_ms;  // between consecutive tokens
  std::string finish_reason;   // from TurnDone ("" if none arrived)
};

// The channel reconnects within about a second of the coordinator coming
// back (a restart on the same address): gRPC's own reconnect back-off would
// otherwise grow to two minutes while it is down.
class Client {
 public:
  // A plaintext channel to `address`.
  explicit Client(const std::string& address);
  // A channel with `credentials` (TLS and the client token).
  Client(const std::string& address,
         std::shared_ptr<grpc::ChannelCredentials> credentials);

  absl::StatusOr<v1::Session> CreateSession(uint64_t seed,
                                            Deadline deadline = {});
  absl::StatusOr<v1::Session> GetSession(const std::string& id);
  absl::Status CloseSession(const std::string& id, Deadline deadline = {});
  absl::StatusOr<v1::ClusterStatus> GetClusterStatus();

  // Runs one turn; `on_token` sees every token as it arrives, and
  // `on_progress` (optional) every prefill progress report of a long prompt.
  // A failed call's status carries the kTurnTokensKey payload when the
  // server sent that trailing metadata.
  absl::StatusOr<TurnResult> Generate(
      const v1::GenerateRequest& request,
      const std::function<void(const v1::GeneratedToken&)>& on_token,
      const std::function<void(const v1::PrefillProgress&)>& on_progress =
          nullptr,
      Deadline deadline = {});

 private:
  std::unique_ptr<v1::Karat::Stub> stub_;
};

}  // namespace karat::ctl
