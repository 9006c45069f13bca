// karat-node: parses flags into KaratNodeOptions and runs the daemon until
// SIGINT or SIGTERM.
#include <string>

#include "absl/strings/numbers.h"
#include "common/node_daemon.h"
#include "karat_node/karat_node.h"

namespace {

constexpr char kUsage[] =
    "usage: karat-node --model DIR [--coordinator HOST:PORT]\n"
    "  (--tls-ca FILE --tls-cert-dir DIR | --plaintext) (TLS: the cluster's\n"
    "  CA, and the folder of NAME.crt / NAME.key; --plaintext: no TLS)\n"
    "  [--listen HOST:PORT] [--name NAME] [--provider shm|tcp]\n"
    "  [--fabric-node ADDR] [--devices N] [--device-capacity BYTES]\n"
    "  [--cores N] [--tokens-per-page N] [--port-file PATH]\n"
    "  [--device-bandwidth-gbps GBPS] [--device-tflops TFLOPS]\n"
    "  [--spill on|off] (pages spill to other devices when the home is full)\n"
    "  [--send-timeout-ms N] [--spin-us N] (data plane: poll this long after\n"
    "  traffic before sleeping; default 1000, 0 never)\n"
    "  [--inline-max-context N] (decode frames of contexts up to N tokens\n"
    "  run on the receive thread when their device is idle; default 4096,\n"
    "  0 never)\n"
    "  [--log-level debug|info|warning|error]\n";

karat::KaratNodeOptions ParseFlags(int argc, char** argv) {
  const karat::NodeFlagParser parser("karat-node", kUsage);
  karat::KaratNodeOptions o;
  parser.Parse(
      argc, argv, karat::NodeFlagsOf(&o),
      [&](const std::string& flag, const std::string& value) {
        if (flag == "--devices") {
          o.devices = parser.PositiveInt(flag, value);
        } else if (flag == "--device-capacity") {
          auto bytes = karat::ParseByteSize(value);
          if (!bytes.ok() || *bytes == 0) {
            const std::string want = "expected a byte size such as 512M or 2G";
            parser.BadFlag(flag, want + ", got '" + value + "'");
          }
          o.device_capacity_bytes = *bytes;
        } else if (flag == "--cores") {
          o.cores = parser.PositiveInt(flag, value);
        } else if (flag == "--device-bandwidth-gbps") {
          o.device_bandwidth_gbps = parser.NonNegativeDouble(flag, value);
        } else if (flag == "--device-tflops") {
          o.device_tflops = parser.NonNegativeDouble(flag, value);
        } else if (flag == "--spill") {
          if (value != "on" && value != "off") {
            parser.BadFlag(flag, "expected on or off, got '" + value + "'");
          }
          o.spill = value == "on";
        } else if (flag == "--inline-max-context") {
          o.inline_max_context = parser.NonNegativeInt(flag, value);
        } else if (flag == "--tokens-per-page") {
          o.tokens_per_page = parser.PositiveInt(flag, value);
        } else {
          return false;
        }
        return true;
      });
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const karat::KaratNodeOptions options = ParseFlags(argc, argv);
  return karat::RunUntilSignal<karat::KaratNodeDaemon>(
      "karat_node", [&] { return karat::KaratNodeDaemon::Start(options); });
}
