// ThreadSanitizer builds only: ThreadSanitizer sees the ordering that
// Abseil's mutexes, waits and notifications and OpenMP's parallel regions
// give (tests/sanitizers/tsan_annotations.cc annotates them, since Debian's
// libraries are not instrumented), and still reports a race that they do not
// order. Each scenario is a run of tsan_probe (ThreadSanitizer exits 66
// after a report).
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <sstream>
#include <string>

extern char** environ;

namespace {

struct Outcome {
  int exit_code = -1;
  std::string output;
};

Outcome RunProbe(const std::string& scenario) {
  char tmpl[] = "/tmp/karat-tsan-probe-XXXXXX";
  const int fd = mkstemp(tmpl);
  REQUIRE(fd >= 0);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fd, 1);
  posix_spawn_file_actions_adddup2(&fa, fd, 2);
  const std::string probe = KARAT_TSAN_PROBE;
  char* argv[] = {const_cast<char*>(probe.c_str()),
                  const_cast<char*>(scenario.c_str()), nullptr};
  pid_t pid;
  const int rc = posix_spawn(&pid, argv[0], &fa, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  close(fd);
  REQUIRE(rc == 0);
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  Outcome out;
  out.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream in(tmpl);
  std::stringstream ss;
  ss << in.rdbuf();
  out.output = ss.str();
  unlink(tmpl);
  return out;
}

bool Reported(const Outcome& o) {
  return o.output.find("WARNING: ThreadSanitizer: data race") !=
         std::string::npos;
}

}  // namespace

TEST_CASE("absl::Mutex orders its critical sections for ThreadSanitizer",
          "[tsan]") {
  const Outcome o = RunProbe("mutex-ordered");
  INFO(o.output);
  CHECK(o.exit_code == 0);
  CHECK_FALSE(Reported(o));
}

TEST_CASE("an access outside the absl::Mutex is still a reported race",
          "[tsan]") {
  const Outcome o = RunProbe("mutex-racy");
  INFO(o.output);
  CHECK(o.exit_code == 66);
  CHECK(Reported(o));
}

TEST_CASE("Await, CondVar::Wait, Notification and ReaderLock order",
          "[tsan]") {
  const Outcome o = RunProbe("waits-ordered");
  INFO(o.output);
  CHECK(o.exit_code == 0);
  CHECK_FALSE(Reported(o));
}

TEST_CASE("an OpenMP region's start and end order its team", "[tsan]") {
  const Outcome o = RunProbe("omp-ordered");
  INFO(o.output);
  CHECK(o.exit_code == 0);
  CHECK_FALSE(Reported(o));
}

TEST_CASE("a race between an OpenMP team's threads is reported", "[tsan]") {
  const Outcome o = RunProbe("omp-racy");
  INFO(o.output);
  CHECK(o.exit_code == 66);
  CHECK(Reported(o));
}
