#include "common/log.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>

namespace karat {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
}  // namespace

void SetLogLevel(LogLevel level) { g_level.store(static_cast<int>(level)); }

bool LogEnabled(LogLevel level) {
  return static_cast<int>(level) >= g_level.load(std::memory_order_relaxed);
}

bool ParseLogLevel(const std::string& text, LogLevel* level) {
  if (text == "debug") *level = LogLevel::kDebug;
  else if (text == "info") *level = LogLevel::kInfo;
  else if (text == "warning") *level = LogLevel::kWarning;
  else if (text == "error") *level = LogLevel::kError;
  else return false;
  return true;
}

LogMessage::LogMessage(LogLevel level, const char* module)
    : level_(level), module_(module) {}

LogMessage::~LogMessage() {
  using namespace std::chrono;
  auto now = system_clock::now();
  std::time_t secs = system_clock::to_time_t(now);
  int ms = static_cast<int>(
      duration_cast<milliseconds>(now.time_since_epoch()).count() % 1000);
  std::tm tm;
  gmtime_r(&secs, &tm);
  char stamp[64];
  std::snprintf(stamp, sizeof(stamp), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ",
                tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour,
                tm.tm_min, tm.tm_sec, ms);
  static const char kLevels[] = {'D', 'I', 'W', 'E'};
  std::string line = std::string(stamp) + " " +
                     kLevels[static_cast<int>(level_)] + " " + module_ + "] " +
                     stream_.str() + "\n";
  ssize_t unused = ::write(2, line.data(), line.size());
  (void)unused;
}

}  // namespace karat
