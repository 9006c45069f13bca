#include "coordinator/data_plane_bind.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace karat::coordinator {
namespace {

// The host part of HOST:PORT ("[::1]:5" -> "::1"); `listen` without a port
// as it is.
std::string HostOf(const std::string& listen) {
  if (!listen.empty() && listen.front() == '[') {
    const size_t close = listen.find(']');
    return close == std::string::npos ? listen : listen.substr(1, close - 1);
  }
  const size_t colon = listen.rfind(':');
  // More than one colon and no brackets: an IPv6 address without a port.
  if (colon == std::string::npos || listen.find(':') != colon) return listen;
  return listen.substr(0, colon);
}

}  // namespace

absl::StatusOr<std::string> DataPlaneBindAddress(
    const cluster::ClusterConfig& config, const std::string& listen,
    const std::string& fabric_node, const std::string& what) {
  const std::string& provider = config.provider();
  if (provider.empty() || provider == "shm") return std::string();
  if (!fabric_node.empty()) return fabric_node;
  if (provider != "tcp") return std::string();
  const std::string host = HostOf(listen);
  if (host.empty()) return std::string("127.0.0.1");
  if (host == "localhost") return std::string("127.0.0.1");
  if (host == "0.0.0.0" || host == "::" || host == "*") {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": listen ", listen,
        " names no interface for the data plane to bind to; set fabric_node "
        "to the address of the one its tcp data plane should use"));
  }
  return host;
}

}  // namespace karat::coordinator
