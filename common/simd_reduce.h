// AVX-512 reductions shared by the sparse-attention kernels. Each is a fixed
// sequence of operations, so a kernel that uses it stays a pure function of
// its inputs (DESIGN.md §6).
#pragma once

#include <immintrin.h>

namespace karat {

// Sums each of 16 vectors by halving (lane i + lane i+8, then +4, +2, +1,
// as _mm512_reduce_add_ps does) and returns the 16 sums in one vector: the
// sum of v[4 * (L % 4) + L / 4] lands in lane L.
inline __m512 ReduceAdd16(const __m512* v) {
  __m512 s[8], t[4], u[2];
  for (int k = 0; k < 8; ++k) {
    s[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  }
  for (int m = 0; m < 4; ++m) {
    t[m] = _mm512_add_ps(
        _mm512_shuffle_f32x4(s[2 * m], s[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
        _mm512_shuffle_f32x4(s[2 * m], s[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  for (int m = 0; m < 2; ++m) {
    u[m] = _mm512_add_ps(
        _mm512_shuffle_ps(t[2 * m], t[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
        _mm512_shuffle_ps(t[2 * m], t[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// The slot of ReduceAdd16's input whose sum lands in lane L.
constexpr int ReduceSlot(int L) { return 4 * (L % 4) + L / 4; }

}  // namespace karat
