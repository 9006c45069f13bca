#include "coordinator/wal.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/stable_hash.h"

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
  WalContents contents;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return contents;
    return Errno("open", path);
  }
  std::string data;
  char buf[1 << 16];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      absl::Status st = Errno("read", path);
      ::close(fd);
      return st;
    }
    if (n == 0) break;
    data.append(buf, size_t(n));
  }
  ::close(fd);
  std::string_view rest(data);
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
        if (!sessions.emplace(s.id, s).second) {
          KLOG(Warning, kLog) << "session=" << s.id
                              << " created twice in the log; the second "
                                 "record is skipped";
        }
        break;
      }
      case cluster::WalRecord::kTurn: {
        auto it = sessions.find(r.turn().id());
        if (it == sessions.end()) {
          KLOG(Warning, kLog) << "session=" << r.turn().id()
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
          KLOG(Warning, kLog) << "session=" << r.started().id()
                              << " has a turn start in the log but no "
                                 "creation; skipped";
          break;
        }
        if (!r.started().has_turn()) {
          KLOG(Warning, kLog) << "session=" << r.started().id()
                              << " has a turn start without its turn in the "
                                 "log; skipped";
          break;
        }
        it->second.last_turn = r.started().turn();
        break;
      }
      case cluster::WalRecord::kClosed:
        if (sessions.erase(r.closed().id()) == 0) {
          KLOG(Warning, kLog) << "session=" << r.closed().id()
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
    out += EncodeWalRecord(created);
    if (s.history.empty() && s.turns == 0 && !s.last_turn.has_value())
      continue;
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
    std::optional<std::vector<cluster::LinkConfig>>* links) {
  if (dir.empty())
    return absl::InvalidArgumentError("coordinator state: empty state dir");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    return absl::FailedPreconditionError(
        absl::StrCat("coordinator state: cannot create the state dir ", dir,
                     ": ", ec.message()));
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
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("create", tmp);
  if (!WriteAll(fd, snapshot) || ::fsync(fd) != 0) {
    absl::Status st = Errno("write", tmp);
    ::close(fd);
    return st;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) return Errno("rename", tmp);
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);  // the rename
    ::close(dfd);
  }
  fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (fd < 0) return Errno("open", path);
  if (!sessions->empty() || contents->valid_bytes > 0) {
    KLOG(Info, kLog) << path << ": " << contents->records.size()
                     << " records replayed, " << sessions->size()
                     << " sessions alive";
  }
  return std::unique_ptr<SessionLog>(new SessionLog(path, fd));
}

SessionLog::~SessionLog() {
  absl::MutexLock lock(&mu_);
  if (fd_ >= 0) ::close(fd_);
}

absl::Status SessionLog::Append(const cluster::WalRecord& record) {
  const std::string bytes = EncodeWalRecord(record);
  absl::MutexLock lock(&mu_);
  const off_t before = ::lseek(fd_, 0, SEEK_END);
  if (WriteAll(fd_, bytes) && ::fdatasync(fd_) == 0) return absl::OkStatus();
  absl::Status st = Errno("append to", path_);
  // A partial record would hide every later one from the replay.
  if (before >= 0 && ::ftruncate(fd_, before) != 0) {
    KLOG(Error, kLog) << path_ << ": cannot cut a failed append: "
                      << std::strerror(errno);
  }
  return st;
}

}  // namespace karat::coordinator
