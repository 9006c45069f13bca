// Process faults injected at run time through the coordinator's admin API
// (DESIGN.md §7): a node kills or pauses itself when told to.
#pragma once

#include <string>

#include "absl/status/status.h"

namespace karat {

// "kill": the process ends by SIGKILL, as in a crash. "pause": it is
// stopped by SIGSTOP and continues (SIGCONT) after `pause_ms`, as a process
// that hangs for a while.
inline constexpr int kMaxPauseMs = 600000;

// INVALID_ARGUMENT naming the field when `action` is not "kill" or "pause",
// or a pause's `pause_ms` is outside [1, kMaxPauseMs].
absl::Status ValidateProcessFault(const std::string& action, int pause_ms);

// Carries out a valid fault on this process after `delay_ms`, so that the
// answer to the request that asked for it goes out first. For a pause a
// child process is forked first; it sends the SIGCONT after the pause (the
// stopped process cannot) and is reaped once the process runs again.
absl::Status ScheduleProcessFault(const std::string& action, int pause_ms,
                                  int delay_ms = 50);

}  // namespace karat
