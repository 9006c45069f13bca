// The coordinator's write-ahead log of sessions (DESIGN.md §7 "Coordinator
// restarted"): the session table and every session's token log, so that a
// restarted coordinator serves the same sessions, and the link rules set at
// run time (Admin.SetLink), so that they stay in force. Their KV is not logged:
// it is rebuilt from the token log by prefill at each session's next turn.
//
// File: DIR/sessions.wal (0600, and DIR 0700 when Open creates it: the log
// holds every session's prompts and outputs), a sequence of records
//
//   u32 length (little endian) | u64 FNV-1a of the payload | payload
//
// where the payload is a serialized cluster::WalRecord. Appends are
// fdatasync'ed before Append returns. Open replays the file: a torn tail (a
// short record, a bad checksum or a payload that does not parse, as a crash
// in the middle of an append leaves) is cut off with a warning, and the live
// sessions are written as a fresh file (temp file, fsync, rename).
//
// Online compaction: when an append leaves the file larger than both
// SessionLogOptions::compact_min_bytes and compact_ratio times its size
// after the last compaction, a background thread of the SessionLog rewrites
// it to the same compacted form while appends go on. Phase 1 (no lock):
// read the file up to its size O at the start, replay it, write the
// compacted records to DIR/sessions.wal.tmp and fdatasync it, then copy the
// records appended meanwhile. Phase 2 (appends wait): copy the records
// appended since, fdatasync, rename over sessions.wal, fsync the directory,
// append to the new file. Every record appended is thus kept once and in
// order. A compaction that fails leaves the old file in use (error logged
// and counted) and is tried again once the file has grown by another
// max(compact_min_bytes, (compact_ratio - 1) x its size after the last
// compaction).
//
// Usage:
//   std::vector<LoggedSession> sessions;
//   ASSIGN_OR_RETURN(auto log, SessionLog::Open(dir, &sessions));
//   ...
//   RETURN_IF_ERROR(log->Append(record));
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
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
  std::string owner;  // the principal that created it ("": plaintext mode)
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
// then per session one SessionCreated (with its owner) and, when it has
// tokens, turns or a
// last turn, one TurnLogged with its whole history, prefill_ends, turns and
// last_turn. Its replay gives `sessions` and `links` back.
std::string EncodeCompactedWal(
    const std::vector<LoggedSession>& sessions,
    const std::optional<std::vector<cluster::LinkConfig>>& links);

struct SessionLogOptions {
  // Online compaction starts when an append leaves the file larger than
  // both compact_min_bytes and compact_ratio times its size right after the
  // last compaction (or Open). compact_ratio >= 1, compact_min_bytes >= 0.
  int64_t compact_min_bytes = int64_t{1} << 20;
  double compact_ratio = 2.0;
  // Tests: called by the online compaction at each of its steps, on its
  // thread: "read" (before reading the file), "write" (before writing the
  // temp file), "copy" (before copying, without the lock, what was appended
  // until then; what is appended later is copied in phase 2) and "switch"
  // (phase 2, appends wait: it must not call Append). A non-OK status other
  // than CANCELLED fails the compaction at that step as an I/O error would.
  // Except at "switch" the hook may block or call Append.
  std::function<absl::Status(std::string_view step)> compaction_hook;
};

// Thread-safe.
class SessionLog {
 public:
  // Creates `dir` when missing (0700; an existing one keeps its mode, with
  // a warning when group or others may use it), replays DIR/sessions.wal
  // into `*sessions` (and, when `links` is given, the last logged link
  // rules into it),
  // cuts a torn tail (warning), compacts the file and opens it for appends.
  // FAILED_PRECONDITION naming the path when the directory cannot be created
  // or read, or the file cannot be read or written; INVALID_ARGUMENT for an
  // empty `dir` or thresholds out of range.
  static absl::StatusOr<std::unique_ptr<SessionLog>> Open(
      const std::string& dir, std::vector<LoggedSession>* sessions,
      std::optional<std::vector<cluster::LinkConfig>>* links = nullptr,
      SessionLogOptions options = SessionLogOptions());
  // Waits for a running compaction to stop (one in phase 1 is abandoned).
  ~SessionLog();

  // Appends one record and fdatasyncs it, and starts an online compaction
  // when the file crosses the threshold. An error leaves the log unusable
  // for the record (the caller reports it); later appends are tried again.
  absl::Status Append(const cluster::WalRecord& record);

  // Blocks until no online compaction is wanted or running.
  void AwaitCompaction();

  // The file's size in bytes.
  int64_t bytes() const { return bytes_.load(std::memory_order_relaxed); }
  // Online compactions done and failed since Open.
  int64_t compactions() const {
    return compactions_.load(std::memory_order_relaxed);
  }
  int64_t compaction_failures() const {
    return compaction_failures_.load(std::memory_order_relaxed);
  }

  // DIR/sessions.wal.
  const std::string& path() const { return path_; }

  static constexpr char kFileName[] = "sessions.wal";

 private:
  SessionLog(std::string dir, std::string path, int fd, int64_t size,
             SessionLogOptions options);
  // Whether the file has crossed the threshold of a compaction.
  bool CompactionDue() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts a failed compaction and sets when the next one is tried.
  void CompactionFailed() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool CompactionWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return compaction_wanted_ || stopping_;
  }
  bool CompactionIdle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !compaction_wanted_;
  }
  void CompactionThread();
  // One online compaction of the file's first `start` bytes plus what is
  // appended meanwhile; ok, CANCELLED when the log is closing, or the error.
  absl::Status Compact(int64_t start);
  absl::Status Hook(std::string_view step);

  const std::string dir_;
  const std::string path_;
  const SessionLogOptions options_;
  absl::Mutex mu_;
  int fd_ ABSL_GUARDED_BY(mu_) = -1;
  // The records' length; the file holds more after an append that failed
  // and could not be cut off (tail_dirty_: cut before the next append).
  int64_t size_ ABSL_GUARDED_BY(mu_) = 0;
  bool tail_dirty_ ABSL_GUARDED_BY(mu_) = false;
  // A rename of the file is not known to be on disk: the directory is
  // fsync'ed before the next append.
  bool dir_sync_pending_ ABSL_GUARDED_BY(mu_) = false;
  int64_t compacted_size_ ABSL_GUARDED_BY(mu_) = 0;
  // After a failed compaction: the size that the next one waits for.
  int64_t retry_at_ ABSL_GUARDED_BY(mu_) = 0;
  bool compaction_wanted_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> stop_{false};  // stopping_, read without the lock
  std::thread thread_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> bytes_{0};
  std::atomic<int64_t> compactions_{0};
  std::atomic<int64_t> compaction_failures_{0};
};

}  // namespace karat::coordinator
