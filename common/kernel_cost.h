// What a computation reads and computes, for the timing models of the
// emulated hardware (DESIGN.md §3 for the KARAT devices, §4 for the GPU
// ranks): a kernel completes no earlier than max(bytes / bandwidth,
// flops / FLOP rate) after it started.
//
// A GPU rank's computations report their cost to the meter installed on the
// calling thread (SetKernelMeter): the linear layers (weights and
// activations read and written, 2 x multiply-adds) and, in gpu_only mode,
// the attention kernels (their KernelCost). With no meter installed (the
// reference engine, the KARAT node) reporting costs one thread-local load.
#pragma once

#include <algorithm>

namespace karat {

// What one kernel call read and computed, for the timing models and the
// benchmarks (bytes read, floating-point operations).
struct KernelCost {
  double bytes = 0;
  double flops = 0;
  KernelCost& operator+=(const KernelCost& o) {
    bytes += o.bytes;
    flops += o.flops;
    return *this;
  }
};

// The roofline time of `cost` in seconds: max(bytes / bandwidth,
// flops / rate), each term only when its rate is > 0; zero when both are
// off. Pure.
inline double RooflineSeconds(const KernelCost& cost, double bandwidth_gbps,
                              double tflops) {
  double seconds = 0;
  if (bandwidth_gbps > 0) {
    seconds = std::max(seconds, cost.bytes / (bandwidth_gbps * 1e9));
  }
  if (tflops > 0) seconds = std::max(seconds, cost.flops / (tflops * 1e12));
  return seconds;
}

namespace kernel_cost_internal {
inline thread_local KernelCost* meter = nullptr;
}  // namespace kernel_cost_internal

// Adds `cost` to the calling thread's meter, if one is installed.
inline void ChargeKernelCost(const KernelCost& cost) {
  if (KernelCost* m = kernel_cost_internal::meter) *m += cost;
}
inline void ChargeKernelCost(double bytes, double flops) {
  if (KernelCost* m = kernel_cost_internal::meter) {
    m->bytes += bytes;
    m->flops += flops;
  }
}

// The calling thread's meter: what the thread's computations charge is
// added to `*meter` (null: nothing is counted).
inline KernelCost* CurrentKernelMeter() { return kernel_cost_internal::meter; }
inline void SetKernelMeter(KernelCost* meter) {
  kernel_cost_internal::meter = meter;
}

}  // namespace karat
