// The extension module pystronghold._C: the one source that includes pybind11 and torch's Python
// headers (the rest of csrc/ is plain C++, or ATen for the torch.library operators of ops.cpp, and
// compiles in seconds). It binds the stateful classes (HostArena, CopyEngine, RecordFile) and the
// build and probe functions, one section each, in the order PYBIND11_MODULE calls them. Loading the
// module also registers the operators torch.ops.pystronghold.* (ops.cpp, static registration).
#include <ATen/ops/from_blob.h>
#include <omp.h>
#include <torch/csrc/utils/pybind.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "adam.h"
#include "build_info.h"
#include "copy_engine.h"
#include "file_store.h"
#include "gil.h"
#include "host_arena.h"
#include "simd_dispatch.h"

#if defined(PYSTRONGHOLD_WITH_CUDA)
#include <c10/cuda/CUDAStream.h>

#include "copy_engine_cuda.h"
#endif

namespace py = pybind11;

namespace pystronghold {

void run_without_gil(const std::function<void()>& work) {
  if (Py_IsInitialized() && PyGILState_Check()) {
    py::gil_scoped_release nogil;
    work();
  } else {
    work();
  }
}

namespace {

// ---- SIMD variants and build facts

void bind_simd(py::module_& m) {
  simd::active();  // NOTE: a bad PYSTRONGHOLD_SIMD_FORCE fails the import, before any kernel runs
  m.def("simd_level", []() { return std::string(simd::active().name); },
        "The SIMD variant the kernels run (avx512, avx2, neon or scalar): the CPU's best among those "
        "built, or PYSTRONGHOLD_SIMD_FORCE.");
  m.def("simd_variants", []() { return simd::variant_names(false); },
        "The SIMD variants built into this extension, best first.");
  m.def("simd_supported", []() { return simd::variant_names(true); },
        "The built SIMD variants this CPU can run, best first (the values PYSTRONGHOLD_SIMD_FORCE accepts).");
}

void bind_build_info(py::module_& m) {
  m.def("build_info", []() {
    const BuildInfo& built = build_info();
    py::dict info;
    info["version"] = built.version;
    info["source_hash"] = built.source_hash;
    info["simd"] = simd::active().name;  // the variant that runs (simd_variants(): all built)
    info["compiler"] = built.compiler;
    info["build_type"] = built.build_type;
    info["with_cuda"] = built.with_cuda;
    info["openmp_max_threads"] = omp_get_max_threads();
#if defined(PYSTRONGHOLD_WITH_CUDA)
    info["cuda_runtime_version"] = cuda_runtime_version();
#endif
    return info;
  }, "Build facts of pystronghold._C: version, source hash, SIMD variant in use, compiler, CUDA.");
  m.def("set_num_threads", [](int n) {
    TORCH_CHECK(n >= 1, "set_num_threads: n must be >= 1, got ", n);
    omp_set_num_threads(n);
  }, "Threads used by pystronghold's OpenMP kernels (CPU Adam).");
  m.def("get_num_threads", []() { return omp_get_max_threads(); });
}

// ---- Adam's probes (the kernels themselves are operators: ops.cpp)

void bind_adam_probes(py::module_& m) {
  m.def("adam_torch_sqrt", []() { return std::string(::vmsSqrt ? "mkl-vml-ha" : "ieee"); },
        "The sqrt adam_step uses with bitwise_torch=True: MKL's vmsSqrt from libtorch_cpu (torch's CPU "
        "sqrt), or IEEE when torch has no MKL. The default path always uses the IEEE SIMD sqrt.");
  m.def("roofline_stream", &adam::roofline_stream, py::arg("a"), py::arg("b"), py::arg("c"), py::arg("d"),
        py::arg("s"), py::call_guard<py::gil_scoped_release>(),
        "Adam-shaped memory stream: a,b,c <- x*s + d in place; returns the bytes moved.");
}

// ---- the host arena

void bind_host_arena(py::module_& m) {
  py::class_<HostArena>(m, "_HostArena", "One aligned host allocation carved into named views.")
      .def(py::init<int64_t, int64_t, const std::string&, bool>(), py::arg("capacity_bytes"),
           py::arg("alignment"), py::arg("pin"), py::arg("lock"))
      .def("allocate", [](HostArena& arena, const std::string& name, int64_t nbytes, int64_t item_bytes) {
        ArenaView view = arena.allocate(name, nbytes, item_bytes);
        return at::from_blob(view.data, {view.nbytes}, [keep = std::move(view.keep_alive)](void*) {},
                             at::TensorOptions().dtype(at::kByte).device(at::kCPU));
      }, py::arg("name"), py::arg("nbytes"), py::arg("item_bytes"),
           "A uint8 view of nbytes bytes, aligned; the view keeps the allocation alive.")
      .def("views", &HostArena::views, "{name: (offset_bytes, nbytes)}")
      .def_property_readonly("capacity_bytes", &HostArena::capacity)
      .def_property_readonly("used_bytes", &HostArena::used)
      .def_property_readonly("alignment", &HostArena::alignment)
      .def_property_readonly("pinned", &HostArena::pinned)
      .def_property_readonly("locked", &HostArena::locked)
      .def_property_readonly("base_address", &HostArena::base_address)
      .def_property_readonly("pin_warning", &HostArena::pin_warning)
      .def_property_readonly("lock_warning", &HostArena::lock_warning);
}

// ---- the copy engine: tensor requests (host<->host; host<->device on CUDA builds)

// numel * element size of a tensor, in bytes.
int64_t tensor_nbytes(const at::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

// The tensors a request reads or writes, held until it ends (Request::keep_alive).
std::shared_ptr<void> keep_tensors(std::vector<at::Tensor> tensors) {
  return std::make_shared<std::vector<at::Tensor>>(std::move(tensors));
}

void check_copy_operand(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined(), "CopyEngine.copy: ", name, " is undefined");
  TORCH_CHECK(t.layout() == at::kStrided, "CopyEngine.copy: ", name, " must be a strided tensor, got ",
              t.layout());
  TORCH_CHECK(t.is_contiguous(), "CopyEngine.copy: ", name, " must be contiguous (shape ", t.sizes(),
              ", strides ", t.strides(), ")");
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), "CopyEngine.copy: ", name,
              " must be on cpu or cuda, got ", t.device());
}

std::shared_ptr<Request> make_tensor_copy(CopyEngine& engine, const at::Tensor& dst,
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
  req->keep_alive = keep_tensors({dst, src});
  return req;
}

py::object error_tuple(Request& req) {
  if (!req.failed.load()) return py::none();
  std::lock_guard<std::mutex> guard(req.error_mutex);
  const CopyFailure& e = req.error;
  return py::make_tuple(e.message, e.err, e.path, e.offset, e.size);
}

// Deletes the engine with the GIL released when it is held: the destructor joins the workers, and
// a worker may need the GIL to free a Python-owned storage.
struct EngineDeleter {
  void operator()(CopyEngine* engine) const {
    run_without_gil([engine] { delete engine; });
  }
};

void bind_copy_engine(py::module_& m) {
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

// ---- the file tier

// A record read's or write's host buffer: the checks on the tensor itself are the file's
// (RecordFile::check_request), which names the record.
RecordBuffer record_buffer(const at::Tensor& t) {
  RecordBuffer buffer;
  buffer.host_contiguous = t.defined() && t.device().is_cpu() && t.layout() == at::kStrided && t.is_contiguous();
  if (buffer.host_contiguous) {
    buffer.data = t.data_ptr();
    buffer.nbytes = tensor_nbytes(t);
    buffer.keep_alive = keep_tensors({t});
  }
  return buffer;
}

void bind_file_store(py::module_& m) {
  py::class_<RecordFile, std::shared_ptr<RecordFile>>(m, "_RecordFile", "One file of fixed-size records.")
      .def_static("create", [](const std::string& path, int64_t num_blocks, int64_t record_bytes,
                               int64_t segment_bytes, const std::string& state, const std::string& direct,
                               bool preallocate) {
        RecordLayout layout;
        layout.num_blocks = num_blocks;
        layout.record_bytes = record_bytes;
        layout.segment_bytes = segment_bytes;
        layout.state = state;
        py::gil_scoped_release nogil;
        return RecordFile::create(path, layout, direct, preallocate);
      }, py::arg("path"), py::arg("num_blocks"), py::arg("record_bytes"), py::arg("segment_bytes"),
         py::arg("state"), py::arg("direct"), py::arg("preallocate"))
      .def_static("open", [](const std::string& path, const std::string& direct) {
        py::gil_scoped_release nogil;
        return RecordFile::open(path, direct);
      }, py::arg("path"), py::arg("direct"))
      .def("write", [](RecordFile& f, CopyEngine& engine, int64_t block, const at::Tensor& src, int queue,
                       const std::vector<std::shared_ptr<Request>>& after) {
        auto req = f.write(block, record_buffer(src));
        req->queue = queue;
        return engine.submit(req, after);
      }, py::arg("engine"), py::arg("block"), py::arg("src"), py::arg("queue"), py::arg("after"))
      .def("read", [](RecordFile& f, CopyEngine& engine, int64_t block, const at::Tensor& dst, int queue,
                      const std::vector<std::shared_ptr<Request>>& after) {
        auto req = f.read(block, record_buffer(dst));
        req->queue = queue;
        return engine.submit(req, after);
      }, py::arg("engine"), py::arg("block"), py::arg("dst"), py::arg("queue"), py::arg("after"))
      .def("flush", [](RecordFile& f) {
        py::gil_scoped_release nogil;
        f.flush();
      })
      .def("close", &RecordFile::close)
      .def_property_readonly("path", &RecordFile::path)
      .def_property_readonly("direct", &RecordFile::direct)
      .def_property_readonly("direct_note", &RecordFile::direct_note)
      .def_property_readonly("read_only_reason", &RecordFile::read_only_reason)
      .def_property_readonly("num_blocks", [](const RecordFile& f) { return f.layout().num_blocks; })
      .def_property_readonly("record_bytes", [](const RecordFile& f) { return f.layout().record_bytes; })
      .def_property_readonly("segment_bytes", [](const RecordFile& f) { return f.layout().segment_bytes; })
      .def_property_readonly("slot_bytes", [](const RecordFile& f) { return f.layout().slot_bytes; })
      .def_property_readonly("file_bytes", [](const RecordFile& f) { return f.layout().file_bytes(); })
      .def_property_readonly("state", [](const RecordFile& f) { return f.layout().state; });
}

}  // namespace
}  // namespace pystronghold

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pystronghold native core: copy engine, host arena, file tier (pybind11); the fused CPU "
            "Adam, gradient norms and CRC32C are torch.ops.pystronghold operators";
  // NOTE: simd first: a bad PYSTRONGHOLD_SIMD_FORCE fails the import before anything else is bound
  pystronghold::bind_simd(m);
  pystronghold::bind_build_info(m);
  pystronghold::bind_adam_probes(m);
  pystronghold::bind_host_arena(m);
  pystronghold::bind_copy_engine(m);
  pystronghold::bind_file_store(m);
}
