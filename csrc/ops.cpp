// The stateless kernels as torch.library operators, torch.ops.pystronghold.*: one schema per op
// (TORCH_LIBRARY), the CPU implementations registered apart (TORCH_LIBRARY_IMPL), as
// pytorch/extension-cpp does. The schemas say which arguments are written (Tensor(a!)), so
// functionalization, torch.compile and torch.library.opcheck see the in-place updates; the fake
// (shape-only) implementations are in Python (pystronghold/ops.py), the only caller of these ops.
//
// Results are 0-dim tensors, not Python scalars: an op whose result depends on the data must return
// a tensor to be traced (auto_functionalized accepts only tensor returns of mutable ops).
// NOTE: the dispatcher releases the GIL before it calls a kernel from Python (torch's
// invokeOperatorFromPython), so these run without it, like the pybind11 functions they replace;
// tests/test_adam.py proves it by running two updates from two threads at once.
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include "adam.h"
#include "file_store_crc.h"

namespace pystronghold {
namespace {

at::Tensor flag(bool value) { return at::scalar_tensor(value, at::TensorOptions().dtype(at::kBool)); }

at::Tensor adam_step_op(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                        const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& shadow, int64_t step,
                        double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
                        double grad_scale, bool check_finite, bool bitwise_torch) {
  return flag(adam::adam_step(param, grad, exp_avg, exp_avg_sq, shadow, step, lr, beta1, beta2, eps, weight_decay,
                              adamw, grad_scale, check_finite, bitwise_torch));
}

at::Tensor adam_step_multi_op(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                              at::TensorList exp_avg_sqs, std::optional<at::TensorList> shadows, int64_t step,
                              double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
                              double grad_scale, bool check_finite, bool bitwise_torch) {
  return flag(adam::adam_step_multi(params, grads, exp_avgs, exp_avg_sqs, shadows, step, lr, beta1, beta2, eps,
                                    weight_decay, adamw, grad_scale, check_finite, bitwise_torch));
}

at::Tensor grad_sq_norm_op(const at::Tensor& grad, double grad_scale) {
  return at::scalar_tensor(adam::grad_sq_norm(grad, grad_scale), at::TensorOptions().dtype(at::kDouble));
}

at::Tensor param_grad_norms_op(at::TensorList grads, double grad_scale) {
  return adam::param_grad_norms(grads, grad_scale);
}

at::Tensor crc32c_op(const at::Tensor& data, bool force_software) {
  TORCH_CHECK_VALUE(data.device().is_cpu(), "crc32c: data must be on the CPU, got device ", data.device());
  TORCH_CHECK_VALUE(data.layout() == at::kStrided && data.is_contiguous(),
                    "crc32c: data must be a contiguous dense tensor (its bytes are checksummed in memory order)");
  const int64_t nbytes = data.numel() * static_cast<int64_t>(data.element_size());
  const uint32_t crc = crc32c(data.numel() ? data.data_ptr() : nullptr, nbytes, force_software);
  return at::scalar_tensor(static_cast<int64_t>(crc), at::TensorOptions().dtype(at::kLong));
}

}  // namespace
}  // namespace pystronghold

TORCH_LIBRARY(pystronghold, m) {
  m.def("adam_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor(d!)? shadow, "
        "int step, float lr, float beta1, float beta2, float eps, float weight_decay, bool adamw, "
        "float grad_scale, bool check_finite, bool bitwise_torch) -> Tensor");
  m.def("adam_step_multi(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[]? shadows, int step, float lr, float beta1, float beta2, float eps, float weight_decay, "
        "bool adamw, float grad_scale, bool check_finite, bool bitwise_torch) -> Tensor");
  m.def("grad_sq_norm(Tensor grad, float grad_scale) -> Tensor");
  m.def("param_grad_norms(Tensor[] grads, float grad_scale) -> Tensor");
  m.def("crc32c(Tensor data, bool force_software=False) -> Tensor");
}

namespace pystronghold {
namespace {

void register_cpu_kernels(torch::Library& m) {
  m.impl("adam_step", &adam_step_op);
  m.impl("adam_step_multi", &adam_step_multi_op);
  m.impl("grad_sq_norm", &grad_sq_norm_op);
  m.impl("param_grad_norms", &param_grad_norms_op);
  m.impl("crc32c", &crc32c_op);
}

}  // namespace
}  // namespace pystronghold

TORCH_LIBRARY_IMPL(pystronghold, CPU, m) { pystronghold::register_cpu_kernels(m); }
// NOTE: sparse CPU tensors reach the same kernels, whose layout check then names the argument
// ("param must be a dense (strided) tensor") instead of the dispatcher's "no kernel for SparseCPU".
TORCH_LIBRARY_IMPL(pystronghold, SparseCPU, m) { pystronghold::register_cpu_kernels(m); }
TORCH_LIBRARY_IMPL(pystronghold, SparseCsrCPU, m) { pystronghold::register_cpu_kernels(m); }
