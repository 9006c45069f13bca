// karat.v1.Karat, the client API (proto/karat.proto): sessions, turns
// (Generate: karat_service_generate.cc), admission (admission.cc), turns
// resumed after a lost node (turn_resume.cc) and the cluster's status.
#pragma once

#include "coordinator/control_push.h"
#include "coordinator/state.h"

namespace karat::coordinator {

// Everything a turn needs once it is admitted, copied out of the state.
struct AdmittedTurn {
  uint64_t key = 0;
  uint64_t seed = 0;
  int rank = 0;
  uint32_t gpu_id = 0;
  std::string gpu_name;
  std::shared_ptr<grpc::Channel> gpu_channel;
  cl::KaratPlacement placement;  // empty in gpu_only mode
  int pos_start = 0;
  std::vector<int32_t> feed;
  std::vector<int32_t> prefill_ends;
  uint64_t epoch = 0;  // the turn epoch its KV was reserved with
};

class KaratService final : public v1::Karat::Service {
 public:
  // One Generate call (generate.cc).
  friend class TurnCall;

  explicit KaratService(State* state) : s_(state) {}

  // Runs the SetMicroBatches pushes.
  void set_control_pusher(ControlPusher* pusher) { control_ = pusher; }
  // Posts a SetMicroBatches push for `rank`.
  void PostMicroBatchPush(int rank);

  grpc::Status CreateSession(grpc::ServerContext*,
                             const v1::CreateSessionRequest* req,
                             v1::Session* resp) override;

  grpc::Status GetSession(grpc::ServerContext*,
                          const v1::GetSessionRequest* req,
                          v1::Session* resp) override;

  grpc::Status CloseSession(grpc::ServerContext*,
                            const v1::CloseSessionRequest* req,
                            v1::CloseSessionResponse*) override;

  grpc::Status GetClusterStatus(grpc::ServerContext*,
                                const v1::GetClusterStatusRequest*,
                                v1::ClusterStatus* resp) override;

  grpc::Status Generate(
      grpc::ServerContext* ctx, const v1::GenerateRequest* req,
      grpc::ServerWriter<v1::GenerateResponse>* writer) override;

 private:
  void FillStatsLocked(absl::Time now,
                       google::protobuf::Map<std::string, double>* stats) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu_);

  static grpc::Status NoSession(const std::string& id);

  // The caller of a client API call (ClientAuth::Client): its principal and
  // limits, or UNAUTHENTICATED.
  absl::StatusOr<Caller> Authenticate(const grpc::ServerContext& ctx) const;
  // The session `id` when it exists and `caller` created it, else null.
  // The handlers answer both cases with NoSession(id), so that a caller
  // cannot tell another principal's session from an id that does not exist.
  Session* OwnedLocked(const std::string& id, const Caller& caller) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu_);

  void FillSession(const Session& s, bool tokens, v1::Session* out) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu_);

  // A client that cancels a Generate sees CANCELLED before the coordinator
  // has noticed and wound the turn down. So that the client's next call
  // sees the session idle with its final history, calls on a busy session
  // first wait up to `grace` for the running turn's cancellation to become
  // visible, and then (bounded) for the turn to end.
  void WaitForCancelledTurn(const std::string& session_id,
                            absl::Duration grace) const;

  // Appends what the session's history, prefill ends and turn count gained
  // since its last record to the write-ahead log (nothing without one, or
  // when nothing changed). Call without the lock, while the session is busy
  // (so that no close comes in between).
  absl::Status LogTurn(const std::string& sid);
  // Appends the start of a turn with an idempotency key (WalRecord.
  // TurnStarted), so that a retry after a restart can run it again.
  absl::Status LogTurnStart(const std::string& sid, const cl::LastTurn& turn);
  // Ends the turn running on `sid` (a take-over by a retry with its key, or
  // CloseSession): asks its call to stop and waits up to `timeout` for the
  // session to be idle. False when it is still busy.
  bool StopRunningTurn(const std::string& sid, absl::Duration timeout);
  // UNAVAILABLE unless a GPU node (and in karat mode a KARAT node) is alive
  // and every routed expert has an alive owner that acknowledged it: with
  // several ranks whose nodes report the expert count, the alive ranks
  // acknowledged the ownership pushed for them (a lost rank's experts
  // spread over them, DESIGN.md §7); otherwise every rank is alive. While
  // the ownership is being pushed and acknowledged `*settling` (may be
  // null) is set: the caller may wait instead of failing.
  absl::Status CheckNodesLocked(bool* settling = nullptr) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu_);

  // Asks every alive node for its stats; those that cannot be reached are
  // taken for lost at once (not after node_timeout_ms): for a GPU node the
  // rank table is pushed again, for a KARAT node the GPU nodes are told
  // (NoteLostKaratNodesLocked). Makes RPCs: call without the lock.
  void ProbeNodes();
  // What a turn's GPU call started with, to tell afterwards whether a node
  // was lost meanwhile.
  struct LossMarks {
    uint64_t rank_removals = 0;           // State::rank_removals_
    uint64_t karat_losses = 0;            // State::karat_losses_
    std::map<int, uint32_t> alive_ranks;  // rank -> node id
  };
  // After the GPU call of the turn on `turn->rank` failed with UNAVAILABLE:
  // false when no node was lost since the call started (`before`: no table
  // without one of its ranks was pushed, the alive ranks it started with
  // are alive, no KARAT node was taken for lost; the nodes are probed
  // first). Otherwise waits (bounded) for the alive ranks to own every
  // expert, moves the turn to an alive rank if a rank was lost (gpu_only:
  // to the rank holding the session's KV), to a new home if the node
  // holding its KV was lost (ReplaceHome: a KARAT node, in gpu_only mode
  // its rank), and rewrites
  // `run` to continue it: the KV up to the session's kv_len is on its home,
  // the token log's tail is fed again (after `generated` tokens of the turn
  // it holds sampled ones: resumed_decode), `remaining` tokens are left.
  // True once resumed; CANCELLED when the client went away meanwhile, other
  // errors when it cannot be resumed.
  absl::StatusOr<bool> ResumeTurn(grpc::ServerContext* ctx,
                                  const std::string& sid, int generated,
                                  int remaining, const LossMarks& before,
                                  AdmittedTurn* turn, cl::RunTurnRequest* run);
  // For ResumeTurn: the node holding the session's KV is lost (its home
  // KARAT node; in gpu_only mode its rank). Reserves KV for its token log
  // plus `remaining` tokens on the device ChooseHomeDevices prefers (gpu_only:
  // the alive rank with the fewest running turns), the next one when one
  // refuses, makes it the session's home (and rank) with no KV stored
  // (kv_len 0) and points `turn` and `run` there.
  absl::Status ReplaceHome(const std::string& sid, int remaining,
                           uint64_t epoch, AdmittedTurn* turn,
                           cl::RunTurnRequest* run);
  // For ResumeTurn: the home stays; a Reserve there under the new turn
  // `epoch` refuses the failed pass's frames from now on and cuts what it
  // stored beyond the session's kv_len (all of it: kv_len 0).
  absl::Status FenceHome(const std::string& sid, int remaining, uint64_t epoch);

  struct Attempt {
    enum Kind { kAdmitted, kWait, kFailed } kind;
    absl::Status status;  // kFailed
    bool quota = false;   // kFailed by the owner's max_kv_bytes
  };
  // One admission attempt of a queued turn: picks the rank (fewest
  // running; gpu_only: the one holding the KV) if its batch has room,
  // reserves the KV (home device, or the rank in gpu_only mode) under a new
  // turn epoch and on success enters the turn into the rank's batch
  // (filling `turn`); a `new_turn` also appends its prompt to the history
  // and counts as a turn (a continued one feeds what the history holds).
  // kWait: no room now, or the session's KV is being freed (idle
  // eviction); kFailed: never (RESOURCE_EXHAUSTED when no device or rank
  // could hold it even empty: Reserve's OUT_OF_RANGE), a node error, or
  // the reservation would take the session's owner past `limits`'
  // max_kv_bytes (RESOURCE_EXHAUSTED, `quota` set; the session's KV is
  // then freed and its home cleared, so that its next turn rebuilds it).
  // Otherwise the session is left unchanged unless admitted.
  Attempt TryAdmit(const std::string& session_id,
                   const cluster::ClientLimits& limits, int tokens,
                   const std::vector<int32_t>& prompt, bool new_turn,
                   AdmittedTurn* turn);
  // Queues the turn and returns once it is admitted (TryAdmit), streaming
  // its queue position; the queue's fairness rule is admission_policy.h.
  // Fails on timeout (RESOURCE_EXHAUSTED), cancel (CANCELLED), shutdown or
  // lost nodes (UNAVAILABLE).
  absl::StatusOr<AdmittedTurn> WaitForAdmission(
      grpc::ServerContext* ctx,
      grpc::ServerWriter<v1::GenerateResponse>* writer, const std::string& sid,
      const cluster::ClientLimits& limits, int reserve_tokens,
      const std::vector<int32_t>& prompt, bool new_turn);

  State* s_;
  ControlPusher* control_ = nullptr;
};

}  // namespace karat::coordinator
