// The arithmetic of the fused CPU Adam over one range of one tensor set (simd_kernels.h runs it
// over threads and tensors): the two update paths, the default one-pass kernel with the ISA's IEEE
// sqrt and the bitwise-torch kernel with MKL's vmsSqrt (see adam.cpp's header comment for why there
// are two). Compiled once per SIMD variant (simd.h explains the BEGIN/END region).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "simd.h"
#include "simd_dispatch.h"  // Coeffs, Buffers, vmsSqrt

PYSTRONGHOLD_SIMD_BEGIN

namespace pystronghold {
namespace adam {
inline namespace PYSTRONGHOLD_SIMD_NS {

namespace sv = ::pystronghold::simd;

// NOTE: an empty asm with the value as in/out operand forces it to be rounded to fp32 here, so
// the compiler cannot contract a multiply with the following add into an FMA (-ffp-contract=fast
// is GCC's default for C++). torch's kernels round these products separately.
template <typename T>
inline T opaque(T x) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+v"(x));
#elif defined(__aarch64__)
  asm("" : "+w"(x));
#endif
  return x;
}

// sqrt as torch computes it. torch's CPU sqrt of a contiguous fp32 tensor calls MKL's vmsSqrt
// (VML_HA accuracy, not always correctly rounded: ~16% of results differ by 1 ulp from IEEE sqrt)
// when torch is built with MKL. We call the same routine, found in libtorch_cpu at load time
// (weak symbol, declared in simd_dispatch.h), on each block; it is elementwise, so any block split gives
// torch's results. Without it (non-MKL torch, e.g. aarch64) torch's sqrt is IEEE and so is ours.
constexpr long long kVmlMode = 0x2 | 0x140000 | 0x100;  // VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE

// Elements per block: stage 1 (moments) and stage 2 (param) run over one block while it is in L1.
constexpr int64_t kBlock = 512;

// torch's CPU kernels (vector and scalar loops alike) fuse the multiply-add of lerp, addcmul and
// add(alpha=) into an FMA; every other product is rounded on its own (opaque() keeps it so).
// Stage 1, one element: grad scale, L2 or decay, both moments. Decayed param written back.
template <typename G, bool kL2, bool kDecay>
inline void moments_one(const Buffers& b, int64_t i, const Coeffs& c) {
  float g = sv::scalar_as_float(static_cast<const G*>(b.grad) + i) * c.grad_scale;
  if (kL2) g = std::fma(c.l2, b.param[i], g);  // grad.add(param, alpha=wd)
  if (kDecay) b.param[i] = b.param[i] * c.decay;
  const float m = b.exp_avg[i];
  // exp_avg.lerp_(g, w1), torch's two branches: m + w*(g - m) for w < 0.5, else g + (w - 1)*(g - m)
  b.exp_avg[i] = c.w1 < 0.5f ? std::fma(c.w1, g - m, m) : std::fma(c.w1 - 1.0f, g - m, g);
  const float vb = opaque(b.exp_avg_sq[i] * c.beta2);
  b.exp_avg_sq[i] = std::fma(opaque(c.c2 * g), g, vb);  // mul_(beta2).addcmul_(g, g, value=1-beta2)
}

// Stage 2, one element: param.addcdiv_(exp_avg, sqrt(v)/bc2 + eps, value=-step_size); shadow.
template <typename S>
inline void param_one(const Buffers& b, int64_t i, float root, const Coeffs& c) {
  const float denom = root / c.bc2_sqrt + c.eps;
  const float p = b.param[i] + opaque(c.neg_step * b.exp_avg[i]) / denom;
  b.param[i] = p;
  if constexpr (!std::is_same_v<S, void>) sv::scalar_from_float(static_cast<S*>(b.shadow) + i, p);
}

// Default (IEEE) path, one element: the whole update with a correctly rounded sqrt. Every other
// operation is torch's, in torch's order and rounding, so only sqrt can differ from torch.
template <typename G, typename S, bool kL2, bool kDecay>
inline void fused_one(const Buffers& b, int64_t i, const Coeffs& c) {
  moments_one<G, kL2, kDecay>(b, i, c);
  param_one<S>(b, i, std::sqrt(b.exp_avg_sq[i]), c);
}

// Default (IEEE) path over elements [begin, end): one fused pass, each element loaded and stored
// once; the SIMD body and the scalar tail. sv::sqrt is the ISA's IEEE sqrt (vsqrtps).
template <typename G, typename S, bool kL2, bool kDecay>
void update_range_ieee(const Buffers& b, int64_t begin, int64_t end, const Coeffs& c) {
  const sv::vf gs = sv::set1(c.grad_scale), l2 = sv::set1(c.l2), decay = sv::set1(c.decay);
  const sv::vf w1 = sv::set1(c.w1), beta2 = sv::set1(c.beta2), c2 = sv::set1(c.c2);
  const sv::vf bc2 = sv::set1(c.bc2_sqrt), eps = sv::set1(c.eps), neg_step = sv::set1(c.neg_step);
  const bool small_w1 = c.w1 < 0.5f;  // uniform over the call: the branch predicts perfectly
  const sv::vf w1m1 = sv::set1(c.w1 - 1.0f);
  const G* grad = static_cast<const G*>(b.grad);
  int64_t i = begin;
  if constexpr (!std::is_same_v<S, void>) {
    // NOTE: the shadow is write-only here: non-temporal stores skip the read for ownership of its
    // lines (2 of ~30 bytes per element). They need kStreamAlign-aligned addresses: peel the head.
    const auto addr = [&](int64_t j) { return reinterpret_cast<uintptr_t>(static_cast<S*>(b.shadow) + j); };
    while (i < end && addr(i) % sv::kStreamAlign != 0) fused_one<G, S, kL2, kDecay>(b, i++, c);
  }
  for (; i + sv::kWidth <= end; i += sv::kWidth) {
    sv::vf p = sv::load(b.param + i);
    sv::vf g = sv::mul(sv::load_as_float(grad + i), gs);
    if (kL2) g = sv::fmadd(l2, p, g);
    if (kDecay) p = opaque(sv::mul(p, decay));
    const sv::vf m0 = sv::load(b.exp_avg + i);
    const sv::vf m = small_w1 ? sv::fmadd(w1, sv::sub(g, m0), m0) : sv::fmadd(w1m1, sv::sub(g, m0), g);
    const sv::vf vb = opaque(sv::mul(sv::load(b.exp_avg_sq + i), beta2));
    const sv::vf v = sv::fmadd(opaque(sv::mul(c2, g)), g, vb);
    sv::store(b.exp_avg + i, m);
    sv::store(b.exp_avg_sq + i, v);
    const sv::vf denom = sv::add(sv::div(sv::sqrt(v), bc2), eps);
    p = sv::add(p, sv::div(opaque(sv::mul(neg_step, m)), denom));
    sv::store(b.param + i, p);
    if constexpr (!std::is_same_v<S, void>) sv::stream_from_float(static_cast<S*>(b.shadow) + i, p);
  }
  for (; i < end; ++i) fused_one<G, S, kL2, kDecay>(b, i, c);
  if constexpr (!std::is_same_v<S, void>) sv::stream_fence();  // streamed stores visible before return
}

// Bitwise-torch path over [begin, end), block by block: stage 1 (moments) over a block, MKL's
// vmsSqrt over its exp_avg_sq (as torch's sqrt), stage 2 (param) while the block is in L1.
template <typename G, typename S, bool kL2, bool kDecay>
void update_range_torch(const Buffers& b, int64_t begin, int64_t end, const Coeffs& c) {
  const sv::vf gs = sv::set1(c.grad_scale), l2 = sv::set1(c.l2), decay = sv::set1(c.decay);
  const sv::vf w1 = sv::set1(c.w1), beta2 = sv::set1(c.beta2), c2 = sv::set1(c.c2);
  const sv::vf bc2 = sv::set1(c.bc2_sqrt), eps = sv::set1(c.eps), neg_step = sv::set1(c.neg_step);
  const bool small_w1 = c.w1 < 0.5f;
  const sv::vf w1m1 = sv::set1(c.w1 - 1.0f);
  const G* grad = static_cast<const G*>(b.grad);
  alignas(64) float root[kBlock];
  for (int64_t b0 = begin; b0 < end; b0 += kBlock) {
    const int64_t b1 = std::min(end, b0 + kBlock);
    int64_t i = b0;
    for (; i + sv::kWidth <= b1; i += sv::kWidth) {
      sv::vf g = sv::mul(sv::load_as_float(grad + i), gs);
      if (kL2) g = sv::fmadd(l2, sv::load(b.param + i), g);
      if (kDecay) sv::store(b.param + i, sv::mul(sv::load(b.param + i), decay));
      const sv::vf m = sv::load(b.exp_avg + i);
      sv::store(b.exp_avg + i, small_w1 ? sv::fmadd(w1, sv::sub(g, m), m) : sv::fmadd(w1m1, sv::sub(g, m), g));
      const sv::vf vb = opaque(sv::mul(sv::load(b.exp_avg_sq + i), beta2));
      sv::store(b.exp_avg_sq + i, sv::fmadd(opaque(sv::mul(c2, g)), g, vb));
    }
    for (; i < b1; ++i) moments_one<G, kL2, kDecay>(b, i, c);

    const int64_t len = b1 - b0;
    if (::vmsSqrt != nullptr) {
      ::vmsSqrt(static_cast<int>(len), b.exp_avg_sq + b0, root, kVmlMode);
    } else {
      int64_t j = 0;
      for (; j + sv::kWidth <= len; j += sv::kWidth) sv::store(root + j, sv::sqrt(sv::load(b.exp_avg_sq + b0 + j)));
      for (; j < len; ++j) root[j] = std::sqrt(b.exp_avg_sq[b0 + j]);
    }

    for (i = b0; i + sv::kWidth <= b1; i += sv::kWidth) {
      const sv::vf denom = sv::add(sv::div(sv::load(root + (i - b0)), bc2), eps);
      const sv::vf p = sv::add(sv::load(b.param + i), sv::div(opaque(sv::mul(neg_step, sv::load(b.exp_avg + i))), denom));
      sv::store(b.param + i, p);
      if constexpr (!std::is_same_v<S, void>) sv::store_from_float(static_cast<S*>(b.shadow) + i, p);
    }
    for (; i < b1; ++i) param_one<S>(b, i, root[i - b0], c);
  }
}

}  // inline namespace PYSTRONGHOLD_SIMD_NS
}  // namespace adam
}  // namespace pystronghold

PYSTRONGHOLD_SIMD_END
