// karat-coordinator: flags -> Options -> Coordinator.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>

#include "absl/strings/numbers.h"
#include "common/log.h"
#include "coordinator/cluster_config.h"
#include "coordinator/coordinator.h"

namespace {

constexpr char kUsage[] =
    "usage: karat-coordinator [--config FILE] [--model DIR] [--listen "
    "HOST:PORT]\n"
    "                         [--port-file PATH] [--log-level LEVEL]\n"
    "                         [--max-new-tokens-limit N] [--state-dir DIR]\n"
    "                         [--tls-dir DIR | --plaintext]\n"
    "                         [--admin-port-file PATH] [--admin-listen "
    "HOST:PORT]\n"
    "  --tls-dir DIR    TLS and credentials (docs/security.md): DIR/ca.crt,\n"
    "                   DIR/coordinator.crt and .key, DIR/client.tokens,\n"
    "                   DIR/admin.tokens (deploy/karat-certs makes them),\n"
    "                   for what the config's `security` does not name.\n"
    "                   One of the two, or the config's security block, is\n"
    "                   required.\n"
    "  --plaintext      no TLS, no credentials: every caller is trusted (as\n"
    "                   the config's security.plaintext; for tests)\n"
    "  --admin-port-file PATH  where the admin API's bound address is\n"
    "                   written\n"
    "  --admin-listen HOST:PORT  the admin API's address (default: the\n"
    "                   config's security.admin_listen, else 127.0.0.1:0)\n"
    "  --model DIR      the model the config is checked against (experts per\n"
    "                   GPU rank, hbm_bytes); default: the config's model_dir\n"
    "  --state-dir DIR  keep a write-ahead log of the sessions in DIR\n"
    "                   (created when missing; default: the config's\n"
    "                   coordinator.state_dir, else none). A coordinator\n"
    "                   restarted on the same DIR serves the same sessions\n"
    "                   with their token logs; their KV is rebuilt at each\n"
    "                   one's next turn, and a turn running at the restart\n"
    "                   fails. Link rules set through the admin API are\n"
    "                   logged too and replace the config's at the next\n"
    "                   start. Without it sessions end with the process.\n";

[[noreturn]] void UsageError(const std::string& message) {
  std::fprintf(stderr, "karat-coordinator: %s\n%s", message.c_str(), kUsage);
  std::exit(2);
}

bool WriteFileAtomically(const std::string& path, const std::string& text) {
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) return false;
    out << text << "\n";
    if (!out.good()) return false;
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string config_path, model_dir, listen, port_file, state_dir,
      log_level = "info", tls_dir, admin_port_file, admin_listen;
  bool plaintext = false;
  int max_new_tokens_limit = 0;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    bool has_value = false;
    if (auto eq = arg.find('=');
        arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    auto next = [&]() -> std::string {
      if (has_value) return value;
      if (i + 1 >= argc) UsageError(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--config")
      config_path = next();
    else if (arg == "--plaintext" && !has_value)
      plaintext = true;
    else if (arg == "--tls-dir")
      tls_dir = next();
    else if (arg == "--admin-port-file")
      admin_port_file = next();
    else if (arg == "--admin-listen")
      admin_listen = next();
    else if (arg == "--model")
      model_dir = next();
    else if (arg == "--listen")
      listen = next();
    else if (arg == "--port-file")
      port_file = next();
    else if (arg == "--state-dir") {
      state_dir = next();
      if (state_dir.empty()) UsageError("--state-dir needs a directory");
    } else if (arg == "--log-level")
      log_level = next();
    else if (arg == "--max-new-tokens-limit") {
      std::string v = next();
      if (!absl::SimpleAtoi(v, &max_new_tokens_limit) ||
          max_new_tokens_limit < 1)
        UsageError("--max-new-tokens-limit must be a positive integer, got " +
                   v);
    } else if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    } else {
      UsageError("unknown flag " + arg);
    }
  }
  karat::LogLevel level;
  if (!karat::ParseLogLevel(log_level, &level))
    UsageError("unknown --log-level " + log_level);
  karat::SetLogLevel(level);

  karat::coordinator::Options options;
  if (!config_path.empty()) {
    auto config = karat::coordinator::LoadClusterConfig(config_path);
    if (!config.ok()) {
      std::fprintf(stderr, "karat-coordinator: %s\n",
                   std::string(config.status().message()).c_str());
      return 2;
    }
    const auto& c = config->coordinator();
    if (!c.listen().empty()) options.listen = c.listen();
    if (c.max_new_tokens_limit() > 0)
      options.max_new_tokens_limit = c.max_new_tokens_limit();
    if (c.heartbeat_interval_ms() > 0)
      options.heartbeat_interval_ms = c.heartbeat_interval_ms();
    if (c.node_timeout_ms() > 0) options.node_timeout_ms = c.node_timeout_ms();
    options.state_dir = c.state_dir();
    if (c.max_message_bytes() > 0)
      options.max_message_bytes = c.max_message_bytes();
    options.idle_kv_evict = absl::Seconds(config->security().idle_kv_evict_s());
    options.links.assign(config->links().begin(), config->links().end());
    if (config->link_seed() != 0) options.link_seed = config->link_seed();
    if (!config->mode().empty()) options.mode = config->mode();
    options.scheduling = config->scheduling();
    options.security = config->security();
    karat::cluster::SecurityConfig& sec = options.security;
    auto from_config = [&](const std::string& path) {
      return karat::coordinator::PathFromConfig(config_path, path);
    };
    sec.set_ca_cert(from_config(sec.ca_cert()));
    sec.set_cert_dir(from_config(sec.cert_dir()));
    sec.set_client_tokens(from_config(sec.client_tokens()));
    sec.set_admin_tokens(from_config(sec.admin_tokens()));
    for (const auto& g : config->gpu_nodes())
      options.max_batch_by_rank.push_back(g.max_batch());
    // A config that cannot work with its model is refused now, with the
    // reason, rather than by a GPU node later.
    if (model_dir.empty()) model_dir = config->model_dir();
    if (!model_dir.empty()) {
      absl::Status fits = karat::coordinator::CheckClusterConfigAgainstModel(
          *config, model_dir);
      if (fits.code() == absl::StatusCode::kNotFound) {
        KLOG(Warning, "coordinator") << fits.message()
                                     << "; the config is not checked against "
                                        "the model (pass --model DIR)";
      } else if (!fits.ok()) {
        std::fprintf(stderr, "karat-coordinator: %s: %s\n", config_path.c_str(),
                     std::string(fits.message()).c_str());
        return 2;
      }
    }
  } else if (!model_dir.empty()) {
    UsageError("--model needs --config");
  }
  if (!listen.empty()) options.listen = listen;
  if (max_new_tokens_limit > 0)
    options.max_new_tokens_limit = max_new_tokens_limit;
  if (!state_dir.empty()) options.state_dir = state_dir;
  if (config_path.empty()) options.security.set_plaintext(false);
  if (!admin_listen.empty()) options.security.set_admin_listen(admin_listen);
  {
    karat::cluster::SecurityConfig& sec = options.security;
    if (plaintext && !tls_dir.empty())
      UsageError("--plaintext contradicts --tls-dir");
    if (plaintext) sec.set_plaintext(true);
    if (!tls_dir.empty()) {
      auto fill = [&](const std::string& have, const char* file) {
        return have.empty() ? tls_dir + "/" + file : have;
      };
      sec.set_ca_cert(fill(sec.ca_cert(), "ca.crt"));
      if (sec.cert_dir().empty()) sec.set_cert_dir(tls_dir);
      sec.set_client_tokens(fill(sec.client_tokens(), "client.tokens"));
      sec.set_admin_tokens(fill(sec.admin_tokens(), "admin.tokens"));
    }
    if (!sec.plaintext() && (sec.ca_cert().empty() || sec.cert_dir().empty()))
      UsageError(
          "no TLS files: name them in the config's `security` block "
          "(ca_cert, cert_dir, client_tokens, admin_tokens) or pass "
          "--tls-dir DIR; a cluster without TLS says security.plaintext: "
          "true (or --plaintext)");
  }

  // Signals are taken synchronously by this thread; every other thread
  // inherits the blocked mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  auto coordinator = karat::coordinator::Coordinator::Start(options);
  if (!coordinator.ok()) {
    std::fprintf(stderr, "karat-coordinator: %s\n",
                 std::string(coordinator.status().message()).c_str());
    return 1;
  }
  // The admin address first: a launcher waits for the port file.
  if (!admin_port_file.empty() &&
      !WriteFileAtomically(admin_port_file, (*coordinator)->admin_address())) {
    std::fprintf(stderr, "karat-coordinator: cannot write %s\n",
                 admin_port_file.c_str());
    return 1;
  }
  if (!port_file.empty() &&
      !WriteFileAtomically(port_file, (*coordinator)->address())) {
    std::fprintf(stderr, "karat-coordinator: cannot write %s\n",
                 port_file.c_str());
    return 1;
  }
  int sig = 0;
  sigwait(&signals, &sig);
  KLOG(Info, "coordinator") << "signal " << sig << ": shutting down";
  (*coordinator)->Shutdown(absl::Seconds(5));
  return 0;
}
