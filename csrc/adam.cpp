// Fused CPU Adam/AdamW over flat fp32 buffers: one pass reads param, grad (fp32/bf16/fp16),
// exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq and optionally a bf16/fp16 shadow of
// the new param. The arithmetic follows torch.optim's single-tensor CPU path operation by
// operation (same roundings, same fused lerp). Two sqrt choices:
//   default        the ISA's correctly rounded SIMD sqrt, in one fused pass (memory-bound). Only
//                  sqrt differs from torch (MKL's vmsSqrt is 1 ulp off IEEE for ~16% of inputs), so
//                  exp_avg/exp_avg_sq are bit-identical to torch's and param within a few ulp of
//                  its update (docs/DESIGN.md, "Fused CPU Adam").
//   bitwise_torch  MKL's vmsSqrt, as torch's CPU sqrt: bit-identical to torch, ~5x slower.
// adam_step_multi updates many tensors in one OpenMP region: the tensors are laid end to end and
// each thread takes one contiguous range of the whole, so threads never sync per tensor.
// This file validates and computes the coefficients; the arithmetic runs in the SIMD variant the
// CPU supports (simd_kernels.h, adam_kernel.h; chosen by simd_dispatch.cpp). The roofline probe,
// Adam's memory ceiling, is validated here too (its own section at the end).
//
// Overflow skip: before anything is written, each thread scans its range of the grad (times
// grad_scale) for inf/NaN; after a barrier, either every thread updates its range or none does.
// The scan reads only the grad (4 or 2 bytes per element of the 28-30 the update moves); callers
// that already know the grad is finite (e.g. from grad_sq_norm) pass check_finite=false.
#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

#include "adam.h"
#include "simd_dispatch.h"

namespace pystronghold {
namespace adam {
namespace {

// The element type of a validated grad or shadow.
simd::Elem elem(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return simd::Elem::f32;
    case at::kBFloat16: return simd::Elem::bf16;
    case at::kHalf: return simd::Elem::f16;
    default: TORCH_INTERNAL_ASSERT(false, "dtype was validated before: ", t.scalar_type());
  }
  return simd::Elem::f32;
}

// Validates one tensor set (the k-th of a multi call when `k` >= 0) and returns its buffers.
Buffers check_set(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                  const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& shadow, const char* fn, int64_t k) {
  // adam_step names "param"; adam_step_multi names the list element, "params[3]"
  const std::string sfx = k < 0 ? "" : "s[" + std::to_string(k) + "]";
  const std::string np = "param" + sfx, ng = "grad" + sfx, nm = "exp_avg" + sfx, nv = "exp_avg_sq" + sfx;
  const std::string ns = "shadow" + sfx;
  check_cpu_contiguous(param, fn, np.c_str());
  check_cpu_contiguous(grad, fn, ng.c_str());
  check_cpu_contiguous(exp_avg, fn, nm.c_str());
  check_cpu_contiguous(exp_avg_sq, fn, nv.c_str());
  check_dtype_in(param, fn, np.c_str(), {at::kFloat}, "float32");
  check_dtype_in(exp_avg, fn, nm.c_str(), {at::kFloat}, "float32");
  check_dtype_in(exp_avg_sq, fn, nv.c_str(), {at::kFloat}, "float32");
  check_dtype_in(grad, fn, ng.c_str(), {at::kFloat, at::kBFloat16, at::kHalf}, "float32, bfloat16 or float16");
  const int64_t n = param.numel();
  check_numel(grad, fn, ng.c_str(), n);
  check_numel(exp_avg, fn, nm.c_str(), n);
  check_numel(exp_avg_sq, fn, nv.c_str(), n);
  std::vector<std::pair<const char*, const at::Tensor*>> named = {
      {np.c_str(), &param}, {ng.c_str(), &grad}, {nm.c_str(), &exp_avg}, {nv.c_str(), &exp_avg_sq}};
  if (shadow.has_value()) {
    check_cpu_contiguous(*shadow, fn, ns.c_str());
    check_dtype_in(*shadow, fn, ns.c_str(), {at::kBFloat16, at::kHalf}, "bfloat16 or float16");
    check_numel(*shadow, fn, ns.c_str(), n);
    named.emplace_back(ns.c_str(), &*shadow);
  }
  check_disjoint(named, fn);
  return Buffers{param.data_ptr<float>(), grad.data_ptr(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
                 shadow.has_value() ? shadow->data_ptr() : nullptr};
}

Coeffs coeffs(const char* fn, int64_t step, double lr, double beta1, double beta2, double eps,
              double weight_decay, double grad_scale) {
  TORCH_CHECK_VALUE(step >= 1, fn, ": step must be >= 1 (the count after incrementing), got ", step);
  TORCH_CHECK_VALUE(lr >= 0.0, fn, ": lr must be >= 0, got ", lr);
  TORCH_CHECK_VALUE(beta1 >= 0.0 && beta1 < 1.0, fn, ": beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK_VALUE(beta2 >= 0.0 && beta2 < 1.0, fn, ": beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK_VALUE(eps >= 0.0, fn, ": eps must be >= 0, got ", eps);
  TORCH_CHECK_VALUE(weight_decay >= 0.0, fn, ": weight_decay must be >= 0, got ", weight_decay);
  TORCH_CHECK_VALUE(std::isfinite(grad_scale), fn, ": grad_scale must be finite, got ", grad_scale);
  const double stepd = static_cast<double>(step);
  const double bias_correction1 = 1.0 - std::pow(beta1, stepd);
  const double bias_correction2 = 1.0 - std::pow(beta2, stepd);
  const double step_size = lr / bias_correction1;
  Coeffs c;
  c.grad_scale = static_cast<float>(grad_scale);
  c.decay = static_cast<float>(1.0 - lr * weight_decay);
  c.l2 = static_cast<float>(weight_decay);
  c.w1 = static_cast<float>(1.0 - beta1);
  c.beta2 = static_cast<float>(beta2);
  c.c2 = static_cast<float>(1.0 - beta2);
  c.bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  c.eps = static_cast<float>(eps);
  c.neg_step = static_cast<float>(-step_size);
  return c;
}

// Across the sets of a multi call no two buffers may overlap either (e.g. one tensor passed twice):
// sort every buffer's [start, end) by address and compare neighbours, O(n log n).
void check_sets_disjoint(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList exp_avg_sqs, const std::optional<at::TensorList>& shadows, const char* fn) {
  struct Span { uintptr_t lo, hi; const char* list; size_t k; };
  std::vector<Span> spans;
  auto add = [&](at::TensorList ts, const char* list) {
    for (size_t k = 0; k < ts.size(); ++k) {
      if (ts[k].numel() == 0) continue;
      const auto lo = reinterpret_cast<uintptr_t>(ts[k].data_ptr());
      spans.push_back({lo, lo + ts[k].nbytes(), list, k});
    }
  };
  add(params, "params");
  add(grads, "grads");
  add(exp_avgs, "exp_avgs");
  add(exp_avg_sqs, "exp_avg_sqs");
  if (shadows.has_value()) add(*shadows, "shadows");
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.lo < b.lo; });
  for (size_t i = 1; i < spans.size(); ++i) {
    const Span& a = spans[i - 1];
    const Span& b = spans[i];
    TORCH_CHECK_VALUE(a.hi <= b.lo, fn, ": ", a.list, "[", a.k, "] and ", b.list, "[", b.k,
                      "] overlap in memory; every buffer must be separate");
  }
}

// The one implementation of both entry points; `single`: called as adam_step (names "param", not "params[0]").
bool update_sets(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 const std::optional<at::TensorList>& shadows, int64_t step, double lr, double beta1, double beta2,
                 double eps, double weight_decay, bool adamw, double grad_scale, bool check_finite,
                 bool bitwise_torch, const char* fn, bool single) {
  const size_t count = params.size();
  TORCH_CHECK_VALUE(grads.size() == count && exp_avgs.size() == count && exp_avg_sqs.size() == count, fn,
                    ": params, grads, exp_avgs and exp_avg_sqs must have the same length, got ", count, ", ",
                    grads.size(), ", ", exp_avgs.size(), " and ", exp_avg_sqs.size());
  TORCH_CHECK_VALUE(!shadows.has_value() || shadows->size() == count, fn,
                    ": shadows must be None or have one tensor per param (", count, "), got ",
                    shadows.has_value() ? shadows->size() : 0);
  const Coeffs c = coeffs(fn, step, lr, beta1, beta2, eps, weight_decay, grad_scale);
  std::vector<Buffers> bufs;
  std::vector<int64_t> offsets = {0};
  bufs.reserve(count);
  offsets.reserve(count + 1);
  for (size_t k = 0; k < count; ++k) {
    const std::optional<at::Tensor> sh = shadows.has_value() ? std::optional<at::Tensor>((*shadows)[k]) : std::nullopt;
    bufs.push_back(check_set(params[k], grads[k], exp_avgs[k], exp_avg_sqs[k], sh, fn, single ? -1 : int64_t(k)));
    if (k > 0) {
      TORCH_CHECK_VALUE(grads[k].scalar_type() == grads[0].scalar_type(), fn, ": grads[", k, "] must have the dtype of grads[0] (",
                        grads[0].scalar_type(), "), got ", grads[k].scalar_type());
      TORCH_CHECK_VALUE(!sh || sh->scalar_type() == (*shadows)[0].scalar_type(), fn, ": shadows[", k,
                        "] must have the dtype of shadows[0] (", (*shadows)[0].scalar_type(), "), got ", sh->scalar_type());
    }
    offsets.push_back(offsets.back() + params[k].numel());
  }
  if (!single) check_sets_disjoint(params, grads, exp_avgs, exp_avg_sqs, shadows, fn);
  if (offsets.back() == 0) return true;
  const Mode m{!adamw && weight_decay != 0.0, adamw && weight_decay != 0.0, check_finite, bitwise_torch};
  const bool has_shadow = shadows.has_value() && count > 0;
  return simd::active().adam_update(bufs.data(), offsets.data(), count, c, elem(grads[0]), has_shadow,
                                    has_shadow ? elem((*shadows)[0]) : simd::Elem::bf16, m);
}

}  // namespace

bool adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
               const std::optional<at::Tensor>& shadow, int64_t step, double lr, double beta1, double beta2,
               double eps, double weight_decay, bool adamw, double grad_scale, bool check_finite, bool bitwise_torch) {
  std::optional<at::TensorList> shadows;
  if (shadow.has_value()) shadows = at::TensorList(*shadow);
  return update_sets(param, grad, exp_avg, exp_avg_sq, shadows, step, lr, beta1, beta2, eps, weight_decay, adamw,
                     grad_scale, check_finite, bitwise_torch, "adam_step", true);
}

bool adam_step_multi(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                     const std::optional<at::TensorList>& shadows, int64_t step, double lr, double beta1,
                     double beta2, double eps, double weight_decay, bool adamw, double grad_scale,
                     bool check_finite, bool bitwise_torch) {
  return update_sets(params, grads, exp_avgs, exp_avg_sqs, shadows, step, lr, beta1, beta2, eps, weight_decay,
                     adamw, grad_scale, check_finite, bitwise_torch, "adam_step_multi", false);
}

// ---- the roofline probe: an in-place stream with Adam's memory access pattern (four
// fp32 read streams, three of them written back in place) and almost no arithmetic, split over
// OpenMP threads exactly as adam_step splits its work. Its bytes/s is this machine's ceiling for
// any one-pass Adam; bench/adam.py reports Adam's effective GB/s against it.
int64_t roofline_stream(at::Tensor a, at::Tensor b, at::Tensor c, at::Tensor d, double s) {
  constexpr const char* fn = "roofline_stream";
  const at::Tensor* ts[] = {&a, &b, &c, &d};
  const char* names[] = {"a", "b", "c", "d"};
  for (int k = 0; k < 4; ++k) {
    check_cpu_contiguous(*ts[k], fn, names[k]);
    check_dtype_in(*ts[k], fn, names[k], {at::kFloat}, "float32");
    check_numel(*ts[k], fn, names[k], a.numel());
  }
  check_disjoint({{"a", &a}, {"b", &b}, {"c", &c}, {"d", &d}}, fn);
  const int64_t n = a.numel();
  simd::active().roofline_stream(a.data_ptr<float>(), b.data_ptr<float>(), c.data_ptr<float>(),
                                 d.data_ptr<float>(), n, static_cast<float>(s));
  return n * 28;
}

}  // namespace adam
}  // namespace pystronghold
