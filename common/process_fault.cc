#include "common/process_fault.h"

#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/log.h"

namespace karat {

absl::Status ValidateProcessFault(const std::string& action, int pause_ms) {
  if (action == "kill") return absl::OkStatus();
  if (action != "pause") {
    return absl::InvalidArgumentError(absl::StrCat(
        "action: must be \"kill\" or \"pause\", got \"", action, "\""));
  }
  if (pause_ms < 1 || pause_ms > kMaxPauseMs) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pause_ms: must be in [1, ", kMaxPauseMs, "], got ", pause_ms));
  }
  return absl::OkStatus();
}

absl::Status ScheduleProcessFault(const std::string& action, int pause_ms,
                                  int delay_ms) {
  if (absl::Status valid = ValidateProcessFault(action, pause_ms); !valid.ok())
    return valid;
  if (action == "kill") {
    KLOG(Warning, "fault") << "killing this process (SIGKILL) in " << delay_ms
                           << " ms, as asked through the admin API";
    std::thread([delay_ms] {
      absl::SleepFor(absl::Milliseconds(delay_ms));
      raise(SIGKILL);
    }).detach();
    return absl::OkStatus();
  }
  // The child only sleeps, signals and exits (async-signal-safe calls, as
  // required after fork() in a threaded process).
  const pid_t parent = getpid();
  const pid_t child = fork();
  if (child < 0) {
    return absl::InternalError(
        absl::StrCat("pause: fork failed: ", std::strerror(errno)));
  }
  if (child == 0) {
    const int64_t total_ms = int64_t(delay_ms) + pause_ms;
    timespec t{time_t(total_ms / 1000), long(total_ms % 1000) * 1000000L};
    while (nanosleep(&t, &t) != 0 && errno == EINTR) {
    }
    kill(parent, SIGCONT);
    _exit(0);
  }
  KLOG(Warning, "fault") << "pausing this process (SIGSTOP) for " << pause_ms
                         << " ms in " << delay_ms
                         << " ms, as asked through the admin API";
  std::thread([delay_ms, child] {
    absl::SleepFor(absl::Milliseconds(delay_ms));
    raise(SIGSTOP);
    // Runs again once the child sent SIGCONT.
    int status;
    while (waitpid(child, &status, 0) < 0 && errno == EINTR) {
    }
    KLOG(Info, "fault") << "pause over";
  }).detach();
  return absl::OkStatus();
}

}  // namespace karat
