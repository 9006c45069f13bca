// tsan_probe SCENARIO: one small concurrent program per scenario, for
// tsan_annotations_test (ThreadSanitizer builds only), which runs each and
// reads ThreadSanitizer's verdict from its exit status and output. The
// "ordered" scenarios hand data between threads only through Abseil's
// synchronization or an OpenMP region's edges, which ThreadSanitizer sees
// through tests/sanitizers/tsan_annotations.cc alone; the "racy" ones have
// a real data race that it must still report.
#include <omp.h>

#include <cstdio>
#include <cstring>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace {

// Written and read by the scenarios' threads; volatile so that -O1 keeps
// every access.
volatile long shared_value = 0;

// Two threads increment under one absl::Mutex.
int MutexOrdered() {
  absl::Mutex mu;
  auto work = [&] {
    for (int i = 0; i < 1000; ++i) {
      absl::MutexLock lock(&mu);
      shared_value = shared_value + 1;
    }
  };
  std::thread a(work), b(work);
  a.join();
  b.join();
  return shared_value == 2000 ? 0 : 1;
}

// The same, but one of the threads does not lock.
int MutexRacy() {
  absl::Mutex mu;
  std::thread a([&] {
    for (int i = 0; i < 1000; ++i) {
      absl::MutexLock lock(&mu);
      shared_value = shared_value + 1;
    }
  });
  std::thread b([&] {
    for (int i = 0; i < 1000; ++i) shared_value = shared_value + 1;
  });
  a.join();
  b.join();
  return 0;
}

// A value handed over by Mutex::Await, CondVar::Wait and a Notification,
// and read back under ReaderLock.
int WaitsOrdered() {
  absl::Mutex mu;
  absl::CondVar cv;
  bool ready = false, seen = false;
  absl::Notification done;
  long payload = 0;
  std::thread producer([&] {
    shared_value = 42;
    {
      absl::MutexLock lock(&mu);
      ready = true;
    }
    {
      absl::MutexLock lock(&mu);
      while (!seen) cv.Wait(&mu);
    }
    payload = 7;
    done.Notify();
  });
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(&ready));
    if (shared_value != 42) return 1;
    seen = true;
    cv.Signal();
  }
  done.WaitForNotification();
  if (payload != 7) return 1;
  if (!done.WaitForNotificationWithTimeout(absl::Seconds(1))) return 1;
  {
    absl::ReaderMutexLock lock(&mu);
    if (!ready) return 1;
  }
  producer.join();
  return 0;
}

// Written before a parallel region, read in it; written in it (one slot per
// thread), read after it; twice, so that the second region reuses the
// team's threads.
int OmpOrdered() {
  long slots[64] = {};
  for (int round = 0; round < 2; ++round) {
    shared_value = round + 1;
#pragma omp parallel num_threads(4)
    {
      const int t = omp_get_thread_num();
      if (t < 64) slots[t] = shared_value;
    }
    for (int t = 0; t < 4; ++t) {
      if (slots[t] != round + 1) return 1;
    }
  }
  return 0;
}

// The team's threads all write one variable.
int OmpRacy() {
#pragma omp parallel num_threads(4)
  { shared_value = shared_value + omp_get_thread_num(); }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const struct {
    const char* name;
    int (*run)();
  } scenarios[] = {
      {"mutex-ordered", MutexOrdered}, {"mutex-racy", MutexRacy},
      {"waits-ordered", WaitsOrdered}, {"omp-ordered", OmpOrdered},
      {"omp-racy", OmpRacy},
  };
  if (argc == 2) {
    for (const auto& s : scenarios) {
      if (std::strcmp(argv[1], s.name) == 0) return s.run();
    }
  }
  std::fprintf(stderr, "usage: tsan_probe SCENARIO (mutex-ordered, "
                       "mutex-racy, waits-ordered, omp-ordered, omp-racy)\n");
  return 2;
}
