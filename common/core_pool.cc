#include "common/core_pool.h"

#include <immintrin.h>

#include <algorithm>

namespace karat {
namespace {

// Polls (each a pause instruction, ~50 ns) before blocking: long enough to
// catch the next stage of a kernel, short enough that a thread waiting
// for a core shared with other programs soon yields it.
constexpr int kSpinPolls = 1 << 7;

}  // namespace

CorePool::CorePool(int cores, double min_parallel_work)
    : cores_(std::max(1, cores)), min_parallel_work_(min_parallel_work) {
  for (int w = 1; w < cores_; ++w) {
    threads_.emplace_back([this, w] { WorkerLoop(w); });
  }
}

CorePool::~CorePool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_.store(true);
  }
  wake_.notify_all();
  for (auto& t : threads_) t.join();
}

void CorePool::WorkerLoop(int worker) {
  uint64_t seen = 0;
  for (;;) {
    // The next loop: poll for a while, then block.
    uint64_t gen = seen;
    for (int i = 0; i < kSpinPolls; ++i) {
      gen = generation_.load(std::memory_order_acquire);
      if (gen != seen || stopping_.load(std::memory_order_relaxed)) break;
      _mm_pause();
    }
    if (gen == seen) {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] {
        return stopping_.load() || generation_.load() != seen;
      });
      gen = generation_.load(std::memory_order_acquire);
    }
    if (stopping_.load()) return;
    seen = gen;
    const std::function<void(int64_t, int64_t)>* fn = fn_;
    const int64_t n = n_items_, chunk = chunk_;
    const int64_t begin = int64_t(worker) * chunk;
    const int64_t end = std::min(n, begin + chunk);
    if (begin < end) (*fn)(begin, end);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      // The caller may be blocked on done_: notify under mu_ so that it
      // cannot miss it between its check and its wait.
      std::lock_guard<std::mutex> lock(mu_);
      done_.notify_one();
    }
  }
}

void CorePool::ParallelFor(int64_t n_items, int64_t grain,
                           const std::function<void(int64_t, int64_t)>& fn) {
  if (n_items <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t units = (n_items + grain - 1) / grain;
  const int64_t chunk = (units + cores_ - 1) / cores_ * grain;
  // One range only: no need to wake anyone.
  if (cores_ == 1 || chunk >= n_items) {
    fn(0, n_items);
    return;
  }
  std::lock_guard<std::mutex> call(call_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_items_ = n_items;
    chunk_ = chunk;
    pending_.store(cores_ - 1, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  fn(0, std::min(n_items, chunk));  // range 0 on the calling thread
  for (int i = 0; i < kSpinPolls; ++i) {
    if (pending_.load(std::memory_order_acquire) == 0) break;
    _mm_pause();
  }
  if (pending_.load(std::memory_order_acquire) != 0) {
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return pending_.load() == 0; });
  }
  fn_ = nullptr;
}

void ParallelFor(CorePool* pool, int64_t n_items, int64_t grain,
                 const std::function<void(int64_t, int64_t)>& fn) {
  if (pool != nullptr) {
    pool->ParallelFor(n_items, grain, fn);
  } else if (n_items > 0) {
    fn(0, n_items);
  }
}

}  // namespace karat
