// The SIMD kernels of the extension, compiled once per ISA variant (csrc/simd_<isa>.cpp) and
// chosen once at load time from the CPU's features, as PyTorch's CPU capability dispatch does.
// Torch-free on purpose: the variant sources include only this, simd.h and adam_kernel.h, so no
// torch inline function is ever compiled with AVX-512 instructions (the linker could keep that
// copy for the whole library and crash on an older CPU).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

// MKL VML single-precision sqrt (LP64), exported by an MKL build of libtorch_cpu; null otherwise.
extern "C" void vmsSqrt(int n, const float* a, float* r, long long mode) __attribute__((weak));

namespace pystronghold {

namespace adam {

// Per-call constants, computed in double exactly as torch computes its Python scalars, then
// rounded to fp32 as torch's CPU kernels do with scalar arguments.
struct Coeffs {
  float grad_scale;  // grad multiplier (1/loss_scale * clip coefficient)
  float decay;       // AdamW: 1 - lr*wd (param.mul_)
  float l2;          // Adam: wd (grad.add(param, alpha=wd))
  float w1;          // 1 - beta1 (exp_avg.lerp_(grad, w1))
  float beta2;       // exp_avg_sq.mul_(beta2)
  float c2;          // 1 - beta2 (addcmul_ value)
  float bc2_sqrt;    // sqrt(1 - beta2^step)
  float eps;
  float neg_step;    // -lr / (1 - beta1^step) (addcdiv_ value)
};

struct Buffers {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* shadow;  // nullptr: no shadow
};

struct Mode {
  bool l2, decay, check_finite, bitwise_torch;
};

}  // namespace adam

namespace simd {

// Element type of a grad or shadow buffer (fp32 is for grads only).
enum class Elem { f32, bf16, f16 };

// One ISA variant's kernels. Arguments are validated by the callers (adam.cpp, grad_norms.cpp);
// these only compute.
struct Kernels {
  const char* name;  // "avx512", "avx2", "neon", "scalar"
  // Adam over `count` tensor sets laid end to end (offsets[k]: first global index of set k,
  // offsets[count]: the total); false, with nothing written, on a non-finite grad.
  bool (*adam_update)(const adam::Buffers* bufs, const int64_t* offsets, size_t count,
                      const adam::Coeffs& c, Elem grad, bool has_shadow, Elem shadow, adam::Mode mode);
  // Sum of squares of grad[i] * scale (fp32 product, float64 accumulation), OpenMP.
  double (*grad_sq_sum)(const void* grad, int64_t n, float scale, Elem grad_type);
  // a, b, c <- a*s + d, b*s + d, c*s + d, in place, OpenMP (the roofline probe).
  void (*roofline_stream)(float* a, float* b, float* c, const float* d, int64_t n, float s);
};

// The variant that runs: chosen on first use (the module's import) from the CPU's features, or
// forced by PYSTRONGHOLD_SIMD_FORCE (a c10::Error naming the variants this CPU can run if it
// cannot run the forced one).
const Kernels& active();

// The names of the variants built into this library, best first; runnable_only: those this CPU can
// run (the values PYSTRONGHOLD_SIMD_FORCE accepts).
std::vector<std::string> variant_names(bool runnable_only);

}  // namespace simd
}  // namespace pystronghold
