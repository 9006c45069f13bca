// `karatctl bench`: the closed-loop workload driver. N sessions run
// concurrently (one thread each), each sending its planned turns in order
// and waiting for each to finish (plus the think time) before the next.
#pragma once

#include <string>

#include "tools/karatctl/client.h"
#include "tools/karatctl/workload.h"

namespace karat::ctl {

struct BenchOptions {
  std::string trace;
  WorkloadOptions workload;
  float temperature = 0;
  std::string json_path;  // also write the figures here when set
};

// Runs the workload against `client`, printing progress to stderr about
// once a second and the report to stdout. Returns the process exit code:
// 0 when every turn succeeded, 1 when any failed, 2 for bad options/trace.
int RunBench(Client& client, const BenchOptions& options);

}  // namespace karat::ctl
