// karat-node: parses flags into KaratNodeOptions and runs the daemon until
// SIGINT or SIGTERM.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"
#include "karat_node/karat_node.h"

namespace {

constexpr char kUsage[] =
    "usage: karat-node --model DIR [--coordinator HOST:PORT]\n"
    "  [--listen HOST:PORT] [--name NAME] [--provider shm|tcp]\n"
    "  [--fabric-node ADDR] [--devices N] [--device-capacity BYTES]\n"
    "  [--cores N] [--tokens-per-page N] [--port-file PATH]\n"
    "  [--device-bandwidth-gbps GBPS] [--device-tflops TFLOPS]\n"
    "  [--send-timeout-ms N] [--log-level debug|info|warning|error]\n";

[[noreturn]] void BadFlag(const std::string& flag, const std::string& why) {
  std::fprintf(stderr, "karat-node: %s: %s\n", flag.c_str(), why.c_str());
  std::exit(2);
}

int PositiveInt(const std::string& flag, const std::string& value) {
  int v = 0;
  if (!absl::SimpleAtoi(value, &v) || v <= 0) {
    BadFlag(flag, "expected a positive integer, got '" + value + "'");
  }
  return v;
}

double NonNegativeDouble(const std::string& flag, const std::string& value) {
  double v = 0;
  if (!absl::SimpleAtod(value, &v) || !(v >= 0) || v > 1e12) {
    BadFlag(flag, "expected a non-negative number, got '" + value + "'");
  }
  return v;
}

karat::KaratNodeOptions ParseFlags(int argc, char** argv) {
  karat::KaratNodeOptions o;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (arg.rfind("--", 0) != 0) BadFlag(arg, "unexpected argument");
    std::string flag = arg, value;
    const size_t eq = arg.find('=');
    if (eq != std::string::npos) {
      flag = arg.substr(0, eq);
      value = arg.substr(eq + 1);
    } else {
      if (i + 1 >= argc) BadFlag(flag, "missing value");
      value = argv[++i];
    }
    if (flag == "--coordinator") {
      o.coordinator = value;
    } else if (flag == "--listen") {
      if (value.find(':') == std::string::npos) {
        BadFlag(flag, "expected HOST:PORT, got '" + value + "'");
      }
      o.listen = value;
    } else if (flag == "--name") {
      if (value.empty()) BadFlag(flag, "must not be empty");
      o.name = value;
    } else if (flag == "--model") {
      o.model_dir = value;
    } else if (flag == "--provider") {
      if (value.empty()) BadFlag(flag, "must not be empty");
      o.provider = value;
    } else if (flag == "--fabric-node") {
      o.fabric_node = value;
    } else if (flag == "--devices") {
      o.devices = PositiveInt(flag, value);
    } else if (flag == "--device-capacity") {
      auto bytes = karat::ParseByteSize(value);
      if (!bytes.ok() || *bytes == 0) {
        BadFlag(flag,
                "expected a byte size such as 512M or 2G, got '" + value + "'");
      }
      o.device_capacity_bytes = *bytes;
    } else if (flag == "--cores") {
      o.cores = PositiveInt(flag, value);
    } else if (flag == "--device-bandwidth-gbps") {
      o.device_bandwidth_gbps = NonNegativeDouble(flag, value);
    } else if (flag == "--device-tflops") {
      o.device_tflops = NonNegativeDouble(flag, value);
    } else if (flag == "--send-timeout-ms") {
      o.send_timeout_ms = PositiveInt(flag, value);
    } else if (flag == "--tokens-per-page") {
      o.tokens_per_page = PositiveInt(flag, value);
    } else if (flag == "--port-file") {
      o.port_file = value;
    } else if (flag == "--log-level") {
      karat::LogLevel level;
      if (!karat::ParseLogLevel(value, &level)) {
        BadFlag(flag,
                "expected debug, info, warning or error, got '" + value + "'");
      }
      karat::SetLogLevel(level);
    } else {
      BadFlag(flag, "unknown flag");
    }
  }
  if (o.model_dir.empty()) BadFlag("--model", "required");
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const karat::KaratNodeOptions options = ParseFlags(argc, argv);
  // Every thread inherits the blocked signals; main waits for them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  // Debian's abseil is built without NDEBUG: without this, every Mutex
  // lock also updates a process-wide lock-order graph (a global lock on the
  // data plane's hot path).
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  auto daemon = karat::KaratNodeDaemon::Start(options);
  if (!daemon.ok()) {
    KLOG(Error, "karat_node") << "cannot start: " << daemon.status();
    return 1;
  }
  int signal = 0;
  sigwait(&signals, &signal);
  KLOG(Info, "karat_node") << "signal " << signal << " received";
  (*daemon)->Shutdown();
  return 0;
}
