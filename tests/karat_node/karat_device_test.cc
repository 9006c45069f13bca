// The device timing model as pure functions (no clocks, no sleeps), and
// the device worker's inline runs.
#include "karat_node/karat_device.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace karat {
namespace {

TEST_CASE("roofline time is max(bytes / BW, flops / FLOPS)", "[karat_device]") {
  KernelCost cost;
  cost.bytes = 2e9;   // 2 GB
  cost.flops = 3e12;  // 3 TFLOP
  // Off: no pacing at all.
  CHECK(RooflineTime(cost, 0, 0) == absl::ZeroDuration());
  // 2 GB at 100 GB/s = 20 ms; 3 TFLOP at 1 TFLOP/s = 3 s.
  CHECK(RooflineTime(cost, 100, 0) == absl::Milliseconds(20));
  CHECK(RooflineTime(cost, 0, 1) == absl::Seconds(3));
  CHECK(RooflineTime(cost, 100, 1) == absl::Seconds(3));
  // Memory-bound: 2 GB at 1 GB/s = 2 s beats 3 TFLOP at 10 TFLOP/s.
  CHECK(RooflineTime(cost, 1, 10) == absl::Seconds(2));
}

TEST_CASE("pacing waits only for what the kernel did not take",
          "[karat_device]") {
  KernelCost cost;
  cost.bytes = 1e9;  // 10 ms at 100 GB/s
  CHECK(PacingDelay(cost, 100, 0, absl::Milliseconds(4)) ==
        absl::Milliseconds(6));
  CHECK(PacingDelay(cost, 100, 0, absl::Milliseconds(10)) ==
        absl::ZeroDuration());
  CHECK(PacingDelay(cost, 100, 0, absl::Milliseconds(25)) ==
        absl::ZeroDuration());
  CHECK(PacingDelay(cost, 0, 0, absl::ZeroDuration()) == absl::ZeroDuration());
}

// Runs TryRunInline until it finds the worker idle (the worker may still be
// finishing an item); false after 10 s.
bool RunInlineWhenIdle(SerialWorker* worker, absl::FunctionRef<void()> work) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    if (worker->TryRunInline(work)) return true;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return false;
}

TEST_CASE("a worker runs work inline only when idle, in posting order",
          "[karat_device]") {
  SerialWorker worker("test");
  absl::Mutex mu;
  std::vector<std::string> order;
  auto note = [&](const std::string& what) {
    absl::MutexLock lock(&mu);
    order.push_back(what);
  };

  // Idle: the work runs on this thread, before TryRunInline returns.
  const std::thread::id me = std::this_thread::get_id();
  std::thread::id ran_on;
  REQUIRE(worker.TryRunInline([&] { ran_on = std::this_thread::get_id(); }));
  CHECK(ran_on == me);

  // An item running on the worker: nothing runs inline, not even once the
  // queue behind it is empty.
  absl::Notification release, started;
  worker.Post([&] {
    started.Notify();
    release.WaitForNotification();
    note("posted 1");
  });
  started.WaitForNotification();
  bool ran = false;
  CHECK_FALSE(worker.TryRunInline([&] { ran = true; }));
  // An item queued behind it: still refused.
  worker.Post([&] { note("posted 2"); });
  CHECK_FALSE(worker.TryRunInline([&] { ran = true; }));
  CHECK_FALSE(ran);
  release.Notify();

  // Work posted while an inline item runs waits for it.
  REQUIRE(RunInlineWhenIdle(&worker, [&] {
    worker.Post([&] { note("posted during inline"); });
    absl::SleepFor(absl::Milliseconds(20));  // time for the worker to jump
    note("inline");
  }));
  worker.Stop();
  absl::MutexLock lock(&mu);
  CHECK(order == std::vector<std::string>{"posted 1", "posted 2", "inline",
                                          "posted during inline"});
}

TEST_CASE("Stop() waits for an inline item, and none runs after it",
          "[karat_device]") {
  SerialWorker worker("test");
  absl::Notification inside, release;
  std::atomic<bool> stopped{false}, ran_inline{false};
  std::thread runner([&] {
    ran_inline = worker.TryRunInline([&] {
      inside.Notify();
      release.WaitForNotification();
    });
  });
  if (!inside.WaitForNotificationWithTimeout(absl::Seconds(10))) {
    runner.join();  // it ran nothing
    FAIL("an idle worker refused to run work inline");
  }
  std::thread stopper([&] {
    worker.Stop();
    stopped.store(true);
  });
  absl::SleepFor(absl::Milliseconds(50));
  CHECK_FALSE(stopped.load());  // the inline item still runs
  release.Notify();
  stopper.join();
  runner.join();
  CHECK(ran_inline.load());
  CHECK(stopped.load());
  bool ran = false;
  CHECK_FALSE(worker.TryRunInline([&] { ran = true; }));
  CHECK_FALSE(ran);
}

}  // namespace
}  // namespace karat
