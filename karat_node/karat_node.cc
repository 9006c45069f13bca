#include "karat_node/karat_node.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cctype>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "cluster.grpc.pb.h"
#include "common/attention.h"
#include "common/link_emulation.h"
#include "common/log.h"
#include "common/log_ids.h"
#include "common/membership.h"
#include "common/model_config.h"
#include "common/node_daemon.h"
#include "common/process_fault.h"
#include "common/status_macros.h"
#include "common/transport.h"
#include "karat_node/data_plane.h"

namespace karat {
namespace {

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()),
                      std::string(s.message()));
}

// Per-device metrics (busy time, frames, kernel and cross-device bytes,
// occupancy, spill) as "device.<i>.<name>" entries of a stats map.
void ExportDevices(const DataPlaneHandler& handler,
                   google::protobuf::Map<std::string, double>* out) {
  std::map<std::string, double> stats;
  for (int i = 0; i < handler.num_devices(); ++i) {
    ExportDeviceMetrics(handler.device(i)->index(),
                        handler.device(i)->Metrics(), &stats);
  }
  for (const auto& [k, v] : stats) (*out)[k] = v;
}

class KaratNodeService final : public cluster::KaratNode::Service {
 public:
  explicit KaratNodeService(DataPlaneHandler* handler) : handler_(handler) {}

  grpc::Status Reserve(grpc::ServerContext*,
                       const cluster::ReserveRequest* request,
                       cluster::ReserveResponse* response) override {
    absl::StatusOr<DataPlaneHandler::Reserved> used = handler_->Reserve(
        request->session(), request->device(), request->tokens(),
        request->turn_epoch(), request->kv_tokens());
    if (!used.ok()) {
      KLOG(Info, "karat_node")
          << "session=" << ShortKey(request->session()) << " reserve of "
          << request->tokens() << " tokens on device " << request->device()
          << " refused: " << used.status();
      return ToGrpc(used.status());
    }
    KLOG(Debug, "karat_node")
        << "session=" << ShortKey(request->session()) << " reserved "
        << request->tokens() << " tokens on device " << request->device()
        << " (device used " << used->used_bytes << " bytes)";
    response->set_used_bytes(used->used_bytes);
    response->set_kv_dropped(used->kv_dropped);
    response->set_session_bytes(used->session_bytes);
    return grpc::Status::OK;
  }

  grpc::Status FreeSession(grpc::ServerContext*,
                           const cluster::FreeSessionRequest* request,
                           cluster::FreeSessionResponse*) override {
    absl::Status s = handler_->FreeSession(request->session());
    KLOG(Info, "karat_node")
        << "session=" << ShortKey(request->session()) << " freed"
        << (s.ok() ? "" : ": ") << (s.ok() ? "" : s.ToString());
    return ToGrpc(s);
  }

  grpc::Status GetStats(grpc::ServerContext*, const cluster::StatsRequest*,
                        cluster::StatsResponse* response) override {
    for (const auto& [k, v] : handler_->Counters()) {
      (*response->mutable_stats())[k] = v;
    }
    ExportDevices(*handler_, response->mutable_stats());
    for (const auto& d : handler_->Devices()) *response->add_devices() = d;
    if (links_ != nullptr) links_->stats()->ExportTo(response->mutable_stats());
    response->set_node_id(handler_->node_id());
    return grpc::Status::OK;
  }

  grpc::Status InjectFault(grpc::ServerContext*,
                           const cluster::ProcessFaultRequest* request,
                           cluster::ProcessFaultResponse*) override {
    return ToGrpc(ScheduleProcessFault(request->action(), request->pause_ms()));
  }

  // Link emulation of the data plane. GPU nodes are known to the data plane
  // as "node-<id>"; the coordinator's id -> name map lets rules use names.
  // The same table, with the nodes' roles, says which node ids may greet
  // the data plane (karat_node/peer_admission.h).
  grpc::Status SetLinks(grpc::ServerContext*,
                        const cluster::SetLinksRequest* request,
                        cluster::SetLinksResponse*) override {
    AnnouncedNodes announced;
    for (const auto& [id, name] : request->node_names()) {
      auto role = request->node_roles().find(id);
      announced[id] = AnnouncedNode{
          name, role == request->node_roles().end() ? "" : role->second};
    }
    handler_->admission().SetAnnounced(std::move(announced));
    if (links_ == nullptr) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "no data plane");
    }
    absl::StatusOr<std::vector<LinkRule>> rules =
        LinkRulesFromProto(request->links());
    if (!rules.ok()) return ToGrpc(rules.status());
    if (request->seed() != 0) links_->SetSeed(request->seed());
    std::map<std::string, std::string> names;
    for (const auto& [id, name] : request->node_names()) {
      names[absl::StrCat("node-", id)] = name;
    }
    links_->SetPeerNames(std::move(names));
    return ToGrpc(links_->SetLinks(*std::move(rules)));
  }

  void set_links(LinkEmulator* links) { links_ = links; }

 private:
  DataPlaneHandler* const handler_;
  LinkEmulator* links_ = nullptr;
};

}  // namespace

absl::StatusOr<size_t> ParseByteSize(const std::string& text) {
  std::string t = absl::AsciiStrToUpper(text);
  for (const char* tail : {"IB", "B"}) {
    const std::string suffix(tail);
    if (t.size() > suffix.size() &&
        t.compare(t.size() - suffix.size(), suffix.size(), suffix) == 0) {
      t.resize(t.size() - suffix.size());
      break;
    }
  }
  uint64_t scale = 1;
  if (!t.empty() && std::isalpha(static_cast<unsigned char>(t.back()))) {
    switch (t.back()) {
      case 'K':
        scale = uint64_t(1) << 10;
        break;
      case 'M':
        scale = uint64_t(1) << 20;
        break;
      case 'G':
        scale = uint64_t(1) << 30;
        break;
      case 'T':
        scale = uint64_t(1) << 40;
        break;
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("'", text, "' is not a byte size (e.g. 512M, 2G)"));
    }
    t.pop_back();
  }
  uint64_t value = 0;
  if (t.empty() || !absl::SimpleAtoi(t, &value) ||
      value > std::numeric_limits<uint64_t>::max() / scale) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", text, "' is not a byte size (e.g. 512M, 2G)"));
  }
  return size_t(value * scale);
}

struct KaratNodeDaemon::Impl {
  KaratNodeOptions options;
  ModelConfig config;
  std::unique_ptr<Transport> transport;
  LinkEmulator* links = nullptr;  // == transport
  std::unique_ptr<DataPlaneHandler> handler;
  std::unique_ptr<KaratNodeService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<NodeRegistrar> registrar;
  std::string address;
  bool shut_down = false;
  // Set by the first successful registration (the registrar's thread).
  std::atomic<bool> registered_once{false};
  bool plaintext_warned = false;  // the registrar's thread

  cluster::RegisterNodeRequest MakeRegistration() const {
    cluster::RegisterNodeRequest r;
    r.set_name(options.name);
    r.set_role("karat");
    r.set_grpc_address(address);
    r.set_fabric_address(transport->LocalAddress());
    r.set_provider(options.provider);
    for (const auto& d : handler->Devices()) *r.add_devices() = d;
    return r;
  }

  void FillHeartbeat(cluster::HeartbeatRequest* r) const {
    for (const auto& d : handler->Devices()) *r->add_devices() = d;
    for (const auto& [k, v] : handler->Counters()) (*r->mutable_stats())[k] = v;
    ExportDevices(*handler, r->mutable_stats());
    if (links != nullptr) links->stats()->ExportTo(r->mutable_stats());
  }
};

KaratNodeDaemon::KaratNodeDaemon() = default;
KaratNodeDaemon::~KaratNodeDaemon() { Shutdown(); }

const std::string& KaratNodeDaemon::grpc_address() const {
  return impl_->address;
}

absl::StatusOr<std::unique_ptr<KaratNodeDaemon>> KaratNodeDaemon::Start(
    const KaratNodeOptions& options) {
  if (options.model_dir.empty()) {
    return absl::InvalidArgumentError("no model directory (--model)");
  }
  if (options.devices <= 0) {
    return absl::InvalidArgumentError("--devices must be > 0");
  }
  if (options.send_timeout_ms <= 0) {
    return absl::InvalidArgumentError("--send-timeout-ms must be > 0");
  }
  if (options.spin_us < 0) {
    return absl::InvalidArgumentError("--spin-us must be >= 0");
  }
  if (options.inline_max_context < 0) {
    return absl::InvalidArgumentError("--inline-max-context must be >= 0");
  }
  std::unique_ptr<KaratNodeDaemon> daemon(new KaratNodeDaemon());
  daemon->impl_ = std::make_unique<Impl>();
  Impl* impl = daemon->impl_.get();
  impl->options = options;
  ASSIGN_OR_RETURN(impl->config, LoadModelConfig(options.model_dir));

  ASSIGN_OR_RETURN(
      std::unique_ptr<LinkEmulator> links,
      OpenDataPlane(options.provider, options.fabric_node,
                    options.send_timeout_ms, options.spin_us, options.name));
  impl->links = links.get();
  impl->transport = std::move(links);

  DataPlaneOptions plane;
  plane.tokens_per_page = options.tokens_per_page;
  plane.inline_max_context = options.inline_max_context;
  plane.model_dir = options.model_dir;  // MagicPIG reads its hyperplanes
  // One memory for the node's devices: a full home device spills to the
  // others (DESIGN.md §3 "Placement").
  auto memory = options.spill ? std::make_shared<NodeMemory>() : nullptr;
  for (int i = 0; i < options.devices; ++i) {
    DeviceOptions device{options.device_capacity_bytes, options.cores};
    device.bandwidth_gbps = options.device_bandwidth_gbps;
    device.tflops = options.device_tflops;
    device.memory = memory;
    plane.devices.push_back(device);
  }
  ASSIGN_OR_RETURN(
      impl->handler,
      DataPlaneHandler::Create(impl->config, plane, impl->transport.get()));
  // No frame is taken before the registration says whether the cluster's
  // data plane is authenticated (and with which secret).
  impl->handler->admission().Close();

  impl->service = std::make_unique<KaratNodeService>(impl->handler.get());
  impl->service->set_links(impl->links);
  ASSIGN_OR_RETURN(NodeGrpcServer grpc_server,
                   StartNodeGrpcServer(impl->service.get(), options.listen,
                                       options.tls));
  impl->server = std::move(grpc_server.server);
  impl->address = std::move(grpc_server.address);
  KLOG(Info, "karat_node") << options.name << " listening on " << impl->address
                           << ", " << options.devices << " devices of "
                           << impl->handler->device(0)->capacity_bytes()
                           << " bytes, " << options.cores << " cores each, "
                           << options.tokens_per_page << " tokens per page"
                           << (options.spill ? ""
                                             : ", no spill across devices");
  KLOG(Info, "karat_node") << "kernels: " << KernelUnitsDescription();

  RegistrarOptions reg;
  reg.coordinator = options.coordinator;
  reg.interval = options.heartbeat_interval;
  reg.log_module = "karat_node";
  reg.make_request = [impl] {
    // Registering again: the coordinator restarted, or dropped this node.
    // Either way no coordinator counts the sessions held here any more and
    // none will free them (DESIGN.md §7: a session whose home is gone is
    // placed again and its KV rebuilt), so their pages go now, before the
    // registration lets the coordinator place new ones.
    if (impl->registered_once.load()) {
      // Until the coordinator answers, the node has no registration (a
      // probe's GetStats says 0).
      impl->handler->set_node_id(0);
      const int freed = impl->handler->FreeAllSessions();
      if (freed > 0) {
        KLOG(Info, "karat_node")
            << "registering again: freed the KV of " << freed
            << " sessions placed by the previous registration";
      }
    }
    return impl->MakeRegistration();
  };
  reg.fill_heartbeat = [impl](cluster::HeartbeatRequest* r) {
    impl->FillHeartbeat(r);
  };
  reg.on_registered = [impl](const cluster::RegisterNodeResponse& response) {
    const uint32_t id = response.node_id();
    impl->registered_once = true;
    // The secret before the id: a hello to the new id needs it.
    impl->handler->admission().SetSecret(response.data_plane_secret());
    if (response.data_plane_secret().empty() && !impl->plaintext_warned) {
      impl->plaintext_warned = true;
      KLOG(Warning, "karat_node")
          << "the coordinator gave no data-plane secret (plaintext mode): "
             "data-plane hellos are taken without proof";
    }
    impl->handler->set_node_id(id);
    KLOG(Info, "karat_node") << "ready: " << impl->options.name
                             << " node_id=" << id << " grpc=" << impl->address;
  };
  ASSIGN_OR_RETURN(impl->registrar,
                   AnnounceNode(options.name, impl->address, options.port_file,
                                options.tls,
                                std::move(reg)));
  return daemon;
}

void KaratNodeDaemon::Shutdown() {
  Impl* impl = impl_.get();
  if (impl == nullptr || impl->shut_down) return;
  impl->shut_down = true;
  KLOG(Info, "karat_node") << impl->options.name << " shutting down";
  if (impl->server) {
    impl->server->Shutdown(std::chrono::system_clock::now() +
                           std::chrono::seconds(2));
    impl->server->Wait();
  }
  if (impl->registrar) impl->registrar->Stop();
  // Workers finish their queued frames (replies still go out) before the
  // endpoint closes; frames arriving meanwhile are dropped.
  if (impl->handler) impl->handler->Stop();
  if (impl->transport) impl->transport->Shutdown();
}

}  // namespace karat
