// Helpers of the write-ahead log's tests (coordinator/wal.h): temp dirs,
// records, and comparisons of replayed sessions.
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "coordinator/wal.h"

namespace karat::coordinator::wal_testing {

namespace cl = ::karat::cluster;

// /dev/shm where it can be written (fdatasync costs nothing there: for
// tests of many appends), else the system temp dir.
inline std::filesystem::path MemoryTempBase() {
  std::error_code ec;
  if (std::filesystem::is_directory("/dev/shm", ec) &&
      ::access("/dev/shm", W_OK | X_OK) == 0)
    return "/dev/shm";
  return std::filesystem::temp_directory_path();
}

// A fresh directory under `base` (default: the system temp dir), removed at
// scope exit.
class TempDir {
 public:
  explicit TempDir(std::filesystem::path base = {}) {
    if (base.empty()) base = std::filesystem::temp_directory_path();
    std::string tmpl = (base / "karat_wal_XXXXXX").string();
    REQUIRE(mkdtemp(tmpl.data()) != nullptr);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::permissions(path_, std::filesystem::perms::owner_all,
                                 std::filesystem::perm_options::add, ec);
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string File() const { return path_ + "/" + SessionLog::kFileName; }

 private:
  std::string path_;
};

inline cl::WalRecord Created(const std::string& id, uint64_t key, uint64_t seed,
                             const std::string& owner = "") {
  cl::WalRecord r;
  r.mutable_created()->set_id(id);
  r.mutable_created()->set_key(key);
  r.mutable_created()->set_seed(seed);
  r.mutable_created()->set_owner(owner);
  return r;
}

inline cl::WalRecord Turn(const std::string& id, std::vector<int32_t> tokens,
                          std::vector<int32_t> prefill_ends, int turns) {
  cl::WalRecord r;
  r.mutable_turn()->set_id(id);
  r.mutable_turn()->mutable_tokens()->Assign(tokens.begin(), tokens.end());
  r.mutable_turn()->mutable_prefill_ends()->Assign(prefill_ends.begin(),
                                                   prefill_ends.end());
  r.mutable_turn()->set_turns(turns);
  return r;
}

inline cl::WalRecord Closed(const std::string& id) {
  cl::WalRecord r;
  r.mutable_closed()->set_id(id);
  return r;
}

inline int64_t FileSize(const std::string& path) {
  return static_cast<int64_t>(std::filesystem::file_size(path));
}

inline void AppendBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::app);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline cl::WalRecord Links(std::vector<std::pair<std::string, int64_t>> rules) {
  cl::WalRecord r;
  auto* links = r.mutable_links();  // set even when empty
  for (const auto& [source, latency] : rules) {
    cl::LinkConfig* l = links->add_links();
    l->set_source(source);
    l->set_destination("*");
    l->set_latency_us(latency);
  }
  return r;
}

inline cl::LastTurn MakeLastTurn(const std::string& key,
                                 std::vector<int32_t> prompt, int base_tokens,
                                 int generated,
                                 const std::string& finish_reason) {
  cl::LastTurn t;
  t.set_idempotency_key(key);
  t.mutable_prompt()->Assign(prompt.begin(), prompt.end());
  t.set_max_new_tokens(16);
  t.set_temperature(0.5f);
  t.set_base_tokens(base_tokens);
  t.set_generated(generated);
  t.set_finish_reason(finish_reason);
  t.set_prompt_in_history(generated > 0 || !finish_reason.empty());
  return t;
}

inline cl::WalRecord Started(const std::string& id, const cl::LastTurn& turn) {
  cl::WalRecord r;
  r.mutable_started()->set_id(id);
  *r.mutable_started()->mutable_turn() = turn;
  return r;
}

inline cl::WalRecord TurnWithLast(const std::string& id,
                                  std::vector<int32_t> tokens,
                                  std::vector<int32_t> prefill_ends, int turns,
                                  const cl::LastTurn& last) {
  cl::WalRecord r = Turn(id, std::move(tokens), std::move(prefill_ends), turns);
  *r.mutable_turn()->mutable_last_turn() = last;
  return r;
}

inline bool SameTurn(const std::optional<cl::LastTurn>& a,
                     const std::optional<cl::LastTurn>& b) {
  if (a.has_value() != b.has_value()) return false;
  return !a.has_value() || a->SerializeAsString() == b->SerializeAsString();
}

// Every field of `a` and `b` is the same, session by session.
inline void CheckSameSessions(const std::vector<LoggedSession>& a,
                              const std::vector<LoggedSession>& b) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("session " << i << ": " << a[i].id);
    CHECK(a[i].id == b[i].id);
    CHECK(a[i].key == b[i].key);
    CHECK(a[i].seed == b[i].seed);
    CHECK(a[i].owner == b[i].owner);
    CHECK(a[i].history == b[i].history);
    CHECK(a[i].prefill_ends == b[i].prefill_ends);
    CHECK(a[i].turns == b[i].turns);
    CHECK(SameTurn(a[i].last_turn, b[i].last_turn));
  }
}

// The link rules of `a` and `b` are the same.
inline bool SameLinks(const std::optional<std::vector<cl::LinkConfig>>& a,
                      const std::optional<std::vector<cl::LinkConfig>>& b) {
  if (a.has_value() != b.has_value()) return false;
  if (!a.has_value()) return true;
  if (a->size() != b->size()) return false;
  for (size_t i = 0; i < a->size(); ++i) {
    if ((*a)[i].SerializeAsString() != (*b)[i].SerializeAsString())
      return false;
  }
  return true;
}

}  // namespace karat::coordinator::wal_testing
