// One emulated KARAT device (DESIGN.md §3): a page arena of fixed capacity,
// the caches of the sessions whose home it is, and one worker thread that
// runs the device's data-plane work in arrival order. The devices of one
// node share a NodeMemory: when a session's home device is full, its new
// pages spill to the node's other devices and the home's kernels read them
// in place.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
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
#include "karat_node/frame_order.h"

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
  // Runs `work` on the calling thread, at once, when the worker is idle
  // (nothing queued, nothing running, not stopping) and returns true; work
  // posted meanwhile waits for it as for a posted item, and so does Stop().
  // Otherwise runs nothing and returns false. Saves the worker's wake-up
  // (8-30 us here) for short work that finds the worker idle; `work` must
  // not call Stop() on this worker.
  bool TryRunInline(absl::FunctionRef<void()> work);
  // Runs the work already queued, then joins. Idempotent.
  void Stop();
  size_t queued() const;

 private:
  void Run();
  const std::string name_;
  mutable absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // An item runs (on the worker or inline).
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// The arenas of one KARAT node's devices, which share the node's host memory
// (DESIGN.md §3 "Placement"). A session's pages go to its home device's
// arena and spill to the others only when the home is full. Each device adds
// its arena when it is created, before any session is placed; the NodeMemory
// keeps every arena alive as long as it lives (a session of one device may
// hold pages of another device's arena, so no arena may go before every
// session is gone: each device holds the NodeMemory). Thread-safe.
class NodeMemory {
 public:
  // INVALID_ARGUMENT when `device` already has an arena or the page size
  // differs from the arenas added before.
  absl::Status Add(int device, std::shared_ptr<PageArena> arena);
  // The arenas a session homed on `home` draws from: home first, then the
  // node's other devices in increasing device order.
  std::vector<PageArena*> ArenasFor(int home) const;
  // The device ids in ArenasFor(home)'s order.
  std::vector<int> DevicesFor(int home) const;

 private:
  mutable absl::Mutex mu_;
  std::map<int, std::shared_ptr<PageArena>> arenas_ ABSL_GUARDED_BY(mu_);
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
  // The node's shared memory: when set, the device adds its arena and its
  // sessions spill to the other devices of the same NodeMemory. When null
  // the device stands alone (a full arena refuses).
  std::shared_ptr<NodeMemory> memory = nullptr;
};

// What one device has done and holds (DESIGN.md §3), for the node's stats.
struct DeviceMetrics {
  // Seconds the worker spent in kernels: from taking the device to the end
  // of the frame's kernels, including the timing model's pacing.
  double busy_seconds = 0;
  uint64_t frames = 0;        // data frames processed successfully
  uint64_t frame_errors = 0;  // data frames refused or failed
  // Frame order (karat_node/frame_order.h): stale copies skipped, repeats
  // of an attention frame computed again, frames of superseded turns
  // refused, attention frames refused for want of their index keys.
  uint64_t frames_stale = 0;
  uint64_t frames_repeated = 0;
  uint64_t frames_superseded = 0;
  uint64_t frames_without_index = 0;
  // Bytes the kernels read (their KernelCost), and the part of it read from
  // other devices' arenas: a frame's bytes are attributed to spilled pages
  // in proportion to the layer's stored positions that lie on them.
  uint64_t kernel_bytes = 0;
  uint64_t cross_device_bytes = 0;
  // Occupancy: pages of this device's arena (whoever's home they serve).
  uint64_t used_bytes = 0;
  uint64_t capacity_bytes = 0;
  // Of the pages of this device's sessions: bytes held on other devices.
  uint64_t spilled_bytes = 0;
  // Of this arena's pages: bytes held for other devices' sessions.
  uint64_t hosted_bytes = 0;
  // The attention methods' metadata (exact bytes; it is charged to the
  // arenas in whole pages).
  uint64_t metadata_bytes = 0;
  int sessions = 0;  // sessions whose home this is
};

// Adds `m` to a stats map as "device.<index>.<name>" entries (busy_seconds,
// frames, frame_errors, frames_stale, frames_repeated, frames_superseded,
// frames_without_index, kernel_bytes, cross_device_bytes, used_bytes,
// capacity_bytes, spilled_bytes, hosted_bytes, metadata_bytes, sessions).
void ExportDeviceMetrics(int index, const DeviceMetrics& m,
                         std::map<std::string, double>* stats);

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

  // What Reserve did besides making room.
  struct ReserveResult {
    // The session's KV could not be cut at kv_tokens (an attention method's
    // turn-end metadata covered the cut: TruncateSessionKv) and was dropped
    // whole; the caller feeds the whole token log.
    bool kv_dropped = false;
    // The bytes the session holds afterwards (SessionCache::bytes: its
    // pages here and spilled, those of its metadata included).
    int64_t session_bytes = 0;
  };
  // Ensures room for `tokens` positions of `session`, creating its cache on
  // first use. Pages the arena cannot hold spill to the node's other devices
  // (DeviceOptions::memory). RESOURCE_EXHAUSTED (and nothing changed, a new
  // session not created) when the node's arenas cannot hold them now,
  // counting the pages held for the session's metadata; OUT_OF_RANGE when
  // they could not even with no other session on the node. `turn_epoch`
  // fences the session's older turns off (their frames are refused from
  // now on: frame_order.h); `kv_tokens` >= 0 cuts what is stored beyond
  // that many positions (a failed turn's leftovers), -1 keeps everything.
  absl::StatusOr<ReserveResult> Reserve(uint64_t session, int tokens,
                                        uint64_t turn_epoch = 0,
                                        int kv_tokens = -1);
  bool HasSession(uint64_t session) const;
  // Frees the session's pages, each to its own arena; NOT_FOUND when the
  // session's home is not this device.
  absl::Status Free(uint64_t session);

  // Runs one kIndexQK or kAttnQKV frame for this device: validates the
  // session, layer, segment and every section length against the shapes,
  // then appends the entries and runs the kernels. For kAttnQKV `out`
  // receives n x H x out_dim floats. `ingested` receives the bytes of KV
  // and index-key entries appended. Never reads outside the frame. The
  // methods' metadata that grows in a frame is charged to the arenas after
  // the kernels; when they cannot supply the pages the frame fails with
  // RESOURCE_EXHAUSTED naming the metadata. Frames go in the session's
  // frame order (frame_order.h): `*skipped` (may be null) is set for a
  // stale copy or a repeated index frame, which changes nothing and needs
  // no answer; a frame of a superseded turn fails FAILED_PRECONDITION; an
  // attention frame whose index keys did not arrive fails ABORTED (the
  // sender resends both).
  absl::Status Process(const FrameView& frame, std::vector<float>* out,
                       uint64_t* ingested, bool* skipped = nullptr);

  // Runs `work` on the device's worker thread, after the work posted before.
  void Post(absl::AnyInvocable<void()> work) { worker_.Post(std::move(work)); }
  // Runs `work` on the calling thread instead when the worker is idle
  // (SerialWorker::TryRunInline); false, running nothing, otherwise.
  bool TryRunInline(absl::FunctionRef<void()> work) {
    return worker_.TryRunInline(work);
  }
  // Whether the timing model is on (a kernel may sleep to last its
  // roofline time).
  bool paced() const {
    return options_.bandwidth_gbps > 0 || options_.tflops > 0;
  }
  // Stops the worker after the queued work.
  void Stop() { worker_.Stop(); }

  cluster::DeviceInfo Info() const;
  size_t capacity_bytes() const;
  // The pages of this device's arena: KV and the pages charged for the
  // attention methods' metadata, of its own sessions and of sessions spilled
  // here from other devices. Never exceeds capacity_bytes().
  size_t used_bytes() const;
  int sessions() const { return num_sessions_.load(); }
  DeviceMetrics Metrics() const;

 private:
  struct Session {
    std::unique_ptr<SessionCache> cache;
    SelectionState selection;
    // GQA methods: per-layer metadata, and its bytes counted in
    // metadata_bytes_ and charged to the cache's pages.
    std::unique_ptr<AttentionSessionState> method_state;
    size_t metadata_bytes = 0;
    uint64_t ingested_bytes = 0;
    // Pages of the cache on this device and off it, as last added to
    // home_pages_ and spilled_pages_.
    int64_t home_pages = 0;
    int64_t spilled_pages = 0;
    // Frame order (frame_order.h): the newest turn Reserve fenced in, the
    // last frame applied, and the index frame `selection` came from.
    uint64_t fence = 0;
    std::optional<FrameKey> last;
    std::optional<FrameKey> selection_key;
    // The output of `last` when it is a decode-sized attention frame
    // (kKeptOutputTokens) or a GQA frame that ends its turn's prefill,
    // answered again to its repeat. The latter cannot be computed again:
    // the method's turn-end metadata (ClusterKV's clusters, MagicPIG's
    // mean), built after its tokens attended, would change their selections.
    std::vector<float> last_out;
  };
  static constexpr uint32_t kKeptOutputTokens = 4;
  // A fresh cache (and method state) on this device's arenas.
  Session NewSession();
  // Pages `tokens` positions of a session take in every layer; whether the
  // node's arenas could hold them with nothing else on them.
  bool FitsEmptyNode(int tokens) const;
  KaratDevice(int index, const ModelConfig& config, int tokens_per_page,
              const DeviceOptions& options);
  absl::Status EnsureRoom(uint64_t session, Session* s, int tokens)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Charges the session's metadata, as it is now, to its cache's pages.
  absl::Status ChargeMetadata(uint64_t session, Session* s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Brings home_pages_ and spilled_pages_ up to date with the session's
  // cache (before it is dropped: with `dropping`, removes its share).
  void UpdatePageCounts(Session* s, bool dropping = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The frame's work under mu_ (Process validates the header first).
  absl::Status ProcessLocked(const FrameView& frame, std::vector<float>* out,
                             uint64_t* ingested, KernelCost* cost,
                             bool* skipped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Applies a frame the session's frame order admits: appends its entries
  // and runs the kernels.
  absl::Status ApplyLocked(const FrameView& frame, Session* session,
                           std::vector<float>* out, uint64_t* ingested,
                           KernelCost* cost) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
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
  // Shared with options_.memory, which keeps it alive while pages of it may
  // still be held by sessions of other devices.
  std::shared_ptr<PageArena> arena_;
  // The device's GPNM cores; kernels run on it under mu_.
  std::unique_ptr<CorePool> pool_;
  std::shared_ptr<const SparseAttention> method_;  // GQA forms only
  std::atomic<size_t> metadata_bytes_{0};
  // Pages of this device's sessions on its own arena and on other devices'.
  std::atomic<int64_t> home_pages_{0};
  std::atomic<int64_t> spilled_pages_{0};
  std::atomic<int64_t> busy_ns_{0};
  std::atomic<uint64_t> frames_{0};
  std::atomic<uint64_t> frame_errors_{0};
  std::atomic<uint64_t> frames_stale_{0};
  std::atomic<uint64_t> frames_repeated_{0};
  std::atomic<uint64_t> frames_superseded_{0};
  std::atomic<uint64_t> frames_without_index_{0};
  std::atomic<uint64_t> kernel_bytes_{0};
  std::atomic<uint64_t> cross_device_bytes_{0};

  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Session> sessions_ ABSL_GUARDED_BY(mu_);
  std::atomic<int> num_sessions_{0};
  SerialWorker worker_;
};

}  // namespace karat
