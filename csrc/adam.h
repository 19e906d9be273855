// Input validation of the fused CPU Adam (adam.cpp), the gradient norm (adam_norm.cpp) and the
// roofline probe (roofline.cpp): each error names the tensor and the expected value.
#pragma once

#include <torch/extension.h>

#include <algorithm>
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

}  // namespace adam
}  // namespace pystronghold
