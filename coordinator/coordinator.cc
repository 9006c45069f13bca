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
#include "coordinator/idle_evict.h"
#include "coordinator/data_plane_secret.h"
#include "coordinator/karat_service.h"
#include "coordinator/membership_service.h"
#include "coordinator/state.h"
#include "security/call_guards.h"
#include "security/tls.h"

namespace karat::coordinator {
namespace {

// Starts a gRPC server for `services` on `listen` with `creds`, the health
// service, reflection and the request-error interceptors: the server and
// the address it bound ("host:port", the port picked when `listen` had 0).
// Only that address: a host name that resolves to several addresses would
// also bind ports nobody is told of.
// `max_message_bytes`: the largest request (explicit, so that the limit is
// the documented one, docs/client-api.md; a larger request gets
// RESOURCE_EXHAUSTED from gRPC).
absl::StatusOr<std::pair<std::unique_ptr<grpc::Server>, std::string>> Serve(
    const std::string& listen, std::shared_ptr<grpc::ServerCredentials> creds,
    std::initializer_list<grpc::Service*> services, int max_message_bytes) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  // With SO_REUSEPORT gRPC opens a listener per completion queue, and with
  // port 0 each picks a port of its own: the server would also answer on a
  // port nobody is told of. One listener, on the advertised port.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(max_message_bytes);
  builder.AddListeningPort(listen, std::move(creds), &port);
  for (grpc::Service* s : services) builder.RegisterService(s);
  builder.experimental().SetInterceptorCreators(RequestErrorInterceptors());
  InstallProtobufLogLimiter();
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0)
    return absl::UnavailableError(absl::StrCat("cannot listen on ", listen));
  const std::string host = listen.substr(0, listen.rfind(':'));
  return std::make_pair(std::move(server), absl::StrCat(host, ":", port));
}

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
        session.owner = std::move(l.owner);
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
        state_.quotas_.AddSession(session.owner);
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
    const cl::SecurityConfig& sec = state_.options().security;
    const security::TlsOptions tls = security::DaemonTlsOptions(
        sec.plaintext(), sec.ca_cert(), sec.cert_dir(), "coordinator");
    if (sec.plaintext())
      KLOG(Warning, kLog)
          << "security.plaintext: no TLS and no credentials; every caller "
             "is trusted (for tests only; docs/security.md)";
    ASSIGN_OR_RETURN(state_.node_credentials_,
                     security::ChannelCredentials(tls));
    // The client API and membership: a daemon's certificate or a client
    // token gets past the port; the handlers check who may do what.
    ASSIGN_OR_RETURN(
        std::shared_ptr<grpc::ServerCredentials> main_creds,
        security::ServerCredentials(
            tls, security::ClientCertificates::kRequestAndVerify,
            sec.plaintext() ? nullptr
                            : security::CertificateOrTokenGuard(
                                  state_.auth_->client_tokens(),
                                  "the coordinator")));
    ASSIGN_OR_RETURN(std::tie(server_, address_),
                     Serve(state_.options().listen, main_creds,
                           {&karat_, &membership_},
                           state_.options().max_message_bytes));
    KLOG(Info, kLog) << "listening on " << address_;
    // The admin API on a port of its own, for admin tokens only.
    ASSIGN_OR_RETURN(
        std::shared_ptr<grpc::ServerCredentials> admin_creds,
        security::ServerCredentials(
            tls, security::ClientCertificates::kRequestAndVerify,
            sec.plaintext() ? nullptr
                            : security::TokenGuard(state_.auth_->admin_tokens(),
                                                   "the admin API")));
    const std::string admin_listen =
        sec.admin_listen().empty() ? "127.0.0.1:0" : sec.admin_listen();
    ASSIGN_OR_RETURN(std::tie(admin_server_, admin_address_),
                     Serve(admin_listen, admin_creds, {&admin_},
                           state_.options().max_message_bytes));
    KLOG(Info, kLog) << "admin API listening on " << admin_address_;
    return absl::OkStatus();
  }

  std::string address() const override { return address_; }
  std::string admin_address() const override { return admin_address_; }

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
    for (grpc::Server* s : {server_.get(), admin_server_.get()}) {
      if (s == nullptr) continue;
      s->Shutdown(absl::ToChronoTime(absl::Now() + deadline));
      s->Wait();
    }
    link_pusher_.Stop();
    rank_watcher_.Stop();
    idle_evictor_.Stop();
    control_pusher_.Stop();
    KLOG(Info, kLog) << "shut down";
  }

  void Wait() override {
    if (server_) server_->Wait();
    if (admin_server_) admin_server_->Wait();
  }

 private:
  State state_;
  KaratService karat_;
  MembershipService membership_;
  AdminService admin_;
  LinkPusher link_pusher_;
  ControlPusher control_pusher_;
  RankWatcher rank_watcher_{&state_, &control_pusher_};
  IdleKvEvictor idle_evictor_{&state_};
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  std::unique_ptr<grpc::Server> admin_server_;
  std::string admin_address_;
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
  if (options.max_message_bytes < 1)
    return absl::InvalidArgumentError(absl::StrCat(
        "max_message_bytes must be >= 1, got ", options.max_message_bytes));
  if (options.idle_kv_evict < absl::ZeroDuration())
    return absl::InvalidArgumentError("idle_kv_evict must be >= 0 (0: never)");
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
