#include "gpu_node/gpu_node.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "cluster.grpc.pb.h"
#include "common/frame.h"
#include "common/link_emulation.h"
#include "common/log.h"
#include "common/log_ids.h"
#include "common/membership.h"
#include "common/model_runner.h"
#include "common/node_daemon.h"
#include "common/process_fault.h"
#include "common/status_macros.h"
#include "common/transport.h"
#include "gpu_node/decode_loop.h"
#include "gpu_node/expert_parallel.h"
#include "gpu_node/local_attention.h"
#include "gpu_node/remote_attention.h"

namespace karat {
namespace {

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()),
                      std::string(s.message()));
}

class Fnv64 {
 public:
  void Add(const void* data, size_t len) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < len; ++i) {
      h_ ^= p[i];
      h_ *= 0x100000001b3ULL;
    }
  }
  void Add(const std::string& s) { Add(s.data(), s.size() + 1); }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 0xcbf29ce484222325ULL;
};

// Sampled every time the RunTurn handler waits, so a cancelled client is
// noticed within this long.
constexpr absl::Duration kCancelPoll = absl::Milliseconds(50);

// Emulated-HBM bytes of the dense weights and the rank's own block
// (RankWeightBytes) plus the experts of `experts` beyond that block.
int64_t WeightBytesWith(const ModelRunner& runner,
                        const std::vector<int>& experts) {
  const ModelConfig& c = runner.config();
  int64_t bytes = RankWeightBytes(c, runner.rank(), runner.ranks());
  const int per_rank = c.n_routed_experts / runner.ranks();
  for (int e : experts) {
    if (e / per_rank != runner.rank()) bytes += ExpertWeightBytes(c, e);
  }
  return bytes;
}

// The experts `owners` gives `rank`, in increasing id.
std::vector<int> OwnedBy(const std::vector<int>& owners, int rank) {
  std::vector<int> owned;
  for (size_t e = 0; e < owners.size(); ++e)
    if (owners[e] == rank) owned.push_back(int(e));
  return owned;
}

class GpuNodeService final : public cluster::GpuNode::Service {
 public:
  // `backend` (karat mode) or `local` (gpu_only) is null.
  GpuNodeService(const GpuNodeOptions* options, ModelRunner* runner,
                 DecodeLoop* loop, RemoteAttentionBackend* backend,
                 GpuLocalAttention* local, ExpertParallel* experts)
      : options_(options),
        runner_(runner),
        loop_(loop),
        backend_(backend),
        local_(local),
        experts_(experts),
        vocab_size_(runner->config().vocab_size) {}

  grpc::Status SetPeers(grpc::ServerContext*,
                        const cluster::SetPeersRequest* request,
                        cluster::SetPeersResponse*) override {
    if (experts_ == nullptr) return grpc::Status::OK;  // the only rank
    absl::MutexLock lock(&set_peers_mu_);
    std::vector<cluster::GpuPeer> peers(request->peers().begin(),
                                        request->peers().end());
    // A table that would be refused moves no expert either.
    if (absl::Status table = experts_->CheckPeers(peers); !table.ok()) {
      KLOG(Warning, "gpu_node") << "SetPeers refused: " << table;
      return ToGrpc(table);
    }
    if (request->expert_owner_size() > 0) {
      absl::Status owners = SetExpertOwners(std::vector<int>(
          request->expert_owner().begin(), request->expert_owner().end()));
      if (!owners.ok()) {
        KLOG(Warning, "gpu_node") << "SetPeers refused: " << owners;
        return ToGrpc(owners);
      }
    }
    return ToGrpc(experts_->SetPeers(peers));
  }

  // Takes the experts `owners` gives this rank (loading those it does not
  // hold from the model directory, after checking that they fit in the
  // emulated HBM) and releases those given back.
  absl::Status SetExpertOwners(const std::vector<int>& owners) {
    ASSIGN_OR_RETURN(std::vector<int> missing, runner_->MissingExperts(owners));
    const int rank = runner_->rank();
    // What the rank will hold: dense weights, its own block and every
    // expert beyond the block that `owners` gives it.
    const std::vector<int> owned = OwnedBy(owners, rank);
    const int64_t weights = WeightBytesWith(*runner_, owned);
    const int per_rank = runner_->config().n_routed_experts / runner_->ranks();
    std::vector<int> extra;  // beyond its own block
    for (int e : owned)
      if (e / per_rank != rank) extra.push_back(e);
    const int64_t kv =
        local_ != nullptr ? int64_t(local_->capacity_bytes()) : int64_t(0);
    if (options_->hbm_bytes > 0 && weights + kv > options_->hbm_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "GPU rank ", rank, " cannot take over experts ",
          absl::StrJoin(extra, ","),
          " of the lost ranks: with them its weights need ", weights, " bytes",
          kv > 0 ? absl::StrCat(" and its KV arena holds ", kv) : "",
          ", but --hbm-bytes is ", options_->hbm_bytes));
    }
    ModelFiles files;
    if (!missing.empty()) {
      absl::StatusOr<ModelFiles> loaded =
          LoadExpertWeights(options_->model_dir, missing);
      if (!loaded.ok()) {
        return absl::Status(
            loaded.status().code(),
            absl::StrCat("GPU rank ", rank, " cannot load experts ",
                         absl::StrJoin(missing, ","), " from ",
                         options_->model_dir, ": ", loaded.status().message()));
      }
      files = *std::move(loaded);
    }
    RETURN_IF_ERROR(runner_->SetExpertOwners(owners, files));
    KLOG(Info, "gpu_node") << "rank " << rank << " owns experts "
                           << absl::StrJoin(owned, ",") << " (loaded "
                           << missing.size() << "; weights "
                           << WeightBytesWith(*runner_, runner_->HeldExperts())
                           << " bytes)";
    return absl::OkStatus();
  }

  grpc::Status RunTurn(
      grpc::ServerContext* context, const cluster::RunTurnRequest* request,
      grpc::ServerWriter<cluster::RunTurnEvent>* writer) override {
    absl::Status valid =
        ValidateTurnRequest(*request, vocab_size_, local_ == nullptr);
    if (valid.ok() && local_ != nullptr &&
        !local_->HasSession(request->session())) {
      valid = absl::FailedPreconditionError(absl::StrCat(
          "session ", request->session(),
          " has no KV room on this rank: call Reserve first (gpu_only mode)"));
    }
    if (!valid.ok()) {
      KLOG(Info, "gpu_node") << "session=" << ShortKey(request->session())
                             << " RunTurn refused: " << valid;
      return ToGrpc(valid);
    }
    absl::StatusOr<std::shared_ptr<TurnStream>> stream =
        loop_->Submit(TurnRequestFromProto(*request));
    if (!stream.ok()) return ToGrpc(stream.status());
    for (;;) {
      cluster::RunTurnEvent event;
      switch ((*stream)->Pop(kCancelPoll, &event)) {
        case TurnStream::Next::kEvent:
          if (!writer->Write(event)) {
            (*stream)->Cancel();
            return grpc::Status(grpc::StatusCode::CANCELLED,
                                "the client went away");
          }
          break;
        case TurnStream::Next::kTimeout:
          if (context->IsCancelled()) {
            (*stream)->Cancel();
            KLOG(Info, "gpu_node") << "session=" << ShortKey(request->session())
                                   << " RunTurn cancelled by the client";
            return grpc::Status(grpc::StatusCode::CANCELLED,
                                "cancelled by the client");
          }
          break;
        case TurnStream::Next::kFinished: {
          const absl::Status status = (*stream)->status();
          if (!status.ok()) {
            KLOG(Warning, "gpu_node")
                << "session=" << ShortKey(request->session())
                << " turn failed: " << status;
          }
          return ToGrpc(status);
        }
      }
    }
  }

  grpc::Status GetStats(grpc::ServerContext*, const cluster::StatsRequest*,
                        cluster::StatsResponse* response) override {
    Fill(response->mutable_stats());
    FillDevices(response->mutable_devices());
    response->set_node_id(node_id_.load());
    return grpc::Status::OK;
  }

  // The id of the node's registration in force (0: none), for GetStats.
  void set_node_id(uint32_t id) { node_id_.store(id); }

  grpc::Status SetLinks(grpc::ServerContext*,
                        const cluster::SetLinksRequest* request,
                        cluster::SetLinksResponse*) override {
    if (links_ == nullptr) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "no data plane");
    }
    absl::StatusOr<std::vector<LinkRule>> rules =
        LinkRulesFromProto(request->links());
    if (!rules.ok()) return ToGrpc(rules.status());
    if (request->seed() != 0) links_->SetSeed(request->seed());
    return ToGrpc(links_->SetLinks(*std::move(rules)));
  }

  void set_links(LinkEmulator* links) { links_ = links; }

  grpc::Status InjectFault(grpc::ServerContext*,
                           const cluster::ProcessFaultRequest* request,
                           cluster::ProcessFaultResponse*) override {
    return ToGrpc(ScheduleProcessFault(request->action(), request->pause_ms()));
  }

  grpc::Status KaratNodeLost(
      grpc::ServerContext*, const cluster::KaratNodeLostRequest* request,
      cluster::KaratNodeLostResponse* response) override {
    if (backend_ == nullptr) return grpc::Status::OK;  // gpu_only
    if (request->fabric_address().empty()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "KaratNodeLost: fabric_address is empty");
    }
    const int failed = backend_->FailNode(
        request->fabric_address(), request->node_id(),
        "the coordinator took it for lost (no heartbeat, or it did not "
        "answer)");
    KLOG(Warning, "gpu_node")
        << "KARAT node " << request->node_name() << " is lost; " << failed
        << " awaited attention output" << (failed == 1 ? "" : "s") << " failed";
    response->set_failed_outputs(failed);
    return grpc::Status::OK;
  }

  grpc::Status SetMicroBatches(grpc::ServerContext*,
                               const cluster::SetMicroBatchesRequest* request,
                               cluster::SetMicroBatchesResponse*) override {
    absl::flat_hash_map<uint64_t, int> assignment;
    for (const auto& [session, mb] : request->micro_batch()) {
      if (mb < 0 || mb > 1) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            absl::StrCat("micro_batch of session ", session,
                                         " must be 0 or 1, got ", mb));
      }
      assignment[session] = mb;
    }
    loop_->SetMicroBatches(assignment);
    return grpc::Status::OK;
  }

  grpc::Status Reserve(grpc::ServerContext*,
                       const cluster::ReserveRequest* request,
                       cluster::ReserveResponse* response) override {
    if (local_ == nullptr) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          "this GPU node runs in karat mode: the KV lives on "
                          "KARAT nodes (Reserve there)");
    }
    if (request->tokens() <= 0) {
      return grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          absl::StrCat("tokens must be > 0, got ", request->tokens()));
    }
    absl::StatusOr<bool> dropped =
        local_->Reserve(request->session(), request->tokens(),
                        request->kv_tokens(), request->turn_epoch());
    if (!dropped.ok()) return ToGrpc(dropped.status());
    response->set_used_bytes(int64_t(local_->used_bytes()));
    response->set_kv_dropped(*dropped);
    response->set_session_bytes(
        int64_t(local_->session_bytes(request->session())));
    return grpc::Status::OK;
  }

  grpc::Status FreeSession(grpc::ServerContext*,
                           const cluster::FreeSessionRequest* request,
                           cluster::FreeSessionResponse*) override {
    if (local_ == nullptr) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          "this GPU node runs in karat mode: the KV lives on "
                          "KARAT nodes");
    }
    local_->Free(request->session());
    return grpc::Status::OK;
  }

  // gpu_only: the rank's KV store as device 0.
  void FillDevices(
      google::protobuf::RepeatedPtrField<cluster::DeviceInfo>* devices) const {
    if (local_ == nullptr) return;
    cluster::DeviceInfo* d = devices->Add();
    d->set_device(0);
    d->set_capacity_bytes(int64_t(local_->capacity_bytes()));
    d->set_used_bytes(int64_t(local_->used_bytes()));
    d->set_sessions(local_->sessions());
    d->set_cores(1);
  }

  void Fill(google::protobuf::Map<std::string, double>* stats) const {
    const DecodeStats s = loop_->stats();
    (*stats)["steps"] = double(s.steps);
    (*stats)["failed_steps"] = double(s.failed_steps);
    (*stats)["failed_requests"] = double(s.failed_requests);
    (*stats)["tokens_prefilled"] = double(s.tokens_prefilled);
    (*stats)["tokens_decoded"] = double(s.tokens_decoded);
    (*stats)["tokens_generated"] = double(s.tokens_generated);
    (*stats)["active_requests"] = double(s.active_requests);
    (*stats)["queued_requests"] = double(s.queued_requests);
    (*stats)["batch_size_mean"] = s.mean_batch_size;
    (*stats)["step_tokens_mean"] = s.mean_step_tokens;
    (*stats)["busy_seconds"] = s.busy_seconds;
    (*stats)["stalled_seconds"] = s.stalled_seconds;
    (*stats)["micro_batch_switches"] = double(s.switches);
    (*stats)["gpu_model_wait_seconds"] = s.model_wait_seconds;
    (*stats)["gpu_model_seconds"] = s.model_seconds;
    (*stats)["two_micro_batch_steps"] = double(s.two_micro_batch_steps);
    (*stats)["micro_batch_0_tokens"] = double(s.micro_batch_tokens[0]);
    (*stats)["micro_batch_1_tokens"] = double(s.micro_batch_tokens[1]);
    if (backend_ != nullptr) {
      (*stats)["data_bytes_sent"] = double(backend_->bytes_sent());
      (*stats)["data_bytes_received"] = double(backend_->bytes_received());
      (*stats)["frames_invalid"] = double(backend_->frames_invalid());
      for (const auto& [k, v] : backend_->Counters()) (*stats)[k] = v;
    }
    if (experts_ != nullptr) {
      experts_->ExportTo(stats);
      int owned = 0;
      for (int owner : runner_->ExpertOwners())
        owned += owner == runner_->rank();
      (*stats)["experts_owned"] = double(owned);
      (*stats)["experts_held"] = double(runner_->HeldExperts().size());
    }
    (*stats)["weight_bytes"] =
        double(WeightBytesWith(*runner_, runner_->HeldExperts()));
    if (local_ != nullptr) {
      (*stats)["kv_used_bytes"] = double(local_->used_bytes());
      (*stats)["kv_capacity_bytes"] = double(local_->capacity_bytes());
    }
    if (links_ != nullptr) links_->stats()->ExportTo(stats);
  }

 private:
  LinkEmulator* links_ = nullptr;
  std::atomic<uint32_t> node_id_{0};
  const GpuNodeOptions* const options_;
  ModelRunner* const runner_;
  absl::Mutex set_peers_mu_;  // one SetPeers at a time
  DecodeLoop* const loop_;
  RemoteAttentionBackend* const backend_;
  GpuLocalAttention* const local_;
  ExpertParallel* const experts_;
  const int vocab_size_;
};

}  // namespace

std::string ModelFingerprint(const ModelFiles& files) {
  Fnv64 h;
  h.Add(ModelConfigToJson(files.config));
  for (const auto& [name, tensor] : files.tensors) {  // std::map: name order
    h.Add(name);
    for (int64_t d : tensor.shape) h.Add(&d, sizeof(d));
    h.Add(tensor.data.data(), tensor.data.size() * sizeof(float));
  }
  return absl::StrFormat("%016x", h.value());
}

struct GpuNodeDaemon::Impl {
  GpuNodeOptions options;
  std::unique_ptr<ModelRunner> runner;
  std::string fingerprint;
  std::unique_ptr<Transport> transport;
  LinkEmulator* links = nullptr;                    // == transport
  std::unique_ptr<RemoteAttentionBackend> backend;  // karat mode
  std::unique_ptr<GpuLocalAttention> local;         // gpu_only mode
  std::unique_ptr<DecodeLoop> loop;
  std::unique_ptr<GpuNodeService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<NodeRegistrar> registrar;
  std::string address;
  bool shut_down = false;
  // Set by the first successful registration (the registrar's thread).
  std::atomic<bool> registered_once{false};

  // Expert parallelism (ranks > 1).
  std::unique_ptr<ExpertParallel> experts;
  void OnMoeMessage(std::string_view message, PeerId from) {
    if (experts != nullptr) {
      experts->OnMessage(message, from);
    } else {
      KLOG(Warning, "gpu_node") << "dropping a MoE frame of " << message.size()
                                << " bytes: this node is the only GPU rank";
    }
  }
  ExpertSource ExpertSourceFn() {
    if (experts == nullptr) return nullptr;
    ExpertParallel* ep = experts.get();
    return
        [ep](int mb, WaitHooks* hooks) { return ep->ForMicroBatch(mb, hooks); };
  }
  void SetNodeId(uint32_t id) {
    if (experts != nullptr) experts->set_node_id(id);
  }
};

GpuNodeDaemon::GpuNodeDaemon() = default;
GpuNodeDaemon::~GpuNodeDaemon() { Shutdown(); }

const std::string& GpuNodeDaemon::grpc_address() const {
  return impl_->address;
}

absl::StatusOr<std::unique_ptr<GpuNodeDaemon>> GpuNodeDaemon::Start(
    const GpuNodeOptions& options) {
  if (options.model_dir.empty()) {
    return absl::InvalidArgumentError("no model directory (--model)");
  }
  if (options.max_step_tokens <= 0 || options.max_batch <= 0) {
    return absl::InvalidArgumentError(
        "--max-step-tokens and --max-batch must be > 0");
  }
  if (!(options.hbm_bandwidth_gbps >= 0) ||
      !std::isfinite(options.hbm_bandwidth_gbps)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--hbm-bandwidth-gbps must be a finite number >= 0, got ",
                     options.hbm_bandwidth_gbps));
  }
  if (!(options.tflops >= 0) || !std::isfinite(options.tflops)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tflops must be a finite number >= 0, got ", options.tflops));
  }
  if (options.spin_us < 0) {
    return absl::InvalidArgumentError("--spin-us must be >= 0");
  }
  std::unique_ptr<GpuNodeDaemon> daemon(new GpuNodeDaemon());
  daemon->impl_ = std::make_unique<Impl>();
  Impl* impl = daemon->impl_.get();
  impl->options = options;

  {
    ASSIGN_OR_RETURN(ModelFiles files, LoadModel(options.model_dir));
    impl->fingerprint = ModelFingerprint(files);
    if (options.rank < 0 || options.ranks < 1 ||
        options.rank >= options.ranks) {
      return absl::InvalidArgumentError(absl::StrCat("--rank ", options.rank,
                                                     " must be in [0, --ranks ",
                                                     options.ranks, ")"));
    }
    RunnerOptions runner;
    runner.rank = options.rank;
    runner.ranks = options.ranks;
    ASSIGN_OR_RETURN(impl->runner, ModelRunner::Create(files, runner));
  }
  const int64_t weight_bytes =
      RankWeightBytes(impl->runner->config(), options.rank, options.ranks);
  if (options.hbm_bytes > 0 && options.hbm_bytes < weight_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--hbm-bytes ", options.hbm_bytes, " cannot hold rank ",
                     options.rank, "'s ", weight_bytes, " bytes of weights"));
  }
  if (options.gpu_only && options.hbm_bytes <= 0) {
    return absl::InvalidArgumentError(
        "gpu_only mode needs --hbm-bytes (the emulated GPU memory that holds "
        "the weights and the KV)");
  }
  const int64_t kv_capacity = options.hbm_bytes - weight_bytes;
  KLOG(Info, "gpu_node") << "model " << options.model_dir << " loaded ("
                         << AttentionTypeName(
                                impl->runner->config().attention.type)
                         << ", " << impl->runner->config().num_hidden_layers
                         << " layers, fingerprint " << impl->fingerprint << ")";

  ASSIGN_OR_RETURN(
      std::unique_ptr<LinkEmulator> links,
      OpenDataPlane(options.provider, options.fabric_node,
                    options.send_timeout_ms, options.spin_us, options.name));
  impl->links = links.get();
  impl->transport = std::move(links);
  StepBackend* step_backend = nullptr;
  if (options.gpu_only) {
    ASSIGN_OR_RETURN(
        MethodWeights weights,
        LoadMethodWeights(options.model_dir, impl->runner->config()));
    ASSIGN_OR_RETURN(impl->local,
                     GpuLocalAttention::Create(impl->runner->config(), weights,
                                               options.tokens_per_page,
                                               size_t(kv_capacity)));
    step_backend = impl->local.get();
  } else {
    RemoteAttentionOptions remote;
    remote.timeout = options.attention_timeout;
    impl->backend = std::make_unique<RemoteAttentionBackend>(
        impl->runner->shapes(), impl->transport.get(), remote,
        /*install_handler=*/false);
    step_backend = impl->backend.get();
  }
  if (options.ranks > 1) {
    ExpertParallelOptions ep;
    ep.timeout = options.attention_timeout;
    impl->experts = std::make_unique<ExpertParallel>(impl->runner.get(),
                                                     impl->transport.get(), ep);
  }
  // One receive handler for the node: attention frames to the remote
  // attention backend, MoE frames to the expert-parallel service.
  impl->transport->SetPeerReceiveHandler([impl](PeerId from,
                                                std::string_view message) {
    const uint16_t type = PeekFrameType(message);
    if (type == static_cast<uint16_t>(FrameType::kMoeDispatch) ||
        type == static_cast<uint16_t>(FrameType::kMoeCombine)) {
      impl->OnMoeMessage(message, from);
    } else if (impl->backend != nullptr) {
      impl->backend->OnMessage(message, from);
    } else {
      KLOG(Warning, "gpu_node")
          << "dropping a " << FrameTypeName(type) << " frame from "
          << impl->transport->PeerName(from) << ": attention runs on this rank";
    }
  });

  DecodeLoopOptions loop;
  loop.max_step_tokens = options.max_step_tokens;
  loop.max_batch = options.max_batch;
  loop.threads = options.threads;
  loop.micro_batches = options.micro_batches;
  ASSIGN_OR_RETURN(loop.schedule, ParseSchedule(options.schedule));
  loop.timing.bandwidth_gbps = options.hbm_bandwidth_gbps;
  loop.timing.tflops = options.tflops;
  if (loop.timing.enabled()) {
    KLOG(Info, "gpu_node") << "timing model: HBM " << options.hbm_bandwidth_gbps
                           << " GB/s, " << options.tflops
                           << " TFLOP/s (0: term left out)";
  }
  impl->loop = std::make_unique<DecodeLoop>(impl->runner.get(), step_backend,
                                            loop, impl->ExpertSourceFn());
  // Other ranks' dispatches are computed on this rank's worker. The
  // service thread stops (experts is destroyed) before the loop.
  if (impl->experts != nullptr)
    impl->experts->set_service_gate(impl->loop->service_gate());
  impl->loop->Start();

  impl->service = std::make_unique<GpuNodeService>(
      &impl->options, impl->runner.get(), impl->loop.get(), impl->backend.get(),
      impl->local.get(), impl->experts.get());
  impl->service->set_links(impl->links);
  ASSIGN_OR_RETURN(NodeGrpcServer grpc_server,
                   StartNodeGrpcServer(impl->service.get(), options.listen,
                                       options.tls));
  impl->server = std::move(grpc_server.server);
  impl->address = std::move(grpc_server.address);
  KLOG(Info, "gpu_node") << options.name << " listening on " << impl->address
                         << ", max_step_tokens " << options.max_step_tokens
                         << ", max_batch " << options.max_batch;

  RegistrarOptions reg;
  reg.coordinator = options.coordinator;
  reg.interval = options.heartbeat_interval;
  reg.log_module = "gpu_node";
  reg.make_request = [impl] {
    // gpu_only: registering again means the coordinator restarted or
    // dropped this node; the sessions whose KV is here are no longer counted
    // by it (DESIGN.md §7: their KV is rebuilt where they are placed next),
    // so their pages go now, before the registration lets it place new ones.
    if (impl->registered_once.load()) impl->service->set_node_id(0);
    if (impl->local != nullptr && impl->registered_once.load()) {
      const int freed = impl->local->FreeAll();
      if (freed > 0) {
        KLOG(Info, "gpu_node")
            << "registering again: freed the KV of " << freed
            << " sessions placed by the previous registration";
      }
    }
    cluster::RegisterNodeRequest r;
    r.set_name(impl->options.name);
    r.set_role("gpu");
    r.set_grpc_address(impl->address);
    r.set_fabric_address(impl->transport->LocalAddress());
    r.set_provider(impl->options.provider);
    r.set_model_fingerprint(impl->fingerprint);
    r.set_rank(impl->options.rank);
    r.set_ranks(impl->options.ranks);
    r.set_routed_experts(impl->runner->config().n_routed_experts);
    if (impl->local != nullptr) {
      r.set_kv_capacity_bytes(int64_t(impl->local->capacity_bytes()));
    }
    impl->service->FillDevices(r.mutable_devices());
    return r;
  };
  reg.fill_heartbeat = [impl](cluster::HeartbeatRequest* r) {
    impl->service->Fill(r->mutable_stats());
    impl->service->FillDevices(r->mutable_devices());
  };
  reg.on_registered = [impl](const cluster::RegisterNodeResponse& response) {
    const uint32_t id = response.node_id();
    impl->registered_once = true;
    // The data-plane secret first: the handshakes under the new id carry
    // proofs made with it, and the other ranks' frames are checked.
    const std::string& secret = response.data_plane_secret();
    if (impl->backend) impl->backend->set_data_plane_secret(secret);
    if (impl->experts) impl->experts->set_authenticated(!secret.empty());
    impl->service->set_node_id(id);
    if (impl->backend) impl->backend->set_node_id(id);
    impl->SetNodeId(id);
    KLOG(Info, "gpu_node") << "ready: " << impl->options.name
                           << " node_id=" << id << " grpc=" << impl->address;
  };
  ASSIGN_OR_RETURN(impl->registrar,
                   AnnounceNode(options.name, impl->address, options.port_file,
                                options.tls,
                                std::move(reg)));
  return daemon;
}

void GpuNodeDaemon::Shutdown() {
  Impl* impl = impl_.get();
  if (impl == nullptr || impl->shut_down) return;
  impl->shut_down = true;
  KLOG(Info, "gpu_node") << impl->options.name << " shutting down";
  // Running turns end first (UNAVAILABLE), so their RunTurn calls return
  // and the server can drain.
  if (impl->backend) impl->backend->Abort();
  if (impl->experts) impl->experts->Abort();
  if (impl->loop) impl->loop->Stop();
  if (impl->server) {
    impl->server->Shutdown(std::chrono::system_clock::now() +
                           std::chrono::seconds(2));
    impl->server->Wait();
  }
  if (impl->registrar) impl->registrar->Stop();
  if (impl->transport) impl->transport->Shutdown();
}

}  // namespace karat
