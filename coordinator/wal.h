// The coordinator's write-ahead log of sessions (DESIGN.md §7 "Coordinator
// restarted"): the session table and every session's token log, so that a
// restarted coordinator serves the same sessions, and the link rules set at
// run time (Admin.SetLink), so that they stay in force. Their KV is not logged:
// it is rebuilt from the token log by prefill at each session's next turn.
//
// File: DIR/sessions.wal, a sequence of records
//
//   u32 length (little endian) | u64 FNV-1a of the payload | payload
//
// where the payload is a serialized cluster::WalRecord. Appends are
// fdatasync'ed before Append returns. Open replays the file: a torn tail (a
// short record, a bad checksum or a payload that does not parse, as a crash
// in the middle of an append leaves) is cut off with a warning, and the live
// sessions are written as a fresh file (temp file, fsync, rename), so the
// log never holds more than the sessions alive at the last start plus what
// happened since.
//
// Usage:
//   std::vector<LoggedSession> sessions;
//   ASSIGN_OR_RETURN(auto log, SessionLog::Open(dir, &sessions));
//   ...
//   RETURN_IF_ERROR(log->Append(record));
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "cluster.pb.h"

namespace karat::coordinator {

// A session as the log leaves it.
struct LoggedSession {
  std::string id;
  uint64_t key = 0;
  uint64_t seed = 0;
  std::vector<int32_t> history;  // BOS, prompts, generated tokens
  std::vector<int> prefill_ends;
  int turns = 0;
  // The latest turn as a retry with its idempotency key finds it: set by a
  // TurnStarted record, replaced by a TurnLogged record that carries one.
  std::optional<cluster::LastTurn> last_turn;
};

// What reading a log file found.
struct WalContents {
  std::vector<cluster::WalRecord> records;  // the intact ones, in order
  int64_t valid_bytes = 0;                  // their length in the file
  int64_t torn_bytes = 0;                   // bytes after them (cut off)
};

// Reads every intact record of the log file at `path` (a missing file has
// none). Errors only when the file cannot be read.
absl::StatusOr<WalContents> ReadWalFile(const std::string& path);

// Applies `records` in order: the sessions alive after them, by id. A
// TurnLogged appends its tokens, replaces prefill_ends and turns, and
// replaces last_turn when it carries one; a TurnStarted sets last_turn only.
// Records that do not fit (a turn, start or close of an unknown session, a
// second create of one id, a start without its turn) are skipped with a
// warning.
std::vector<LoggedSession> ReplayWal(
    const std::vector<cluster::WalRecord>& records);

// The link rules of the last LinkRules record of `records`, if any.
std::optional<std::vector<cluster::LinkConfig>> ReplayWalLinks(
    const std::vector<cluster::WalRecord>& records);

// One record as it is stored (header and payload).
std::string EncodeWalRecord(const cluster::WalRecord& record);

// The LinkRules record of `links` (its `links` field set even when the list
// is empty, so that an empty list is logged as such).
cluster::WalRecord LinkRulesRecord(
    const std::vector<cluster::LinkConfig>& links);

// The compacted form of a log: the LinkRules record of `links` (when set),
// then per session one SessionCreated and, when it has tokens, turns or a
// last turn, one TurnLogged with its whole history, prefill_ends, turns and
// last_turn. Its replay gives `sessions` and `links` back.
std::string EncodeCompactedWal(
    const std::vector<LoggedSession>& sessions,
    const std::optional<std::vector<cluster::LinkConfig>>& links);

// Thread-safe.
class SessionLog {
 public:
  // Creates `dir` when missing, replays DIR/sessions.wal into `*sessions`
  // (and, when `links` is given, the last logged link rules into it),
  // cuts a torn tail (warning), compacts the file and opens it for appends.
  // FAILED_PRECONDITION naming the path when the directory cannot be created
  // or read, or the file cannot be read or written.
  static absl::StatusOr<std::unique_ptr<SessionLog>> Open(
      const std::string& dir, std::vector<LoggedSession>* sessions,
      std::optional<std::vector<cluster::LinkConfig>>* links = nullptr);
  ~SessionLog();

  // Appends one record and fdatasyncs it. An error leaves the log unusable
  // for the record (the caller reports it); later appends are tried again.
  absl::Status Append(const cluster::WalRecord& record);

  // DIR/sessions.wal.
  const std::string& path() const { return path_; }

  static constexpr char kFileName[] = "sessions.wal";

 private:
  SessionLog(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  const std::string path_;
  absl::Mutex mu_;
  int fd_ ABSL_GUARDED_BY(mu_) = -1;
};

}  // namespace karat::coordinator
