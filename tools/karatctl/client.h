// A thin synchronous client of karat.v1.Karat used by every karatctl
// command. Thread-safe (one stub, one channel).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "karat.grpc.pb.h"

namespace karat::ctl {

// "NOT_FOUND", "UNAVAILABLE", ...
const char* StatusCodeName(absl::StatusCode code);

// The outcome of one streamed turn, timed on the client.
struct TurnResult {
  int tokens = 0;
  double ttft_ms = 0;          // request sent -> first token
  std::vector<double> tbt_ms;  // between consecutive tokens
  std::string finish_reason;   // from TurnDone ("" if none arrived)
};

class Client {
 public:
  explicit Client(const std::string& address);

  absl::StatusOr<v1::Session> CreateSession(uint64_t seed);
  absl::StatusOr<v1::Session> GetSession(const std::string& id);
  absl::Status CloseSession(const std::string& id);
  absl::StatusOr<v1::ClusterStatus> GetClusterStatus();

  // Runs one turn; `on_token` sees every token as it arrives, and
  // `on_progress` (optional) every prefill progress report of a long prompt.
  absl::StatusOr<TurnResult> Generate(
      const v1::GenerateRequest& request,
      const std::function<void(const v1::GeneratedToken&)>& on_token,
      const std::function<void(const v1::PrefillProgress&)>& on_progress =
          nullptr);

 private:
  std::unique_ptr<v1::Karat::Stub> stub_;
};

}  // namespace karat::ctl
