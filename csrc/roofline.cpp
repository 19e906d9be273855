// Roofline probe for the fused Adam: an in-place stream with Adam's memory access pattern (four
// fp32 read streams, three of them written back in place) and almost no arithmetic, split over
// OpenMP threads exactly as adam_step splits its work. Its bytes/s is this machine's ceiling for
// any one-pass Adam; bench/adam.py reports Adam's effective GB/s against it.
#include "adam.h"
#include "bindings.h"
#include "simd_dispatch.h"

namespace pystronghold {
namespace adam {
namespace {

// a, b, c <- a*s + d, b*s + d, c*s + d (in place). Returns the bytes moved (16 read + 12 written per element).
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

}  // namespace
}  // namespace adam
}  // namespace pystronghold

void pystronghold::bind_roofline(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("roofline_stream", &pystronghold::adam::roofline_stream, py::arg("a"), py::arg("b"), py::arg("c"),
        py::arg("d"), py::arg("s"), py::call_guard<py::gil_scoped_release>(),
        "Adam-shaped memory stream: a,b,c <- x*s + d in place; returns the bytes moved.");
}
