// A thin logging layer: levels and a per-module name. Lines go to stderr as
//   2026-11-30T07:42:01.123Z I gpu_node] message
// Lines about a request carry its session id (`session=...`).
// Thread-safe: each line is written with one write().
#pragma once

#include <sstream>

namespace karat {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

void SetLogLevel(LogLevel level);
bool LogEnabled(LogLevel level);
// Parses "debug", "info", "warning", "error"; false when unknown.
bool ParseLogLevel(const std::string& text, LogLevel* level);

class LogMessage {
 public:
  LogMessage(LogLevel level, const char* module);
  ~LogMessage();
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  const char* module_;
  std::ostringstream stream_;
};

}  // namespace karat

// KLOG(Info, "coordinator") << "session=" << id << " admitted";
#define KLOG(level, module)                                   \
  if (!::karat::LogEnabled(::karat::LogLevel::k##level)) {    \
  } else                                                      \
    ::karat::LogMessage(::karat::LogLevel::k##level, module).stream()
