#include "common/core_pool.h"

#include <immintrin.h>

#include <algorithm>
#include <chrono>

namespace karat {
namespace {

// How long a thread polls before it blocks. A blocked worker takes 8-30 us
// to be woken here (a futex wake and a reschedule), which is the whole read
// time of a small Gather + Attend; a device's stages of one step follow each
// other closely (Score, then Select on the calling thread, ~40 us at 128K
// tokens of the small models, then Attend). Reading 2048 scattered entries
// of the small models through the pool right after another loop took
// 59-95 us with 3 us of polling, 37-53 us with 45-50 us (karat-bench-kernels,
// "the gather alone"). Short enough that an idle device's threads soon give
// their cores back.
constexpr std::chrono::microseconds kSpin{50};

// Polls `ready` (a pause instruction between polls, ~20 ns here) until it
// holds or kSpin has passed; returns its last value.
template <typename Ready>
bool SpinUntil(const Ready& ready) {
  const auto deadline = std::chrono::steady_clock::now() + kSpin;
  for (uint32_t i = 1;; ++i) {
    if (ready()) return true;
    // The clock every 16 polls: a read costs about as much as a poll.
    if (i % 16 == 0 && std::chrono::steady_clock::now() >= deadline) {
      return ready();
    }
    _mm_pause();
  }
}

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
    SpinUntil([&] {
      gen = generation_.load(std::memory_order_acquire);
      return gen != seen || stopping_.load(std::memory_order_relaxed);
    });
    if (gen == seen) {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(
          lock, [&] { return stopping_.load() || generation_.load() != seen; });
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
  if (!SpinUntil(
          [&] { return pending_.load(std::memory_order_acquire) == 0; })) {
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
