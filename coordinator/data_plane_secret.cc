#include "coordinator/data_plane_secret.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "security/hmac.h"

namespace karat::coordinator {
namespace {

absl::Status FileError(const std::string& path, const std::string& what) {
  return absl::FailedPreconditionError(
      absl::StrCat("data-plane secret ", path, ": ", what));
}

// Reads the secret from an open file descriptor after checking what it is.
absl::StatusOr<std::string> ReadSecret(int fd, const std::string& path) {
  struct stat st;
  if (fstat(fd, &st) != 0) return FileError(path, std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return FileError(path, "not a regular file");
  if ((st.st_mode & 077) != 0) {
    return FileError(
        path, absl::StrCat("mode ", absl::StrFormat("%03o", st.st_mode & 0777),
                           " lets others than its owner read or write it "
                           "(chmod 600 ",
                           path, ")"));
  }
  if (st.st_size != off_t(kDataPlaneSecretBytes)) {
    return FileError(path, absl::StrCat(st.st_size, " bytes, expected ",
                                        kDataPlaneSecretBytes,
                                        " (remove it to make a new secret)"));
  }
  std::string secret(kDataPlaneSecretBytes, '\0');
  size_t done = 0;
  while (done < secret.size()) {
    const ssize_t n = read(fd, secret.data() + done, secret.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return FileError(path, "cannot read it");
    done += size_t(n);
  }
  return secret;
}

absl::Status WriteAll(int fd, const std::string& bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::InternalError(std::strerror(errno));
    done += size_t(n);
  }
  return absl::OkStatus();
}

// Writes a new secret to `path` (a temporary file first, mode 0600 from its
// creation, then a rename, and the directory synced).
absl::StatusOr<std::string> CreateSecret(const std::string& dir,
                                         const std::string& path) {
  const std::string secret = security::RandomBytes(kDataPlaneSecretBytes);
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  const int fd =
      open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    return FileError(tmp,
                     absl::StrCat("cannot create: ", std::strerror(errno)));
  }
  absl::Status written = WriteAll(fd, secret);
  if (written.ok() && fsync(fd) != 0)
    written = absl::InternalError(std::strerror(errno));
  close(fd);
  if (!written.ok() || rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why =
        written.ok() ? std::strerror(errno) : std::string(written.message());
    unlink(tmp.c_str());
    return FileError(path, absl::StrCat("cannot write: ", why));
  }
  const int dir_fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    fsync(dir_fd);
    close(dir_fd);
  }
  return secret;
}

}  // namespace

absl::StatusOr<std::string> LoadOrCreateDataPlaneSecret(
    const std::string& state_dir) {
  if (state_dir.empty()) {
    return security::RandomBytes(kDataPlaneSecretBytes);
  }
  std::error_code ec;
  std::filesystem::create_directories(state_dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(absl::StrCat(
        "state dir ", state_dir, ": cannot create it: ", ec.message()));
  }
  const std::string path = absl::StrCat(state_dir, "/", kDataPlaneSecretFile);
  const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd >= 0) {
    absl::StatusOr<std::string> secret = ReadSecret(fd, path);
    close(fd);
    return secret;
  }
  if (errno != ENOENT) {
    return FileError(path, absl::StrCat("cannot open: ", std::strerror(errno)));
  }
  return CreateSecret(state_dir, path);
}

absl::StatusOr<std::string> DataPlaneSecretFor(
    const cluster::SecurityConfig& security, const std::string& state_dir) {
  if (security.plaintext()) return std::string();
  return LoadOrCreateDataPlaneSecret(state_dir);
}

}  // namespace karat::coordinator
