// karat-gpu-node: parses flags into GpuNodeOptions and runs the daemon until
// SIGINT or SIGTERM.
#include <cstdint>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/time/time.h"
#include "common/node_daemon.h"
#include "gpu_node/gpu_node.h"

namespace {

constexpr char kUsage[] =
    "usage: karat-gpu-node --model DIR [--coordinator HOST:PORT]\n"
    "  (--tls-ca FILE --tls-cert-dir DIR | --plaintext) (TLS: the cluster's\n"
    "  CA, and the folder of NAME.crt / NAME.key; --plaintext: no TLS)\n"
    "  [--listen HOST:PORT] [--name NAME] [--provider shm|tcp]\n"
    "  [--fabric-node ADDR] [--max-step-tokens N] [--max-batch N]\n"
    "  [--threads N] [--attention-timeout-ms N] [--send-timeout-ms N]\n"
    "  [--rank R --ranks G] [--mode karat|gpu_only] [--hbm-bytes N]\n"
    "  [--micro-batches 1|2] [--schedule ofms|scms]\n"
    "  [--hbm-bandwidth-gbps GBPS] [--tflops TFLOPS]\n"
    "  [--port-file PATH] [--spin-us N] (data plane: poll this long after\n"
    "  traffic before sleeping; default 1000, 0 never)\n"
    "  [--log-level debug|info|warning|error]\n";

karat::GpuNodeOptions ParseFlags(int argc, char** argv) {
  const karat::NodeFlagParser parser("karat-gpu-node", kUsage);
  karat::GpuNodeOptions o;
  parser.Parse(
      argc, argv, karat::NodeFlagsOf(&o),
      [&](const std::string& flag, const std::string& value) {
        if (flag == "--max-step-tokens") {
          o.max_step_tokens = parser.PositiveInt(flag, value);
        } else if (flag == "--max-batch") {
          o.max_batch = parser.PositiveInt(flag, value);
        } else if (flag == "--threads") {
          o.threads = parser.PositiveInt(flag, value);
        } else if (flag == "--rank") {
          int64_t rank = 0;
          if (!absl::SimpleAtoi(value, &rank) || rank < 0) {
            parser.BadFlag(flag, "must be an integer >= 0");
          }
          o.rank = int(rank);
        } else if (flag == "--ranks") {
          o.ranks = parser.PositiveInt(flag, value);
        } else if (flag == "--mode") {
          if (value != "karat" && value != "gpu_only") {
            parser.BadFlag(flag, "must be karat or gpu_only");
          }
          o.gpu_only = value == "gpu_only";
        } else if (flag == "--hbm-bytes") {
          if (!absl::SimpleAtoi(value, &o.hbm_bytes) || o.hbm_bytes < 0) {
            parser.BadFlag(flag, "must be a byte count >= 0");
          }
        } else if (flag == "--micro-batches") {
          o.micro_batches = parser.PositiveInt(flag, value);
          if (o.micro_batches > 2) {
            parser.BadFlag(flag, "must be 1 or 2");
          }
        } else if (flag == "--schedule") {
          if (value != "ofms" && value != "scms") {
            parser.BadFlag(flag, "must be ofms or scms");
          }
          o.schedule = value;
        } else if (flag == "--hbm-bandwidth-gbps") {
          o.hbm_bandwidth_gbps = parser.NonNegativeDouble(flag, value);
        } else if (flag == "--tflops") {
          o.tflops = parser.NonNegativeDouble(flag, value);
        } else if (flag == "--attention-timeout-ms") {
          o.attention_timeout =
              absl::Milliseconds(parser.PositiveInt(flag, value));
        } else {
          return false;
        }
        return true;
      });
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const karat::GpuNodeOptions options = ParseFlags(argc, argv);
  return karat::RunUntilSignal<karat::GpuNodeDaemon>(
      "gpu_node", [&] { return karat::GpuNodeDaemon::Start(options); });
}
