// Building blocks shared by the node daemons (karat-gpu-node, karat-node):
// the flags every node accepts, the signal loop of main(), the data plane
// (libfabric transport behind a LinkEmulator) and the gRPC server.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/link_emulation.h"
#include "common/membership.h"
#include "security/tls.h"

namespace karat {

// Where the flags shared by every node daemon are stored: each pointer
// refers to a field of the daemon's Options struct, so the daemon's own
// defaults stay in force for flags that are not given. All pointers must be
// non-null and outlive parsing.
struct NodeFlags {
  std::string* coordinator;  // --coordinator HOST:PORT
  std::string* listen;       // --listen HOST:PORT
  std::string* name;         // --name NAME (non-empty)
  std::string* model_dir;    // --model DIR (required)
  std::string* provider;     // --provider NAME (non-empty)
  std::string* fabric_node;  // --fabric-node ADDR
  std::string* port_file;    // --port-file PATH
  int* send_timeout_ms;      // --send-timeout-ms N (> 0)
  int* spin_us;              // --spin-us N (>= 0)
  // --tls-ca FILE --tls-cert-dir DIR (the certificate DIR/NAME.crt and key
  // DIR/NAME.key), or --plaintext; one of the two is required.
  security::TlsOptions* tls;
};

// Binds NodeFlags to the same-named fields of a daemon's Options.
template <typename Options>
NodeFlags NodeFlagsOf(Options* o) {
  return NodeFlags{&o->coordinator, &o->listen,          &o->name,
                   &o->model_dir,   &o->provider,        &o->fabric_node,
                   &o->port_file,   &o->send_timeout_ms, &o->spin_us,
                   &o->tls};
}

// Command-line parsing for a node daemon. Flags take their value either as
// `--flag=value` or as the next argument. Every error is one line on stderr,
// "<program>: <flag>: <why>", followed by exit(2); --help and -h print the
// usage text on stdout and exit(0). --log-level is applied at once (it sets
// the process-wide log level). Not thread-safe: meant for main() only.
class NodeFlagParser {
 public:
  // `program` prefixes error lines; `usage` is printed by --help.
  NodeFlagParser(std::string program, std::string usage);

  // Parses argv[1..argc). Shared flags are stored through `common`; any
  // other flag is passed to `parse_own(flag, value)`, which returns false
  // for a flag it does not know (reported as "unknown flag"). Fails with
  // "--model: required" when no model directory was given, and when neither
  // the TLS flags nor --plaintext were.
  void Parse(
      int argc, char** argv, const NodeFlags& common,
      absl::FunctionRef<bool(const std::string& flag, const std::string& value)>
          parse_own) const;

  // Reports a bad flag as described above and exits with status 2.
  [[noreturn]] void BadFlag(const std::string& flag,
                            const std::string& why) const;

  // `value` as an integer > 0, or BadFlag.
  int PositiveInt(const std::string& flag, const std::string& value) const;
  // `value` as an integer >= 0, or BadFlag.
  int NonNegativeInt(const std::string& flag, const std::string& value) const;
  // `value` as a number in [0, 1e12] (a rate of a timing model), or BadFlag.
  double NonNegativeDouble(const std::string& flag,
                           const std::string& value) const;

 private:
  // Handles one shared flag; false if `flag` is not one of them.
  bool ParseCommonFlag(const std::string& flag, const std::string& value,
                       const NodeFlags& common) const;

  std::string program_;
  std::string usage_;
  // --tls-cert-dir as given: the certificate's path needs --name, which may
  // come later.
  mutable std::string cert_dir_;
};

// The body of a node daemon's main(): blocks SIGINT and SIGTERM in every
// thread (so they are inherited by threads `start` creates), turns off
// abseil's mutex deadlock detection, calls `start`, then waits for one of
// the signals and calls Shutdown() on what `start` returned. Returns the
// process exit status: 1 when `start` fails (logged under `log_module`),
// 0 after a clean shutdown. `Daemon` needs a Shutdown() method.
template <typename Daemon>
int RunUntilSignal(
    const char* log_module,
    absl::FunctionRef<absl::StatusOr<std::unique_ptr<Daemon>>()> start);

// Opens the data plane of a node: a libfabric transport on `provider`
// (bound to DataPlaneBindNode(provider, fabric_node): `fabric_node` when
// non-empty, 127.0.0.1 for tcp without one) whose sends time out after
// `send_timeout_ms` and which polls for `spin_us` after traffic
// (FabricOptions), wrapped in a LinkEmulator that names this node
// `local_name`. An error names the provider.
absl::StatusOr<std::unique_ptr<LinkEmulator>> OpenDataPlane(
    const std::string& provider, const std::string& fabric_node,
    int send_timeout_ms, int spin_us, const std::string& local_name);

// A started gRPC server and the address it listens on.
struct NodeGrpcServer {
  std::unique_ptr<grpc::Server> server;
  // `listen`'s host with the port actually bound (port 0 picks one).
  std::string address;
};

// Starts a gRPC server for `service` (not owned; must outlive the server)
// on `listen`, with the default health-check service and server reflection
// enabled. With TLS (`tls` not plaintext) a caller may present a
// certificate (verified against the cluster's CA) and every call must come
// with the coordinator's (security::PeerNameGuard): the node services take
// calls from the coordinator only; anyone else gets UNAUTHENTICATED with
// the reason before any handler. UNAVAILABLE if the address cannot be bound; the TLS
// files' errors (security::ServerCredentials) as they are.
absl::StatusOr<NodeGrpcServer> StartNodeGrpcServer(
    grpc::Service* service, const std::string& listen,
    const security::TlsOptions& tls);

// Finishes a node's start once its gRPC server listens at `address`:
// writes the address to `port_file` (when non-empty); then, when
// `reg.coordinator` is empty, logs "ready (no coordinator)" under
// `reg.log_module` and returns nullptr (the node runs alone); otherwise
// starts registration and heartbeats with `reg` (see NodeRegistrar) over a
// channel with `tls`'s credentials (the node's certificate).
absl::StatusOr<std::unique_ptr<NodeRegistrar>> AnnounceNode(
    const std::string& name, const std::string& address,
    const std::string& port_file, const security::TlsOptions& tls,
    RegistrarOptions reg);

// Implementation details of RunUntilSignal.
namespace node_daemon_internal {
// Blocks SIGINT and SIGTERM and turns off deadlock detection.
void PrepareMainThread();
// Waits for SIGINT or SIGTERM and logs it under `log_module`.
void WaitForSignal(const char* log_module);
// Logs a failed start.
void LogStartFailure(const char* log_module, const absl::Status& status);
}  // namespace node_daemon_internal

template <typename Daemon>
int RunUntilSignal(
    const char* log_module,
    absl::FunctionRef<absl::StatusOr<std::unique_ptr<Daemon>>()> start) {
  node_daemon_internal::PrepareMainThread();
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = start();
  if (!daemon.ok()) {
    node_daemon_internal::LogStartFailure(log_module, daemon.status());
    return 1;
  }
  node_daemon_internal::WaitForSignal(log_module);
  (*daemon)->Shutdown();
  return 0;
}

}  // namespace karat
