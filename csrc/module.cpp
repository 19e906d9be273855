// The extension module pystronghold._C. Loading it also registers the torch.library operators
// torch.ops.pystronghold.* (ops.cpp, static registration when the library loads); this file binds
// the pybind11 side, one explicit call per source file (bindings.h).
#include "bindings.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pystronghold native core: copy engine, host arena, file tier (pybind11); the fused CPU "
            "Adam, gradient norms and CRC32C are torch.ops.pystronghold operators";
  // NOTE: simd first: a bad PYSTRONGHOLD_SIMD_FORCE fails the import before anything else is bound
  pystronghold::bind_simd(m);
  pystronghold::bind_build_info(m);
  pystronghold::bind_adam_info(m);
  pystronghold::bind_roofline(m);
  pystronghold::bind_host_arena(m);
  pystronghold::bind_copy_engine(m);
  pystronghold::bind_file_store(m);
}
