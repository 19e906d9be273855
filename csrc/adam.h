// Input validation of the fused CPU Adam and the roofline probe (adam.cpp) and the gradient norms
// (grad_norms.cpp): each error names the tensor and the expected value.
#pragma once

// NOTE: ATen's tensor header, not torch/extension.h: these sources bind to torch's dispatcher
// (ops.cpp), not to Python, and compile several times faster without the Python side.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace pystronghold {
namespace adam {

inline void check_cpu_contiguous(const at::Tensor& t, const char* fn, const char* name) {
  TORCH_CHECK_VALUE(t.defined(), fn, ": ", name, " must be a tensor, got None");
  TORCH_CHECK_VALUE(t.device().is_cpu(), fn, ": ", name, " must be on the CPU, got device ", t.device());
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, fn, ": ", name, " must be a dense (strided) tensor");
  TORCH_CHECK_VALUE(t.is_contiguous(), fn, ": ", name, " must be contiguous (a flat buffer), got strides ",
                    t.strides());
  TORCH_CHECK_VALUE(!t.is_complex(), fn, ": ", name, " must be real, got ", t.scalar_type());
}

inline void check_dtype_in(const at::Tensor& t, const char* fn, const char* name,
                           std::initializer_list<at::ScalarType> allowed, const char* expected) {
  bool ok = false;
  for (auto s : allowed) ok = ok || t.scalar_type() == s;
  TORCH_CHECK_VALUE(ok, fn, ": ", name, " must be ", expected, ", got ", t.scalar_type());
}

inline void check_numel(const at::Tensor& t, const char* fn, const char* name, int64_t n) {
  TORCH_CHECK_VALUE(t.numel() == n, fn, ": ", name, " must have the same number of elements as param (",
                    n, "), got ", t.numel());
}

// Every pair of named buffers must be disjoint in memory (an in-place update through two views of
// the same storage would read values it has already written).
inline void check_disjoint(const std::vector<std::pair<const char*, const at::Tensor*>>& named, const char* fn) {
  for (size_t i = 0; i < named.size(); ++i) {
    for (size_t j = i + 1; j < named.size(); ++j) {
      const at::Tensor& a = *named[i].second;
      const at::Tensor& b = *named[j].second;
      if (a.numel() == 0 || b.numel() == 0) continue;
      const auto a0 = reinterpret_cast<uintptr_t>(a.data_ptr());
      const auto b0 = reinterpret_cast<uintptr_t>(b.data_ptr());
      const auto a1 = a0 + a.nbytes();
      const auto b1 = b0 + b.nbytes();
      TORCH_CHECK_VALUE(a1 <= b0 || b1 <= a0, fn, ": ", named[i].first, " and ", named[j].first,
                        " overlap in memory; they must be separate buffers");
    }
  }
}

// ---- the kernels behind torch.ops.pystronghold.* (ops.cpp registers them; the arguments are
// documented in pystronghold/optim/functional.py). Each validates its inputs (ValueError naming the
// argument) and runs without touching Python objects; the dispatcher calls them without the GIL.

// Fused Adam/AdamW over flat CPU buffers, in place (adam.cpp); false, nothing written, on a
// non-finite grad*grad_scale when check_finite.
bool adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
               const std::optional<at::Tensor>& shadow, int64_t step, double lr, double beta1, double beta2,
               double eps, double weight_decay, bool adamw, double grad_scale, bool check_finite, bool bitwise_torch);

// adam_step over lists of buffers in one parallel region: all applied or none (adam.cpp).
bool adam_step_multi(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                     const std::optional<at::TensorList>& shadows, int64_t step, double lr, double beta1,
                     double beta2, double eps, double weight_decay, bool adamw, double grad_scale,
                     bool check_finite, bool bitwise_torch);

// Sum of squares of grad*grad_scale in float64; inf/NaN when a value is not finite (grad_norms.cpp).
double grad_sq_norm(const at::Tensor& grad, double grad_scale);

// fp32 L2 norm of each grads[i]*grad_scale, shape (len(grads),), bit for bit
// torch.linalg.vector_norm of the fp32 gradient; the parameters shared among threads (grad_norms.cpp).
at::Tensor param_grad_norms(at::TensorList grads, double grad_scale);

// The roofline probe (adam.cpp), bound in module.cpp: a, b, c <- a*s + d, b*s + d, c*s + d in place,
// Adam's access pattern; returns the bytes moved (16 read + 12 written per element).
int64_t roofline_stream(at::Tensor a, at::Tensor b, at::Tensor c, at::Tensor d, double s);

}  // namespace adam
}  // namespace pystronghold
