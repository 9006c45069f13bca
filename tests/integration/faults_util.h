// Client-side helpers of the fault tests (faults_test.cc,
// faults_recovery_test.cc): Generate calls with idempotency keys, deadlines
// and cancellation that keep what the client saw (tokens, their positions,
// the done event, the karat-turn-tokens trailer), a turn retried as a
// retrying client does, node counters, and the reference engine's turns.
// Nothing here asserts: the helpers run on client threads, and Catch2's
// assertions belong to the test's thread.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/reference_engine.h"
#include "common/weights.h"
#include "karat.grpc.pb.h"
#include "tests/integration/cluster_harness.h"

namespace karat::testing {

// One Generate call as the client saw it.
struct CallResult {
  grpc::Status status;
  std::vector<int32_t> tokens;
  std::vector<int64_t> positions;  // GeneratedToken.position of each token
  std::string finish_reason;       // of TurnDone, if one came
  int done_generated = -1;         // TurnDone.generated_tokens, if one came
  int trailer_tokens = -1;         // karat-turn-tokens; -1: none came
};

struct CallOptions {
  std::string key;  // idempotency_key
  int tokens_received = 0;
  // Cancel the call once this many tokens have arrived; 0: right after it
  // starts, before anything is read. -1: never.
  int cancel_after = -1;
  std::chrono::milliseconds deadline = std::chrono::minutes(3);
  // Called on the calling thread after each token (with the tokens so far).
  std::function<void(const CallResult&)> on_token;
};

CallResult GenerateCall(karat::v1::Karat::Stub* stub,
                        const std::string& session, const std::string& prompt,
                        int max_new_tokens, float temperature,
                        const CallOptions& options = {});

// A turn run to its end the way a retrying client does (karatctl bench
// --retry): every attempt carries `key` and tokens_received = the tokens
// it has; a failed attempt (a broken stream, a refused connection, or any
// code but INVALID_ARGUMENT and NOT_FOUND) or a stream that ends without
// TurnDone is retried on a fresh channel after 100 ms, doubling to 1 s,
// until `timeout` after the turn began.
struct RetriedTurn {
  std::vector<int32_t> tokens;
  std::vector<int64_t> positions;
  std::string finish_reason;
  bool completed = false;
  int attempts = 0;
  std::vector<grpc::Status> failures;  // each failed attempt's status
};
RetriedTurn RunTurnWithRetries(
    const Cluster& cluster, const std::string& session,
    const std::string& prompt, int max_new_tokens, float temperature,
    const std::string& key,
    std::chrono::seconds timeout = std::chrono::seconds(120),
    const std::function<void(const CallResult&)>& on_token = {});

// The positions of a turn's tokens, as a sequence starting at positions[0],
// have neither gap nor repeat.
bool ConsecutivePositions(const std::vector<int64_t>& positions);

// GetSession with the token log; a non-OK status leaves *out untouched.
grpc::Status GetSessionInfo(karat::v1::Karat::Stub* stub,
                            const std::string& session,
                            karat::v1::Session* out);
// CreateSession with `seed`; "" when it is refused.
std::string CreateSessionOrEmpty(karat::v1::Karat::Stub* stub, uint64_t seed);
grpc::Status CloseSessionCall(karat::v1::Karat::Stub* stub,
                              const std::string& session);

// The counters of daemon `name` ("gpu0", "karat1", ...) from its own
// GetStats (not the coordinator's heartbeat copy); empty when it cannot be
// reached.
std::map<std::string, double> NodeStats(const Cluster& cluster,
                                        const std::string& name);
// The sum of the counters of `stats` whose names start with `prefix` and
// end with `suffix` (link.<peer>.dropped: "link.", ".dropped").
double SumStats(const std::map<std::string, double>& stats,
                const std::string& prefix, const std::string& suffix);
// The coordinator's own counters (ClusterStatus.stats).
std::map<std::string, double> CoordinatorStats(const Cluster& cluster);

// The reference engine on a cluster's model, and its sessions.
class Reference {
 public:
  explicit Reference(const std::string& model_dir);
  bool ok() const { return engine_ != nullptr; }
  const std::string& error() const { return error_; }
  // The next turn of `session` (prompt as text); empty with error() set
  // when the engine refuses it.
  std::vector<int32_t> Turn(ReferenceSession* session,
                            const std::string& prompt, int max_new_tokens,
                            float temperature);

 private:
  std::unique_ptr<ModelFiles> files_;
  std::unique_ptr<ReferenceEngine> engine_;
  std::string error_;
};

// An Admin stub of the cluster's coordinator.
std::unique_ptr<karat::cluster::Admin::Stub> NewAdminStub(
    const Cluster& cluster);
// A link rule source -> destination with the given loss or down flag.
karat::cluster::LinkConfig LinkRule(const std::string& source,
                                    const std::string& destination,
                                    double loss = 0, bool down = false,
                                    int64_t latency_us = 0);
// Removes the rule source -> destination.
grpc::Status RemoveLink(karat::cluster::Admin::Stub* admin,
                        const std::string& source,
                        const std::string& destination);

}  // namespace karat::testing
