// The gradient norms behind torch.ops.pystronghold.grad_sq_norm and param_grad_norms (ops.cpp
// registers them).
//
// grad_sq_norm: the sum of squares of grad * grad_scale (fp32 product, as Adam sees the grad) with
// float64 accumulation: the runtime's global-norm clipping and overflow check. One read pass,
// OpenMP, in the SIMD variant the CPU supports (simd_kernels.h); this file validates.
//
// param_grad_norms: per-parameter L2 norms of a block's host gradient, for global-norm clipping:
// the parameters are shared among threads, each parameter's reduction is torch's own
// (at::linalg_vector_norm of the fp32 gradient x grad_scale), so every norm is bit for bit what
// torch.linalg.vector_norm(grad.float() * grad_scale) gives, which is what
// torch.nn.utils.clip_grad_norm_ computes per parameter on the CPU.
//
// NOTE: why torch's kernel and not our SIMD one: the fp32 norm's summation order is torch's (lanes of
// its Vectorized<float> for the CPU capability it dispatched to, then a horizontal sum); a kernel of
// ours would differ in the last bits, and Adam's eps turns last-bit differences of near-zero
// gradients into visible ones. Torch reduces one tensor on one thread whatever its thread count
// (tests/runtime/test_runtime_grad_norms.py checks it), so splitting by parameter leaves every result as is.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linalg_vector_norm.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "adam.h"
#include "simd_dispatch.h"

namespace pystronghold {
namespace adam {
namespace {

// Below this many elements in all, one thread does the whole list: waking threads costs more.
constexpr int64_t kMinParallelNumel = 1 << 15;

float one_norm(const at::Tensor& grad, double grad_scale) {
  at::Tensor g = grad.to(at::kFloat);  // no copy when already fp32, as Tensor.float()
  if (grad_scale != 1.0) g = g.mul(grad_scale);
  return at::linalg_vector_norm(g).item<float>();
}

}  // namespace

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

// NOTE: the dispatcher calls this without the GIL; the loop below touches only ATen tensors.
at::Tensor param_grad_norms(at::TensorList grads, double grad_scale) {
  constexpr const char* fn = "param_grad_norms";
  TORCH_CHECK_VALUE(std::isfinite(grad_scale), fn, ": grad_scale must be finite, got ", grad_scale);
  const int64_t n = static_cast<int64_t>(grads.size());
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const std::string name = "grads[" + std::to_string(i) + "]";
    const at::Tensor& g = grads[i];
    TORCH_CHECK_VALUE(g.defined(), fn, ": ", name, " must be a tensor, got None");
    TORCH_CHECK_VALUE(g.device().is_cpu(), fn, ": ", name, " must be on the CPU, got device ", g.device());
    TORCH_CHECK_VALUE(g.layout() == at::kStrided, fn, ": ", name, " must be a dense (strided) tensor");
    adam::check_dtype_in(g, fn, name.c_str(), {at::kFloat, at::kBFloat16, at::kHalf},
                         "float32, bfloat16 or float16");
    total += g.numel();
  }
  at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kFloat));
  float* norms = out.data_ptr<float>();
  const int threads = total < kMinParallelNumel ? 1 : std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) norms[i] = one_norm(grads[i], grad_scale);
    return out;
  }
  // Largest first, each thread taking the next when it is done: the longest reduction starts at
  // once, so the step ends close to total / threads unless one parameter is larger than that.
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return grads[a].numel() > grads[b].numel(); });
  std::atomic<int64_t> next{0};
  // NOTE: at::parallel_for marks its threads as inside a parallel region, so the ops of one_norm
  // run on the calling thread (one parameter per thread), and it re-raises a worker's exception.
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t k = next.fetch_add(1); k < n; k = next.fetch_add(1)) {
        norms[order[k]] = one_norm(grads[order[k]], grad_scale);
      }
    }
  });
  return out;
}

}  // namespace adam
}  // namespace pystronghold
