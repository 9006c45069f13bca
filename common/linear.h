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

#include <cstddef>
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
//
// Storage. When every weight is exactly a bf16 value (the low 16 bits of
// its fp32 pattern are zero, as for weights read from a bf16 checkpoint),
// the packed copy keeps only the high halves: half the bytes for a
// memory-bound product (a decode step reads each weight once per step).
// The kernel widens them back (in registers, or for a large batch once per
// panel group into an fp32 scratch), which reproduces the fp32 values
// exactly, so Apply() returns the same bits either way.
class LinearWeight {
 public:
  enum class Storage {
    kAuto,  // bf16 when that is exact, fp32 otherwise
    kFp32,  // fp32 always
  };
  LinearWeight() = default;
  LinearWeight(const float* w, int out, int in,
               Storage storage = Storage::kAuto);
  int out() const { return out_; }
  int in() const { return in_; }
  bool empty() const { return out_ == 0; }
  // Whether the packed copy holds bf16 (see Storage).
  bool bf16() const { return bf16_; }
  // Bytes of the packed copy.
  size_t bytes() const { return packed_.size() * sizeof(PackedRow); }

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
  // One 64-byte row of a packed panel. fp32: 16 consecutive output rows'
  // weights for one input index. bf16: 16 output rows' weights for two
  // consecutive input indices 2t, 2t + 1, one 32-bit word per output row
  // (the high half of w[2t]'s fp32 bits in its low half, w[2t + 1]'s in its
  // high half). The alignment makes every panel load aligned.
  struct alignas(64) PackedRow {
    uint32_t v[16];
  };

  int out_ = 0;
  int in_ = 0;
  bool bf16_ = false;
  // ceil(out / 16) panels (the last one 8 wide when it holds at most 8
  // outputs), zero-padded past `out`: fp32 `in` rows each, bf16
  // ceil(in / 2).
  std::vector<PackedRow> packed_;
};

// The exact per-element arithmetic of LinearWeight, one element at a time
// (slow; for tests): returns the value Apply() produces for W[o,:] . x.
float LinearReferenceDot(const float* w_row, const float* x, int in);

}  // namespace karat
