#include "common/core_pool.h"

#include <algorithm>

namespace karat {

CorePool::CorePool(int cores, double min_parallel_work)
    : cores_(std::max(1, cores)), min_parallel_work_(min_parallel_work) {
  for (int w = 1; w < cores_; ++w) {
    threads_.emplace_back([this, w] { WorkerLoop(w); });
  }
}

CorePool::~CorePool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (auto& t : threads_) t.join();
}

void CorePool::WorkerLoop(int worker) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t, int64_t)>* fn;
    int64_t n, chunk;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      fn = fn_;
      n = n_items_;
      chunk = chunk_;
    }
    const int64_t begin = int64_t(worker) * chunk;
    const int64_t end = std::min(n, begin + chunk);
    if (begin < end) (*fn)(begin, end);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_.notify_one();
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
    pending_ = cores_ - 1;
    ++generation_;
  }
  wake_.notify_all();
  fn(0, std::min(n_items, chunk));  // range 0 on the calling thread
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return pending_ == 0; });
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
