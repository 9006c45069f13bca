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
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cluster.pb.h"
#include "common/attention.h"
#include "common/core_pool.h"
#include "common/frame.h"
#include "common/kv_store.h"
#include "common/model_config.h"
#include "common/sparse_attention.h"

namespace karat {

// Bit 0 of kAttnQKV's optional flags section: the segment's last token is
// the last of its turn's prefill.
constexpr uint32_t kAttnFlagEndsPrefill = 1;

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
  // GPNM cores: the size of the device's core pool. The device worker is
  // one of them; cores - 1 more threads join each kernel (a scan is split by
  // token range, the result does not depend on the count).
  int cores = 1;
  // Timing model (DESIGN.md §3), off when both are 0: a kernel completes
  // no earlier than max(bytes / bandwidth, flops / FLOP rate) after it
  // started, so one box can stand in for slower devices. A zero rate leaves
  // its term out.
  double bandwidth_gbps = 0;  // 1e9 bytes/s
  double tflops = 0;          // 1e12 floating-point operations/s
};

// The roofline time of a kernel: max(bytes / bandwidth, flops / rate), each
// term only when its rate is > 0; zero when both are off. Pure.
absl::Duration RooflineTime(const KernelCost& cost, double bandwidth_gbps,
                            double tflops);
// How much longer a kernel that started `elapsed` ago must take to last its
// roofline time: RooflineTime - elapsed, or zero when that is not positive.
// Pure.
absl::Duration PacingDelay(const KernelCost& cost, double bandwidth_gbps,
                           double tflops, absl::Duration elapsed);

// Thread safety: every method may be called from any thread; the session
// caches are guarded by one mutex, so a Reserve() waits for a kernel in
// progress. Data frames should be handed to Post() so that they run on the
// device's worker in arrival order.
class KaratDevice {
 public:
  static absl::StatusOr<std::unique_ptr<KaratDevice>> Create(
      int index, const ModelConfig& config, int tokens_per_page,
      const DeviceOptions& options);
  // `attention`: the method of the GQA forms, shared by the devices of a
  // node; when null it is built from the config (MagicPIG then fails: it
  // needs its hyperplanes). Ignored for mla_dsa.
  static absl::StatusOr<std::unique_ptr<KaratDevice>> Create(
      int index, const ModelConfig& config, int tokens_per_page,
      const DeviceOptions& options,
      std::shared_ptr<const SparseAttention> attention);
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
  // Pages held plus the attention methods' metadata.
  size_t used_bytes() const;
  int sessions() const { return num_sessions_.load(); }

 private:
  struct Session {
    std::unique_ptr<SessionCache> cache;
    SelectionState selection;
    // GQA methods: per-layer metadata, and its bytes counted in
    // metadata_bytes_.
    std::unique_ptr<AttentionSessionState> method_state;
    size_t metadata_bytes = 0;
    uint64_t ingested_bytes = 0;
  };
  KaratDevice(int index, const ModelConfig& config, int tokens_per_page,
              const DeviceOptions& options);
  absl::Status EnsureRoom(uint64_t session, Session* s, int tokens)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // kAttnQKV for the GQA forms: validates the sections (q, kv, optional
  // flags) and runs RunAttentionLayer.
  absl::Status ProcessGqa(const FrameView& frame, Session* session,
                          std::vector<float>* out, KernelCost* cost)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int index_;
  const ModelConfig config_;
  const KvLayout layout_;
  const AttnShapes shapes_;
  const DeviceOptions options_;
  std::unique_ptr<PageArena> arena_;
  // The device's GPNM cores; kernels run on it under mu_.
  std::unique_ptr<CorePool> pool_;
  std::shared_ptr<const SparseAttention> method_;  // GQA forms only
  std::atomic<size_t> metadata_bytes_{0};

  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Session> sessions_ ABSL_GUARDED_BY(mu_);
  std::atomic<int> num_sessions_{0};
  SerialWorker worker_;
};

}  // namespace karat
