// Sum of squares of grad * grad_scale (fp32 product, as Adam sees the grad) with float64
// accumulation: the runtime's global-norm clipping and overflow check. One read pass, OpenMP, in
// the SIMD variant the CPU supports (simd_kernels.h); this file validates (ops.cpp registers it).
#include "adam.h"
#include "simd_dispatch.h"

namespace pystronghold {
namespace adam {

double grad_sq_norm(const at::Tensor& grad, double grad_scale) {
  constexpr const char* fn = "grad_sq_norm";
  check_cpu_contiguous(grad, fn, "grad");
  check_dtype_in(grad, fn, "grad", {at::kFloat, at::kBFloat16, at::kHalf}, "float32, bfloat16 or float16");
  TORCH_CHECK_VALUE(std::isfinite(grad_scale), fn, ": grad_scale must be finite, got ", grad_scale);
  const simd::Elem type = grad.scalar_type() == at::kFloat      ? simd::Elem::f32
                          : grad.scalar_type() == at::kBFloat16 ? simd::Elem::bf16
                                                                : simd::Elem::f16;
  return simd::active().grad_sq_sum(grad.data_ptr(), grad.numel(), static_cast<float>(grad_scale), type);
}

}  // namespace adam
}  // namespace pystronghold
