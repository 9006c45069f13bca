// karat-gpu-node: parses flags into GpuNodeOptions and runs the daemon until
// SIGINT or SIGTERM.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/log.h"
#include "gpu_node/gpu_node.h"

namespace {

constexpr char kUsage[] =
    "usage: karat-gpu-node --model DIR [--coordinator HOST:PORT]\n"
    "  [--listen HOST:PORT] [--name NAME] [--provider shm|tcp]\n"
    "  [--fabric-node ADDR] [--max-step-tokens N] [--max-batch N]\n"
    "  [--threads N] [--attention-timeout-ms N] [--send-timeout-ms N]\n"
    "  [--port-file PATH]\n"
    "  [--log-level debug|info|warning|error]\n";

[[noreturn]] void BadFlag(const std::string& flag, const std::string& why) {
  std::fprintf(stderr, "karat-gpu-node: %s: %s\n", flag.c_str(), why.c_str());
  std::exit(2);
}

int PositiveInt(const std::string& flag, const std::string& value) {
  int v = 0;
  if (!absl::SimpleAtoi(value, &v) || v <= 0) {
    BadFlag(flag, "expected a positive integer, got '" + value + "'");
  }
  return v;
}

karat::GpuNodeOptions ParseFlags(int argc, char** argv) {
  karat::GpuNodeOptions o;
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
    } else if (flag == "--max-step-tokens") {
      o.max_step_tokens = PositiveInt(flag, value);
    } else if (flag == "--max-batch") {
      o.max_batch = PositiveInt(flag, value);
    } else if (flag == "--threads") {
      o.threads = PositiveInt(flag, value);
    } else if (flag == "--attention-timeout-ms") {
      o.attention_timeout = absl::Milliseconds(PositiveInt(flag, value));
    } else if (flag == "--send-timeout-ms") {
      o.send_timeout_ms = PositiveInt(flag, value);
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
  const karat::GpuNodeOptions options = ParseFlags(argc, argv);
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
  auto daemon = karat::GpuNodeDaemon::Start(options);
  if (!daemon.ok()) {
    KLOG(Error, "gpu_node") << "cannot start: " << daemon.status();
    return 1;
  }
  int signal = 0;
  sigwait(&signals, &signal);
  KLOG(Info, "gpu_node") << "signal " << signal << " received";
  (*daemon)->Shutdown();
  return 0;
}
