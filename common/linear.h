// Batch-invariant linear layers: y = W x for a batch of row vectors.
//
// Contract (DESIGN.md §6): the reduction order of every output element is a
// function of the weight shape only, never of the batch size, the row's
// position in the batch, or the number of threads. A request's logits are
// therefore bit-identical alone and inside any batch.
//
// The order, for one output element y = W[o,:] . x (what LinearReferenceDot
// spells out): the input dimension is cut into segments of
// kLinearSegment consecutive indices (the last one may be shorter). Each
// segment is one chain of fused multiply-adds in increasing i, starting from
// +0.0f:  c = fma(W[o,i], x[i], c).  The segment results are then summed left
// to right: y = ((c_0 + c_1) + c_2) + ...  (y = c_0 when there is one
// segment; y = +0.0f when in == 0). All arithmetic is fp32 with
// round-to-nearest. Segments give the kernel independent chains to overlap
// when a batch is too small to fill the vector registers on its own.
#pragma once

#include <cstdint>
#include <vector>

namespace karat {

// Length of one reduction segment (see above). Part of the numeric contract:
// changing it changes results in the last bits.
inline constexpr int kLinearSegment = 64;

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
  // Same with an explicit upper bound on OpenMP threads; num_threads <= 0
  // means the OpenMP default (omp_get_max_threads(), i.e. OMP_NUM_THREADS).
  // Small products run on the calling thread whatever the bound. The result
  // never depends on the thread count. x and y must not overlap.
  void Apply(const float* x, int x_stride, int batch, float* y, int y_stride,
             int num_threads) const;

 private:
  // One 64-byte row of a packed panel: 16 consecutive output rows' weights
  // for one input index. The alignment makes every panel load aligned.
  struct alignas(64) PackedRow {
    float v[16];
  };

  int out_ = 0;
  int in_ = 0;
  // ceil(out / 16) panels, each `in` PackedRows (zero-padded past `out`).
  std::vector<PackedRow> packed_;
};

// The exact per-element arithmetic of LinearWeight, one element at a time
// (slow; for tests): returns the value Apply() produces for W[o,:] . x.
float LinearReferenceDot(const float* w_row, const float* x, int in);

}  // namespace karat
