// The device timing model as pure functions (no clocks, no sleeps).
#include <catch2/catch.hpp>

#include "karat_node/karat_device.h"

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

}  // namespace
}  // namespace karat
