#include "gpu_node/gpu_node.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cluster.grpc.pb.h"
#include "common/link_emulation.h"
#include "common/log.h"
#include "common/membership.h"
#include "common/model_runner.h"
#include "common/node_daemon.h"
#include "common/status_macros.h"
#include "common/transport.h"
#include "gpu_node/decode_loop.h"
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

class GpuNodeService final : public cluster::GpuNode::Service {
 public:
  GpuNodeService(DecodeLoop* loop, const RemoteAttentionBackend* backend,
                 int vocab_size)
      : loop_(loop), backend_(backend), vocab_size_(vocab_size) {}

  grpc::Status RunTurn(
      grpc::ServerContext* context, const cluster::RunTurnRequest* request,
      grpc::ServerWriter<cluster::RunTurnEvent>* writer) override {
    absl::Status valid = ValidateTurnRequest(*request, vocab_size_);
    if (!valid.ok()) {
      KLOG(Info, "gpu_node")
          << "session=" << request->session() << " RunTurn refused: " << valid;
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
            KLOG(Info, "gpu_node") << "session=" << request->session()
                                   << " RunTurn cancelled by the client";
            return grpc::Status(grpc::StatusCode::CANCELLED,
                                "cancelled by the client");
          }
          break;
        case TurnStream::Next::kFinished: {
          const absl::Status status = (*stream)->status();
          if (!status.ok()) {
            KLOG(Warning, "gpu_node") << "session=" << request->session()
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
    return grpc::Status::OK;
  }

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

  void Fill(google::protobuf::Map<std::string, double>* stats) const {
    const DecodeStats s = loop_->stats();
    (*stats)["steps"] = double(s.steps);
    (*stats)["failed_steps"] = double(s.failed_steps);
    (*stats)["tokens_prefilled"] = double(s.tokens_prefilled);
    (*stats)["tokens_decoded"] = double(s.tokens_decoded);
    (*stats)["tokens_generated"] = double(s.tokens_generated);
    (*stats)["active_requests"] = double(s.active_requests);
    (*stats)["queued_requests"] = double(s.queued_requests);
    (*stats)["batch_size_mean"] = s.mean_batch_size;
    (*stats)["step_tokens_mean"] = s.mean_step_tokens;
    (*stats)["data_bytes_sent"] = double(backend_->bytes_sent());
    (*stats)["data_bytes_received"] = double(backend_->bytes_received());
    (*stats)["frames_invalid"] = double(backend_->frames_invalid());
    if (links_ != nullptr) links_->stats()->ExportTo(stats);
  }

 private:
  LinkEmulator* links_ = nullptr;
  DecodeLoop* const loop_;
  const RemoteAttentionBackend* const backend_;
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
  LinkEmulator* links = nullptr;  // == transport
  std::unique_ptr<RemoteAttentionBackend> backend;
  std::unique_ptr<DecodeLoop> loop;
  std::unique_ptr<GpuNodeService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<NodeRegistrar> registrar;
  std::string address;
  bool shut_down = false;
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
  std::unique_ptr<GpuNodeDaemon> daemon(new GpuNodeDaemon());
  daemon->impl_ = std::make_unique<Impl>();
  Impl* impl = daemon->impl_.get();
  impl->options = options;

  {
    ASSIGN_OR_RETURN(ModelFiles files, LoadModel(options.model_dir));
    impl->fingerprint = ModelFingerprint(files);
    ASSIGN_OR_RETURN(impl->runner, ModelRunner::Create(files));
  }
  KLOG(Info, "gpu_node") << "model " << options.model_dir << " loaded ("
                         << AttentionTypeName(
                                impl->runner->config().attention.type)
                         << ", " << impl->runner->config().num_hidden_layers
                         << " layers, fingerprint " << impl->fingerprint << ")";

  ASSIGN_OR_RETURN(std::unique_ptr<LinkEmulator> links,
                   OpenDataPlane(options.provider, options.fabric_node,
                                 options.send_timeout_ms, options.name));
  impl->links = links.get();
  impl->transport = std::move(links);
  RemoteAttentionOptions remote;
  remote.timeout = options.attention_timeout;
  impl->backend = std::make_unique<RemoteAttentionBackend>(
      impl->runner->shapes(), impl->transport.get(), remote);

  DecodeLoopOptions loop;
  loop.max_step_tokens = options.max_step_tokens;
  loop.max_batch = options.max_batch;
  loop.threads = options.threads;
  impl->loop = std::make_unique<DecodeLoop>(impl->runner.get(),
                                            impl->backend.get(), loop);
  impl->loop->Start();

  impl->service = std::make_unique<GpuNodeService>(
      impl->loop.get(), impl->backend.get(), impl->runner->config().vocab_size);
  impl->service->set_links(impl->links);
  ASSIGN_OR_RETURN(NodeGrpcServer grpc_server,
                   StartNodeGrpcServer(impl->service.get(), options.listen));
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
    cluster::RegisterNodeRequest r;
    r.set_name(impl->options.name);
    r.set_role("gpu");
    r.set_grpc_address(impl->address);
    r.set_fabric_address(impl->transport->LocalAddress());
    r.set_provider(impl->options.provider);
    r.set_model_fingerprint(impl->fingerprint);
    return r;
  };
  reg.fill_heartbeat = [impl](cluster::HeartbeatRequest* r) {
    impl->service->Fill(r->mutable_stats());
  };
  reg.on_registered = [impl](uint32_t id) {
    impl->backend->set_node_id(id);
    KLOG(Info, "gpu_node") << "ready: " << impl->options.name
                           << " node_id=" << id << " grpc=" << impl->address;
  };
  ASSIGN_OR_RETURN(impl->registrar,
                   AnnounceNode(options.name, impl->address, options.port_file,
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
