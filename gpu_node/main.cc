// karat-gpu-node: parses flags into GpuNodeOptions and runs the daemon until
// SIGINT or SIGTERM.
#include <string>

#include "absl/time/time.h"
#include "common/node_daemon.h"
#include "gpu_node/gpu_node.h"

namespace {

constexpr char kUsage[] =
    "usage: karat-gpu-node --model DIR [--coordinator HOST:PORT]\n"
    "  [--listen HOST:PORT] [--name NAME] [--provider shm|tcp]\n"
    "  [--fabric-node ADDR] [--max-step-tokens N] [--max-batch N]\n"
    "  [--threads N] [--attention-timeout-ms N] [--send-timeout-ms N]\n"
    "  [--port-file PATH]\n"
    "  [--log-level debug|info|warning|error]\n";

karat::GpuNodeOptions ParseFlags(int argc, char** argv) {
  const karat::NodeFlagParser parser("karat-gpu-node", kUsage);
  karat::GpuNodeOptions o;
  parser.Parse(argc, argv, karat::NodeFlagsOf(&o),
               [&](const std::string& flag, const std::string& value) {
                 if (flag == "--max-step-tokens") {
                   o.max_step_tokens = parser.PositiveInt(flag, value);
                 } else if (flag == "--max-batch") {
                   o.max_batch = parser.PositiveInt(flag, value);
                 } else if (flag == "--threads") {
                   o.threads = parser.PositiveInt(flag, value);
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
