// karat-bench-linear: the batch-invariant linear kernel against Eigen's GEMM
// on the dsa-tiny projection shapes (MODEL.md), with the machine's fp32 FMA
// peak measured in the same run as the ceiling.
//
//   karat-bench-linear [--quick]
//
// The weights are bf16 values, as a bf16 checkpoint's are, so the kernel
// keeps them as bf16 (LinearWeight's storage); Eigen multiplies the same
// values in fp32. "fp32/bf16" is the kernel's time with the weights kept as
// fp32 (LinearWeight::Storage::kFp32) over its time with them as bf16: the
// same results bit for bit, from twice the weight bytes.
//
// Then a decode pass: batch 1 through every matrix of dsa-tiny (all
// layers, every expert: what a rank reads over a few decode steps), too
// large to stay in the core caches, with the weights kept as fp32 and as
// bf16, in stored GB/s.
//
// Threads: OMP_NUM_THREADS (default: all cores); Eigen gets the same count.

// GCC 12 reports the deliberately undefined registers inside its own
// AVX-512 intrinsics, as instantiated by Eigen's GEMM, as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <immintrin.h>
#include <omp.h>

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/linear.h"
#include "common/numeric.h"

namespace {

using Clock = std::chrono::steady_clock;
using RowMatrix =
    Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Peak fp32 FMA rate of all threads: 24 independent zmm accumulators per
// thread (more than FMA latency x ports), no memory traffic. The best of
// many short rounds within `seconds`.
double MeasurePeakGflops(int threads, double seconds) {
  constexpr int kAcc = 24;
  constexpr int64_t kInner = 1 << 13;
  double best = 0.0;
  float sink = 0.0f;
  const auto start = Clock::now();
  do {
    const auto t0 = Clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
      __m512 acc[kAcc];
      for (int a = 0; a < kAcc; ++a) acc[a] = _mm512_set1_ps(1.0f * a);
      const __m512 m = _mm512_set1_ps(0.999999f);
      const __m512 c = _mm512_set1_ps(1e-7f);
      for (int64_t i = 0; i < kInner; ++i) {
#pragma GCC unroll 24
        for (int a = 0; a < kAcc; ++a) acc[a] = _mm512_fmadd_ps(acc[a], m, c);
      }
      __m512 s = acc[0];
      for (int a = 1; a < kAcc; ++a) s = _mm512_add_ps(s, acc[a]);
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, s);
      for (float v : lanes) sink += v;
    }
    const double flops = 2.0 * 16 * kAcc * kInner * threads;
    best = std::max(best, flops / Seconds(t0, Clock::now()) * 1e-9);
  } while (Seconds(start, Clock::now()) < seconds);
  if (sink == 1.2345f) std::printf(" ");  // keeps the work observable
  return best;
}

// Time per call of `a` and of `b`: the best of many short repetitions
// (each about `rep_seconds`, at least one call) within `budget_seconds`,
// alternating a and b. Short repetitions, the minimum and the alternation
// keep both figures, and their ratio, meaningful on a machine that other
// processes share.
struct PairTimes {
  double a;
  double b;
};
PairTimes TimePerCall(const std::function<void()>& a,
                      const std::function<void()>& b, double rep_seconds,
                      double budget_seconds) {
  auto calls_for = [&](const std::function<void()>& fn) {
    fn();  // warm caches and the thread team
    const auto c0 = Clock::now();
    fn();
    const double once = std::max(Seconds(c0, Clock::now()), 1e-8);
    return std::max<int64_t>(1, static_cast<int64_t>(rep_seconds / once));
  };
  const int64_t calls_a = calls_for(a);
  const int64_t calls_b = calls_for(b);
  auto rep = [](const std::function<void()>& fn, int64_t calls) {
    const auto t0 = Clock::now();
    for (int64_t i = 0; i < calls; ++i) fn();
    return Seconds(t0, Clock::now()) / calls;
  };
  PairTimes best{1e30, 1e30};
  const auto start = Clock::now();
  for (int r = 0; r < 3 || Seconds(start, Clock::now()) < budget_seconds; ++r) {
    best.a = std::min(best.a, rep(a, calls_a));
    best.b = std::min(best.b, rep(b, calls_b));
  }
  return best;
}

struct Shape {
  const char* name;
  int out;
  int in;
};

// Uniform weights in [-1, 1) of shape `s`, rounded to bf16 as a bf16
// checkpoint holds them (so LinearWeight keeps them as bf16).
std::vector<float> RandomBf16Weights(const Shape& s, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> w(static_cast<size_t>(s.out) * s.in);
  for (float& v : w) v = dist(rng);
  karat::RoundThroughBf16(w.data(), w.size());
  return w;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else {
      std::fprintf(stderr, "usage: %s [--quick]\n", argv[0]);
      return 2;
    }
  }
  const int threads = omp_get_max_threads();
  Eigen::setNbThreads(threads);
  const double rep_seconds = quick ? 0.0005 : 0.002;
  const double budget_seconds = quick ? 0.008 : 0.12;

  const double peak = MeasurePeakGflops(threads, quick ? 0.02 : 0.2);
  std::printf("threads %d (kernel and Eigen), Eigen %d.%d.%d with %d threads\n",
              threads, EIGEN_WORLD_VERSION, EIGEN_MAJOR_VERSION,
              EIGEN_MINOR_VERSION, Eigen::nbThreads());
  std::printf("measured fp32 FMA peak: %.1f GFLOP/s\n\n", peak);

  // dsa-tiny (MODEL.md): hidden 512, q_lora 192, kv_lora 128, 8 heads of
  // nope 32 + rope 16, v 32; indexer 8 x 32; dense FFN 1024; experts 256.
  const std::vector<Shape> shapes = {
      {"q_a", 192, 512},          {"q_b", 384, 192},
      {"kv_a", 144, 512},         {"kv_b", 512, 128},
      {"o_proj", 512, 256},       {"idx_wq_b", 256, 192},
      {"idx_wk", 32, 512},        {"idx_weights", 8, 512},
      {"ffn_gate/up", 1024, 512}, {"ffn_down", 512, 1024},
      {"exp_gate/up", 256, 512},  {"exp_down", 512, 256},
      {"lm_head", 258, 512},
  };
  const std::vector<int> batches =
      quick ? std::vector<int>{1, 64} : std::vector<int>{1, 16, 64, 256};

  std::printf("%-12s %10s %6s %10s %10s %7s %7s %9s\n", "shape", "out x in",
              "batch", "kernel", "Eigen", "ratio", "%peak", "fp32/bf16");
  std::printf("%-12s %10s %6s %10s %10s %7s %7s %9s\n", "", "", "", "GFLOP/s",
              "GFLOP/s", "k/E", "kernel", "time");
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  double worst_ratio = 1e30;
  double worst_big_peak = 1e30;
  for (const Shape& s : shapes) {
    const std::vector<float> w = RandomBf16Weights(s, rng);
    const karat::LinearWeight lw(w.data(), s.out, s.in);
    const karat::LinearWeight lw32(w.data(), s.out, s.in,
                                   karat::LinearWeight::Storage::kFp32);
    const Eigen::Map<const RowMatrix> wm(w.data(), s.out, s.in);
    for (int batch : batches) {
      std::vector<float> x(static_cast<size_t>(batch) * s.in);
      for (float& v : x) v = dist(rng);
      std::vector<float> y(static_cast<size_t>(batch) * s.out);
      std::vector<float> ye(static_cast<size_t>(batch) * s.out);
      const Eigen::Map<const RowMatrix> xm(x.data(), batch, s.in);
      Eigen::Map<RowMatrix> yem(ye.data(), batch, s.out);

      const PairTimes t =
          TimePerCall([&] { lw.Apply(x.data(), batch, y.data()); },
                      [&] { yem.noalias() = xm * wm.transpose(); }, rep_seconds,
                      budget_seconds);
      const double t_kernel = t.a;
      const double t_eigen = t.b;
      const PairTimes st =
          TimePerCall([&] { lw32.Apply(x.data(), batch, y.data()); },
                      [&] { lw.Apply(x.data(), batch, y.data()); }, rep_seconds,
                      budget_seconds);
      float max_diff = 0.0f;
      for (size_t i = 0; i < y.size(); ++i)
        max_diff = std::max(max_diff, std::fabs(y[i] - ye[i]));

      const double flops = 2.0 * batch * s.out * s.in;
      const double gk = flops / t_kernel * 1e-9;
      const double ge = flops / t_eigen * 1e-9;
      char dims[32];
      std::snprintf(dims, sizeof(dims), "%dx%d", s.out, s.in);
      std::printf("%-12s %10s %6d %10.1f %10.1f %7.2f %6.1f%% %9.2f%s\n",
                  s.name, dims, batch, gk, ge, gk / ge, 100.0 * gk / peak,
                  st.a / st.b, max_diff > 1e-3f ? "  MISMATCH vs Eigen" : "");
      worst_ratio = std::min(worst_ratio, gk / ge);
      if (batch >= 64) worst_big_peak = std::min(worst_big_peak, gk / peak);
    }
  }
  std::printf(
      "\nworst kernel/Eigen ratio: %.2f; worst %% of peak at batch >= 64: "
      "%.1f%%\n",
      worst_ratio, 100.0 * worst_big_peak);

  // The decode pass: dsa-tiny's matrices, layer by layer (layer 0's FFN
  // dense, the others' 16 experts), batch 1.
  std::vector<Shape> model;
  for (int layer = 0; layer < 6; ++layer) {
    for (int i = 0; i < 8; ++i) model.push_back(shapes[i]);
    const int ffns = layer == 0 ? 1 : 17;  // 16 routed + 1 shared
    for (int e = 0; e < ffns; ++e) {
      const Shape& gate_up = layer == 0 ? shapes[8] : shapes[10];
      const Shape& down = layer == 0 ? shapes[9] : shapes[11];
      model.push_back(gate_up);
      model.push_back(gate_up);
      model.push_back(down);
    }
  }
  model.push_back(shapes[12]);
  std::vector<karat::LinearWeight> pass16, pass32;
  double weights = 0;
  int max_dim = 0;
  for (const Shape& s : model) {
    const std::vector<float> w = RandomBf16Weights(s, rng);
    pass16.emplace_back(w.data(), s.out, s.in);
    pass32.emplace_back(w.data(), s.out, s.in,
                        karat::LinearWeight::Storage::kFp32);
    weights += double(s.out) * s.in;
    max_dim = std::max({max_dim, s.out, s.in});
  }
  std::vector<float> x(static_cast<size_t>(max_dim)), y(x.size());
  for (float& v : x) v = dist(rng);
  auto pass = [&](const std::vector<karat::LinearWeight>& ws) {
    for (const karat::LinearWeight& lw : ws) lw.Apply(x.data(), 1, y.data());
  };
  const PairTimes tp = TimePerCall([&] { pass(pass32); }, [&] { pass(pass16); },
                                   0.0, quick ? 0.1 : 1.0);
  std::printf(
      "\ndecode pass, batch 1, %zu matrices, %.1f M weights:\n"
      "  fp32 kept: %.1f MB in %.2f ms, %.1f GB/s\n"
      "  bf16 kept: %.1f MB in %.2f ms, %.1f GB/s\n"
      "  fp32 / bf16 time: %.2f\n",
      model.size(), weights * 1e-6, weights * 4e-6, tp.a * 1e3,
      weights * 4 / tp.a * 1e-9, weights * 2e-6, tp.b * 1e3,
      weights * 2 / tp.b * 1e-9, tp.a / tp.b);
  return 0;
}
