#include "coordinator/coordinator.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <cmath>

#include "common/request_errors.h"
#include "common/status_macros.h"
#include "coordinator/admin_service.h"
#include "coordinator/cluster_config.h"
#include "coordinator/control_push.h"
#include "coordinator/data_plane_secret.h"
#include "coordinator/karat_service.h"
#include "coordinator/membership_service.h"
#include "coordinator/state.h"

namespace karat::coordinator {
namespace {

// ---------------------------------------------------------------------------

class CoordinatorImpl final : public Coordinator {
 public:
  explicit CoordinatorImpl(const Options& options)
      : state_(options),
        karat_(&state_),
        membership_(&state_),
        admin_(&state_),
        link_pusher_(&state_) {
    membership_.set_link_pusher(&link_pusher_);
    membership_.set_control_pusher(&control_pusher_);
    karat_.set_control_pusher(&control_pusher_);
  }
  ~CoordinatorImpl() override { Shutdown(absl::Seconds(5)); }

  absl::Status Init() {
    ASSIGN_OR_RETURN(state_.auth_,
                     ClientAuth::Create(state_.options().security));
    if (!state_.options().state_dir.empty()) {
      std::vector<LoggedSession> logged;
      std::optional<std::vector<cl::LinkConfig>> links;
      absl::StatusOr<std::unique_ptr<SessionLog>> wal =
          SessionLog::Open(state_.options().state_dir, &logged, &links);
      if (!wal.ok()) return wal.status();
      state_.wal_ = std::move(*wal);
      absl::MutexLock lock(&state_.mu_);
      if (links.has_value()) {
        // Set through the admin API before the restart: they replace the
        // config's, as they did then.
        KLOG(Info, kLog) << "state dir " << state_.options().state_dir << ": "
                         << links->size()
                         << " link rules restored (they replace the config's "
                         << state_.links_.size() << ")";
        state_.links_ = std::move(*links);
      }
      for (LoggedSession& l : logged) {
        // No home and no KV: the next turn places the session and rebuilds
        // its KV from the token log by prefill (TryAdmit).
        Session session;
        session.id = l.id;
        session.key = l.key;
        session.seed = l.seed;
        session.history = std::move(l.history);
        session.prefill_ends = std::move(l.prefill_ends);
        session.turns = l.turns;
        session.logged_tokens = session.history.size();
        session.logged_turns = session.turns;
        // The latest turn a retry with its key continues or replays (a turn
        // running at the crash: its start only, so it runs again).
        if (l.last_turn.has_value() &&
            !l.last_turn->idempotency_key().empty())
          session.last_turn = std::move(l.last_turn);
        state_.session_keys_.insert(session.key);
        state_.sessions_.emplace(session.id, std::move(session));
      }
      KLOG(Info, kLog) << "state dir " << state_.options().state_dir << ": "
                       << logged.size() << " sessions restored";
    }
    ASSIGN_OR_RETURN(state_.data_plane_secret_,
                     DataPlaneSecretFor(state_.options().security,
                                        state_.options().state_dir));
    if (!state_.data_plane_secret_.empty()) {
      KLOG(Info, kLog) << "data-plane secret "
                       << (state_.options().state_dir.empty()
                               ? std::string("made for this run (no state dir)")
                               : absl::StrCat("in ",
                                              state_.options().state_dir, "/",
                                              kDataPlaneSecretFile));
    }
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort(state_.options().listen,
                             grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&karat_);
    builder.RegisterService(&membership_);
    builder.RegisterService(&admin_);
    builder.experimental().SetInterceptorCreators(RequestErrorInterceptors());
    InstallProtobufLogLimiter();
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || port == 0) {
      return absl::UnavailableError(
          absl::StrCat("cannot listen on ", state_.options().listen));
    }
    const std::string& listen = state_.options().listen;
    std::string host = listen.substr(0, listen.rfind(':'));
    address_ = absl::StrCat(host, ":", port);
    KLOG(Info, kLog) << "listening on " << address_;
    return absl::OkStatus();
  }

  std::string address() const override { return address_; }

  void Shutdown(absl::Duration deadline) override {
    {
      absl::MutexLock lock(&shutdown_mu_);
      if (shut_down_) return;
      shut_down_ = true;
    }
    {
      absl::MutexLock lock(&state_.mu_);
      state_.shutting_down_ = true;
      for (const auto& [c, node] : state_.running_) c->TryCancel();
    }
    if (server_) {
      server_->Shutdown(absl::ToChronoTime(absl::Now() + deadline));
      server_->Wait();
    }
    link_pusher_.Stop();
    rank_watcher_.Stop();
    control_pusher_.Stop();
    KLOG(Info, kLog) << "shut down";
  }

  void Wait() override {
    if (server_) server_->Wait();
  }

 private:
  State state_;
  KaratService karat_;
  MembershipService membership_;
  AdminService admin_;
  LinkPusher link_pusher_;
  ControlPusher control_pusher_;
  RankWatcher rank_watcher_{&state_, &control_pusher_};
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Start(
    const Options& options) {
  if (options.max_new_tokens_limit < 1)
    return absl::InvalidArgumentError("max_new_tokens_limit must be >= 1");
  if (options.node_timeout_ms < 1)
    return absl::InvalidArgumentError("node_timeout_ms must be >= 1");
  if (options.mode != "karat" && options.mode != "gpu_only")
    return absl::InvalidArgumentError(absl::StrCat(
        "mode must be \"karat\" or \"gpu_only\", got \"", options.mode, "\""));
  RETURN_IF_ERROR(ValidateSchedulingConfig(options.scheduling));
  for (const double v :
       {options.step_cost.fixed_ms, options.step_cost.per_request_ms,
        options.step_cost.per_context_token_ms}) {
    if (!(v >= 0) || std::isinf(v))
      return absl::InvalidArgumentError(
          "step_cost: every cost must be >= 0 and finite");
  }
  auto impl = std::make_unique<CoordinatorImpl>(options);
  absl::Status st = impl->Init();
  if (!st.ok()) return st;
  return std::unique_ptr<Coordinator>(std::move(impl));
}

}  // namespace karat::coordinator
