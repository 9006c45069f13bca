#include "coordinator/wal.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <string_view>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/stable_hash.h"
#include "common/status_macros.h"
#include "security/tokens.h"

namespace karat::coordinator {
namespace {

constexpr char kLog[] = "coordinator";
constexpr size_t kHeaderBytes = 4 + 8;
// A record longer than this is taken for garbage (a session's whole token
// log is far smaller).
constexpr uint32_t kMaxRecordBytes = 1u << 30;

absl::Status Errno(const std::string& what, const std::string& path) {
  return absl::FailedPreconditionError(
      absl::StrCat("coordinator state: cannot ", what, " ", path, ": ",
                   std::strerror(errno)));
}

void PutLe(uint64_t v, int bytes, std::string* out) {
  for (int i = 0; i < bytes; ++i) out->push_back(char((v >> (8 * i)) & 0xff));
}

uint64_t GetLe(std::string_view s, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | uint8_t(s[i]);
  return v;
}

// Writes all of `data` to `fd`.
bool WriteAll(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    data.remove_prefix(size_t(n));
  }
  return true;
}

// Writes all of `data` to `fd`, fdatasync'ing each MiB, so that an append's
// fdatasync, which on a journaling file system may wait for other files'
// dirty data, finds at most a MiB of it.
bool WriteSynced(int fd, std::string_view data) {
  constexpr size_t kChunk = size_t{1} << 20;
  do {
    const std::string_view chunk = data.substr(0, kChunk);
    if (!WriteAll(fd, chunk) || ::fdatasync(fd) != 0) return false;
    data.remove_prefix(chunk.size());
  } while (!data.empty());
  return true;
}

// Reads `fd` from `begin` up to `end` (or its end of file) into `*out`.
bool ReadRange(int fd, int64_t begin, int64_t end, std::string* out) {
  char buf[1 << 16];
  while (begin < end) {
    const size_t want = size_t(std::min<int64_t>(end - begin, sizeof(buf)));
    ssize_t n = ::pread(fd, buf, want, off_t(begin));
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    if (n == 0) break;
    out->append(buf, size_t(n));
    begin += n;
  }
  return true;
}

// Copies the bytes [begin, end) of `from` to the end of `to`; false (errno
// set) when a read or write fails or `from` ends before `end`.
bool CopyRange(int from, int64_t begin, int64_t end, int to) {
  std::string chunk;
  while (begin < end) {
    chunk.clear();
    const int64_t stop = std::min<int64_t>(end, begin + (int64_t{1} << 20));
    if (!ReadRange(from, begin, stop, &chunk)) return false;
    if (chunk.empty()) {
      errno = EIO;  // shorter than the records it holds
      return false;
    }
    if (!WriteAll(to, chunk)) return false;
    begin += int64_t(chunk.size());
  }
  return true;
}

// fsyncs the directory `dir` (a rename in it); false with errno set.
bool SyncDir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = ::fsync(fd) == 0;
  const int saved = errno;
  ::close(fd);
  errno = saved;
  return ok;
}

// The intact records at the start of `data`.
WalContents ParseWal(std::string_view data) {
  WalContents contents;
  std::string_view rest = data;
  while (rest.size() >= kHeaderBytes) {
    const uint64_t length = GetLe(rest, 4);
    const uint64_t checksum = GetLe(rest.substr(4), 8);
    if (length > kMaxRecordBytes || rest.size() - kHeaderBytes < length) break;
    std::string_view payload = rest.substr(kHeaderBytes, length);
    if (Fnv1a64(payload) != checksum) break;
    cluster::WalRecord record;
    if (!record.ParseFromArray(payload.data(), int(payload.size()))) break;
    contents.records.push_back(std::move(record));
    rest.remove_prefix(kHeaderBytes + length);
    contents.valid_bytes += int64_t(kHeaderBytes + length);
  }
  contents.torn_bytes = int64_t(rest.size());
  return contents;
}

// Creates `dir` (and its parents) when missing, itself 0700. An existing
// `dir` keeps its mode (it may be shared, as /tmp is); one open to group
// or others is warned about (the log file itself is 0600).
absl::Status MakePrivateDir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(dir, ec)) {
    const fs::perms mode = fs::status(dir, ec).permissions();
    if (!ec && (mode & (fs::perms::group_all | fs::perms::others_all)) !=
                   fs::perms::none) {
      KLOG(Warning, kLog) << "state dir " << dir
                          << " is open to other users; the session log in it "
                             "is 0600, but a state dir of its own (created "
                             "0700) keeps even its name private";
    }
    return absl::OkStatus();
  }
  fs::create_directories(dir, ec);
  if (ec)
    return absl::FailedPreconditionError(
        absl::StrCat("coordinator state: cannot create the state dir ", dir,
                     ": ", ec.message()));
  fs::permissions(dir, fs::perms::owner_all, fs::perm_options::replace, ec);
  if (ec)
    return absl::FailedPreconditionError(
        absl::StrCat("coordinator state: cannot make the state dir ", dir,
                     " private (mode 0700): ", ec.message()));
  return absl::OkStatus();
}

// The temp file of a compaction; removed unless kept (renamed into place).
struct TempFile {
  std::string path;
  int fd = -1;
  ~TempFile() {
    if (fd < 0) return;
    ::close(fd);
    ::unlink(path.c_str());
  }
};

// A file descriptor closed at scope exit.
struct ScopedFd {
  int fd = -1;
  ~ScopedFd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

std::string EncodeWalRecord(const cluster::WalRecord& record) {
  std::string payload = record.SerializeAsString();
  std::string out;
  out.reserve(kHeaderBytes + payload.size());
  PutLe(payload.size(), 4, &out);
  PutLe(Fnv1a64(payload), 8, &out);
  out += payload;
  return out;
}

absl::StatusOr<WalContents> ReadWalFile(const std::string& path) {
  ScopedFd file;
  file.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (file.fd < 0) {
    if (errno == ENOENT) return WalContents();
    return Errno("open", path);
  }
  std::string data;
  if (!ReadRange(file.fd, 0, INT64_MAX, &data)) return Errno("read", path);
  return ParseWal(data);
}

std::vector<LoggedSession> ReplayWal(
    const std::vector<cluster::WalRecord>& records) {
  std::map<std::string, LoggedSession> sessions;
  for (const cluster::WalRecord& r : records) {
    switch (r.record_case()) {
      case cluster::WalRecord::kCreated: {
        LoggedSession s;
        s.id = r.created().id();
        s.key = r.created().key();
        s.seed = r.created().seed();
        s.owner = r.created().owner();
        if (!sessions.emplace(s.id, s).second) {
          KLOG(Warning, kLog) << "session=" << security::ShortId(s.id)
                              << " created twice in the log; the second "
                                 "record is skipped";
        }
        break;
      }
      case cluster::WalRecord::kTurn: {
        auto it = sessions.find(r.turn().id());
        if (it == sessions.end()) {
          KLOG(Warning, kLog) << "session=" << security::ShortId(r.turn().id())
                              << " has a turn in the log but no creation; "
                                 "skipped";
          break;
        }
        LoggedSession& s = it->second;
        s.history.insert(s.history.end(), r.turn().tokens().begin(),
                         r.turn().tokens().end());
        s.prefill_ends.assign(r.turn().prefill_ends().begin(),
                              r.turn().prefill_ends().end());
        s.turns = r.turn().turns();
        if (r.turn().has_last_turn()) s.last_turn = r.turn().last_turn();
        break;
      }
      case cluster::WalRecord::kStarted: {
        auto it = sessions.find(r.started().id());
        if (it == sessions.end()) {
          KLOG(Warning, kLog)
              << "session=" << security::ShortId(r.started().id())
              << " has a turn start in the log but no creation; skipped";
          break;
        }
        if (!r.started().has_turn()) {
          KLOG(Warning, kLog)
              << "session=" << security::ShortId(r.started().id())
              << " has a turn start without its turn in the log; skipped";
          break;
        }
        it->second.last_turn = r.started().turn();
        break;
      }
      case cluster::WalRecord::kClosed:
        if (sessions.erase(r.closed().id()) == 0) {
          KLOG(Warning, kLog)
              << "session=" << security::ShortId(r.closed().id())
              << " closed in the log but never created";
        }
        break;
      case cluster::WalRecord::kLinks:  // ReplayWalLinks
        break;
      case cluster::WalRecord::RECORD_NOT_SET:
        KLOG(Warning, kLog) << "an empty record in the log; skipped";
        break;
    }
  }
  std::vector<LoggedSession> out;
  out.reserve(sessions.size());
  for (auto& [id, s] : sessions) out.push_back(std::move(s));
  return out;
}

cluster::WalRecord LinkRulesRecord(
    const std::vector<cluster::LinkConfig>& links) {
  cluster::WalRecord record;
  auto* list = record.mutable_links();
  for (const cluster::LinkConfig& l : links) *list->add_links() = l;
  return record;
}

std::optional<std::vector<cluster::LinkConfig>> ReplayWalLinks(
    const std::vector<cluster::WalRecord>& records) {
  std::optional<std::vector<cluster::LinkConfig>> links;
  for (const cluster::WalRecord& r : records) {
    if (r.record_case() != cluster::WalRecord::kLinks) continue;
    links.emplace(r.links().links().begin(), r.links().links().end());
  }
  return links;
}

std::string EncodeCompactedWal(
    const std::vector<LoggedSession>& sessions,
    const std::optional<std::vector<cluster::LinkConfig>>& links) {
  std::string out;
  if (links.has_value()) out += EncodeWalRecord(LinkRulesRecord(*links));
  for (const LoggedSession& s : sessions) {
    cluster::WalRecord created;
    created.mutable_created()->set_id(s.id);
    created.mutable_created()->set_key(s.key);
    created.mutable_created()->set_seed(s.seed);
    created.mutable_created()->set_owner(s.owner);
    out += EncodeWalRecord(created);
    if (s.history.empty() && s.turns == 0 && !s.last_turn.has_value()) continue;
    cluster::WalRecord turn;
    cluster::WalRecord::TurnLogged* t = turn.mutable_turn();
    t->set_id(s.id);
    t->mutable_tokens()->Assign(s.history.begin(), s.history.end());
    t->mutable_prefill_ends()->Assign(s.prefill_ends.begin(),
                                      s.prefill_ends.end());
    t->set_turns(s.turns);
    if (s.last_turn.has_value()) *t->mutable_last_turn() = *s.last_turn;
    out += EncodeWalRecord(turn);
  }
  return out;
}

absl::StatusOr<std::unique_ptr<SessionLog>> SessionLog::Open(
    const std::string& dir, std::vector<LoggedSession>* sessions,
    std::optional<std::vector<cluster::LinkConfig>>* links,
    SessionLogOptions options) {
  if (dir.empty())
    return absl::InvalidArgumentError("coordinator state: empty state dir");
  if (options.compact_min_bytes < 0 || !std::isfinite(options.compact_ratio) ||
      options.compact_ratio < 1.0)
    return absl::InvalidArgumentError(absl::StrCat(
        "coordinator state: compaction thresholds out of range (min bytes ",
        options.compact_min_bytes, ", ratio ", options.compact_ratio,
        "; want min bytes >= 0 and a finite ratio >= 1)"));
  RETURN_IF_ERROR(MakePrivateDir(dir));
  if (::access(dir.c_str(), R_OK | W_OK | X_OK) != 0)
    return Errno("read and write the state dir", dir);
  const std::string path = (std::filesystem::path(dir) / kFileName).string();
  absl::StatusOr<WalContents> contents = ReadWalFile(path);
  if (!contents.ok()) return contents.status();
  if (contents->torn_bytes > 0) {
    KLOG(Warning, kLog) << path << ": the last " << contents->torn_bytes
                        << " bytes are not a whole record (an append cut "
                           "short); cut off after "
                        << contents->records.size() << " records";
  }
  *sessions = ReplayWal(contents->records);
  const std::optional<std::vector<cluster::LinkConfig>> logged_links =
      ReplayWalLinks(contents->records);
  if (links != nullptr) *links = logged_links;

  const std::string snapshot = EncodeCompactedWal(*sessions, logged_links);
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return Errno("create", tmp);
  if (!WriteAll(fd, snapshot) || ::fsync(fd) != 0) {
    absl::Status st = Errno("write", tmp);
    ::close(fd);
    return st;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) return Errno("rename", tmp);
  const bool dir_synced = SyncDir(dir);
  fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (fd < 0) return Errno("open", path);
  if (!sessions->empty() || contents->valid_bytes > 0) {
    KLOG(Info, kLog) << path << ": " << contents->records.size()
                     << " records replayed, " << sessions->size()
                     << " sessions alive";
  }
  std::unique_ptr<SessionLog> log(new SessionLog(
      dir, path, fd, int64_t(snapshot.size()), std::move(options)));
  if (!dir_synced) {
    absl::MutexLock lock(&log->mu_);
    log->dir_sync_pending_ = true;  // tried again before the first append
  }
  return log;
}

SessionLog::SessionLog(std::string dir, std::string path, int fd, int64_t size,
                       SessionLogOptions options)
    : dir_(std::move(dir)),
      path_(std::move(path)),
      options_(std::move(options)),
      fd_(fd),
      size_(size),
      compacted_size_(size) {
  bytes_.store(size, std::memory_order_relaxed);
}

SessionLog::~SessionLog() {
  std::thread thread;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    stop_.store(true);
    thread = std::move(thread_);
  }
  if (thread.joinable()) thread.join();
  absl::MutexLock lock(&mu_);
  if (fd_ >= 0) ::close(fd_);
}

absl::Status SessionLog::Append(const cluster::WalRecord& record) {
  const std::string bytes = EncodeWalRecord(record);
  absl::MutexLock lock(&mu_);
  if (dir_sync_pending_) {
    // The file was renamed into place: records appended to it are not on
    // disk until the rename is.
    if (!SyncDir(dir_))
      return Errno("sync the state dir (the log was renamed in it)", dir_);
    dir_sync_pending_ = false;
  }
  if (tail_dirty_) {
    if (::ftruncate(fd_, off_t(size_)) != 0)
      return Errno("cut a failed append from", path_);
    tail_dirty_ = false;
  }
  if (WriteAll(fd_, bytes) && ::fdatasync(fd_) == 0) {
    size_ += int64_t(bytes.size());
    bytes_.store(size_, std::memory_order_relaxed);
    if (!compaction_wanted_ && !stopping_ && CompactionDue()) {
      compaction_wanted_ = true;
      if (!thread_.joinable()) {
        try {
          thread_ = std::thread(&SessionLog::CompactionThread, this);
        } catch (const std::system_error& e) {
          compaction_wanted_ = false;
          CompactionFailed();
          KLOG(Error, kLog)
              << path_ << ": cannot start the compaction: " << e.what();
        }
      }
    }
    return absl::OkStatus();
  }
  absl::Status st = Errno("append to", path_);
  // A partial record would hide every later one from the replay.
  if (::ftruncate(fd_, off_t(size_)) != 0) {
    tail_dirty_ = true;
    KLOG(Error, kLog) << path_ << ": cannot cut a failed append: "
                      << std::strerror(errno);
  }
  return st;
}

bool SessionLog::CompactionDue() const {
  const double size = double(size_);
  return size > double(options_.compact_min_bytes) &&
         size > options_.compact_ratio * double(compacted_size_) &&
         size_ >= retry_at_;
}

void SessionLog::CompactionFailed() {
  compaction_failures_.fetch_add(1, std::memory_order_relaxed);
  const double step =
      std::max(double(options_.compact_min_bytes),
               (options_.compact_ratio - 1.0) * double(compacted_size_));
  retry_at_ = size_ + std::max<int64_t>(1, int64_t(step));
}

void SessionLog::AwaitCompaction() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(this, &SessionLog::CompactionIdle));
}

void SessionLog::CompactionThread() {
  mu_.Lock();
  for (;;) {
    mu_.Await(absl::Condition(this, &SessionLog::CompactionWork));
    if (stopping_) break;
    const int64_t start = size_;
    mu_.Unlock();
    const absl::Status st = Compact(start);
    if (!st.ok() && !absl::IsCancelled(st)) {
      KLOG(Error, kLog) << path_ << ": online compaction failed, the log "
                        << "goes on in the old file: " << st.message();
    }
    mu_.Lock();
    if (st.ok()) {
      compactions_.fetch_add(1, std::memory_order_relaxed);
      retry_at_ = 0;
    } else if (!absl::IsCancelled(st)) {
      CompactionFailed();
    }
    compaction_wanted_ = false;
  }
  compaction_wanted_ = false;
  mu_.Unlock();
}

absl::Status SessionLog::Hook(std::string_view step) {
  if (!options_.compaction_hook) return absl::OkStatus();
  absl::Status st = options_.compaction_hook(step);
  if (st.ok()) return st;
  return absl::Status(
      st.code(), absl::StrCat("at ", std::string(step), ": ", st.message()));
}

absl::Status SessionLog::Compact(const int64_t start) {
  const absl::Time began = absl::Now();
  const absl::Status cancelled =
      absl::CancelledError("coordinator state: the log is closing");
  // Phase 1: the records up to `start`, compacted, without the lock. Only
  // this thread renames the file, so `path_` is the file appends go to.
  RETURN_IF_ERROR(Hook("read"));
  ScopedFd old;
  old.fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (old.fd < 0) return Errno("open", path_);
  std::string snapshot;
  {
    std::string data;
    if (!ReadRange(old.fd, 0, start, &data)) return Errno("read", path_);
    WalContents contents = ParseWal(data);
    if (contents.valid_bytes != start) {
      return absl::DataLossError(absl::StrCat(
          "coordinator state: ", path_, ": bytes ", contents.valid_bytes,
          " to ", start, " are not whole records (read ", data.size(), ")"));
    }
    data = std::string();
    if (stop_.load()) return cancelled;
    snapshot = EncodeCompactedWal(ReplayWal(contents.records),
                                  ReplayWalLinks(contents.records));
  }
  RETURN_IF_ERROR(Hook("write"));
  if (stop_.load()) return cancelled;
  TempFile tmp;
  tmp.path = path_ + ".tmp";
  tmp.fd = ::open(tmp.path.c_str(),
                  O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0600);
  if (tmp.fd < 0) return Errno("create", tmp.path);
  if (!WriteSynced(tmp.fd, snapshot)) return Errno("write", tmp.path);
  // The records appended meanwhile, still without the lock: those below
  // size_ are on disk and no failed append cuts them.
  int64_t copied = start;
  int64_t end = 0;
  {
    absl::MutexLock lock(&mu_);
    end = size_;
  }
  RETURN_IF_ERROR(Hook("copy"));
  if (stop_.load()) return cancelled;
  if (!CopyRange(old.fd, copied, end, tmp.fd) || ::fdatasync(tmp.fd) != 0)
    return Errno("copy the records appended during the compaction to",
                 tmp.path);
  copied = end;
  if (stop_.load()) return cancelled;

  // Phase 2: appends wait while the last records are copied and the file
  // is switched.
  ScopedFd replaced;  // closed after the lock (freeing the old file's blocks)
  int64_t before = 0;
  int64_t compacted = 0;
  int dir_sync_errno = 0;
  absl::Duration blocked;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time locked = absl::Now();
    RETURN_IF_ERROR(Hook("switch"));
    if (!CopyRange(old.fd, copied, size_, tmp.fd) || ::fdatasync(tmp.fd) != 0)
      return Errno("copy the records appended during the compaction to",
                   tmp.path);
    compacted = int64_t(snapshot.size()) + (size_ - start);
    const off_t written = ::lseek(tmp.fd, 0, SEEK_END);
    if (written != off_t(compacted)) {
      return absl::DataLossError(absl::StrCat(
          "coordinator state: ", tmp.path, " holds ", int64_t(written),
          " bytes after the compaction, not ", compacted));
    }
    if (::rename(tmp.path.c_str(), path_.c_str()) != 0)
      return Errno("rename", tmp.path);
    replaced.fd = fd_;
    fd_ = tmp.fd;
    tmp.fd = -1;  // kept: it is the log now
    before = size_;
    size_ = compacted;
    compacted_size_ = compacted;
    tail_dirty_ = false;  // the bytes of a failed append were not copied
    bytes_.store(size_, std::memory_order_relaxed);
    if (!SyncDir(dir_)) {
      dir_sync_errno = errno;
      dir_sync_pending_ = true;
    }
    blocked = absl::Now() - locked;
  }
  if (dir_sync_errno != 0) {
    KLOG(Error, kLog) << dir_ << ": cannot fsync the state dir after "
                      << "compacting the log (tried again before the next "
                      << "append): " << std::strerror(dir_sync_errno);
  }
  KLOG(Info, kLog) << path_ << ": compacted " << before << " -> " << compacted
                   << " bytes in "
                   << absl::ToDoubleMilliseconds(absl::Now() - began)
                   << " ms (appends waited "
                   << absl::ToDoubleMilliseconds(blocked) << " ms)";
  return absl::OkStatus();
}

}  // namespace karat::coordinator
