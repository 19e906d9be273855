// Sum of squares of grad * grad_scale (fp32 product, as Adam sees the grad) with float64
// accumulation: the runtime's global-norm clipping and overflow check. One read pass, OpenMP.
#include <vector>

#include "adam.h"
#include "bindings.h"
#include "simd.h"

namespace pystronghold {
namespace adam {
namespace {

namespace sv = ::pystronghold::simd;

template <typename G>
double sq_sum_range(const G* grad, int64_t begin, int64_t end, float scale) {
  constexpr int W = sv::kWidth;
  const sv::vf s = sv::set1(scale);
  alignas(64) float lanes[W];
  double acc[W] = {};
  int64_t i = begin;
  for (; i + W <= end; i += W) {
    sv::store(lanes, sv::mul(sv::load_as_float(grad + i), s));
    for (int j = 0; j < W; ++j) acc[j] += static_cast<double>(lanes[j]) * static_cast<double>(lanes[j]);
  }
  double total = 0.0;
  for (; i < end; ++i) {
    const double x = static_cast<double>(sv::scalar_as_float(grad + i) * scale);
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

double grad_sq_norm(at::Tensor grad, double grad_scale) {
  constexpr const char* fn = "grad_sq_norm";
  check_cpu_contiguous(grad, fn, "grad");
  check_dtype_in(grad, fn, "grad", {at::kFloat, at::kBFloat16, at::kHalf}, "float32, bfloat16 or float16");
  TORCH_CHECK_VALUE(std::isfinite(grad_scale), fn, ": grad_scale must be finite, got ", grad_scale);
  const int64_t n = grad.numel();
  const float scale = static_cast<float>(grad_scale);
  switch (grad.scalar_type()) {
    case at::kFloat: return sq_sum(grad.data_ptr<float>(), n, scale);
    case at::kBFloat16: return sq_sum(static_cast<const sv::BF16*>(grad.data_ptr()), n, scale);
    case at::kHalf: return sq_sum(static_cast<const sv::F16*>(grad.data_ptr()), n, scale);
    default: TORCH_INTERNAL_ASSERT(false, "grad dtype was validated above");
  }
  return 0.0;
}

}  // namespace
}  // namespace adam
}  // namespace pystronghold

PYSTRONGHOLD_BINDINGS(adam_norm) {
  namespace py = pybind11;
  m.def("grad_sq_norm", &pystronghold::adam::grad_sq_norm, py::arg("grad"), py::arg("grad_scale"),
        py::call_guard<py::gil_scoped_release>(),
        "Sum of squares of grad*grad_scale (float64 accumulation); inf/NaN when a value is not finite.");
}
