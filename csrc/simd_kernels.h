// The body of every SIMD variant source (csrc/simd_<isa>.cpp): the fused Adam's threads-over-
// tensors region with its overflow scan, the gradient's sum of squares and the roofline stream,
// compiled for the variant's ISA, and the table (simd_dispatch.h) that hands them to the dispatcher.
// Include it from exactly one source per variant, after the ISA macro; torch-free (see simd.h).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "adam_kernel.h"
#include "simd.h"
#include "simd_dispatch.h"
#include "thread_split.h"

PYSTRONGHOLD_SIMD_BEGIN

namespace pystronghold {
namespace simd {
inline namespace PYSTRONGHOLD_SIMD_NS {

using adam::Buffers;
using adam::Coeffs;
using adam::opaque;
using adam::range_start;
using adam::threads_for;

// ---- fused Adam: overflow scan, then every thread updates its range of the tensors end to end

// True when every grad[i] * scale in [begin, end) is finite. Stops early when `stop` is set.
template <typename G>
bool grad_finite(const G* grad, int64_t begin, int64_t end, float scale, const std::atomic<bool>& stop) {
  constexpr int64_t kBlock = 1 << 14;
  const vf s = set1(scale);
  for (int64_t b0 = begin; b0 < end; b0 += kBlock) {
    if (stop.load(std::memory_order_relaxed)) return true;  // another thread found one already
    const int64_t b1 = std::min(end, b0 + kBlock);
    vf acc = set1(0.0f);
    float acc_tail = 0.0f;
    int64_t i = b0;
    for (; i + kWidth <= b1; i += kWidth) {
      const vf x = opaque(mul(load_as_float(grad + i), s));
      acc = add(acc, sub(x, x));  // x - x is 0 when finite, NaN for inf/NaN; NaN sticks
    }
    for (; i < b1; ++i) {
      const float x = opaque(scalar_as_float(grad + i) * scale);
      acc_tail += x - x;
    }
    if (!all_finite(acc) || std::isnan(acc_tail)) return false;
  }
  return true;
}

// Calls f(buffers, local_begin, local_end) for each piece of the global range [begin, end) of the
// tensors laid end to end (offsets[k] = first global index of tensor k, offsets[count] = total).
template <typename F>
inline void for_pieces(const Buffers* bufs, const int64_t* offsets, size_t count, int64_t begin, int64_t end,
                       F&& f) {
  size_t k = static_cast<size_t>(std::upper_bound(offsets, offsets + count + 1, begin) - offsets) - 1;
  for (; k < count && offsets[k] < end; ++k) {
    const int64_t lo = std::max(begin, offsets[k]) - offsets[k];
    const int64_t hi = std::min(end, offsets[k + 1]) - offsets[k];
    if (lo < hi) f(bufs[k], lo, hi);
  }
}

// One parallel region for all tensors: each thread takes one contiguous range of the tensors laid
// end to end (static split, no per-tensor synchronisation). With check_finite, every thread scans
// its range of the grads, then a barrier, then all update or none does.
template <typename G, typename S, bool kL2, bool kDecay>
bool adam_run(const Buffers* bufs, const int64_t* offsets, size_t count, const Coeffs& c, bool check_finite,
              bool bitwise_torch) {
  const int64_t n = offsets[count];
  const int nth = threads_for(n);
  std::atomic<bool> overflow{false};
#pragma omp parallel num_threads(nth)
  {
    const int t = omp_get_thread_num();
    const int team = omp_get_num_threads();
    const int64_t begin = range_start(n, t, team), end = range_start(n, t + 1, team);
    if (check_finite) {
      bool finite = true;
      for_pieces(bufs, offsets, count, begin, end, [&](const Buffers& b, int64_t lo, int64_t hi) {
        finite = finite && grad_finite(static_cast<const G*>(b.grad), lo, hi, c.grad_scale, overflow);
      });
      if (!finite) overflow.store(true, std::memory_order_relaxed);
#pragma omp barrier
    }
    if (!overflow.load(std::memory_order_relaxed)) {
      for_pieces(bufs, offsets, count, begin, end, [&](const Buffers& b, int64_t lo, int64_t hi) {
        if (bitwise_torch) {
          adam::update_range_torch<G, S, kL2, kDecay>(b, lo, hi, c);
        } else {
          adam::update_range_ieee<G, S, kL2, kDecay>(b, lo, hi, c);
        }
      });
    }
  }
  return !overflow.load();
}

template <typename G, typename S>
bool adam_mode(const Buffers* b, const int64_t* off, size_t count, const Coeffs& c, adam::Mode m) {
  if (m.l2) return adam_run<G, S, true, false>(b, off, count, c, m.check_finite, m.bitwise_torch);
  if (m.decay) return adam_run<G, S, false, true>(b, off, count, c, m.check_finite, m.bitwise_torch);
  return adam_run<G, S, false, false>(b, off, count, c, m.check_finite, m.bitwise_torch);
}

template <typename G>
bool adam_shadow(const Buffers* b, const int64_t* off, size_t count, const Coeffs& c, bool has_shadow,
                 Elem shadow, adam::Mode m) {
  if (!has_shadow) return adam_mode<G, void>(b, off, count, c, m);
  if (shadow == Elem::bf16) return adam_mode<G, BF16>(b, off, count, c, m);
  return adam_mode<G, F16>(b, off, count, c, m);
}

bool adam_update(const Buffers* b, const int64_t* off, size_t count, const Coeffs& c, Elem grad, bool has_shadow,
                 Elem shadow, adam::Mode m) {
  switch (grad) {
    case Elem::f32: return adam_shadow<float>(b, off, count, c, has_shadow, shadow, m);
    case Elem::bf16: return adam_shadow<BF16>(b, off, count, c, has_shadow, shadow, m);
    case Elem::f16: return adam_shadow<F16>(b, off, count, c, has_shadow, shadow, m);
  }
  return false;  // unreachable: every Elem is handled above
}

// ---- sum of squares of grad * scale (fp32 product, as Adam sees the grad), float64 accumulation

template <typename G>
double sq_sum_range(const G* grad, int64_t begin, int64_t end, float scale) {
  constexpr int W = kWidth;
  const vf s = set1(scale);
  alignas(64) float lanes[W];
  double acc[W] = {};
  int64_t i = begin;
  for (; i + W <= end; i += W) {
    store(lanes, mul(load_as_float(grad + i), s));
    for (int j = 0; j < W; ++j) acc[j] += static_cast<double>(lanes[j]) * static_cast<double>(lanes[j]);
  }
  double total = 0.0;
  for (; i < end; ++i) {
    const double x = static_cast<double>(scalar_as_float(grad + i) * scale);
    total += x * x;
  }
  for (int j = 0; j < W; ++j) total += acc[j];
  return total;
}

template <typename G>
double sq_sum(const G* grad, int64_t n, float scale) {
  const int nth = threads_for(n);
  std::vector<double> partial(static_cast<size_t>(nth), 0.0);
#pragma omp parallel num_threads(nth)
  {
    const int t = omp_get_thread_num();
    const int team = omp_get_num_threads();
    partial[t] = sq_sum_range(grad, range_start(n, t, team), range_start(n, t + 1, team), scale);
  }
  double total = 0.0;
  for (double p : partial) total += p;  // fixed order: the result does not depend on timing
  return total;
}

double grad_sq_sum(const void* grad, int64_t n, float scale, Elem grad_type) {
  switch (grad_type) {
    case Elem::f32: return sq_sum(static_cast<const float*>(grad), n, scale);
    case Elem::bf16: return sq_sum(static_cast<const BF16*>(grad), n, scale);
    case Elem::f16: return sq_sum(static_cast<const F16*>(grad), n, scale);
  }
  return 0.0;  // unreachable: every Elem is handled above
}

// ---- roofline: Adam's memory access pattern with almost no arithmetic

void stream_range(float* a, float* b, float* c, const float* d, int64_t begin, int64_t end, float s) {
  const vf vs = set1(s);
  int64_t i = begin;
  for (; i + kWidth <= end; i += kWidth) {
    const vf x = load(d + i);
    store(a + i, add(mul(load(a + i), vs), x));
    store(b + i, add(mul(load(b + i), vs), x));
    store(c + i, add(mul(load(c + i), vs), x));
  }
  for (; i < end; ++i) {
    a[i] = a[i] * s + d[i];
    b[i] = b[i] * s + d[i];
    c[i] = c[i] * s + d[i];
  }
}

void roofline_stream(float* a, float* b, float* c, const float* d, int64_t n, float s) {
  const int nth = threads_for(n);
#pragma omp parallel num_threads(nth)
  {
    const int t = omp_get_thread_num(), team = omp_get_num_threads();
    stream_range(a, b, c, d, range_start(n, t, team), range_start(n, t + 1, team), s);
  }
}

// This variant's table; simd_dispatch.cpp declares it as simd::<variant>::kernels().
const Kernels& kernels() {
  static const Kernels table{kName, &adam_update, &grad_sq_sum, &roofline_stream};
  return table;
}

}  // inline namespace PYSTRONGHOLD_SIMD_NS
}  // namespace simd
}  // namespace pystronghold

PYSTRONGHOLD_SIMD_END
