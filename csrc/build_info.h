// What this extension was built from and with (pystronghold info; the stale-build check). Plain
// C++: build_info.cpp is the only source that includes the generated ps_build_info.h (which changes
// with every edit of csrc/), so it is the only one an edit recompiles besides the edited source.
#pragma once

namespace pystronghold {

struct BuildInfo {
  const char* version;
  const char* source_hash;  // of csrc/, as pystronghold/_ext.py computes it
  const char* compiler;
  const char* build_type;   // "release" or "debug"
  bool with_cuda;
};

const BuildInfo& build_info();

// cudaRuntimeGetVersion's answer, -1 when it fails (CUDA builds only).
int cuda_runtime_version();

}  // namespace pystronghold
