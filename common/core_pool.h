// A fixed pool of worker threads standing in for one KARAT device's GPNM
// cores (DESIGN.md §3, §III-C). Kernels split a scan by token range with
// ParallelFor; every item range is computed with the same per-item
// arithmetic whatever the split, so results do not depend on the number of
// cores (DESIGN.md §6).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace karat {

class CorePool {
 public:
  // Starts `cores - 1` worker threads: the thread that calls ParallelFor
  // works too, so `cores` threads run a loop. cores <= 1 starts none and runs
  // everything on the caller. Kernels with less work than
  // `min_parallel_work` multiply-adds run on the caller alone (waking the
  // workers costs microseconds); tests pass 0 to split everything.
  explicit CorePool(int cores, double min_parallel_work = 2e6);
  ~CorePool();  // joins the workers
  CorePool(const CorePool&) = delete;
  CorePool& operator=(const CorePool&) = delete;

  int cores() const { return cores_; }
  double min_parallel_work() const { return min_parallel_work_; }

  // Splits [0, n_items) into at most cores() contiguous ranges, each a
  // multiple of `grain` items except the last, and calls fn(begin, end) once
  // per non-empty range, concurrently; returns when all calls are done.
  // Range i covers items [i * chunk, (i + 1) * chunk) with chunk =
  // ceil(n_items / (cores * grain)) * grain, so the split is a pure function
  // of (n_items, grain, cores). Calls from several threads are serialised
  // (one loop at a time); fn must not call ParallelFor on the same pool.
  // A worker that finished a loop polls for the next one for up to 50 us
  // before it blocks on a condition variable, and the caller polls for the
  // workers' completion the same way: a device's stages of one step follow
  // each other within tens of microseconds, and a blocked thread takes
  // 8-30 us to be woken.
  void ParallelFor(int64_t n_items, int64_t grain,
                   const std::function<void(int64_t, int64_t)>& fn);

 private:
  void WorkerLoop(int worker);

  const int cores_;
  const double min_parallel_work_;
  std::mutex call_mu_;  // one ParallelFor at a time
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_;
  // The current loop; written before generation_ advances (release), read
  // by a worker after it sees the new generation (acquire).
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_items_ = 0, chunk_ = 0;
  // Advanced under mu_ (so that a blocking worker cannot miss it), read
  // without it by polling workers.
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};        // workers still running the loop
  std::atomic<bool> stopping_{false};  // set under mu_
  std::vector<std::thread> threads_;
};

// Waking the other cores costs a few microseconds: a kernel with less work
// than the pool's threshold (in multiply-adds) runs on the calling thread
// alone (null is returned for it; so is a null pool). The split never
// changes the result, only where it is computed.
inline CorePool* PoolFor(CorePool* pool, double work) {
  return pool != nullptr && work >= pool->min_parallel_work() ? pool : nullptr;
}

// Runs fn over [0, n_items) on `pool`, or on the calling thread in one call
// when `pool` is null (the reference engine's path: same ranges' arithmetic,
// same bits).
void ParallelFor(CorePool* pool, int64_t n_items, int64_t grain,
                 const std::function<void(int64_t, int64_t)>& fn);

}  // namespace karat
