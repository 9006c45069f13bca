// The write-ahead log's online compaction (coordinator/wal.h): its
// threshold, the replay it keeps, records appended while it runs, and
// compactions that fail or are cut short.
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "coordinator/wal.h"
#include "tests/coordinator/wal_test_util.h"

namespace karat::coordinator {
namespace {

namespace cl = ::karat::cluster;
using namespace wal_testing;  // NOLINT: the tests' helpers

// A log opened in `dir` that remembers every record appended through it.
class LoggedRecords {
 public:
  LoggedRecords(const std::string& dir, SessionLogOptions options) {
    std::vector<LoggedSession> sessions;
    auto log = SessionLog::Open(dir, &sessions, nullptr, std::move(options));
    REQUIRE(log.ok());
    REQUIRE(sessions.empty());
    log_ = std::move(*log);
  }
  SessionLog& log() { return *log_; }
  void Close() { log_.reset(); }

  // Appends `record` (thread-safe); false when the log refused it.
  bool Append(const cl::WalRecord& record) {
    std::lock_guard<std::mutex> lock(mu_);  // the records' order is the log's
    if (!log_->Append(record).ok()) return false;
    records_.push_back(record);
    return true;
  }
  std::vector<cl::WalRecord> records() {
    std::lock_guard<std::mutex> lock(mu_);
    return records_;
  }

 private:
  std::mutex mu_;
  std::unique_ptr<SessionLog> log_;
  std::vector<cl::WalRecord> records_;
};

// The file replays to what `records` replay to.
void CheckFileReplays(const std::string& file,
                      const std::vector<cl::WalRecord>& records) {
  auto contents = ReadWalFile(file);
  REQUIRE(contents.ok());
  CHECK(contents->torn_bytes == 0);
  CheckSameSessions(ReplayWal(contents->records), ReplayWal(records));
  CHECK(SameLinks(ReplayWalLinks(contents->records), ReplayWalLinks(records)));
}

// Session `n`'s records: created, a turn started and logged, and for odd n
// a second turn without a last turn.
std::vector<cl::WalRecord> SessionRecords(int n) {
  const std::string id = absl::StrFormat("s-%04d", n);
  const cl::LastTurn done = MakeLastTurn(absl::StrCat("k", n), {n, 1}, 0, 2,
                                         n % 4 == 0 ? "eos" : "length");
  std::vector<cl::WalRecord> records = {
      Created(id, uint64_t(1000 + n), uint64_t(n), n % 2 ? "alice" : ""),
      Started(id, MakeLastTurn(absl::StrCat("k", n), {n, 1}, 0, 0, "")),
      TurnWithLast(id, {256, n, 1, 7, n}, {3}, 1, done)};
  if (n % 2 == 1) records.push_back(Turn(id, {n + 1, 9}, {3, 7}, 2));
  return records;
}

TEST_CASE("Online compaction starts at its threshold and keeps the replay",
          "[wal][compaction]") {
  TempDir dir;
  SessionLogOptions options;
  options.compact_min_bytes = 3000;
  options.compact_ratio = 2.0;
  LoggedRecords wal(dir.path(), options);
  SessionLog& log = wal.log();
  CHECK(log.bytes() == 0);
  int64_t base = 0;  // the size after the last compaction
  int64_t compactions = 0;
  int n = 0;
  while (compactions < 3) {
    std::vector<cl::WalRecord> records = SessionRecords(n);
    if (n % 3 != 0) records.push_back(Closed(records[0].created().id()));
    if (n % 10 == 5) records.push_back(Links({{"gpu0", n}}));
    ++n;
    for (const cl::WalRecord& record : records) {
      const int64_t before = log.bytes();
      const int64_t after = before + int64_t(EncodeWalRecord(record).size());
      REQUIRE(wal.Append(record));
      log.AwaitCompaction();
      CHECK(log.compaction_failures() == 0);
      const bool crossed =
          after > std::max<int64_t>(options.compact_min_bytes, 2 * base);
      if (!crossed) {
        REQUIRE(log.compactions() == compactions);
        REQUIRE(log.bytes() == after);
        REQUIRE(FileSize(dir.File()) == after);
        continue;
      }
      REQUIRE(log.compactions() == ++compactions);
      base = log.bytes();
      CHECK(FileSize(dir.File()) == base);
      CHECK(base < after);
      CheckFileReplays(dir.File(), wal.records());
      // Only live sessions are left: no record names a closed one.
      auto file = ReadWalFile(dir.File());
      REQUIRE(file.ok());
      const std::vector<LoggedSession> live = ReplayWal(wal.records());
      int created = 0;
      for (const cl::WalRecord& r : file->records) {
        CHECK(r.record_case() != cl::WalRecord::kClosed);
        CHECK(r.record_case() != cl::WalRecord::kStarted);
        if (r.record_case() == cl::WalRecord::kCreated) ++created;
      }
      CHECK(created == int(live.size()));
      CHECK_FALSE(std::filesystem::exists(dir.File() + ".tmp"));
    }
  }
  // Records after the last compaction, and a restart.
  REQUIRE(wal.Append(Turn("s-0000", {5, 5}, {3, 7, 9}, 2)));
  REQUIRE(wal.Append(Started("s-0003", MakeLastTurn("k9", {4}, 8, 0, ""))));
  const std::vector<cl::WalRecord> records = wal.records();
  CheckFileReplays(dir.File(), records);
  wal.Close();
  std::vector<LoggedSession> sessions;
  std::optional<std::vector<cl::LinkConfig>> links;
  REQUIRE(SessionLog::Open(dir.path(), &sessions, &links).ok());
  CheckSameSessions(sessions, ReplayWal(records));
  CHECK(SameLinks(links, ReplayWalLinks(records)));
  REQUIRE(links.has_value());
  CHECK(sessions.size() > 10);
}

TEST_CASE("Records appended during a compaction are kept once, in order",
          "[wal][compaction]") {
  TempDir dir;
  LoggedRecords* wal = nullptr;
  int token = 100;
  int appended_in_hook = 0;
  SessionLogOptions options;
  options.compact_min_bytes = 200;
  options.compact_ratio = 1.0;
  // Phase 1 ("write": copied without the lock; "copy": in phase 2).
  options.compaction_hook = [&](std::string_view step) {
    if (step == "write" || step == "copy") {
      for (int i = 0; i < 3; ++i) {
        ++token;
        if (!wal->Append(Turn("s-a", {token}, {token}, token))) break;
        ++appended_in_hook;
      }
      if (!wal->Append(Created(absl::StrCat("s-", std::string(step)), 7, 7)))
        return absl::InternalError("append failed");
    }
    return absl::OkStatus();
  };
  LoggedRecords log(dir.path(), options);
  wal = &log;
  REQUIRE(log.Append(Created("s-a", 1, 1)));
  std::vector<int32_t> history;
  while (log.log().compactions() == 0) {
    REQUIRE(log.log().compaction_failures() == 0);
    REQUIRE(history.size() < 1000);
    ++token;
    history.push_back(token);
    REQUIRE(log.Append(Turn("s-a", {token}, {token}, token)));
    log.log().AwaitCompaction();
  }
  REQUIRE(appended_in_hook == 6);
  CHECK(log.log().compaction_failures() == 0);
  CHECK(log.log().bytes() == FileSize(dir.File()));
  auto file = ReadWalFile(dir.File());
  REQUIRE(file.ok());
  const std::vector<LoggedSession> sessions = ReplayWal(file->records);
  REQUIRE(sessions.size() == 3);
  CHECK(sessions[0].id == "s-a");
  CHECK(sessions[1].id == "s-copy");
  CHECK(sessions[2].id == "s-write");
  // Every token once and in order: the hook's follow the others.
  for (int t = token - 5; t <= token; ++t) history.push_back(t);
  CHECK(sessions[0].history == history);
  CHECK(sessions[0].turns == token);
  CheckFileReplays(dir.File(), log.records());
}

TEST_CASE("Appends racing with online compactions are all kept",
          "[wal][compaction]") {
  TempDir dir(MemoryTempBase());
  SessionLogOptions options;
  options.compact_min_bytes = 1024;
  options.compact_ratio = 1.1;
  std::vector<LoggedSession> none;
  auto opened = SessionLog::Open(dir.path(), &none, nullptr, options);
  REQUIRE(opened.ok());
  SessionLog& log = **opened;
  constexpr int kThreads = 4;
  constexpr int kRecords = 2000;
  // Each thread's records, in its order; sessions are the thread's own, so
  // the threads' lists concatenated replay as the log does.
  std::vector<std::vector<cl::WalRecord>> appended(kThreads);
  std::atomic<int> refused{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&log, &refused, t, records = &appended[t]] {
      auto append = [&](const cl::WalRecord& record) {
        if (log.Append(record).ok()) {
          records->push_back(record);
        } else {
          ++refused;
        }
      };
      // Five sessions at a time; one is closed and replaced every 97
      // records. Each turn adds the session's next number.
      std::map<std::string, int> next;
      int created = 0;
      auto create = [&] {
        const std::string id = absl::StrFormat("t%d-%04d", t, created++);
        next[id] = 0;
        append(Created(id, uint64_t(t * 100000 + created), 0));
      };
      for (int i = 0; i < 5; ++i) create();
      for (int i = 0; i < kRecords; ++i) {
        // Now and then a pause, as an fdatasync to a disk makes, in which
        // the compaction takes the lock.
        if (i % 16 == 0)
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        auto it = next.begin();
        std::advance(it, i % next.size());
        if (i % 97 == 96) {
          append(Closed(it->first));
          next.erase(it);
          create();
        } else if (i % 13 == 0) {
          append(
              Started(it->first, MakeLastTurn(absl::StrCat(i), {i}, 0, 0, "")));
        } else {
          const int n = it->second++;
          append(Turn(it->first, {n}, {n}, n + 1));
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  log.AwaitCompaction();
  CHECK(refused == 0);
  INFO("compactions " << log.compactions());
  CHECK(log.compactions() >= 3);
  CHECK(log.compaction_failures() == 0);
  CHECK(log.bytes() == FileSize(dir.File()));
  std::vector<cl::WalRecord> records;
  for (const auto& list : appended)
    records.insert(records.end(), list.begin(), list.end());
  CHECK(records.size() == size_t(kThreads) * (5 + kRecords + kRecords / 97));
  CheckFileReplays(dir.File(), records);
  // Each live session's history is 0, 1, 2, ...: no record lost, repeated
  // or reordered.
  const std::vector<LoggedSession> sessions = ReplayWal(records);
  REQUIRE(sessions.size() == kThreads * 5);
  for (const LoggedSession& s : sessions) {
    for (size_t i = 0; i < s.history.size(); ++i)
      REQUIRE(s.history[i] == int32_t(i));
  }
  opened->reset();
  std::vector<LoggedSession> reopened;
  REQUIRE(SessionLog::Open(dir.path(), &reopened).ok());
  CheckSameSessions(reopened, sessions);
}

TEST_CASE("A failed compaction keeps the log whole and is tried again later",
          "[wal][compaction]") {
  TempDir dir;
  LoggedRecords* wal = nullptr;
  std::string fail_at;
  SessionLogOptions options;
  options.compact_min_bytes = 600;
  options.compact_ratio = 2.0;
  options.compaction_hook = [&](std::string_view step) {
    if (step == "write") wal->Append(Turn("s-0001", {77}, {3, 7, 8}, 3));
    if (step != fail_at) return absl::OkStatus();
    fail_at.clear();  // once
    return absl::ResourceExhaustedError("no space left on device (test)");
  };
  LoggedRecords log(dir.path(), options);
  wal = &log;
  SECTION("reading the log") { fail_at = "read"; }
  SECTION("writing the temp file") { fail_at = "write"; }
  SECTION("copying appended records") { fail_at = "copy"; }
  SECTION("switching files") { fail_at = "switch"; }
  SECTION("the temp file cannot be created") {
    std::filesystem::create_directory(dir.File() + ".tmp");  // EISDIR
  }
  std::vector<cl::WalRecord> records;
  for (int n = 0; n < 20; ++n) {
    for (const cl::WalRecord& record : SessionRecords(n))
      records.push_back(record);
  }
  for (size_t i = 0; log.log().compaction_failures() == 0; ++i) {
    REQUIRE(i < records.size());
    REQUIRE(log.Append(records[i]));
    log.log().AwaitCompaction();  // the failure's size is the file's now
  }
  CHECK(log.log().compactions() == 0);
  const int64_t retry_at = log.log().bytes() + options.compact_min_bytes;
  std::error_code ec;
  std::filesystem::remove(dir.File() + ".tmp", ec);  // the directory
  // The old file is in use, with every record, and takes appends.
  CHECK(log.log().bytes() == FileSize(dir.File()));
  CheckFileReplays(dir.File(), log.records());
  REQUIRE(log.Append(Closed("s-0000")));
  CheckFileReplays(dir.File(), log.records());
  // Tried again once the file has grown by compact_min_bytes from its size
  // at the failure (the size after the last compaction is 0: the log was
  // opened empty).
  while (log.log().compactions() == 0) {
    const cl::WalRecord record = Turn("s-0002", {1}, {3}, 1);
    const int64_t before = log.log().bytes();
    const int64_t after = before + int64_t(EncodeWalRecord(record).size());
    REQUIRE(log.Append(record));
    log.log().AwaitCompaction();
    CHECK(log.log().compaction_failures() == 1);
    if (log.log().compactions() == 0) {
      REQUIRE(after < retry_at);
    } else {
      CHECK(before < retry_at);
      CHECK(after >= retry_at);
    }
  }
  CHECK_FALSE(std::filesystem::exists(dir.File() + ".tmp"));
  CheckFileReplays(dir.File(), log.records());
  records = log.records();
  log.Close();
  std::vector<LoggedSession> sessions;
  REQUIRE(SessionLog::Open(dir.path(), &sessions).ok());
  CheckSameSessions(sessions, ReplayWal(records));
}

TEST_CASE("Closing the log during a compaction abandons it",
          "[wal][compaction]") {
  TempDir dir;
  std::atomic<bool> entered{false};
  std::atomic<bool> release{false};
  SessionLogOptions options;
  options.compact_min_bytes = 300;
  options.compaction_hook = [&](std::string_view step) {
    if (step == "write") {
      entered = true;
      while (!release)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return absl::OkStatus();
  };
  LoggedRecords log(dir.path(), options);
  int n = 0;
  while (!entered) {
    REQUIRE(n < 100);
    for (const cl::WalRecord& record : SessionRecords(n++))
      REQUIRE(log.Append(record));
    REQUIRE(log.Append(Closed(SessionRecords(n - 1)[0].created().id())));
  }
  const std::vector<cl::WalRecord> records = log.records();
  std::thread closer([&log] { log.Close(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  release = true;
  closer.join();
  // Not compacted: every record is still in the file, and no temp file.
  auto file = ReadWalFile(dir.File());
  REQUIRE(file.ok());
  CHECK(file->records.size() == records.size());
  CHECK_FALSE(std::filesystem::exists(dir.File() + ".tmp"));
  CheckFileReplays(dir.File(), records);
}

}  // namespace
}  // namespace karat::coordinator
