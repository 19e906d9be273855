// Roofline probe for the fused Adam: an in-place stream with Adam's memory access pattern (four
// fp32 read streams, three of them written back in place) and almost no arithmetic, split over
// OpenMP threads exactly as adam_step splits its work. Its bytes/s is this machine's ceiling for
// any one-pass Adam; bench/adam.py reports Adam's effective GB/s against it.
#include "adam.h"
#include "bindings.h"
#include "simd.h"

namespace pystronghold {
namespace adam {
namespace {

namespace sv = ::pystronghold::simd;

void stream_range(float* a, float* b, float* c, const float* d, int64_t begin, int64_t end, float s) {
  const sv::vf vs = sv::set1(s);
  int64_t i = begin;
  for (; i + sv::kWidth <= end; i += sv::kWidth) {
    const sv::vf x = sv::load(d + i);
    sv::store(a + i, sv::add(sv::mul(sv::load(a + i), vs), x));
    sv::store(b + i, sv::add(sv::mul(sv::load(b + i), vs), x));
    sv::store(c + i, sv::add(sv::mul(sv::load(c + i), vs), x));
  }
  for (; i < end; ++i) {
    a[i] = a[i] * s + d[i];
    b[i] = b[i] * s + d[i];
    c[i] = c[i] * s + d[i];
  }
}

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
  float *pa = a.data_ptr<float>(), *pb = b.data_ptr<float>(), *pc = c.data_ptr<float>();
  const float* pd = d.data_ptr<float>();
  const float fs = static_cast<float>(s);
  const int nth = threads_for(n);
#pragma omp parallel num_threads(nth)
  {
    const int t = omp_get_thread_num(), team = omp_get_num_threads();
    stream_range(pa, pb, pc, pd, range_start(n, t, team), range_start(n, t + 1, team), fs);
  }
  return n * 28;
}

}  // namespace
}  // namespace adam
}  // namespace pystronghold

PYSTRONGHOLD_BINDINGS(roofline) {
  namespace py = pybind11;
  m.def("roofline_stream", &pystronghold::adam::roofline_stream, py::arg("a"), py::arg("b"), py::arg("c"),
        py::arg("d"), py::arg("s"), py::call_guard<py::gil_scoped_release>(),
        "Adam-shaped memory stream: a,b,c <- x*s + d in place; returns the bytes moved.");
}
