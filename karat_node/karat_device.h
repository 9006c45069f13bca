// One emulated KARAT device (DESIGN.md §3): a page arena of fixed capacity,
// the caches of the sessions whose home it is, and one worker thread that
// runs the device's data-plane work in arrival order.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "cluster.pb.h"
#include "common/attention.h"
#include "common/frame.h"
#include "common/kv_store.h"
#include "common/model_config.h"

namespace karat {

// A thread that runs posted work items one at a time, in posting order.
// Blocks on a condition variable while idle. Thread-safe.
class SerialWorker {
 public:
  explicit SerialWorker(std::string name);
  ~SerialWorker();  // Stop()s
  // Work posted after Stop() is dropped.
  void Post(absl::AnyInvocable<void()> work);
  // Runs the work already queued, then joins. Idempotent.
  void Stop();
  size_t queued() const;

 private:
  void Run();
  const std::string name_;
  mutable absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

struct DeviceOptions {
  size_t capacity_bytes = size_t(1) << 30;
  // GPNM cores; kernels run on the device worker for now, the count is
  // configuration and reported in statistics.
  int cores = 1;
};

// Thread safety: every method may be called from any thread; the session
// caches are guarded by one mutex, so a Reserve() waits for a kernel in
// progress. Data frames should be handed to Post() so that they run on the
// device's worker in arrival order.
class KaratDevice {
 public:
  static absl::StatusOr<std::unique_ptr<KaratDevice>> Create(
      int index, const ModelConfig& config, int tokens_per_page,
      const DeviceOptions& options);
  ~KaratDevice();

  int index() const { return index_; }
  const KvLayout& layout() const { return layout_; }
  const AttnShapes& shapes() const { return shapes_; }

  // Ensures room for `tokens` positions of `session`, creating its cache on
  // first use. RESOURCE_EXHAUSTED (and nothing changed, a new session not
  // created) when the arena cannot hold them.
  absl::Status Reserve(uint64_t session, int tokens);
  bool HasSession(uint64_t session) const;
  // Frees the session's pages; NOT_FOUND when it is not on this device.
  absl::Status Free(uint64_t session);

  // Runs one kIndexQK or kAttnQKV frame for this device: validates the
  // session, layer, segment and every section length against the shapes,
  // then appends the entries and runs the kernels. For kAttnQKV `out`
  // receives n x H x out_dim floats. `ingested` receives the bytes of KV
  // and index-key entries appended. Never reads outside the frame.
  absl::Status Process(const FrameView& frame, std::vector<float>* out,
                       uint64_t* ingested);

  // Runs `work` on the device's worker thread, after the work posted before.
  void Post(absl::AnyInvocable<void()> work) { worker_.Post(std::move(work)); }
  // Stops the worker after the queued work.
  void Stop() { worker_.Stop(); }

  cluster::DeviceInfo Info() const;
  size_t capacity_bytes() const;
  size_t used_bytes() const;
  int sessions() const { return num_sessions_.load(); }

 private:
  struct Session {
    std::unique_ptr<SessionCache> cache;
    SelectionState selection;
    uint64_t ingested_bytes = 0;
  };
  KaratDevice(int index, const ModelConfig& config, int tokens_per_page,
              const DeviceOptions& options);
  absl::Status EnsureRoom(uint64_t session, Session* s, int tokens)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int index_;
  const ModelConfig config_;
  const KvLayout layout_;
  const AttnShapes shapes_;
  const DeviceOptions options_;
  std::unique_ptr<PageArena> arena_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Session> sessions_ ABSL_GUARDED_BY(mu_);
  std::atomic<int> num_sessions_{0};
  SerialWorker worker_;
};

}  // namespace karat
