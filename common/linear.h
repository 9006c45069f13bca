// Batch-invariant linear layers: y = W x for a batch of row vectors.
//
// Contract (DESIGN.md §6): the reduction order of every output element is a
// function of the weight shape only, never of the batch size, the row's
// position in the batch, or the number of threads. A request's logits are
// therefore bit-identical alone and inside any batch.
#pragma once

#include <cstdint>
#include <vector>

namespace karat {

// A weight matrix [out, in] (row-major fp32, y = W x), packed once for the
// register-blocked kernel. Immutable after construction; Apply() is
// thread-safe and may use OpenMP threads internally (splitting work by
// output blocks, which keeps each element's order fixed).
class LinearWeight {
 public:
  LinearWeight() = default;
  LinearWeight(const float* w, int out, int in);
  int out() const { return out_; }
  int in() const { return in_; }
  bool empty() const { return out_ == 0; }

  // x: [batch, in] (row stride `in`), y: [batch, out] (row stride `out`).
  void Apply(const float* x, int batch, float* y) const;
  // Same with explicit row strides (in floats).
  void Apply(const float* x, int x_stride, int batch, float* y,
             int y_stride) const;

 private:
  int out_ = 0;
  int in_ = 0;
  std::vector<float> packed_;  // layout chosen by the kernel
};

// The exact per-element arithmetic of LinearWeight, one element at a time
// (slow; for tests): returns the value Apply() produces for W[o,:] . x.
float LinearReferenceDot(const float* w_row, const float* x, int in);

}  // namespace karat
