// karat-bench-fabric: the project's Transport against libfabric's own
// fi_pingpong (Debian's libfabric-bin) on the same provider and sizes, in the
// same run, on this host.
//
//   karat-bench-fabric [--providers shm,tcp] [--sizes 64,4096,...]
//                      [--quick] [--no-fi-pingpong] [--repeat N]
//                      [--receive-buffers N] [--posted-receives N]
//                      [--no-table] [--no-ingest]
//                      [--ingest-tokens N] [--ingest-chunk N] [--spin-us N]
//                      [--one-send-endpoint] [--window N]
//
// For every provider and message size, two processes (this one and a forked
// child):
//   * latency: ping-pong with SendShared(); the reply is sent from the
//     receive handler, and the next ping from the originator's handler, so
//     only the transports' own threads run; the originator's handler counts
//     without a lock. Reported one-way: round trip / 2 (as fi_pingpong's
//     usec/xfer).
//   * bandwidth: one-way stream of messages from the parent's main thread;
//     the child acknowledges the last one. MB/s = 1e6 bytes per second.
//     "MB/s" sends the way the daemons do: with SendSharedAsync() (large
//     messages without a copy), at most --window (default 8) in flight;
//     with RmaPays(provider) (tcp), messages from
//     FabricOptions::rma_threshold on are written by RMA into the receiver's
//     landing zone (where the provider does not order a send after a
//     write, FI_ORDER_SAW, such a send waits for its write's completion);
//     otherwise (shm) they go as plain messages. "alt" is the other way
//     (shm with RMA, tcp with plain messages), "wait" SendShared(), each
//     send waiting for its completion (before this table had the
//     asynchronous column, its "MB/s"), "copy" Send(), which copies each
//     message into a transport buffer first. The latency column uses
//     SendShared().
//   * fi_pingpong: `fi_pingpong -e rdm -p PROVIDER -S SIZE -I ITERS` server
//     and client on localhost; its usec/xfer and MB/sec columns. A client
//     gets 2 min; a server that outlives SIGTERM by 3 s is killed.
// Ratios: our bandwidth / fi_pingpong's MB/sec, our latency / its usec/xfer.
// With --repeat N every measurement is taken N times and the best kept.
// --receive-buffers sets FabricOptions::receive_buffers (default 16) and
// --posted-receives FabricOptions::posted_receives (default 1): large
// messages cycle through the posted buffers only, so with few posted they
// land in cache-warm memory, as fi_pingpong's one buffer does.
// --one-send-endpoint turns FabricOptions::send_endpoint_per_peer off (shm:
// every send from the one endpoint peers know, as before per-peer send
// endpoints), for comparison.
//
// KV ingestion (after the table; --no-ingest skips it, --no-table runs only
// it): the KV entries and DSA index keys of one turn of --ingest-tokens new
// tokens (default 4096) of dsa-tiny, all layers, sent as frames of
// --ingest-chunk tokens (default 512) per layer, [kv bf16 | index-key codes
// | scales], as a prefill's frames go. Two rows per setting: "async" posts
// every frame with SendSharedAsync() and then "E" without waiting for any
// completion (the daemons' way); "wait" sends each frame with SendShared(),
// which returns only once the provider completed it. The child decodes
// each frame (DecodeFrame) and writes its entries into a session's pages
// (common/kv_store.h: PageArena + SessionCache, the store a KARAT device
// uses) on a worker thread, as a KARAT node's device does: the receive
// handler holds each frame in its receive buffer (ReceivedBytes) and queues
// it, so the next frame arrives while one is stored; the clock runs from the
// first frame to the child's acknowledgement after the last one. Pages are
// reserved before the clock starts, as admission does. The child then checks
// every stored byte; "store ms" is the child's own decode + store time within
// the timed turn. Two bounds, each the time the same KV bytes take at a
// streaming bandwidth measured in this run (same provider, same RMA
// setting, the table's "MB/s" way): "hot" streams one frame-sized buffer
// again and again (cache-hot on both sides), "cold" cycles through the
// turn's distinct frames, as the ingestion reads them. The goal is a hot
// ratio (ingest ms / hot bound ms) <= 2.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
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
#include "common/frame.h"
#include "common/kv_store.h"
#include "common/log.h"
#include "common/model_config.h"
#include "common/transport.h"

namespace karat {
namespace {

using Clock = std::chrono::steady_clock;

// kBandwidth streams with SendSharedAsync(), at most g_window messages in
// flight (zero copy for large messages; the daemons' way), kBandwidthWait
// with SendShared(), each send waiting for its completion, kBandwidthCopy
// with Send() (copies every message).
enum class Mode { kLatency, kBandwidth, kBandwidthWait, kBandwidthCopy };

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
int g_posted_receives = FabricOptions().posted_receives;
int g_spin_us = FabricOptions().spin_us;
int g_window = 8;
bool g_send_endpoint_per_peer = FabricOptions().send_endpoint_per_peer;

FabricOptions Options(const std::string& provider, size_t size,
                      bool rma = true) {
  FabricOptions o;
  o.provider = provider;
  if (provider == "tcp") o.node = "127.0.0.1";
  o.max_message_size = std::max<size_t>(size, 4096);
  o.receive_buffers = g_receive_buffers;
  o.posted_receives = g_posted_receives;
  o.use_rma = rma;
  o.spin_us = g_spin_us;
  o.send_endpoint_per_peer = g_send_endpoint_per_peer;
  return o;
}

// The forked peer: echoes (latency) or counts and acknowledges (bandwidth).
[[noreturn]] void RunChild(const std::string& provider, Mode mode, size_t size,
                           int iters, bool rma, int to_parent,
                           int from_parent) {
  auto t = OpenFabricTransport(Options(provider, size, rma));
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

// One measurement of the project's transport with a forked peer. With
// `cycle` (kBandwidth only), the stream sends those messages in turn instead
// of one buffer again and again; `size` must be at least the largest.
std::optional<Result> MeasureOurs(
    const std::string& provider, Mode mode, size_t size, int iters, int warmup,
    bool rma = true,
    const std::vector<std::shared_ptr<const std::string>>* cycle = nullptr) {
  int c2p[2], p2c[2];
  if (pipe(c2p) != 0 || pipe(p2c) != 0) return std::nullopt;
  const int total = iters + warmup;
  const pid_t pid = fork();
  if (pid < 0) return std::nullopt;
  if (pid == 0) {
    close(c2p[0]);
    close(p2c[1]);
    RunChild(provider, mode, size, mode == Mode::kLatency ? total : iters, rma,
             c2p[1], p2c[0]);
  }
  close(c2p[1]);
  close(p2c[0]);
  std::optional<Result> result;
  {
    auto t = OpenFabricTransport(Options(provider, size, rma));
    if (!t.ok()) {
      std::fprintf(stderr, "%s\n", t.status().ToString().c_str());
    } else {
      Transport* transport = t->get();
      std::atomic<PeerId> child{kUnknownPeer};
      absl::Mutex mu;
      int pongs = 0;
      int in_flight = 0;  // kBandwidth's asynchronous sends
      bool send_failed = false;
      bool finished = false;
      Clock::time_point start, end;
      std::string ping(size, 'p');
      auto shared = std::make_shared<const std::string>(size, 's');
      // Latency: the handler (always on the transport's progress thread)
      // counts the pongs itself and takes the lock only at the end, so the
      // round trip holds no lock that the waiting main thread's condition
      // would be evaluated under (fi_pingpong's loop holds none either).
      int lat_pongs = 0;
      transport->SetReceiveHandler([&](std::string_view) {
        if (mode == Mode::kLatency) {
          ++lat_pongs;
          if (lat_pongs == warmup) start = Clock::now();
          if (lat_pongs == total) {
            end = Clock::now();
            absl::MutexLock lock(&mu);
            finished = true;
            return;
          }
          (void)transport->SendShared(child.load(), shared);
          return;
        }
        absl::MutexLock lock(&mu);
        end = Clock::now();
        ++pongs;
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
            double bytes = 0;
            for (int round = 0; round < 2 && ok; ++round) {
              mu.Unlock();
              start = Clock::now();
              bytes = 0;
              for (int i = 0; i < iters && ok; ++i) {
                const std::shared_ptr<const std::string>& m =
                    cycle != nullptr ? (*cycle)[i % cycle->size()] : shared;
                if (mode == Mode::kBandwidth) {
                  bytes += static_cast<double>(m->size());
                  {
                    absl::MutexLock lock(&mu);
                    auto room = [&]() { return in_flight < g_window; };
                    mu.Await(absl::Condition(&room));
                    ++in_flight;
                  }
                  ok = transport
                           ->SendSharedAsync(*id, m,
                                             [&](absl::Status status) {
                                               absl::MutexLock lock(&mu);
                                               --in_flight;
                                               if (!status.ok())
                                                 send_failed = true;
                                             })
                           .ok();
                  if (!ok) {
                    absl::MutexLock lock(&mu);
                    --in_flight;  // not posted: no callback
                  }
                } else if (mode == Mode::kBandwidthWait) {
                  bytes += static_cast<double>(m->size());
                  ok = transport->SendShared(*id, m).ok();
                } else {
                  bytes += static_cast<double>(size);
                  ok = transport->Send(*id, ping.data(), ping.size()).ok();
                }
              }
              mu.Lock();
              // Acknowledged, and every asynchronous send's callback run
              // (they refer to this frame's variables).
              auto acked = [&pongs, &in_flight, round]() {
                return pongs > round && in_flight == 0;
              };
              ok = ok && mu.AwaitWithTimeout(absl::Condition(&acked), bound) &&
                   !send_failed;
            }
            if (ok) {
              const double s =
                  std::chrono::duration<double>(end - start).count();
              result = Result{s / iters * 1e6, bytes / s / 1e6};
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
    // A client that never finishes would hold this loop: at most 2 min.
    const std::string cmd = absl::StrCat("timeout -k 5 120 ", common, " -P ",
                                         port, " 127.0.0.1 2>/dev/null");
    FILE* f = popen(cmd.c_str(), "r");
    if (f == nullptr) break;
    char line[512];
    while (std::fgets(line, sizeof(line), f) != nullptr) {
      std::vector<std::string> cols =
          absl::StrSplit(line, ' ', absl::SkipWhitespace());
      double mbps, usec;
      if (cols.size() >= 7 && cols[0] != "bytes" &&
          absl::SimpleAtod(cols[5], &mbps) &&
          absl::SimpleAtod(cols[6], &usec)) {
        result = Result{usec, mbps};
      }
    }
    const int rc = pclose(f);
    // 127: no fi_pingpong; 124 / 137: the client timed out (no retry).
    if (!result && WIFEXITED(rc) &&
        (WEXITSTATUS(rc) == 127 || WEXITSTATUS(rc) == 124 ||
         WEXITSTATUS(rc) == 137)) {
      if (WEXITSTATUS(rc) != 127) {
        std::fprintf(stderr, "fi_pingpong client timed out after 120 s\n");
      }
      break;
    }
  }
  // An fi_pingpong server has been seen to stay up after SIGTERM (in a
  // futex wait with SIGTERM masked): give it 3 s, then SIGKILL.
  kill(server, SIGTERM);
  int status = 0;
  bool reaped = false;
  for (int i = 0; i < 300 && !reaped; ++i) {
    reaped = waitpid(server, &status, WNOHANG) == server;
    if (!reaped) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (!reaped) {
    std::fprintf(stderr,
                 "fi_pingpong server (pid %d) ignored SIGTERM for 3 s; "
                 "killed\n",
                 static_cast<int>(server));
    kill(server, SIGKILL);
    waitpid(server, &status, 0);
  }
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

// --- KV ingestion -----------------------------------------------------------

constexpr int kIngestTokensPerPage = 64;

// Deterministic contents of position `pos` of `layer`, so the child can
// check what it stored.
uint16_t KvValue(int layer, int pos, int i) {
  return static_cast<uint16_t>((layer * 7919 + pos * 131 + i * 17) & 0x7fff);
}
uint8_t CodeValue(int layer, int pos, int i) {
  return static_cast<uint8_t>(layer * 31 + pos * 7 + i);
}
float ScaleValue(int layer, int pos) { return float(pos) + 0.25f * layer; }

struct IngestPlan {
  ModelConfig config;
  KvLayout layout;
  int tokens = 0;
  int chunk = 0;
  uint64_t kv_bytes = 0;  // KV entries and index keys: "its bytes"
  size_t max_frame = 0;
  std::vector<std::shared_ptr<const std::string>> frames;
};

absl::StatusOr<IngestPlan> MakeIngestPlan(int tokens, int chunk) {
  IngestPlan plan;
  auto config = PresetConfig("dsa-tiny");
  if (!config.ok()) return config.status();
  plan.config = *config;
  plan.layout = MakeKvLayout(plan.config, kIngestTokensPerPage);
  plan.tokens = tokens;
  plan.chunk = chunk;
  const KvLayout& l = plan.layout;
  for (int layer = 0; layer < l.num_layers; ++layer) {
    const bool keys = plan.config.HasIndexer(layer) && l.index_dim > 0;
    for (int start = 0; start < tokens; start += chunk) {
      const int n = std::min(chunk, tokens - start);
      std::vector<uint16_t> kv(size_t(n) * l.kv_dim);
      std::vector<uint8_t> codes(keys ? size_t(n) * l.index_dim : 0);
      std::vector<float> scales(keys ? n : 0);
      for (int t = 0; t < n; ++t) {
        for (int i = 0; i < l.kv_dim; ++i) {
          kv[size_t(t) * l.kv_dim + i] = KvValue(layer, start + t, i);
        }
        if (!keys) continue;
        for (int i = 0; i < l.index_dim; ++i) {
          codes[size_t(t) * l.index_dim + i] = CodeValue(layer, start + t, i);
        }
        scales[t] = ScaleValue(layer, start + t);
      }
      FrameHeader h;
      h.type = static_cast<uint16_t>(FrameType::kAttnQKV);
      h.layer = uint32_t(layer);
      h.session = 1;
      h.pos_start = uint32_t(start);
      h.n_tokens = uint32_t(n);
      std::vector<std::string_view> sections = {std::string_view(
          reinterpret_cast<const char*>(kv.data()), kv.size() * 2)};
      if (keys) {
        sections.emplace_back(reinterpret_cast<const char*>(codes.data()),
                              codes.size());
        sections.emplace_back(reinterpret_cast<const char*>(scales.data()),
                              scales.size() * 4);
      }
      auto frame = std::make_shared<std::string>();
      EncodeFrame(h, sections, frame.get());
      plan.max_frame = std::max(plan.max_frame, frame->size());
      plan.kv_bytes += kv.size() * 2 + codes.size() + scales.size() * 4;
      plan.frames.push_back(std::move(frame));
    }
  }
  return plan;
}

// The KARAT side: writes each frame's entries into a session's pages, from
// the transport's receive thread. Messages: "B" reserves a fresh session
// (answers "b"), a frame is stored, "E" answers "k" at once and then
// "v:<ns>" when every stored byte is as sent ("x:<ns>" otherwise), <ns> being
// the time spent decoding and storing the turn's frames.
class IngestStore {
 public:
  IngestStore(const IngestPlan& plan, std::unique_ptr<PageArena> arena)
      : plan_(plan), arena_(std::move(arena)) {}

  // Returns the reply to send, if any, and whether a check must follow.
  std::string OnMessage(std::string_view m, bool* check) {
    *check = false;
    if (m == "B") {
      cache_.reset();
      cache_ = std::make_unique<SessionCache>(&plan_.layout, arena_.get());
      failed_ = !cache_->Reserve(plan_.tokens).ok();
      store_ns_ = 0;
      return "b";
    }
    if (m == "E") {
      *check = true;
      return "k";
    }
    const Clock::time_point start = Clock::now();
    if (!Store(m)) failed_ = true;
    store_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(
                     Clock::now() - start)
                     .count();
    return "";
  }

  int64_t store_ns() const { return store_ns_; }

  bool Check() const {
    if (failed_ || cache_ == nullptr) return false;
    const KvLayout& l = plan_.layout;
    for (int layer = 0; layer < l.num_layers; ++layer) {
      const bool keys = plan_.config.HasIndexer(layer) && l.index_dim > 0;
      if (cache_->length(layer) != plan_.tokens) return false;
      const LayerView v = cache_->View(layer);
      std::vector<uint8_t> codes(l.index_dim);
      std::vector<uint16_t> kv(l.kv_dim);
      for (int pos = 0; pos < plan_.tokens; ++pos) {
        v.ReadKv(pos, kv.data());
        for (int i = 0; i < l.kv_dim; ++i) {
          if (kv[i] != KvValue(layer, pos, i)) return false;
        }
        if (!keys) continue;
        v.IndexKeyCodes(pos, codes.data());
        for (int i = 0; i < l.index_dim; ++i) {
          if (codes[i] != CodeValue(layer, pos, i)) return false;
        }
        if (v.IndexScale(pos) != ScaleValue(layer, pos)) return false;
      }
    }
    return true;
  }

 private:
  bool Store(std::string_view m) {
    if (cache_ == nullptr) return false;
    absl::StatusOr<FrameView> f = DecodeFrame(m);
    if (!f.ok()) return false;
    const FrameHeader& h = f->header;
    const KvLayout& l = plan_.layout;
    const int layer = int(h.layer);
    const int n = int(h.n_tokens);
    const int start = int(h.pos_start);
    if (layer >= l.num_layers || start + n > plan_.tokens) return false;
    const bool keys = plan_.config.HasIndexer(layer) && l.index_dim > 0;
    if (h.n_sections != (keys ? 3u : 1u) ||
        f->sections[0].size() != size_t(n) * l.kv_dim * 2) {
      return false;
    }
    if (keys && (f->sections[1].size() != size_t(n) * l.index_dim ||
                 f->sections[2].size() != size_t(n) * 4)) {
      return false;
    }
    const auto* kv = reinterpret_cast<const uint16_t*>(f->sections[0].data());
    if (!cache_->WriteKvRun(layer, start, n, kv).ok()) return false;
    if (keys &&
        !cache_
             ->WriteIndexKeyRun(
                 layer, start, n,
                 reinterpret_cast<const uint8_t*>(f->sections[1].data()),
                 reinterpret_cast<const float*>(f->sections[2].data()))
             .ok()) {
      return false;
    }
    cache_->SetLength(layer, std::max(cache_->length(layer), start + n));
    return true;
  }

  const IngestPlan& plan_;
  std::unique_ptr<PageArena> arena_;
  std::unique_ptr<SessionCache> cache_;
  bool failed_ = false;
  int64_t store_ns_ = 0;
};

[[noreturn]] void RunIngestChild(const std::string& provider, bool rma,
                                 const IngestPlan& plan, int to_parent,
                                 int from_parent) {
  auto t = OpenFabricTransport(Options(provider, plan.max_frame, rma));
  if (!t.ok()) {
    std::fprintf(stderr, "child: %s\n", t.status().ToString().c_str());
    _exit(1);
  }
  Transport* transport = t->get();
  const size_t pages_per_layer = plan.layout.PagesFor(plan.tokens);
  auto arena = PageArena::Create(
      2 * pages_per_layer * plan.layout.num_layers * plan.layout.page_bytes,
      plan.layout.page_bytes);
  if (!arena.ok()) _exit(1);
  IngestStore store(plan, std::move(arena).value());
  std::atomic<PeerId> parent{kUnknownPeer};
  // As a KARAT node does: the receive thread hands each message (held in
  // its receive buffer) to the device's worker, which stores it.
  absl::Mutex mu;
  std::deque<ReceivedBytes> queue;  // guarded by mu
  bool stop = false;                // guarded by mu
  std::thread worker([&] {
    for (;;) {
      ReceivedBytes m;
      {
        absl::MutexLock lock(&mu);
        auto ready = [&] { return stop || !queue.empty(); };
        mu.Await(absl::Condition(&ready));
        if (queue.empty()) return;  // stopped
        m = std::move(queue.front());
        queue.pop_front();
      }
      bool check = false;
      const std::string reply = store.OnMessage(m.view(), &check);
      const PeerId p = parent.load(std::memory_order_acquire);
      if (!reply.empty()) (void)transport->Send(p, reply.data(), reply.size());
      if (check) {
        const std::string verdict =
            absl::StrCat(store.Check() ? "v:" : "x:", store.store_ns());
        (void)transport->Send(p, verdict.data(), verdict.size());
      }
    }
  });
  transport->SetReceiveHandler([&](std::string_view m) {
    ReceivedBytes bytes(transport, m);
    absl::MutexLock lock(&mu);
    queue.push_back(std::move(bytes));
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
  (void)ReadAll(from_parent, &done, 1);
  transport->Shutdown();
  {
    absl::MutexLock lock(&mu);
    stop = true;
  }
  worker.join();
  _exit(0);
}

struct IngestResult {
  double seconds = 0;        // best of the timed turns
  double store_seconds = 0;  // the child's decode + store time in that turn
  bool verified = false;
  double rma_messages = 0;
};

// One warm-up turn, then `turns` timed ones; nullopt on failure. The frames
// go with SendSharedAsync(), all posted before "E" (the daemons' way), or
// with `wait_each` with SendShared(), each waiting for its completion.
std::optional<IngestResult> MeasureIngest(const std::string& provider, bool rma,
                                          const IngestPlan& plan, int turns,
                                          bool wait_each) {
  int c2p[2], p2c[2];
  if (pipe(c2p) != 0 || pipe(p2c) != 0) return std::nullopt;
  const pid_t pid = fork();
  if (pid < 0) return std::nullopt;
  if (pid == 0) {
    close(c2p[0]);
    close(p2c[1]);
    RunIngestChild(provider, rma, plan, c2p[1], p2c[0]);
  }
  close(c2p[1]);
  close(p2c[0]);
  std::optional<IngestResult> result;
  {
    auto t = OpenFabricTransport(Options(provider, plan.max_frame, rma));
    if (!t.ok()) {
      std::fprintf(stderr, "%s\n", t.status().ToString().c_str());
    } else {
      Transport* transport = t->get();
      absl::Mutex mu;
      std::string replies;  // guarded by mu
      Clock::time_point acked;
      // Asynchronous sends: outcomes reported, and whether one failed.
      int sends_done = 0;        // guarded by mu
      bool send_failed = false;  // guarded by mu
      transport->SetReceiveHandler([&](std::string_view m) {
        absl::MutexLock lock(&mu);
        if (m == "k") acked = Clock::now();
        replies.append(m);
      });
      auto address = ReadString(c2p[0]);
      char ready;
      if (address && WriteString(p2c[1], transport->LocalAddress()) &&
          ReadAll(c2p[0], &ready, 1)) {
        auto id = transport->AddPeer("child", *address);
        bool ok = id.ok();
        auto await = [&](const std::string& want) {
          absl::MutexLock lock(&mu);
          auto got = [&]() { return replies.size() >= want.size(); };
          if (!mu.AwaitWithTimeout(absl::Condition(&got), absl::Seconds(120)) ||
              replies != want) {
            return false;
          }
          replies.clear();
          return true;
        };
        IngestResult r;
        r.verified = true;
        for (int turn = 0; turn <= turns && ok; ++turn) {
          ok = transport->Send(*id, "B", 1).ok() && await("b");
          {
            absl::MutexLock lock(&mu);
            sends_done = 0;
          }
          int posted = 0;
          const Clock::time_point start = Clock::now();
          for (const auto& frame : plan.frames) {
            if (!ok) break;
            if (wait_each) {
              ok = transport->SendShared(*id, frame).ok();
              continue;
            }
            ok = transport
                     ->SendSharedAsync(*id, frame,
                                       [&](absl::Status status) {
                                         absl::MutexLock lock(&mu);
                                         ++sends_done;
                                         if (!status.ok()) send_failed = true;
                                       })
                     .ok();
            if (ok) ++posted;
          }
          ok = ok && transport->Send(*id, "E", 1).ok();
          if (!wait_each) {
            // Every callback must have run before the next turn (they
            // refer to this frame's variables).
            absl::MutexLock lock(&mu);
            auto all = [&]() { return sends_done == posted; };
            if (!mu.AwaitWithTimeout(absl::Condition(&all),
                                     absl::Seconds(120)) ||
                send_failed) {
              std::fprintf(stderr, "ingest: an asynchronous send failed\n");
              ok = false;
            }
          }
          // "k", then the verdict with the child's store time.
          int64_t store_ns = -1;
          if (ok) {
            absl::MutexLock lock(&mu);
            auto got = [&]() {
              return replies.size() > 3 &&
                     replies.find(':') != std::string::npos;
            };
            ok = mu.AwaitWithTimeout(absl::Condition(&got),
                                     absl::Seconds(120)) &&
                 replies.rfind("kv:", 0) == 0 &&
                 absl::SimpleAtoi(replies.substr(3), &store_ns);
            r.verified = replies.rfind("kx:", 0) != 0;
            replies.clear();
          }
          if (!ok) break;
          const double s = std::chrono::duration<double>(acked - start).count();
          if (turn > 0 && (r.seconds == 0 || s < r.seconds)) {
            r.seconds = s;
            r.store_seconds = store_ns * 1e-9;
          }
        }
        if (ok) {
          r.rma_messages = transport->Counters()["rma_messages_sent"];
          result = r;
        } else if (!r.verified) {
          std::fprintf(stderr, "ingest: the child stored wrong bytes\n");
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

void RunIngestion(const std::vector<std::string>& providers, int tokens,
                  int chunk, bool quick, int repeat) {
  absl::StatusOr<IngestPlan> plan = MakeIngestPlan(tokens, chunk);
  if (!plan.ok()) {
    std::fprintf(stderr, "ingest: %s\n", plan.status().ToString().c_str());
    return;
  }
  const size_t frame = plan->frames.front()->size();
  std::printf(
      "\nKV ingestion: dsa-tiny, %d new tokens, %d layers: %.3f MB of KV and "
      "index keys in %zu frames of %d tokens (%s B each)\n",
      tokens, plan->layout.num_layers, plan->kv_bytes / 1e6,
      plan->frames.size(), chunk, SizeName(frame).c_str());
  std::printf(
      "hot: streaming one cache-hot frame-sized buffer again and again; "
      "cold: streaming the %zu distinct frames in turn. bound = the KV bytes "
      "at that bandwidth; ratio = ingest ms / bound (goal: hot ratio <= 2)\n",
      plan->frames.size());
  std::printf("%-4s %4s %5s | %9s %8s %8s | %8s %8s %6s | %8s %8s %6s | %s\n",
              "prov", "rma", "send", "ingest ms", "MB/s", "store ms",
              "hot MB/s", "bound ms", "ratio", "cold MB/s", "bound ms", "ratio",
              "rma msgs");
  const int turns = quick ? 2 : 5;
  for (const std::string& provider : providers) {
    for (bool rma : {true, false}) {
      // [0]: asynchronous sends, [1]: each send waits for its completion.
      std::optional<IngestResult> best[2];
      std::optional<Result> hot, cold;
      // Interleaved, so that a burst of load elsewhere hits every variant.
      for (int r = 0; r < repeat; ++r) {
        for (int w = 0; w < 2; ++w) {
          auto i = MeasureIngest(provider, rma, *plan, turns, w == 1);
          if (i && (!best[w] || i->seconds < best[w]->seconds)) best[w] = i;
        }
        // The streaming bandwidth at the frame size, same setting.
        auto b = MeasureOurs(provider, Mode::kBandwidth, frame,
                             Iterations(frame, quick), 0, rma);
        if (b && (!hot || b->mbps > hot->mbps)) hot = b;
        auto c = MeasureOurs(provider, Mode::kBandwidth, plan->max_frame,
                             Iterations(frame, quick), 0, rma, &plan->frames);
        if (c && (!cold || c->mbps > cold->mbps)) cold = c;
      }
      for (int w = 0; w < 2; ++w) {
        const char* send = w == 0 ? "async" : "wait";
        if (!best[w] || !hot || !cold) {
          std::printf("%-4s %4s %5s | failed\n", provider.c_str(),
                      rma ? "on" : "off", send);
          continue;
        }
        const double ms = best[w]->seconds * 1e3;
        const double hot_ms = plan->kv_bytes / (hot->mbps * 1e6) * 1e3;
        const double cold_ms = plan->kv_bytes / (cold->mbps * 1e6) * 1e3;
        std::printf(
            "%-4s %4s %5s | %9.3f %8.1f %8.3f | %8.1f %8.3f %6.2f | %8.1f "
            "%8.3f %6.2f | %.0f\n",
            provider.c_str(), rma ? "on" : "off", send, ms,
            plan->kv_bytes / best[w]->seconds / 1e6,
            best[w]->store_seconds * 1e3, hot->mbps, hot_ms, ms / hot_ms,
            cold->mbps, cold_ms, ms / cold_ms, best[w]->rma_messages);
      }
      std::fflush(stdout);
    }
  }
}

int Main(int argc, char** argv) {
  std::vector<std::string> providers = {"shm", "tcp"};
  std::vector<size_t> sizes = {64, 1024, 4096, 65536, 1 << 20, 4 << 20};
  bool quick = false;
  bool fi = true;
  bool table = true;
  bool ingest = true;
  int ingest_tokens = 4096;
  int ingest_chunk = 512;
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
      for (absl::string_view s :
           absl::StrSplit(value(), ',', absl::SkipEmpty())) {
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
    } else if (flag == "--posted-receives") {
      if (!absl::SimpleAtoi(value(), &g_posted_receives) ||
          g_posted_receives < 1) {
        return 2;
      }
    } else if (flag == "--one-send-endpoint") {
      g_send_endpoint_per_peer = false;
    } else if (flag == "--spin-us") {
      if (!absl::SimpleAtoi(value(), &g_spin_us) || g_spin_us < 0) return 2;
    } else if (flag == "--no-table") {
      table = false;
    } else if (flag == "--no-ingest") {
      ingest = false;
    } else if (flag == "--ingest-tokens") {
      if (!absl::SimpleAtoi(value(), &ingest_tokens) || ingest_tokens < 1) {
        return 2;
      }
    } else if (flag == "--ingest-chunk") {
      if (!absl::SimpleAtoi(value(), &ingest_chunk) || ingest_chunk < 1) {
        return 2;
      }
    } else if (flag == "--window") {
      if (!absl::SimpleAtoi(value(), &g_window) || g_window < 1) return 2;
    } else if (flag == "--repeat") {
      if (!absl::SimpleAtoi(value(), &repeat) || repeat < 1) return 2;
    } else {
      std::fprintf(stderr,
                   "usage: karat-bench-fabric [--providers shm,tcp] "
                   "[--sizes N,...] [--quick] [--no-fi-pingpong] "
                   "[--repeat N] [--receive-buffers N] "
                   "[--posted-receives N] [--no-table] "
                   "[--no-ingest] [--ingest-tokens N] [--ingest-chunk N] "
                   "[--spin-us N] [--one-send-endpoint] [--window N]\n");
      return 2;
    }
  }
  SetLogLevel(LogLevel::kWarning);
  // As the daemons do: Debian's abseil is built without NDEBUG, so every
  // Mutex lock would also update a global lock-order graph.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  if (table) {
    std::printf(
        "%-4s %6s | %10s %10s %6s | %10s %10s %6s | %10s %6s | %10s %6s | "
        "%10s %6s\n",
        "prov", "size", "lat us", "fi lat us", "ratio", "MB/s", "fi MB/s",
        "ratio", "alt MB/s", "ratio", "wait MB/s", "ratio", "copy MB/s",
        "ratio");
    int port = 47700 + static_cast<int>(getpid() % 1000);
    for (const std::string& provider : providers) {
      for (size_t size : sizes) {
        const int iters = Iterations(size, quick);
        const int lat_iters = std::max(20, iters / 4);
        std::optional<Result> lat, bw, bw_msg, bw_wait, bw_copy, theirs;
        for (int r = 0; r < repeat; ++r) {
          const bool rma = RmaPays(provider);
          auto l = MeasureOurs(provider, Mode::kLatency, size, lat_iters,
                               std::max(10, lat_iters / 10), rma);
          if (l && (!lat || l->latency_us < lat->latency_us)) lat = l;
          auto b = MeasureOurs(provider, Mode::kBandwidth, size, iters, 0, rma);
          if (b && (!bw || b->mbps > bw->mbps)) bw = b;
          auto m =
              MeasureOurs(provider, Mode::kBandwidth, size, iters, 0, !rma);
          if (m && (!bw_msg || m->mbps > bw_msg->mbps)) bw_msg = m;
          auto w =
              MeasureOurs(provider, Mode::kBandwidthWait, size, iters, 0, rma);
          if (w && (!bw_wait || w->mbps > bw_wait->mbps)) bw_wait = w;
          auto c =
              MeasureOurs(provider, Mode::kBandwidthCopy, size, iters, 0, rma);
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
        std::optional<double> our_lat, fi_lat, our_bw, msg_bw, wait_bw,
            copy_bw, fi_bw;
        if (lat) our_lat = lat->latency_us;
        if (bw) our_bw = bw->mbps;
        if (bw_msg) msg_bw = bw_msg->mbps;
        if (bw_wait) wait_bw = bw_wait->mbps;
        if (bw_copy) copy_bw = bw_copy->mbps;
        if (theirs) {
          fi_lat = theirs->latency_us;
          fi_bw = theirs->mbps;
        }
        std::printf("%-4s %6s | %s %s %s | %s %s %s | %s %s | %s %s | %s %s\n",
                    provider.c_str(), SizeName(size).c_str(),
                    fmt(our_lat).c_str(), fmt(fi_lat).c_str(),
                    ratio(our_lat, fi_lat).c_str(), fmt(our_bw).c_str(),
                    fmt(fi_bw).c_str(), ratio(our_bw, fi_bw).c_str(),
                    fmt(msg_bw).c_str(), ratio(msg_bw, fi_bw).c_str(),
                    fmt(wait_bw).c_str(), ratio(wait_bw, fi_bw).c_str(),
                    fmt(copy_bw).c_str(), ratio(copy_bw, fi_bw).c_str());
        std::fflush(stdout);
      }
    }
  }
  if (ingest) {
    RunIngestion(providers, ingest_tokens, ingest_chunk, quick, repeat);
  }
  return 0;
}

}  // namespace
}  // namespace karat

int main(int argc, char** argv) { return karat::Main(argc, argv); }
