// karat-bench-fabric: the project's Transport against libfabric's own
// fi_pingpong (Debian's libfabric-bin) on the same provider and sizes, in the
// same run, on this host.
//
//   karat-bench-fabric [--providers shm,tcp] [--sizes 64,4096,...]
//                      [--quick] [--no-fi-pingpong] [--repeat N]
//                      [--receive-buffers N]
//
// For every provider and message size, two processes (this one and a forked
// child):
//   * latency: ping-pong with SendShared(); the reply is sent from the
//     receive handler, and the next ping from the originator's handler, so
//     only the transports' own threads run. Reported one-way: round trip / 2
//     (as fi_pingpong's usec/xfer).
//   * bandwidth: one-way stream of messages from the parent's main thread;
//     the child acknowledges the last one. MB/s = 1e6 bytes per second.
//     "MB/s" sends with SendShared() (large messages without a copy), "copy"
//     with Send(), which copies each message into a transport buffer.
//   * fi_pingpong: `fi_pingpong -e rdm -p PROVIDER -S SIZE -I ITERS` server
//     and client on localhost; its usec/xfer and MB/sec columns.
// Ratios: our bandwidth / fi_pingpong's MB/sec, our latency / its usec/xfer.
// With --repeat N every measurement is taken N times and the best kept.
// --receive-buffers sets FabricOptions::receive_buffers (default 16): large
// messages land in that many rotating buffers, fi_pingpong reuses one.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/log.h"
#include "common/transport.h"

namespace karat {
namespace {

using Clock = std::chrono::steady_clock;

// kBandwidth streams with SendShared() (zero copy for large messages),
// kBandwidthCopy with Send() (copies every message).
enum class Mode { kLatency, kBandwidth, kBandwidthCopy };

struct Result {
  double latency_us = 0;  // one-way
  double mbps = 0;        // MB/s (1e6 bytes)
};

bool WriteAll(int fd, const void* data, size_t len) {
  const char* p = static_cast<const char*>(data);
  while (len > 0) {
    const ssize_t n = write(fd, p, len);
    if (n <= 0) return false;
    p += n;
    len -= static_cast<size_t>(n);
  }
  return true;
}

bool ReadAll(int fd, void* data, size_t len) {
  char* p = static_cast<char*>(data);
  while (len > 0) {
    const ssize_t n = read(fd, p, len);
    if (n <= 0) return false;
    p += n;
    len -= static_cast<size_t>(n);
  }
  return true;
}

bool WriteString(int fd, const std::string& s) {
  const uint32_t n = static_cast<uint32_t>(s.size());
  return WriteAll(fd, &n, sizeof(n)) && WriteAll(fd, s.data(), s.size());
}

std::optional<std::string> ReadString(int fd) {
  uint32_t n = 0;
  if (!ReadAll(fd, &n, sizeof(n))) return std::nullopt;
  std::string s(n, '\0');
  if (!ReadAll(fd, s.data(), n)) return std::nullopt;
  return s;
}

int g_receive_buffers = FabricOptions().receive_buffers;

FabricOptions Options(const std::string& provider, size_t size) {
  FabricOptions o;
  o.provider = provider;
  if (provider == "tcp") o.node = "127.0.0.1";
  o.max_message_size = std::max<size_t>(size, 4096);
  o.receive_buffers = g_receive_buffers;
  return o;
}

// The forked peer: echoes (latency) or counts and acknowledges (bandwidth).
[[noreturn]] void RunChild(const std::string& provider, Mode mode, size_t size,
                           int iters, int to_parent, int from_parent) {
  auto t = OpenFabricTransport(Options(provider, size));
  if (!t.ok()) {
    std::fprintf(stderr, "child: %s\n", t.status().ToString().c_str());
    _exit(1);
  }
  Transport* transport = t->get();
  std::atomic<PeerId> parent{kUnknownPeer};
  std::atomic<int> received{0};
  auto reply = std::make_shared<const std::string>(size, 'r');
  transport->SetReceiveHandler([&](std::string_view m) {
    const PeerId p = parent.load(std::memory_order_acquire);
    if (mode == Mode::kLatency) {
      (void)transport->SendShared(p, reply);
    } else if (received.fetch_add(1) + 1 == iters) {
      received.store(0);
      (void)transport->Send(p, "k", 1);
    }
  });
  if (!WriteString(to_parent, transport->LocalAddress())) _exit(1);
  auto address = ReadString(from_parent);
  if (!address) _exit(1);
  auto id = transport->AddPeer("parent", *address);
  if (!id.ok()) _exit(1);
  parent.store(*id, std::memory_order_release);
  const char ready = 'r';
  if (!WriteAll(to_parent, &ready, 1)) _exit(1);
  char done;
  (void)ReadAll(from_parent, &done, 1);  // the parent closes the pipe
  transport->Shutdown();
  _exit(0);
}

// One measurement of the project's transport with a forked peer.
std::optional<Result> MeasureOurs(const std::string& provider, Mode mode,
                                  size_t size, int iters, int warmup) {
  int c2p[2], p2c[2];
  if (pipe(c2p) != 0 || pipe(p2c) != 0) return std::nullopt;
  const int total = iters + warmup;
  const pid_t pid = fork();
  if (pid < 0) return std::nullopt;
  if (pid == 0) {
    close(c2p[0]);
    close(p2c[1]);
    RunChild(provider, mode, size, mode == Mode::kLatency ? total : iters,
             c2p[1], p2c[0]);
  }
  close(c2p[1]);
  close(p2c[0]);
  std::optional<Result> result;
  {
    auto t = OpenFabricTransport(Options(provider, size));
    if (!t.ok()) {
      std::fprintf(stderr, "%s\n", t.status().ToString().c_str());
    } else {
      Transport* transport = t->get();
      std::atomic<PeerId> child{kUnknownPeer};
      absl::Mutex mu;
      int pongs = 0;
      bool finished = false;
      Clock::time_point start, end;
      std::string ping(size, 'p');
      auto shared = std::make_shared<const std::string>(size, 's');
      transport->SetReceiveHandler([&](std::string_view) {
        absl::MutexLock lock(&mu);
        if (mode == Mode::kLatency) {
          ++pongs;
          if (pongs == warmup) start = Clock::now();
          if (pongs == total) {
            end = Clock::now();
            finished = true;
            return;
          }
          (void)transport->SendShared(child.load(), shared);
        } else {
          end = Clock::now();
          ++pongs;
        }
      });
      auto address = ReadString(c2p[0]);
      char ready;
      if (address && WriteString(p2c[1], transport->LocalAddress()) &&
          ReadAll(c2p[0], &ready, 1)) {
        auto id = transport->AddPeer("child", *address);
        if (id.ok()) {
          child.store(*id);
          absl::MutexLock lock(&mu);
          const absl::Duration bound = absl::Seconds(120);
          bool ok = true;
          if (mode == Mode::kLatency) {
            if (warmup == 0) start = Clock::now();
            mu.Unlock();
            ok = transport->SendShared(*id, shared).ok();
            mu.Lock();
            ok = ok && mu.AwaitWithTimeout(absl::Condition(&finished), bound);
            if (ok) {
              const double s =
                  std::chrono::duration<double>(end - start).count();
              result = Result{s / iters / 2 * 1e6, size * iters / s / 1e6};
            }
          } else {
            // A first round of `iters` messages warms up, the second counts.
            for (int round = 0; round < 2 && ok; ++round) {
              mu.Unlock();
              start = Clock::now();
              for (int i = 0; i < iters && ok; ++i) {
                if (mode == Mode::kBandwidth) {
                  ok = transport->SendShared(*id, shared).ok();
                } else {
                  ok = transport->Send(*id, ping.data(), ping.size()).ok();
                }
              }
              mu.Lock();
              auto acked = [&pongs, round]() { return pongs > round; };
              ok = ok && mu.AwaitWithTimeout(absl::Condition(&acked), bound);
            }
            if (ok) {
              const double s =
                  std::chrono::duration<double>(end - start).count();
              result = Result{s / iters * 1e6, size * iters / s / 1e6};
            }
          }
        }
      }
      transport->Shutdown();
    }
  }
  close(p2c[1]);
  close(c2p[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return result;
}

// fi_pingpong server + client; nullopt when it is missing or fails.
std::optional<Result> MeasureFiPingpong(const std::string& provider,
                                        size_t size, int iters, int port) {
  const std::string prov = provider == "tcp" ? "tcp;ofi_rxm" : provider;
  const std::string common = absl::StrCat("fi_pingpong -e rdm -p '", prov,
                                          "' -S ", size, " -I ", iters);
  const pid_t server = fork();
  if (server < 0) return std::nullopt;
  if (server == 0) {
    const std::string cmd =
        absl::StrCat("exec ", common, " -B ", port, " >/dev/null 2>&1");
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  std::optional<Result> result;
  // The server needs a moment to listen on its control port; retry.
  for (int attempt = 0; attempt < 20 && !result; ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const std::string cmd = absl::StrCat(common, " -P ", port,
                                         " 127.0.0.1 2>/dev/null");
    FILE* f = popen(cmd.c_str(), "r");
    if (f == nullptr) break;
    char line[512];
    while (std::fgets(line, sizeof(line), f) != nullptr) {
      std::vector<std::string> cols =
          absl::StrSplit(line, ' ', absl::SkipWhitespace());
      double mbps, usec;
      if (cols.size() >= 7 && cols[0] != "bytes" &&
          absl::SimpleAtod(cols[5], &mbps) && absl::SimpleAtod(cols[6], &usec)) {
        result = Result{usec, mbps};
      }
    }
    const int rc = pclose(f);
    if (!result && WIFEXITED(rc) && WEXITSTATUS(rc) == 127) break;
  }
  kill(server, SIGTERM);
  int status = 0;
  waitpid(server, &status, 0);
  return result;
}

std::string SizeName(size_t s) {
  if (s >= (1 << 20) && s % (1 << 20) == 0) return absl::StrCat(s >> 20, "Mi");
  if (s >= 1024 && s % 1024 == 0) return absl::StrCat(s >> 10, "Ki");
  return absl::StrCat(s);
}

int Iterations(size_t size, bool quick) {
  // About 256 MiB (latency: a quarter) per measurement, within
  // [50, 20000]; --quick: 16 MiB, at least 20.
  const double budget = quick ? (16 << 20) : (256 << 20);
  return static_cast<int>(std::clamp(budget / static_cast<double>(size),
                                     quick ? 20.0 : 50.0, 20000.0));
}

int Main(int argc, char** argv) {
  std::vector<std::string> providers = {"shm", "tcp"};
  std::vector<size_t> sizes = {64, 1024, 4096, 65536, 1 << 20, 4 << 20};
  bool quick = false;
  bool fi = true;
  int repeat = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", flag.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (flag == "--providers") {
      providers = absl::StrSplit(value(), ',', absl::SkipEmpty());
    } else if (flag == "--sizes") {
      sizes.clear();
      for (absl::string_view s : absl::StrSplit(value(), ',', absl::SkipEmpty())) {
        size_t n;
        if (!absl::SimpleAtoi(s, &n) || n == 0) {
          std::fprintf(stderr, "bad size '%s'\n", std::string(s).c_str());
          return 2;
        }
        sizes.push_back(n);
      }
    } else if (flag == "--quick") {
      quick = true;
    } else if (flag == "--no-fi-pingpong") {
      fi = false;
    } else if (flag == "--receive-buffers") {
      if (!absl::SimpleAtoi(value(), &g_receive_buffers) ||
          g_receive_buffers < 1) {
        return 2;
      }
    } else if (flag == "--repeat") {
      if (!absl::SimpleAtoi(value(), &repeat) || repeat < 1) return 2;
    } else {
      std::fprintf(stderr,
                   "usage: karat-bench-fabric [--providers shm,tcp] "
                   "[--sizes N,...] [--quick] [--no-fi-pingpong] "
                   "[--repeat N] [--receive-buffers N]\n");
      return 2;
    }
  }
  SetLogLevel(LogLevel::kWarning);
  // As the daemons do: Debian's abseil is built without NDEBUG, so every
  // Mutex lock would also update a global lock-order graph.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  std::printf(
      "%-4s %6s | %10s %10s %6s | %10s %10s %6s | %10s %6s\n", "prov",
      "size", "lat us", "fi lat us", "ratio", "MB/s", "fi MB/s", "ratio",
      "copy MB/s", "ratio");
  int port = 47700 + static_cast<int>(getpid() % 1000);
  for (const std::string& provider : providers) {
    for (size_t size : sizes) {
      const int iters = Iterations(size, quick);
      const int lat_iters = std::max(20, iters / 4);
      std::optional<Result> lat, bw, bw_copy, theirs;
      for (int r = 0; r < repeat; ++r) {
        auto l = MeasureOurs(provider, Mode::kLatency, size, lat_iters,
                             std::max(10, lat_iters / 10));
        if (l && (!lat || l->latency_us < lat->latency_us)) lat = l;
        auto b = MeasureOurs(provider, Mode::kBandwidth, size, iters, 0);
        if (b && (!bw || b->mbps > bw->mbps)) bw = b;
        auto c = MeasureOurs(provider, Mode::kBandwidthCopy, size, iters, 0);
        if (c && (!bw_copy || c->mbps > bw_copy->mbps)) bw_copy = c;
        if (fi) {
          auto f = MeasureFiPingpong(provider, size, lat_iters, ++port);
          if (f && !theirs) theirs = f;
          if (f && theirs) {
            theirs->latency_us = std::min(theirs->latency_us, f->latency_us);
            theirs->mbps = std::max(theirs->mbps, f->mbps);
          }
        }
      }
      auto fmt = [](std::optional<double> v) {
        return v ? absl::StrFormat("%10.2f", *v) : std::string("       n/a");
      };
      auto ratio = [](std::optional<double> a, std::optional<double> b) {
        return a && b && *b > 0 ? absl::StrFormat("%6.2f", *a / *b)
                                : std::string("   n/a");
      };
      std::optional<double> our_lat, fi_lat, our_bw, copy_bw, fi_bw;
      if (lat) our_lat = lat->latency_us;
      if (bw) our_bw = bw->mbps;
      if (bw_copy) copy_bw = bw_copy->mbps;
      if (theirs) {
        fi_lat = theirs->latency_us;
        fi_bw = theirs->mbps;
      }
      std::printf("%-4s %6s | %s %s %s | %s %s %s | %s %s\n",
                  provider.c_str(), SizeName(size).c_str(),
                  fmt(our_lat).c_str(), fmt(fi_lat).c_str(),
                  ratio(our_lat, fi_lat).c_str(), fmt(our_bw).c_str(),
                  fmt(fi_bw).c_str(), ratio(our_bw, fi_bw).c_str(),
                  fmt(copy_bw).c_str(), ratio(copy_bw, fi_bw).c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace
}  // namespace karat

int main(int argc, char** argv) { return karat::Main(argc, argv); }
