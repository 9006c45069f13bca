// The coordinator's write-ahead log file (coordinator/wal.h): round trip,
// a torn tail cut off, compaction, an unusable state dir.
#include "coordinator/wal.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "tests/coordinator/wal_test_util.h"

namespace karat::coordinator {
namespace {

namespace cl = ::karat::cluster;
using namespace wal_testing;  // NOLINT: the tests' helpers

// Writes two sessions (one closed later) and three turns through a log.
void WriteSome(const std::string& dir) {
  std::vector<LoggedSession> sessions;
  auto log = SessionLog::Open(dir, &sessions);
  REQUIRE(log.ok());
  CHECK(sessions.empty());
  REQUIRE((*log)->Append(Created("s-a", 11, 1)).ok());
  REQUIRE((*log)->Append(Created("s-b", 22, 2)).ok());
  REQUIRE((*log)->Append(Turn("s-a", {256, 1, 2, 9, 9}, {3}, 1)).ok());
  REQUIRE((*log)->Append(Turn("s-b", {256, 5}, {}, 1)).ok());
  REQUIRE((*log)->Append(Turn("s-a", {3, 8}, {3, 6}, 2)).ok());
  REQUIRE((*log)->Append(Closed("s-b")).ok());
}

TEST_CASE("The session log replays what was appended", "[wal]") {
  TempDir dir;
  WriteSome(dir.path());
  std::vector<LoggedSession> sessions;
  auto log = SessionLog::Open(dir.path(), &sessions);
  REQUIRE(log.ok());
  REQUIRE(sessions.size() == 1);
  const LoggedSession& a = sessions[0];
  CHECK(a.id == "s-a");
  CHECK(a.key == 11);
  CHECK(a.seed == 1);
  CHECK(a.history == std::vector<int32_t>{256, 1, 2, 9, 9, 3, 8});
  CHECK(a.prefill_ends == std::vector<int>{3, 6});
  CHECK(a.turns == 2);

  // Appends after a replay continue the same file.
  REQUIRE((*log)->Append(Turn("s-a", {7}, {3, 6, 7}, 3)).ok());
  REQUIRE((*log)->Append(Created("s-c", 33, 3)).ok());
  log->reset();
  REQUIRE(SessionLog::Open(dir.path(), &sessions).ok());
  REQUIRE(sessions.size() == 2);
  CHECK(sessions[0].history == std::vector<int32_t>{256, 1, 2, 9, 9, 3, 8, 7});
  CHECK(sessions[0].turns == 3);
  CHECK(sessions[1].id == "s-c");
  CHECK(sessions[1].key == 33);
  CHECK(sessions[1].history.empty());
}

TEST_CASE("Opening the session log compacts it to the live sessions", "[wal]") {
  TempDir dir;
  WriteSome(dir.path());
  auto before = ReadWalFile(dir.File());
  REQUIRE(before.ok());
  CHECK(before->records.size() == 6);
  std::vector<LoggedSession> sessions;
  REQUIRE(SessionLog::Open(dir.path(), &sessions).ok());
  auto after = ReadWalFile(dir.File());
  REQUIRE(after.ok());
  // s-a: one created and one turn record with its whole history; s-b gone.
  REQUIRE(after->records.size() == 2);
  CHECK(after->records[0].created().id() == "s-a");
  CHECK(after->records[1].turn().tokens_size() == 7);
  CHECK(after->torn_bytes == 0);
  CHECK(after->valid_bytes < before->valid_bytes);
  CHECK_FALSE(std::filesystem::exists(dir.File() + ".tmp"));
  // The compacted file replays to the same sessions.
  CHECK(ReplayWal(after->records).size() == 1);
  CHECK(ReplayWal(after->records)[0].history ==
        ReplayWal(before->records)[0].history);
}

TEST_CASE("Owners are replayed and kept by compaction; the files are private",
          "[wal]") {
  TempDir dir;
  const std::string state = dir.path() + "/state";
  {
    std::vector<LoggedSession> sessions;
    auto log = SessionLog::Open(state, &sessions);
    REQUIRE(log.ok());
    REQUIRE((*log)->Append(Created("s-a", 11, 1, "alice")).ok());
    REQUIRE((*log)->Append(Created("s-b", 22, 2, "bob")).ok());
    REQUIRE((*log)->Append(Created("s-c", 33, 3)).ok());
    REQUIRE((*log)->Append(Closed("s-b")).ok());
  }
  // Created by Open: the dir is 0700, the log 0600 (whatever the umask).
  CHECK((std::filesystem::status(state).permissions() &
         std::filesystem::perms::all) == std::filesystem::perms::owner_all);
  CHECK((std::filesystem::status(state + "/" + SessionLog::kFileName)
             .permissions() &
         std::filesystem::perms::all) == (std::filesystem::perms::owner_read |
                                          std::filesystem::perms::owner_write));
  std::vector<LoggedSession> sessions;
  REQUIRE(SessionLog::Open(state, &sessions).ok());
  REQUIRE(sessions.size() == 2);
  CHECK(sessions[0].owner == "alice");
  CHECK(sessions[1].owner.empty());
  // Open compacted the file: its records still name the owners.
  auto file = ReadWalFile(state + "/" + SessionLog::kFileName);
  REQUIRE(file.ok());
  REQUIRE(file->records.size() == 2);
  CHECK(file->records[0].created().owner() == "alice");
  CheckSameSessions(ReplayWal(file->records), sessions);
}

TEST_CASE("A torn last record of the session log is cut off", "[wal]") {
  TempDir dir;
  WriteSome(dir.path());
  const int64_t whole = FileSize(dir.File());
  std::string record = EncodeWalRecord(Turn("s-a", {42, 43}, {3, 6, 8}, 3));

  SECTION("short") { AppendBytes(dir.File(), record.substr(0, 15)); }
  SECTION("short header") { AppendBytes(dir.File(), record.substr(0, 5)); }
  SECTION("bad checksum") {
    record[6] ^= 0x5a;
    AppendBytes(dir.File(), record);
  }
  SECTION("bad payload") {
    record.back() ^= 0x01;
    AppendBytes(dir.File(), record);
  }
  auto torn = ReadWalFile(dir.File());
  REQUIRE(torn.ok());
  CHECK(torn->records.size() == 6);
  CHECK(torn->valid_bytes == whole);
  CHECK(torn->torn_bytes > 0);

  std::vector<LoggedSession> sessions;
  auto log = SessionLog::Open(dir.path(), &sessions);
  REQUIRE(log.ok());
  REQUIRE(sessions.size() == 1);
  CHECK(sessions[0].history == std::vector<int32_t>{256, 1, 2, 9, 9, 3, 8});
  CHECK(sessions[0].turns == 2);
  // The tail is gone from the file: a record appended now replays.
  REQUIRE((*log)->Append(Turn("s-a", {42}, {3, 6, 8}, 3)).ok());
  log->reset();
  auto clean = ReadWalFile(dir.File());
  REQUIRE(clean.ok());
  CHECK(clean->torn_bytes == 0);
  REQUIRE(SessionLog::Open(dir.path(), &sessions).ok());
  REQUIRE(sessions.size() == 1);
  CHECK(sessions[0].history.back() == 42);
  CHECK(sessions[0].turns == 3);
}

TEST_CASE("Records that do not fit the session table are skipped", "[wal]") {
  auto sessions = ReplayWal({Turn("s-x", {1}, {}, 1), Closed("s-y"),
                             Created("s-a", 1, 2), Created("s-a", 5, 6)});
  REQUIRE(sessions.size() == 1);
  CHECK(sessions[0].key == 1);
}

TEST_CASE("The last logged link rules are replayed and kept by compaction",
          "[wal]") {
  TempDir dir;
  std::vector<LoggedSession> sessions;
  std::optional<std::vector<cl::LinkConfig>> links;
  {
    auto log = SessionLog::Open(dir.path(), &sessions, &links);
    REQUIRE(log.ok());
    CHECK_FALSE(links.has_value());  // none logged: the config's apply
    REQUIRE((*log)->Append(Links({{"gpu0", 100}})).ok());
    REQUIRE((*log)->Append(Created("s-a", 11, 1)).ok());
    REQUIRE((*log)->Append(Links({{"gpu0", 200}, {"karat0", 50}})).ok());
  }
  for (int start = 0; start < 2; ++start) {  // the second after compaction
    auto log = SessionLog::Open(dir.path(), &sessions, &links);
    REQUIRE(log.ok());
    REQUIRE(links.has_value());
    REQUIRE(links->size() == 2);
    CHECK((*links)[0].source() == "gpu0");
    CHECK((*links)[0].latency_us() == 200);
    CHECK((*links)[1].source() == "karat0");
    REQUIRE(sessions.size() == 1);  // sessions are replayed as before
    CHECK(sessions[0].id == "s-a");
  }
  auto file = ReadWalFile(dir.File());
  REQUIRE(file.ok());
  CHECK(file->records.size() == 2);  // the last rules and s-a
  // Every rule removed is logged as an empty list, not as none.
  {
    auto log = SessionLog::Open(dir.path(), &sessions, &links);
    REQUIRE(log.ok());
    REQUIRE((*log)->Append(Links({})).ok());
  }
  for (int start = 0; start < 2; ++start) {  // the second after compaction
    REQUIRE(SessionLog::Open(dir.path(), &sessions, &links).ok());
    REQUIRE(links.has_value());
    CHECK(links->empty());
  }
  CHECK(ReplayWal({Links({{"x", 1}})}).empty());  // not a session record
}

TEST_CASE("A turn start sets the latest turn; a turn record replaces it",
          "[wal]") {
  const cl::LastTurn first = MakeLastTurn("k1", {1, 2}, 0, 0, "");
  const cl::LastTurn first_done = MakeLastTurn("k1", {1, 2}, 0, 3, "eos");
  const cl::LastTurn second = MakeLastTurn("k2", {7}, 6, 0, "");
  std::vector<cl::WalRecord> records = {Created("s-a", 11, 1),
                                        Created("s-b", 22, 2)};
  SECTION("a start alone leaves the history as it was") {
    records.push_back(Started("s-a", first));
    auto sessions = ReplayWal(records);
    REQUIRE(sessions.size() == 2);
    CHECK(sessions[0].history.empty());
    CHECK(sessions[0].turns == 0);
    CHECK(SameTurn(sessions[0].last_turn, first));
    CHECK_FALSE(sessions[1].last_turn.has_value());
  }
  SECTION("the turn's record replaces the start's") {
    records.push_back(Started("s-a", first));
    records.push_back(
        TurnWithLast("s-a", {256, 1, 2, 5, 6, 2}, {3}, 1, first_done));
    auto sessions = ReplayWal(records);
    CHECK(sessions[0].history == std::vector<int32_t>{256, 1, 2, 5, 6, 2});
    CHECK(SameTurn(sessions[0].last_turn, first_done));
  }
  SECTION("a turn record without one keeps the latest turn") {
    records.push_back(TurnWithLast("s-a", {256, 1, 2, 5}, {3}, 1, first_done));
    records.push_back(Turn("s-a", {9}, {3, 5}, 2));
    auto sessions = ReplayWal(records);
    CHECK(sessions[0].history == std::vector<int32_t>{256, 1, 2, 5, 9});
    CHECK(sessions[0].turns == 2);
    CHECK(SameTurn(sessions[0].last_turn, first_done));
  }
  SECTION("a later start replaces a finished turn") {
    records.push_back(TurnWithLast("s-a", {256, 1, 2, 5}, {3}, 1, first_done));
    records.push_back(Started("s-a", second));
    auto sessions = ReplayWal(records);
    CHECK(sessions[0].history == std::vector<int32_t>{256, 1, 2, 5});
    CHECK(SameTurn(sessions[0].last_turn, second));
  }
  SECTION("starts that do not fit are skipped") {
    records.push_back(Started("s-x", first));  // never created
    cl::WalRecord bare;
    bare.mutable_started()->set_id("s-b");  // no turn
    records.push_back(bare);
    records.push_back(Closed("s-a"));
    records.push_back(Started("s-a", second));  // closed
    auto sessions = ReplayWal(records);
    REQUIRE(sessions.size() == 1);
    CHECK(sessions[0].id == "s-b");
    CHECK_FALSE(sessions[0].last_turn.has_value());
  }
}

TEST_CASE("Compaction at open keeps each session's latest turn", "[wal]") {
  TempDir dir;
  const cl::LastTurn done = MakeLastTurn("k1", {1, 2}, 0, 2, "length");
  const cl::LastTurn running = MakeLastTurn("k3", {4}, 0, 0, "");
  std::vector<LoggedSession> sessions;
  {
    auto log = SessionLog::Open(dir.path(), &sessions);
    REQUIRE(log.ok());
    REQUIRE((*log)->Append(Created("s-a", 11, 1)).ok());
    REQUIRE((*log)->Append(Created("s-b", 22, 2)).ok());
    REQUIRE((*log)->Append(Created("s-c", 33, 3)).ok());
    REQUIRE((*log)
                ->Append(Started("s-a", MakeLastTurn("k1", {1, 2}, 0, 0, "")))
                .ok());
    REQUIRE((*log)
                ->Append(TurnWithLast("s-a", {256, 1, 2, 8, 8}, {3}, 1, done))
                .ok());
    REQUIRE((*log)->Append(Turn("s-a", {4, 4}, {3, 7}, 2)).ok());
    // s-c: a start only (the turn broke off before its first token).
    REQUIRE((*log)->Append(Started("s-c", running)).ok());
  }
  auto before = ReadWalFile(dir.File());
  REQUIRE(before.ok());
  for (int start = 0; start < 2; ++start) {  // the second after compaction
    auto log = SessionLog::Open(dir.path(), &sessions);
    REQUIRE(log.ok());
    REQUIRE(sessions.size() == 3);
    CHECK(sessions[0].history == std::vector<int32_t>{256, 1, 2, 8, 8, 4, 4});
    CHECK(sessions[0].prefill_ends == std::vector<int>{3, 7});
    CHECK(sessions[0].turns == 2);
    CHECK(SameTurn(sessions[0].last_turn, done));
    CHECK(sessions[1].id == "s-b");
    CHECK_FALSE(sessions[1].last_turn.has_value());
    CHECK(sessions[2].history.empty());
    CHECK(sessions[2].turns == 0);
    CHECK(SameTurn(sessions[2].last_turn, running));
  }
  auto after = ReadWalFile(dir.File());
  REQUIRE(after.ok());
  // s-a and s-c: created and one turn record; s-b: created only.
  CHECK(after->records.size() == 5);
  CHECK(after->records.size() < before->records.size());
}

TEST_CASE("An unusable state dir is a clear error", "[wal]") {
  TempDir dir;
  std::vector<LoggedSession> sessions;
  SECTION("a file in the way") {
    const std::string file = dir.path() + "/file";
    AppendBytes(file, "x");
    auto log = SessionLog::Open(file + "/state", &sessions);
    REQUIRE_FALSE(log.ok());
    CHECK(log.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(log.status().message().find(file) != std::string::npos);
  }
  SECTION("the log is a directory") {
    std::filesystem::create_directory(dir.File());
    auto log = SessionLog::Open(dir.path(), &sessions);
    REQUIRE_FALSE(log.ok());
    CHECK(log.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(log.status().message().find(dir.File()) != std::string::npos);
  }
  SECTION("not writable") {
    if (geteuid() == 0) return;  // root writes anywhere
    REQUIRE(chmod(dir.path().c_str(), 0500) == 0);
    auto log = SessionLog::Open(dir.path(), &sessions);
    REQUIRE_FALSE(log.ok());
    CHECK(log.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(log.status().message().find(dir.path()) != std::string::npos);
  }
  SECTION("empty") {
    CHECK(SessionLog::Open("", &sessions).status().code() ==
          absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace karat::coordinator
