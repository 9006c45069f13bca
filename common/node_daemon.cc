#include "common/node_daemon.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"
#include "common/request_errors.h"
#include "common/transport.h"
#include "security/call_guards.h"

namespace karat {

NodeFlagParser::NodeFlagParser(std::string program, std::string usage)
    : program_(std::move(program)), usage_(std::move(usage)) {}

void NodeFlagParser::BadFlag(const std::string& flag,
                             const std::string& why) const {
  std::fprintf(stderr, "%s: %s: %s\n", program_.c_str(), flag.c_str(),
               why.c_str());
  std::exit(2);
}

int NodeFlagParser::PositiveInt(const std::string& flag,
                                const std::string& value) const {
  int v = 0;
  if (!absl::SimpleAtoi(value, &v) || v <= 0) {
    BadFlag(flag, "expected a positive integer, got '" + value + "'");
  }
  return v;
}

int NodeFlagParser::NonNegativeInt(const std::string& flag,
                                   const std::string& value) const {
  int v = 0;
  if (!absl::SimpleAtoi(value, &v) || v < 0) {
    BadFlag(flag, "expected a non-negative integer, got '" + value + "'");
  }
  return v;
}

double NodeFlagParser::NonNegativeDouble(const std::string& flag,
                                         const std::string& value) const {
  double v = 0;
  if (!absl::SimpleAtod(value, &v) || !(v >= 0) || v > 1e12) {
    BadFlag(flag, "expected a non-negative number, got '" + value + "'");
  }
  return v;
}

bool NodeFlagParser::ParseCommonFlag(const std::string& flag,
                                     const std::string& value,
                                     const NodeFlags& common) const {
  if (flag == "--coordinator") {
    *common.coordinator = value;
  } else if (flag == "--listen") {
    if (value.find(':') == std::string::npos) {
      BadFlag(flag, "expected HOST:PORT, got '" + value + "'");
    }
    *common.listen = value;
  } else if (flag == "--name") {
    if (value.empty()) BadFlag(flag, "must not be empty");
    *common.name = value;
  } else if (flag == "--model") {
    *common.model_dir = value;
  } else if (flag == "--provider") {
    if (value.empty()) BadFlag(flag, "must not be empty");
    *common.provider = value;
  } else if (flag == "--fabric-node") {
    *common.fabric_node = value;
  } else if (flag == "--send-timeout-ms") {
    *common.send_timeout_ms = PositiveInt(flag, value);
  } else if (flag == "--spin-us") {
    *common.spin_us = NonNegativeInt(flag, value);
  } else if (flag == "--tls-ca") {
    if (value.empty()) BadFlag(flag, "must not be empty");
    common.tls->ca_file = value;
  } else if (flag == "--tls-cert-dir") {
    if (value.empty()) BadFlag(flag, "must not be empty");
    cert_dir_ = value;
  } else if (flag == "--port-file") {
    *common.port_file = value;
  } else if (flag == "--log-level") {
    LogLevel level;
    if (!ParseLogLevel(value, &level)) {
      BadFlag(flag,
              "expected debug, info, warning or error, got '" + value + "'");
    }
    SetLogLevel(level);
  } else {
    return false;
  }
  return true;
}

void NodeFlagParser::Parse(
    int argc, char** argv, const NodeFlags& common,
    absl::FunctionRef<bool(const std::string& flag, const std::string& value)>
        parse_own) const {
  bool plaintext = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(usage_.c_str(), stdout);
      std::exit(0);
    }
    if (arg.rfind("--", 0) != 0) BadFlag(arg, "unexpected argument");
    if (arg == "--plaintext") {
      plaintext = true;
      continue;
    }
    std::string flag = arg, value;
    const size_t eq = arg.find('=');
    if (eq != std::string::npos) {
      flag = arg.substr(0, eq);
      value = arg.substr(eq + 1);
    } else {
      if (i + 1 >= argc) BadFlag(flag, "missing value");
      value = argv[++i];
    }
    if (!ParseCommonFlag(flag, value, common) && !parse_own(flag, value)) {
      BadFlag(flag, "unknown flag");
    }
  }
  if (common.model_dir->empty()) BadFlag("--model", "required");
  if (plaintext) {
    if (!common.tls->ca_file.empty() || !cert_dir_.empty())
      BadFlag("--plaintext", "contradicts --tls-ca / --tls-cert-dir");
    *common.tls = security::TlsOptions();
    common.tls->plaintext = true;
    return;
  }
  if (common.tls->ca_file.empty() || cert_dir_.empty())
    BadFlag("--tls-ca", "--tls-ca FILE and --tls-cert-dir DIR are required "
                        "(the cluster's CA and the folder of NAME.crt and "
                        "NAME.key; deploy/karat-certs makes them), or "
                        "--plaintext for a cluster without TLS");
  *common.tls = security::DaemonTlsOptions(false, common.tls->ca_file,
                                           cert_dir_, *common.name);
}

namespace node_daemon_internal {
namespace {

sigset_t StopSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  return signals;
}

}  // namespace

void PrepareMainThread() {
  // Every thread inherits the blocked signals; main waits for them.
  const sigset_t signals = StopSignals();
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // Debian's abseil is built without NDEBUG: without this, every Mutex
  // lock also updates a process-wide lock-order graph (a global lock on the
  // data plane's hot path).
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
}

void WaitForSignal(const char* log_module) {
  const sigset_t signals = StopSignals();
  int signal = 0;
  sigwait(&signals, &signal);
  KLOG(Info, log_module) << "signal " << signal << " received";
}

void LogStartFailure(const char* log_module, const absl::Status& status) {
  KLOG(Error, log_module) << "cannot start: " << status;
}

}  // namespace node_daemon_internal

absl::StatusOr<std::unique_ptr<LinkEmulator>> OpenDataPlane(
    const std::string& provider, const std::string& fabric_node,
    int send_timeout_ms, int spin_us, const std::string& local_name) {
  FabricOptions fabric;
  fabric.provider = provider;
  fabric.node = DataPlaneBindNode(provider, fabric_node);
  fabric.send_timeout_ms = send_timeout_ms;
  fabric.spin_us = spin_us;
  fabric.use_rma = RmaPays(provider);
  absl::StatusOr<std::unique_ptr<Transport>> transport =
      OpenFabricTransport(fabric);
  if (!transport.ok()) {
    return absl::Status(transport.status().code(),
                        absl::StrCat("data plane (provider ", provider,
                                     "): ", transport.status().message()));
  }
  // Link emulation and per-link counters; rules arrive from the coordinator.
  LinkEmulatorOptions link_options;
  link_options.local_name = local_name;
  return std::make_unique<LinkEmulator>(std::move(transport).value(),
                                        link_options);
}

absl::StatusOr<NodeGrpcServer> StartNodeGrpcServer(
    grpc::Service* service, const std::string& listen,
    const security::TlsOptions& tls) {
  if (tls.plaintext)
    KLOG(Warning, "node")
        << "--plaintext: no TLS; this node takes calls from anyone who "
           "reaches " << listen << " (for tests only; docs/security.md)";
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds =
      security::ServerCredentials(tls,
                                  security::ClientCertificates::kRequestAndVerify,
                                  security::PeerNameGuard({"coordinator"}));
  if (!creds.ok()) return creds.status();
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  // With SO_REUSEPORT gRPC opens a listener per completion queue, and with
  // port 0 each picks a port of its own: the server would also answer on a
  // port nobody is told of. One listener, on the advertised port.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(listen, *creds, &port);
  builder.RegisterService(service);
  builder.experimental().SetInterceptorCreators(RequestErrorInterceptors());
  InstallProtobufLogLimiter();
  NodeGrpcServer started;
  started.server = builder.BuildAndStart();
  if (started.server == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", listen));
  }
  const size_t colon = listen.rfind(':');
  started.address = absl::StrCat(
      colon == std::string::npos ? listen : listen.substr(0, colon), ":", port);
  return started;
}

absl::StatusOr<std::unique_ptr<NodeRegistrar>> AnnounceNode(
    const std::string& name, const std::string& address,
    const std::string& port_file, const security::TlsOptions& tls,
    RegistrarOptions reg) {
  if (!port_file.empty()) {
    absl::Status written = WritePortFile(port_file, address);
    if (!written.ok()) return written;
  }
  if (reg.coordinator.empty()) {
    KLOG(Info, reg.log_module.c_str())
        << "ready (no coordinator): " << name << " at " << address;
    return std::unique_ptr<NodeRegistrar>();
  }
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> creds =
      security::ChannelCredentials(tls);
  if (!creds.ok()) return creds.status();
  reg.credentials = *creds;
  return NodeRegistrar::Start(std::move(reg));
}

}  // namespace karat
