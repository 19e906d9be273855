// The pybind11 side of pystronghold._C: the stateful classes (HostArena, CopyEngine, RecordFile)
// and the build/probe functions. module.cpp calls each binder below explicitly, in one visible
// order. The stateless tensor kernels (adam_step, adam_step_multi, grad_sq_norm, param_grad_norms,
// crc32c) are not here: they are torch.library operators with schemas (ops.cpp).
#pragma once

#include <torch/extension.h>

namespace pystronghold {

void bind_simd(pybind11::module_& m);         // simd_dispatch.cpp: simd_level, simd_variants, ...
void bind_build_info(pybind11::module_& m);   // build_info.cpp: build_info, set/get_num_threads
void bind_adam_info(pybind11::module_& m);    // adam.cpp: adam_torch_sqrt
void bind_roofline(pybind11::module_& m);     // roofline.cpp: roofline_stream
void bind_host_arena(pybind11::module_& m);   // host_arena.cpp: _HostArena
void bind_copy_engine(pybind11::module_& m);  // copy_engine_bind.cpp: _CopyEngine, _CopyRequest, memcpy_probe
void bind_file_store(pybind11::module_& m);   // file_store.cpp: _RecordFile

}  // namespace pystronghold
