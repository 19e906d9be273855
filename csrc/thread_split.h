// The static split of [0, n) over OpenMP threads shared by the SIMD kernels (simd_kernels.h).
// Torch-free: the SIMD variant sources include it.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace pystronghold {
namespace adam {

// Below this many elements one thread does the work: waking the team costs more than it saves.
constexpr int64_t kMinParallelNumel = 1 << 15;
// Thread ranges start on multiples of this many elements (a multiple of every SIMD width, and
// 64 fp32 = 4 cache lines, so no two threads write the same cache line).
constexpr int64_t kRangeAlign = 64;

inline int threads_for(int64_t n) {
  return n < kMinParallelNumel ? 1 : std::max(1, omp_get_max_threads());
}

// Start of thread `t`'s contiguous range out of `nth` (static scheduling, one chunk per thread).
inline int64_t range_start(int64_t n, int t, int nth) {
  if (t >= nth) return n;
  const int64_t raw = static_cast<int64_t>((static_cast<__int128>(n) * t) / nth);
  return std::min(n, raw / kRangeAlign * kRangeAlign);
}

}  // namespace adam
}  // namespace pystronghold
