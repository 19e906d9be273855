// Python bindings of the copy engine (used only by pystronghold/io/copy_engine.py) and the
// tensor-level copy request (host<->host; host<->device on CUDA builds).
#include <Python.h>

#include "bindings.h"
#include "copy_engine.h"

#if defined(PYSTRONGHOLD_WITH_CUDA)
#include <c10/cuda/CUDAStream.h>

#include "copy_engine_cuda.h"
#endif

namespace py = pybind11;

namespace pystronghold {

int64_t tensor_nbytes(const at::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

static void check_copy_operand(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined(), "CopyEngine.copy: ", name, " is undefined");
  TORCH_CHECK(t.layout() == at::kStrided, "CopyEngine.copy: ", name, " must be a strided tensor, got ",
              t.layout());
  TORCH_CHECK(t.is_contiguous(), "CopyEngine.copy: ", name, " must be contiguous (shape ", t.sizes(),
              ", strides ", t.strides(), ")");
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), "CopyEngine.copy: ", name,
              " must be on cpu or cuda, got ", t.device());
}

static std::shared_ptr<Request> make_tensor_copy(CopyEngine& engine, const at::Tensor& dst,
                                                 const at::Tensor& src) {
  check_copy_operand(dst, "dst");
  check_copy_operand(src, "src");
  const int64_t nbytes = tensor_nbytes(dst);
  TORCH_CHECK(nbytes == tensor_nbytes(src), "CopyEngine.copy: dst holds ", nbytes,
              " bytes but src holds ", tensor_nbytes(src), " bytes; they must be equal");
  std::shared_ptr<Request> req;
  if (dst.device().is_cpu() && src.device().is_cpu()) {
    const char* d = static_cast<const char*>(dst.data_ptr());
    const char* s = static_cast<const char*>(src.data_ptr());
    TORCH_CHECK(nbytes == 0 || d + nbytes <= s || s + nbytes <= d,
                "CopyEngine.copy: dst and src overlap in memory (", nbytes, " bytes)");
    req = make_memcpy_request(dst.data_ptr(), src.data_ptr(), nbytes, engine.chunk_bytes());
  } else {
    TORCH_CHECK(dst.device().is_cpu() != src.device().is_cpu(),
                "CopyEngine.copy: device-to-device copies are not supported (dst ", dst.device(),
                ", src ", src.device(), "); use Tensor.copy_");
#if defined(PYSTRONGHOLD_WITH_CUDA)
    const bool to_device = dst.device().is_cuda();
    const int device = to_device ? dst.device().index() : src.device().index();
    const void* host = to_device ? src.data_ptr() : dst.data_ptr();
    const bool pinned = cuda::is_pinned(host);
    req = std::make_shared<Request>();
    req->nbytes = nbytes;
    req->chunk_bytes = engine.chunk_bytes();
    char* d = static_cast<char*>(dst.data_ptr());
    const char* s = static_cast<const char*>(src.data_ptr());
    const int64_t staging = engine.chunk_bytes();
    // NOTE: the copy starts after the work the caller queued on its current stream of `device`
    // (e.g. the kernel that fills `src`, or one still reading `dst`): an event recorded now, on the
    // calling thread, which every chunk's stream waits for. Destroyed with the request.
    std::shared_ptr<CUevent_st> caller_done;
    try {
      caller_done.reset(cuda::record_event(device, c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream()),
                        [](CUevent_st* event) { cuda::destroy_event(event); });
    } catch (const std::runtime_error& exc) {
      TORCH_CHECK(false, "CopyEngine.copy: ordering the copy after the current stream of cuda:", device,
                  " failed: ", exc.what());
    }
    req->run_chunk = [=](int64_t offset, int64_t len, int64_t, WorkerContext& ctx) {
      try {
        cuda::copy_chunk(d + offset, s + offset, len, to_device, device, pinned, staging, caller_done.get(),
                         &ctx.cuda_state);
      } catch (const std::runtime_error& exc) {
        throw CopyFailure{std::string(to_device ? "host-to-device" : "device-to-host") +
                              " copy at offset " + std::to_string(offset) + ", size " +
                              std::to_string(len) + " bytes failed: " + exc.what(),
                          0, to_device ? "cuda:" + std::to_string(device) : "host", offset, len};
      }
    };
#else
    TORCH_CHECK(false, "CopyEngine.copy: this build of pystronghold._C has no CUDA support (dst ",
                dst.device(), ", src ", src.device(), ")");
#endif
  }
  req->keep_alive = {dst, src};
  return req;
}

static py::object error_tuple(Request& req) {
  if (!req.failed.load()) return py::none();
  std::lock_guard<std::mutex> guard(req.error_mutex);
  const CopyFailure& e = req.error;
  return py::make_tuple(e.message, e.err, e.path, e.offset, e.size);
}

// Deletes the engine with the GIL released when it is held: the destructor joins the workers, and
// a worker may need the GIL to free a Python-owned storage.
struct EngineDeleter {
  void operator()(CopyEngine* engine) const {
    if (PyGILState_Check()) {
      py::gil_scoped_release nogil;
      delete engine;
    } else {
      delete engine;
    }
  }
};

}  // namespace pystronghold

void pystronghold::bind_copy_engine(pybind11::module_& m) {
  using namespace pystronghold;
  py::class_<Request, std::shared_ptr<Request>>(m, "_CopyRequest",
                                                "A submitted copy (wrapped by pystronghold.io.CopyHandle).")
      .def("wait", [](Request& r, double timeout_s) {
        py::gil_scoped_release nogil;
        return r.wait(timeout_s);
      }, py::arg("timeout_s"), "Block until done or timeout_s seconds pass (< 0: no limit); True when done.")
      .def("done", &Request::is_done)
      .def("error", &error_tuple, "None, or (message, errno, path, offset, size) of the failure.")
      .def_property_readonly("nbytes", [](const Request& r) { return r.nbytes; })
      .def_property_readonly("queue", [](const Request& r) { return r.queue; })
      .def_property_readonly("start_s", [](const Request& r) { return r.start_s.load(); })
      .def_property_readonly("end_s", [](const Request& r) { return r.end_s.load(); });

  py::class_<CopyEngine, std::shared_ptr<CopyEngine>>(m, "_CopyEngine", "Worker threads serving copy queues.")
      .def(py::init([](int threads, int queues, int64_t chunk_bytes) {
             return std::shared_ptr<CopyEngine>(new CopyEngine(threads, queues, chunk_bytes), EngineDeleter());
           }),
           py::arg("threads"), py::arg("queues"), py::arg("chunk_bytes"))
      .def("copy", [](CopyEngine& engine, const at::Tensor& dst, const at::Tensor& src, int queue,
                      const std::vector<std::shared_ptr<Request>>& after) {
        auto req = make_tensor_copy(engine, dst, src);
        req->queue = queue;
        return engine.submit(req, after);
      }, py::arg("dst"), py::arg("src"), py::arg("queue"), py::arg("after"))
      .def("close", [](CopyEngine& engine, bool wait) {
        py::gil_scoped_release nogil;
        engine.close(wait);
      }, py::arg("wait"))
      .def_property_readonly("closed", &CopyEngine::closed)
      .def_property_readonly("threads", &CopyEngine::threads)
      .def_property_readonly("queues", &CopyEngine::queues)
      .def_property_readonly("chunk_bytes", &CopyEngine::chunk_bytes);

  m.def("memcpy_probe", [](const at::Tensor& dst, const at::Tensor& src) {
    TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu() && dst.is_contiguous() && src.is_contiguous(),
                "memcpy_probe: dst and src must be contiguous cpu tensors");
    const int64_t nbytes = tensor_nbytes(dst);
    TORCH_CHECK(nbytes == tensor_nbytes(src), "memcpy_probe: dst holds ", nbytes, " bytes, src ",
                tensor_nbytes(src));
    py::gil_scoped_release nogil;
    std::memcpy(dst.data_ptr(), src.data_ptr(), static_cast<size_t>(nbytes));
  }, py::arg("dst"), py::arg("src"),
  "One plain single-thread memcpy of src into dst, GIL released: the benchmark's baseline.");
  m.def("page_locked", [](const at::Tensor& host) {
    TORCH_CHECK(host.device().is_cpu(), "page_locked: expects a host tensor, got one on ", host.device());
#if defined(PYSTRONGHOLD_WITH_CUDA)
    return cuda::is_pinned(host.data_ptr());
#else
    return false;
#endif
  }, py::arg("host"),
  "Whether CUDA (cudaPointerGetAttributes) sees the host tensor's memory as page-locked: the copy "
  "engine's own test for direct DMA (torch's Tensor.is_pinned may answer otherwise for registered memory).");
}
