// AVX-512 pieces shared by the sparse-attention kernels: lane sums, a
// running top-k, the lane mask of a vector loop's tail, the 16 x 16
// transpose that turns 16 gathered entries into one lane each, the
// softmax's exp and denominator, and cache line prefetches. Each is a fixed
// sequence of operations, so a kernel that uses it stays a pure function of its
// inputs (DESIGN.md §6).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

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

// Lanes 0 .. min(n, 16) - 1 (n >= 0): the elements left of a 16-wide loop.
inline __mmask16 FirstLanes16(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
}

// Lanes m of v, packed to the front, stored at out[0 ..): all 16 lanes
// are written (those past popcount(m) hold zeros), so out needs room for
// 16. The compress runs in a register and the store is a plain one: a
// compress straight to memory (vpcompress{d,ps} m512{k}) is microcoded on
// AMD Zen 4, where a 128K-score SelectTopK took 316-363 us with it against
// 32 us with this pair (tests/kernel_forms.sh keeps it out of the kernels).
template <typename Int>
inline void CompressStore16(Int* out, __mmask16 m, __m512i v) {
  static_assert(std::is_integral_v<Int> && sizeof(Int) == 4);
  _mm512_storeu_si512(out, _mm512_maskz_compress_epi32(m, v));
}
inline void CompressStore16(float* out, __mmask16 m, __m512 v) {
  _mm512_storeu_ps(out, _mm512_maskz_compress_ps(m, v));
}

// GCC 12 reports its own AVX-512 intrinsic headers (_mm512_undefined_*)
// as (maybe-)uninitialized where these are inlined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

// In-register transpose of a 16 x 16 matrix of 32-bit elements.
inline void Transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // r[4i + c] lane L now holds column 4L + c of rows 4i .. 4i+3.
  for (int c = 0; c < 4; ++c) {
    const __m512i x = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88);
    const __m512i y = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
    const __m512i x2 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);
    const __m512i y2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
    t[c] = _mm512_shuffle_i32x4(x, y, 0x88);
    t[8 + c] = _mm512_shuffle_i32x4(x, y, 0xDD);
    t[4 + c] = _mm512_shuffle_i32x4(x2, y2, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(x2, y2, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// Entries[0, count) (count <= 16; the rows past it zero) 32 dims at a
// time, transposed as 32-bit bf16 pairs: fn(d0, cnt, r) with r[i] lane j =
// dims (d0 + 2i, d0 + 2i + 1) of entry j (dim d0 + 2i in the low half) for
// the cnt = min(32, kv_dim - d0) dims from d0. Always inlined, so that r
// stays in registers (not inlined, it went through memory: dsa-tiny's
// attend ran 2% slower).
template <typename Fn>
[[gnu::always_inline]] inline void ForEachPairBlock(
    const uint16_t* const* entries, int count, int kv_dim, Fn fn) {
  for (int d0 = 0; d0 < kv_dim; d0 += 32) {
    const int cnt = std::min(32, kv_dim - d0);
    const __mmask32 m =
        cnt >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << cnt) - 1);
    __m512i r[16];
    for (int j = 0; j < 16; ++j) {
      r[j] = j < count ? _mm512_maskz_loadu_epi16(m, entries[j] + d0)
                       : _mm512_setzero_si512();
    }
    Transpose16(r);
    fn(d0, cnt, r);
  }
}

// Widened, transposed entries of one block of 16: tile[d * ld + j] =
// e_j[d] for d < kv_dim. Entries past `count` are zero. The bf16 values are
// transposed as 32-bit pairs (dims 2i, 2i + 1 of an entry in one lane) and
// widened after the transpose: one transpose per 32 dims.
inline void LoadEntryTile(const uint16_t* const* entries, int count, int kv_dim,
                          float* tile, int ld) {
  const __m512i hi_mask = _mm512_set1_epi32(int(0xFFFF0000u));
  ForEachPairBlock(entries, count, kv_dim,
                   [&](int d0, int cnt, const __m512i* r) {
                     for (int i = 0; i < (cnt + 1) / 2; ++i) {
                       _mm512_store_si512(tile + size_t(d0 + 2 * i) * ld,
                                          _mm512_slli_epi32(r[i], 16));
                       if (2 * i + 1 < cnt) {
                         _mm512_store_si512(tile + size_t(d0 + 2 * i + 1) * ld,
                                            _mm512_and_si512(r[i], hi_mask));
                       }
                     }
                   });
}

// LoadEntryTile without the widening: tile[i * ld + j] = the bf16 pair
// (dims 2i, 2i + 1) of e_j as one 32-bit lane (dim 2i in the low half),
// for 2i < kv_dim; zero past `count`. Widening a lane is one instruction
// (dim 2i: shift left by 16; dim 2i + 1: clear the low half), which the
// reader does as it goes: half the tile's stores, which bound the widened
// tile's loads (dsa-tiny's 2048 entries, one core, in cache: 10.7 us
// widened, 7.0 as pairs). (GQA's 64-dim rows scored over pairs came out
// slower, 260 -> 300 us for a 16K dense attend: with 4 heads to a widened
// value instead of 8, the widening competes with the FMAs.)
inline void LoadEntryPairTile(const uint16_t* const* entries, int count,
                              int kv_dim, uint32_t* tile, int ld) {
  ForEachPairBlock(entries, count, kv_dim,
                   [&](int d0, int cnt, const __m512i* r) {
                     for (int i = 0; i < (cnt + 1) / 2; ++i) {
                       _mm512_store_si512(tile + size_t(d0 / 2 + i) * ld, r[i]);
                     }
                   });
}

// Floats of one tile of LoadEntryTile(..., kv_dim = dim, ld = 16), a
// multiple of 16, so tiles laid end to end stay 64-byte aligned.
inline size_t EntryTileFloats(int dim) {
  return size_t((dim + 31) / 32 * 32) * 16;
}

// A 64-byte aligned scratch of `tiles` such tiles of this thread,
// EntryTileFloats(dim) apart; valid until the thread's next call.
inline float* EntryTileScratch(int dim, int tiles = 1) {
  thread_local std::vector<float> buf;
  buf.resize(EntryTileFloats(dim) * tiles + 16);
  return reinterpret_cast<float*>(
      (reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
}

#pragma GCC diagnostic pop

// KernelExp's constants: Cody-Waite split of ln 2 and a degree-7 minimax
// polynomial on [-ln2/2, ln2/2] (Cephes expf).
inline constexpr float kExpLog2e = 1.44269504088896341f;
inline constexpr float kExpLn2Hi = 0.693359375f;
inline constexpr float kExpLn2Lo = -2.12194440e-4f;
inline constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f,
                                      8.3334519073e-3f, 4.1665795894e-2f,
                                      1.6666665459e-1f, 5.0000001201e-1f};

// KernelExp (attention.h) on 16 lanes, operation for operation.
inline __m512 KernelExp16(__m512 x) {
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __mmask16 tiny =
      _mm512_cmp_ps_mask(x, _mm512_set1_ps(-104.0f), _CMP_LT_OQ);
  const __m512 xc = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(kExpLog2e)),
                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kExpLn2Hi), xc);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kExpLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i)
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
  __m512 e = _mm512_scalef_ps(y, n);
  e = _mm512_mask_mov_ps(e, tiny, _mm512_setzero_ps());
  return _mm512_mask_mov_ps(e, nan, x);
}

// The attention kernels' softmax denominator: 16 partial sums combined by
// the lane tree (l + l+8), (l + l+4), (l + l+2), (l + l+1), from lane 0's
// side.
inline float LaneTreeSum(__m512 v) {
  alignas(64) float z[16];
  _mm512_store_ps(z, v);
  for (int w = 8; w >= 1; w /= 2) {
    for (int l = 0; l < w; ++l) z[l] = z[l] + z[l + w];
  }
  return z[0];
}

// A prefetch the compiler keeps: GCC treats _mm_prefetch as free of side
// effects and deletes a loop that does nothing else.
inline void PrefetchLine(const void* p) {
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
}
inline void PrefetchLineL2(const void* p) {
  asm volatile("prefetcht2 %0" : : "m"(*static_cast<const char*>(p)));
}

// Calls fn(line address) for every cache line that an entry of `bytes`
// bytes at `e` touches (entries need not start on a line).
template <typename Fn>
inline void ForEachLine(const void* e, size_t bytes, Fn fn) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(e) & ~uintptr_t(63);
  const uintptr_t last =
      (reinterpret_cast<uintptr_t>(e) + bytes - 1) & ~uintptr_t(63);
  for (uintptr_t p = first; p <= last; p += 64) fn(p);
}

// Requests every cache line of an entry (ForEachLine) into L1 (kL1) or L2.
template <bool kL1>
inline void PrefetchEntryLines(const void* e, size_t bytes) {
  ForEachLine(e, bytes, [](uintptr_t p) {
    if constexpr (kL1) {
      PrefetchLine(reinterpret_cast<const void*>(p));
    } else {
      PrefetchLineL2(reinterpret_cast<const void*>(p));
    }
  });
}

// Selected entries' cache lines, requested from inside an attend's loops
// a few at a time instead of all at once (a burst of hundreds of requests
// overruns the core's outstanding misses, and the requests it cannot take
// wait in the load queue or are lost): the entries a[0, na) then b[0, nb),
// `bytes` each, one entry's lines every max(1, slots / (na + nb)) calls of
// Tick, so that all are requested within `slots` ticks (one every tick
// where there are more entries than ticks). A tick is a
// countdown; an entry's lines are computed only when it is requested. (A
// list of every line, built per block and read two lines per tick, cost a
// sixth of dsa-tiny's warm attend: 57-59 us on one core against 49-50.)
// A loop ticks a local copy, which stays in registers, and stores it back.
class EntryRequests {
 public:
  void Start(const uint16_t* const* a, int na, const uint16_t* const* b, int nb,
             size_t bytes, int slots) {
    a_ = a;
    b_ = b;
    na_ = std::max(na, 0);
    count_ = na_ + std::max(nb, 0);
    next_ = 0;
    bytes_ = bytes;
    every_ = count_ > 0 ? std::max(1, slots / count_) : 1;
    wait_ = 1;
  }
  template <bool kL1>
  void Tick() {
    if (--wait_ > 0 || next_ >= count_) return;
    wait_ = every_;
    const uint16_t* e = next_ < na_ ? a_[next_] : b_[next_ - na_];
    ++next_;
    PrefetchEntryLines<kL1>(e, bytes_);
  }

 private:
  const uint16_t* const* a_ = nullptr;
  const uint16_t* const* b_ = nullptr;
  int na_ = 0, count_ = 0, next_ = 0, every_ = 1, wait_ = 1;
  size_t bytes_ = 0;
};

// SelectTopK (attention.h) for small k (0 < k <= 64, k < n), run while
// the scores are produced in position order, so that they need not be
// stored: a binary heap of the k best so far whose root is the worst kept
// (lowest score; of equal scores, the higher position). Positions 0..k-1
// fill it; a later one enters only with a score strictly above the
// root's. It makes SelectTopK's comparisons in SelectTopK's order (a
// vector compare against the root for each aligned run of 16 positions
// from the first multiple of 16 at or after k, where SelectTopK makes
// one), so it keeps SelectTopK's positions, NaN included.
// Thread-compatible; a kernel keeps one per head (or group) and calls
// Reset before each selection.
class RunningTopK {
 public:
  static constexpr int kMaxK = 64;

  void Reset(int k, int n) {
    k_ = k;
    n_ = n;
    vector_from_ = (k + 15) / 16 * 16;
  }
  // The scores of positions first .. first + 15, offered in increasing
  // order of first (a multiple of 16, < n); lanes at or past n are ignored.
  void Offer16(__m512 v, int first) {
    alignas(64) float x[16];
    if (first >= vector_from_ && first + 16 <= n_) {
      __mmask16 m = _mm512_cmp_ps_mask(v, _mm512_set1_ps(hv_[0]), _CMP_GT_OQ);
      if (m == 0) return;
      _mm512_store_ps(x, v);
      while (m != 0) {
        const int i = __builtin_ctz(m);
        Offer(x[i], first + i);
        m &= m - 1;
      }
      return;
    }
    _mm512_store_ps(x, v);
    const int count = std::min(16, n_ - first);
    for (int i = 0; i < count; ++i) {
      const int s = first + i;
      if (s >= k_) {
        Offer(x[i], s);
        continue;
      }
      hv_[s] = x[i];
      hp_[s] = s;
      if (s == k_ - 1) {
        for (int j = k_ / 2 - 1; j >= 0; --j) SiftDown(j);
      }
    }
  }
  int n() const { return n_; }
  // The kept positions in increasing order (once all n were offered).
  void Take(std::vector<int32_t>* out) const {
    out->assign(hp_, hp_ + k_);
    std::sort(out->begin(), out->end());
  }

 private:
  // Entry a is worse than entry b.
  bool Worse(int a, int b) const {
    return hv_[a] < hv_[b] || (!(hv_[b] < hv_[a]) && hp_[a] > hp_[b]);
  }
  void SiftDown(int i) {
    for (;;) {
      const int l = 2 * i + 1, r = l + 1;
      int w = i;
      if (l < k_ && Worse(l, w)) w = l;
      if (r < k_ && Worse(r, w)) w = r;
      if (w == i) return;
      std::swap(hv_[i], hv_[w]);
      std::swap(hp_[i], hp_[w]);
      i = w;
    }
  }
  void Offer(float x, int s) {
    if (x > hv_[0]) {
      hv_[0] = x;
      hp_[0] = s;
      SiftDown(0);
    }
  }

  int k_ = 0, n_ = 0, vector_from_ = 0;
  float hv_[kMaxK];
  int32_t hp_[kMaxK];
};

}  // namespace karat
